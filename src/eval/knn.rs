//! K-nearest-neighbour classification on image embeddings, as in ALIGN's ablations (§6): the
//! embeddings of a labelled train split are the index, validation images are the queries.
//!
//! - Recall@K: the query's label is among the labels of its K nearest index images.
//! - KNN top-1: the label with most votes among the K nearest (ties go to the label whose voters
//!   have the larger summed similarity, then to the nearest voter).

use candle_core::Result;
use serde::{Deserialize, Serialize};

use super::metrics::{for_each_similarity_block, Embeddings};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KnnReport {
    pub k: usize,
    pub top1: f64,
    pub r1: f64,
    pub r5: f64,
    pub r10: f64,
    pub queries: usize,
    pub index: usize,
}

/// Indices of the `k` largest scores, best first (stable: ties by index).
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(scores.len());
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    let cmp = |a: &usize, b: &usize| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx
}

fn vote(neighbours: &[usize], scores: &[f32], labels: &[usize]) -> usize {
    // (label, votes, summed similarity, rank of nearest voter)
    let mut tally: Vec<(usize, usize, f32, usize)> = Vec::new();
    for (rank, &n) in neighbours.iter().enumerate() {
        match tally.iter_mut().find(|t| t.0 == labels[n]) {
            Some(t) => {
                t.1 += 1;
                t.2 += scores[n];
            }
            None => tally.push((labels[n], 1, scores[n], rank)),
        }
    }
    tally.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.total_cmp(&a.2)).then(a.3.cmp(&b.3)));
    tally[0].0
}

pub fn knn(
    index: &Embeddings,
    index_labels: &[usize],
    queries: &Embeddings,
    query_labels: &[usize],
    k: usize,
    block: usize,
) -> Result<KnnReport> {
    if index_labels.len() != index.rows() || query_labels.len() != queries.rows() {
        candle_core::bail!("labels do not match embeddings");
    }
    let depth = k.max(10);
    let (mut top1, mut r1, mut r5, mut r10) = (0usize, 0usize, 0usize, 0usize);
    for_each_similarity_block(queries, index, block, |start, sims| {
        for (r, row) in sims.chunks(index.rows()).enumerate() {
            let truth = query_labels[start + r];
            let nearest = top_k(row, depth);
            let first_hit = nearest.iter().position(|&n| index_labels[n] == truth);
            r1 += first_hit.is_some_and(|p| p < 1) as usize;
            r5 += first_hit.is_some_and(|p| p < 5) as usize;
            r10 += first_hit.is_some_and(|p| p < 10) as usize;
            top1 += (vote(&nearest[..k.min(nearest.len())], row, index_labels) == truth) as usize;
        }
    })?;
    let n = queries.rows().max(1) as f64;
    Ok(KnnReport {
        k,
        top1: top1 as f64 / n,
        r1: r1 as f64 / n,
        r5: r5 as f64 / n,
        r10: r10 as f64 / n,
        queries: queries.rows(),
        index: index.rows(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emb(rows: &[[f32; 2]]) -> Embeddings {
        Embeddings { data: rows.iter().flatten().copied().collect(), dim: 2 }
    }

    #[test]
    fn top_k_is_sorted_and_stable_on_ties() {
        assert_eq!(top_k(&[0.1, 0.9, 0.5, 0.9], 3), vec![1, 3, 2]);
        assert_eq!(top_k(&[0.1, 0.2], 5), vec![1, 0]);
    }

    #[test]
    fn votes_and_recall_by_hand() {
        // Index: two near [1,0] with label 0, one at [0.8,0.6] with label 1, one at [0,1] label 1.
        let index = emb(&[[1.0, 0.0], [0.99, 0.141], [0.8, 0.6], [0.0, 1.0]]);
        let labels = [0, 0, 1, 1];
        // Query near [0.6, 0.8] with label 1: nearest are idx 2 (1), idx 3 (1), then idx 1, 0.
        let q = emb(&[[0.6, 0.8], [1.0, 0.0]]);
        let rep = knn(&index, &labels, &q, &[1, 1], 3, 1).unwrap();
        // Query 0: votes {1: 2, 0: 1} → 1, correct; nearest is label 1 → R@1 hit.
        // Query 1: nearest idx 0, 1 (label 0) then 2 (label 1): vote 0 → wrong; R@1 miss, R@5 hit.
        assert_eq!(rep.top1, 0.5);
        assert_eq!(rep.r1, 0.5);
        assert_eq!(rep.r5, 1.0);
        assert_eq!(rep.r10, 1.0);
    }

    #[test]
    fn a_tied_vote_goes_to_the_closer_label() {
        let scores = [0.9f32, 0.1, 0.8, 0.3];
        // Two votes each: label 0 (0.9 + 0.1) vs label 1 (0.8 + 0.3) → label 1 by similarity.
        assert_eq!(vote(&[0, 2, 3, 1], &scores, &[0, 0, 1, 1]), 1);
    }
}
