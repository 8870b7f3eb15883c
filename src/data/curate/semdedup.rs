//! Semantic deduplication (SemDeDup, Abbas et al. 2023): the image embeddings are clustered with
//! k-means, and within each cluster the pairs whose cosine similarity is at least `threshold` are
//! duplicates; each group of duplicates (connected through such pairs) keeps one member, the one
//! least similar to its cluster's centre (the paper's choice: the most typical copy goes), ties
//! broken by key, so the result does not depend on the order samples were read in.

use super::kmeans::kmeans;

/// What deduplication decided.
pub struct Dedup {
    /// For each sample, whether it is removed as a duplicate of another.
    pub removed: Vec<bool>,
    /// Groups of two or more near-duplicates.
    pub groups: usize,
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn find(parent: &mut [usize], mut i: usize) -> usize {
    while parent[i] != i {
        parent[i] = parent[parent[i]];
        i = parent[i];
    }
    i
}

/// Deduplicates `keys.len()` unit embeddings (`data`: rows of `dim`) in `clusters` k-means
/// clusters at cosine `threshold`.
pub fn semdedup(keys: &[String], data: &[f32], dim: usize, clusters: usize, threshold: f32, seed: u64) -> Dedup {
    let n = keys.len();
    let c = kmeans(data, dim, clusters, seed, 30);
    let row = |i: usize| &data[i * dim..(i + 1) * dim];
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); c.k];
    for (i, &a) in c.assignment.iter().enumerate() {
        members[a].push(i);
    }
    let mut parent: Vec<usize> = (0..n).collect();
    for m in &members {
        for (x, &i) in m.iter().enumerate() {
            for &j in &m[x + 1..] {
                if dot(row(i), row(j)) >= threshold {
                    let (a, b) = (find(&mut parent, i), find(&mut parent, j));
                    if a != b {
                        parent[a.max(b)] = a.min(b);
                    }
                }
            }
        }
    }
    let mut groups: std::collections::HashMap<usize, Vec<usize>> = std::collections::HashMap::new();
    for i in 0..n {
        let r = find(&mut parent, i);
        groups.entry(r).or_default().push(i);
    }
    let mut removed = vec![false; n];
    let mut multi = 0;
    for g in groups.values().filter(|g| g.len() > 1) {
        multi += 1;
        let centre = |i: usize| {
            let a = c.assignment[i];
            dot(row(i), &c.centres[a * dim..(a + 1) * dim])
        };
        let keep =
            *g.iter().min_by(|&&a, &&b| centre(a).total_cmp(&centre(b)).then_with(|| keys[a].cmp(&keys[b]))).expect("a group has members");
        for &i in g {
            removed[i] = i != keep;
        }
    }
    Dedup { removed, groups: multi }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_copies_go_and_distinct_images_stay() {
        let mut rng = crate::util::rng::Rng::new(3);
        let unit = |v: Vec<f32>| {
            let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
            v.into_iter().map(|x| x / n).collect::<Vec<f32>>()
        };
        let mut data = Vec::new();
        let mut keys = Vec::new();
        // Ten distinct images; the first three have two near-copies each (cosine > 0.99).
        let bases: Vec<Vec<f32>> = (0..10).map(|_| unit((0..16).map(|_| rng.normal() as f32).collect())).collect();
        for (b, base) in bases.iter().enumerate() {
            data.extend(base.clone());
            keys.push(format!("img{b}"));
            if b < 3 {
                for copy in 0..2 {
                    data.extend(unit(base.iter().map(|x| x + 0.01 * rng.normal() as f32).collect()));
                    keys.push(format!("img{b}-copy{copy}"));
                }
            }
        }
        let d = semdedup(&keys, &data, 16, 4, 0.95, 1);
        assert_eq!(d.groups, 3);
        assert_eq!(d.removed.iter().filter(|&&r| r).count(), 6);
        for b in 0..10 {
            let family: Vec<usize> = keys
                .iter()
                .enumerate()
                .filter(|(_, k)| k.starts_with(&format!("img{b}")) && (k.len() == 4 || k.as_bytes()[4] == b'-'))
                .map(|(i, _)| i)
                .collect();
            assert_eq!(family.iter().filter(|&&i| !d.removed[i]).count(), 1, "image {b} must keep exactly one copy");
        }
    }
}
