//! Spherical k-means over unit vectors (embeddings), seeded: k-means++ initialisation, then
//! Lloyd's iterations with the centres renormalised, until no assignment changes. The same
//! vectors and seed give the same clusters on any number of threads.
//!
//! Written here rather than taken from a crate: the Rust k-means crates either bring a numerical
//! stack (ndarray and linfa) for what is a few loops over `f32` slices, or need nightly SIMD.

use rayon::prelude::*;

use crate::util::rng::Rng;

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn normalise(v: &mut [f32]) {
    let n = dot(v, v).sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= n);
}

/// The clustering: each vector's centre, and the centres (`k × dim`, unit length).
pub struct Clusters {
    pub assignment: Vec<usize>,
    pub centres: Vec<f32>,
    pub k: usize,
    pub dim: usize,
}

impl Clusters {
    /// The centre most similar to `v` (the first of equals).
    pub fn nearest(&self, v: &[f32]) -> usize {
        nearest(v, &self.centres, self.k, self.dim)
    }
}

fn nearest(v: &[f32], centres: &[f32], k: usize, dim: usize) -> usize {
    (0..k)
        .map(|c| (c, dot(v, &centres[c * dim..(c + 1) * dim])))
        .fold((0, f32::NEG_INFINITY), |best, (c, s)| if s > best.1 { (c, s) } else { best })
        .0
}

/// Clusters `n` unit vectors (`data`: `n × dim`) into at most `k` clusters, with at most
/// `max_iter` updates of the centres.
pub fn kmeans(data: &[f32], dim: usize, k: usize, seed: u64, max_iter: usize) -> Clusters {
    let n = data.len().checked_div(dim).unwrap_or(0);
    let k = k.clamp(1, n.max(1));
    let row = |i: usize| &data[i * dim..(i + 1) * dim];
    let mut rng = Rng::new(seed);
    // k-means++: each next centre drawn with probability proportional to its distance (1 − cos)
    // from the nearest centre so far.
    let mut centres: Vec<f32> = Vec::with_capacity(k * dim);
    if n > 0 {
        centres.extend_from_slice(row(rng.below(n)));
        let mut nearest: Vec<f32> = (0..n).map(|i| (1.0 - dot(row(i), &centres[..dim])).max(0.0)).collect();
        while centres.len() / dim < k {
            let total: f64 = nearest.iter().map(|&d| d as f64).sum();
            let pick = if total <= 0.0 {
                rng.below(n)
            } else {
                let mut x = rng.uniform(0.0, total);
                let mut pick = n - 1;
                for (i, &d) in nearest.iter().enumerate() {
                    x -= d as f64;
                    if x <= 0.0 {
                        pick = i;
                        break;
                    }
                }
                pick
            };
            let c = centres.len() / dim;
            centres.extend_from_slice(row(pick));
            for (i, d) in nearest.iter_mut().enumerate() {
                *d = d.min((1.0 - dot(row(i), &centres[c * dim..(c + 1) * dim])).max(0.0));
            }
        }
    }
    let k = centres.len() / dim.max(1);
    let mut assignment = vec![usize::MAX; n];
    for iteration in 0..=max_iter.max(1) {
        let next: Vec<usize> = (0..n).into_par_iter().map(|i| nearest(row(i), &centres, k, dim)).collect();
        let changed = next != assignment;
        assignment = next;
        // The last pass only assigns, so every vector's centre is its nearest one.
        if !changed || iteration == max_iter.max(1) {
            break;
        }
        let mut sums = vec![0f32; k * dim];
        for (i, &c) in assignment.iter().enumerate() {
            sums[c * dim..(c + 1) * dim].iter_mut().zip(row(i)).for_each(|(s, x)| *s += x);
        }
        for c in 0..k {
            let s = &mut sums[c * dim..(c + 1) * dim];
            // An empty cluster keeps its centre.
            if s.iter().any(|&x| x != 0.0) {
                normalise(s);
                centres[c * dim..(c + 1) * dim].copy_from_slice(s);
            }
        }
    }
    Clusters { assignment, centres, k, dim }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separated_groups_are_found_and_the_result_is_seeded() {
        // Three tight groups around the axes of R^3.
        let mut data = Vec::new();
        let mut rng = Rng::new(1);
        for g in 0..3 {
            for _ in 0..20 {
                let mut v: Vec<f32> = (0..3).map(|d| if d == g { 1.0 } else { 0.05 * rng.normal() as f32 }).collect();
                normalise(&mut v);
                data.extend(v);
            }
        }
        let c = kmeans(&data, 3, 3, 9, 50);
        for g in 0..3 {
            let first = c.assignment[g * 20];
            assert!(c.assignment[g * 20..(g + 1) * 20].iter().all(|&a| a == first), "group {g} split: {:?}", c.assignment);
        }
        let mut distinct = c.assignment.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 3);
        assert_eq!(kmeans(&data, 3, 3, 9, 50).assignment, c.assignment);
    }
}
