//! Which shards each rank and loader worker reads.
//!
//! Epoch mode: every epoch the full shard list is permuted (seeded by the epoch), then dealt like
//! cards: shard `k` of the permutation goes to rank `k % world`, and a rank's `j`-th shard to
//! worker `j % workers`. Every shard is read by exactly one worker of one rank per epoch. When the
//! count does not divide evenly, some workers hold one shard more than others; the loader keeps
//! taking batches round-robin from the workers that still have data, so nothing is dropped, and
//! the deal changes every epoch so no shard is systematically late.
//!
//! Resampled mode (open_clip's `--dataset-resampled`): each worker draws shards with replacement,
//! forever, uniformly or in proportion to per-shard weights (open_clip's
//! `--train-data-upsampling-factors`: every shard of a source weighs its source's factor); the
//! `c`-th draw of a worker is a pure function of (seed, rank, worker, c).

use serde::{Deserialize, Serialize};

use super::spec::ShardSource;
use crate::util::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub rank: usize,
    pub world_size: usize,
    pub worker: usize,
    pub workers: usize,
}

impl Placement {
    pub fn single(workers: usize) -> Self {
        Placement { rank: 0, world_size: 1, worker: 0, workers }
    }

    pub fn with_worker(self, worker: usize) -> Self {
        Placement { worker, ..self }
    }

    /// The worker's index among all workers of all ranks: shard `k` of an epoch's deal goes to
    /// global worker `k mod (world · workers)`. Random streams are keyed by it, so a job's data
    /// depends only on the total worker count: 2 ranks × 1 worker read exactly what 1 rank × 2
    /// workers reads.
    pub fn global_worker(&self) -> u64 {
        (self.rank + self.world_size * self.worker) as u64
    }
}

#[derive(Debug, Clone)]
pub struct ShardPlan {
    pub shards: Vec<ShardSource>,
    pub seed: u64,
    pub shuffle: bool,
    pub resampled: bool,
    /// Resampled mode: each shard's weight (empty: uniform).
    pub weights: Vec<f64>,
    /// The `::` source of `data.train` each shard belongs to (empty: all one source), so that a
    /// mix's samples can be counted by source.
    pub sources: Vec<usize>,
}

const EPOCH_ORDER: u64 = 0x5348_4152_4445_5053; // "SHARDEPS"
const RESAMPLE: u64 = 0x5245_5341_4d50_4c45; // "RESAMPLE"

impl ShardPlan {
    /// The source shard `shard` belongs to.
    pub fn source_of(&self, shard: usize) -> usize {
        self.sources.get(shard).copied().unwrap_or(0)
    }

