//! NaFlex token-budget batches, as timm's NaFlex loader builds them: every batch draws a sequence
//! length (patches per image) from a set, its images are resized to at most that many patches,
//! and it holds as many images as keep its patches near one budget, so that a batch of short
//! sequences carries more images and every step costs about the same.
//!
//! The budget is the batch at the longest length (timm: `batch_size · max(seq_lens)`). A length is
//! a pure function of (seed, worker, the worker's batch count), without the rank: ranks whose
//! workers stay in step draw the same length at the same step, and a restored worker draws again
//! what it drew before.

use crate::util::rng::Rng;

const DRAW: u64 = 0x4e41_464c_4558_4c4e;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBudget {
    /// The lengths a batch draws from (distinct, ascending), uniformly.
    pub seq_lens: Vec<usize>,
    /// Batch sizes above `micro` are rounded down to a multiple of this.
    pub divisor: usize,
    /// Images a batch holds at the longest length.
    pub micro: usize,
}

impl TokenBudget {
    pub fn new(seq_lens: &[usize], divisor: usize, micro: usize) -> Self {
        let mut seq_lens = seq_lens.to_vec();
        seq_lens.sort_unstable();
        seq_lens.dedup();
        TokenBudget { seq_lens, divisor: divisor.max(1), micro: micro.max(1) }
    }

    /// The budget of a micro-batch of `micro` images at the longest of `seq_lens`; None without
    /// lengths.
    pub fn of(seq_lens: &[usize], divisor: usize, micro: usize) -> Option<Self> {
        (!seq_lens.is_empty()).then(|| TokenBudget::new(seq_lens, divisor, micro))
    }

    pub fn longest(&self) -> usize {
        self.seq_lens.last().copied().unwrap_or(1)
    }

    /// Images in a batch of `seq_len` patches each: the budget over the length, rounded down to
    /// the divisor (timm's `calculate_batch_size` with floor rounding), never fewer than at the
    /// longest length.
    pub fn batch_size(&self, seq_len: usize) -> usize {
        let raw = self.micro * self.longest() / seq_len.max(1);
        (raw / self.divisor * self.divisor).max(self.micro)
    }

    /// The length of worker `worker`'s batch number `batch`.
    pub fn draw(&self, seed: u64, worker: usize, batch: u64) -> usize {
        let mut rng = Rng::derived(seed, &[DRAW, worker as u64, batch]);
        self.seq_lens[rng.below(self.seq_lens.len())]
    }

    /// The mean batch over the lengths, which are drawn uniformly.
    pub fn mean_batch(&self) -> f64 {
        self.seq_lens.iter().map(|&s| self.batch_size(s) as f64).sum::<f64>() / self.seq_lens.len().max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// timm's defaults (lengths 128 … 1024, divisor 8) at 32 images per batch at 1024: a budget of
    /// 32,768 patches, 256 images at 128, 128 at 256, 56 at 576 (56.9 rounded down to 8s), 40 at
    /// 784 (41.8), 32 at 1024.
    #[test]
    fn batches_keep_the_patches_near_the_budget() {
        let b = TokenBudget::new(&[1024, 128, 256, 576, 784, 256], 8, 32);
        assert_eq!(b.seq_lens, [128, 256, 576, 784, 1024]);
        let sizes: Vec<usize> = b.seq_lens.iter().map(|&s| b.batch_size(s)).collect();
        assert_eq!(sizes, [256, 128, 56, 40, 32]);
        assert!(b.seq_lens.iter().zip(&sizes).all(|(s, n)| s * n <= 32 * 1024));
        assert_eq!(b.mean_batch(), (256 + 128 + 56 + 40 + 32) as f64 / 5.0);
        // A batch smaller than the divisor is never rounded below itself.
        let small = TokenBudget::new(&[16, 32, 64], 8, 4);
        assert_eq!([16, 32, 64].map(|s| small.batch_size(s)), [16, 8, 4]);
    }

    #[test]
    fn draws_are_a_function_of_the_worker_and_its_batch_and_cover_the_set() {
        let b = TokenBudget::new(&[16, 32, 64], 1, 4);
        let draws: Vec<usize> = (0..60).map(|i| b.draw(7, 0, i)).collect();
        assert_eq!(draws, (0..60).map(|i| b.draw(7, 0, i)).collect::<Vec<_>>());
        for s in [16, 32, 64] {
            let n = draws.iter().filter(|&&d| d == s).count();
            assert!((8..=32).contains(&n), "{s} drawn {n} times of 60");
        }
        assert_ne!(draws, (0..60).map(|i| b.draw(7, 1, i)).collect::<Vec<_>>(), "workers draw apart");
    }
}
