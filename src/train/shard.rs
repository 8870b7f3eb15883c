//! Which rank owns which tensor when data-parallel ranks shard the optimizer state and gradients
//! (`train.shard`, ZeRO's stages 1 and 2).
//!
//! Ranks own whole tensors, dealt by size, rather than equal slices of one flat buffer:
//! - LAMB's trust ratio needs the norms of each whole tensor and of its update; an owner of whole
//!   tensors computes them alone, where slices would need one more collective per step;
//! - a checkpoint shard then holds named tensors (`exp_avg.NAME`), so a resume on another number
//!   of ranks only deals the names again, with no arithmetic on the moments;
//! - the price is balance: no rank can hold less than the largest tensor. For ViT-B/16 + BERT-base
//!   the largest, BERT's word embeddings (23.4M of 196M parameters), is under 1/8 of the whole,
//!   so up to 8 ranks still split it about evenly; past that the largest tensors set the bound.
//!
//! The deal is the classic greedy one (largest tensor first, onto the least-loaded rank, ties to
//! the lower rank), a pure function of the tensors' sizes and the number of ranks, so every rank
//! computes the same deal without exchanging it.

/// The deal of tensors to ranks, seen from one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ownership {
    /// The owning rank of each tensor, in parameter order.
    owner: Vec<usize>,
    /// Elements of each tensor.
    sizes: Vec<usize>,
    rank: usize,
    world: usize,
}

impl Ownership {
    /// Deals tensors of `sizes` elements to `world` ranks; `rank` is the one asking.
    pub fn deal(sizes: &[usize], world: usize, rank: usize) -> Ownership {
        assert!(world > 0 && rank < world, "rank {rank} of {world}");
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
        let mut load = vec![0usize; world];
        let mut owner = vec![0; sizes.len()];
        for i in order {
            let r = (0..world).min_by_key(|&r| (load[r], r)).expect("at least one rank");
            owner[i] = r;
            load[r] += sizes[i];
        }
        Ownership { owner, sizes: sizes.to_vec(), rank, world }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn owns(&self, tensor: usize) -> bool {
        self.owner[tensor] == self.rank
    }

    /// Tensor indices in the order of the flat buffers the collectives exchange: rank 0's
    /// tensors, then rank 1's, and so on, each rank's in parameter order.
    pub fn layout(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.owner.len()).collect();
        order.sort_by_key(|&i| (self.owner[i], i));
        order
    }

    /// This rank's tensors, in parameter order.
    pub fn mine(&self) -> Vec<usize> {
        (0..self.owner.len()).filter(|&i| self.owns(i)).collect()
    }

    /// Elements each rank owns, by rank (the segments of [`Ownership::layout`]).
    pub fn counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.world];
        for (i, &r) in self.owner.iter().enumerate() {
            counts[r] += self.sizes[i];
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tensor_has_one_owner_and_loads_are_balanced_by_size() {
        let sizes = [100, 7, 60, 40, 3, 50, 1, 90];
        for world in 1..=5 {
            let deals: Vec<Ownership> = (0..world).map(|r| Ownership::deal(&sizes, world, r)).collect();
            for (i, _) in sizes.iter().enumerate() {
                assert_eq!(deals.iter().filter(|d| d.owns(i)).count(), 1, "tensor {i} on {world} ranks");
            }
            let counts = deals[0].counts();
            assert_eq!(counts.iter().sum::<usize>(), sizes.iter().sum::<usize>());
            // The greedy deal's bound: no rank exceeds the mean by more than the largest tensor.
            let mean = sizes.iter().sum::<usize>() as f64 / world as f64;
            assert!(counts.iter().all(|&c| c as f64 <= mean + 100.0), "{counts:?}");
            // The layout lists rank 0's tensors first, each rank's in parameter order.
            let layout = deals[0].layout();
            let mut at = 0;
            for (r, d) in deals.iter().enumerate() {
                let mine = d.mine();
                assert_eq!(&layout[at..at + mine.len()], mine.as_slice(), "rank {r}");
                assert_eq!(mine.iter().map(|&i| sizes[i]).sum::<usize>(), counts[r]);
                at += mine.len();
            }
        }
        // Dealt by hand, largest first onto the lighter rank (ties to rank 0): 100 → 0, 90 → 1,
        // 60 → 1 (90 < 100), 50 → 0 (100 < 150), 40 → 0 (150 = 150), 7, 3 and 1 → 1.
        let d = Ownership::deal(&sizes, 2, 0);
        assert_eq!(d.owner, vec![0, 1, 1, 0, 1, 0, 1, 1]);
        assert_eq!(d.counts(), vec![100 + 50 + 40, 90 + 60 + 7 + 3 + 1]);
    }
}