    /// The shard order of an epoch before it is dealt out.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.shards.len()).collect();
        if self.shuffle {
            Rng::derived(self.seed, &[EPOCH_ORDER, epoch]).shuffle(&mut order);
        }
        order
    }

    /// The shards one worker reads in an epoch (epoch mode), in reading order.
    pub fn worker_shards(&self, epoch: u64, at: Placement) -> Vec<usize> {
        self.epoch_order(epoch).into_iter().skip(at.rank).step_by(at.world_size).skip(at.worker).step_by(at.workers).collect()
    }

    /// The shard at position `cursor` of a worker's stream in `epoch`, or None past its end.
    pub fn shard_at(&self, epoch: u64, at: Placement, cursor: usize, cached: &mut Option<(u64, Vec<usize>)>) -> Option<usize> {
        if self.resampled {
            let mut rng = Rng::derived(self.seed, &[RESAMPLE, at.global_worker(), cursor as u64]);
            if self.weights.is_empty() {
                return Some(rng.below(self.shards.len()));
            }
            let total: f64 = self.weights.iter().sum();
            let mut x = rng.uniform(0.0, total);
            for (i, &w) in self.weights.iter().enumerate() {
                if x < w {
                    return Some(i);
                }
                x -= w;
            }
            return Some(self.weights.iter().rposition(|&w| w > 0.0).unwrap_or(0));
        }
        if cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
            *cached = Some((epoch, self.worker_shards(epoch, at)));
        }
        cached.as_ref().unwrap().1.get(cursor).copied()
    }

    /// Shards a rank holds in the smallest epoch deal: zero means the rank would never produce a
    /// batch, which is a configuration error.
    pub fn min_shards_per_rank(&self, world_size: usize) -> usize {
        self.shards.len() / world_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn plan(n: usize, shuffle: bool) -> ShardPlan {
        ShardPlan {
            shards: (0..n).map(|i| ShardSource::File(PathBuf::from(format!("s{i}.tar")))).collect(),
            seed: 42,
            shuffle,
            resampled: false,
            weights: Vec::new(),
            sources: Vec::new(),
        }
    }

    #[test]
    fn every_shard_is_read_exactly_once_per_epoch_across_ranks_and_workers() {
        for (n, world, workers) in [(10, 2, 3), (7, 3, 2), (16, 4, 4), (5, 1, 8)] {
            let p = plan(n, true);
            for epoch in 0..3 {
                let mut seen = vec![0; n];
                for rank in 0..world {
                    for worker in 0..workers {
                        for s in p.worker_shards(epoch, Placement { rank, world_size: world, worker, workers }) {
                            seen[s] += 1;
                        }
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "n={n} world={world} workers={workers}: {seen:?}");
            }
        }
    }

    #[test]
    fn the_deal_depends_only_on_the_global_worker() {
        let p = plan(13, true);
        for epoch in 0..2 {
            for g in 0..4 {
                let two_ranks = Placement { rank: g % 2, world_size: 2, worker: g / 2, workers: 2 };
                let four_workers = Placement { rank: 0, world_size: 1, worker: g, workers: 4 };
                assert_eq!(two_ranks.global_worker(), four_workers.global_worker());
                assert_eq!(p.worker_shards(epoch, two_ranks), p.worker_shards(epoch, four_workers), "epoch {epoch} worker {g}");
            }
        }
    }

    #[test]
    fn uneven_deals_differ_by_at_most_one_shard() {
        let p = plan(10, false);
        let counts: Vec<usize> =
            (0..3).map(|w| p.worker_shards(0, Placement { rank: 0, world_size: 1, worker: w, workers: 3 }).len()).collect();
        assert_eq!(counts, vec![4, 3, 3]);
    }

    #[test]
    fn the_epoch_shuffle_is_seeded_and_changes_between_epochs() {
        let p = plan(50, true);
        assert_eq!(p.epoch_order(3), p.epoch_order(3));
        assert_ne!(p.epoch_order(3), p.epoch_order(4));
        assert_eq!(plan(50, false).epoch_order(9), (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn resampling_draws_with_replacement_forever_and_reproducibly() {
        let mut p = plan(4, true);
        p.resampled = true;
        let at = Placement::single(2);
        let mut cache = None;
        let draws: Vec<usize> = (0..400).map(|c| p.shard_at(0, at, c, &mut cache).unwrap()).collect();
        let again: Vec<usize> = (0..400).map(|c| p.shard_at(0, at, c, &mut cache).unwrap()).collect();
        assert_eq!(draws, again);
        for s in 0..4 {
            let k = draws.iter().filter(|&&d| d == s).count();
            assert!(k > 60, "shard {s} drawn {k} times");
        }
        let other: Vec<usize> = (0..400).map(|c| p.shard_at(0, at.with_worker(1), c, &mut cache).unwrap()).collect();
        assert_ne!(draws, other);
    }

    #[test]
    fn weighted_resampling_follows_the_upsampling_factors() {
        // Source A: shards 0-1 with factor 1; source B: shards 2-5 with factor 0.25. A shard of A
        // is drawn 4 times as often as one of B, and A as a whole twice as often as B.
        let mut p = plan(6, true);
        p.resampled = true;
        p.weights = vec![1.0, 1.0, 0.25, 0.25, 0.25, 0.25];
        let at = Placement::single(1);
        let mut cache = None;
        let n = 60_000;
        let mut counts = [0usize; 6];
        for c in 0..n {
            counts[p.shard_at(0, at, c, &mut cache).unwrap()] += 1;
        }
        let share = |range: std::ops::Range<usize>| counts[range].iter().sum::<usize>() as f64 / n as f64;
        assert!((share(0..2) - 2.0 / 3.0).abs() < 0.01, "{counts:?}");
        for s in 2..6 {
            let expected = n as f64 / 12.0;
            assert!((counts[s] as f64 - expected).abs() < 0.05 * expected, "{counts:?}");
        }
        let again: Vec<usize> = (0..50).map(|c| p.shard_at(0, at, c, &mut cache).unwrap()).collect();
        assert_eq!(again, (0..50).map(|c| p.shard_at(0, at, c, &mut None).unwrap()).collect::<Vec<_>>());
    }
}
