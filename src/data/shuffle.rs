//! The loader's shuffle buffer: samples wait in it until a seeded draw picks one, as webdataset's
//! `shuffle(n)` does. Each entry keeps where it came from (the worker's shard cursor and the
//! sample's index in that shard), so a checkpoint stores the buffer as those identities alone
//! and a resumed loader refills it by re-reading them.

use crate::util::rng::Rng;

/// A sample in the buffer: its shard cursor, its index in that shard, and the sample.
pub type Entry<T> = (usize, u64, T);

pub struct ShuffleBuffer<T> {
    entries: Vec<Entry<T>>,
    capacity: usize,
}

impl<T> ShuffleBuffer<T> {
    /// A buffer that holds `capacity` samples before [`ShuffleBuffer::is_over`] asks for a draw
    /// (0: every sample leaves as soon as it arrives).
    pub fn new(capacity: usize) -> Self {
        ShuffleBuffer { entries: Vec::new(), capacity }
    }

    pub fn push(&mut self, cursor: usize, index: u64, item: T) {
        self.entries.push((cursor, index, item));
    }

    /// Whether the buffer holds more than its capacity: time for a draw.
    pub fn is_over(&self) -> bool {
        self.entries.len() > self.capacity
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Takes the sample `rng` picks (uniformly; the last one moves into its place).
    pub fn draw(&mut self, rng: &mut Rng) -> Option<Entry<T>> {
        if self.entries.is_empty() {
            return None;
        }
        let k = rng.below(self.entries.len());
        Some(self.entries.swap_remove(k))
    }

    /// The earliest shard position a buffered sample comes from.
    pub fn oldest_cursor(&self) -> Option<usize> {
        self.entries.iter().map(|(c, _, _)| *c).min()
    }

    /// The identities `(cursor, index)` of the buffered samples, in buffer order: what a
    /// checkpoint stores.
    pub fn positions(&self) -> Vec<(usize, u64)> {
        self.entries.iter().map(|(c, i, _)| (*c, *i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(buffer: &mut ShuffleBuffer<u32>, seed: u64) -> Vec<u32> {
        let mut out = Vec::new();
        let mut draws = 0u64;
        while let Some((_, _, v)) = buffer.draw(&mut Rng::derived(seed, &[draws])) {
            draws += 1;
            out.push(v);
        }
        out
    }

    fn filled(n: u32) -> ShuffleBuffer<u32> {
        let mut b = ShuffleBuffer::new(4);
        for v in 0..n {
            b.push(v as usize / 3, v as u64 % 3, v);
        }
        b
    }

    #[test]
    fn draws_take_every_sample_once_in_a_seeded_order() {
        let a = drain(&mut filled(20), 7);
        assert_eq!(a, drain(&mut filled(20), 7), "the same seed, the same order");
        assert_ne!(a, drain(&mut filled(20), 8), "another seed, another order");
        assert_ne!(a, (0..20).collect::<Vec<_>>(), "shuffled");
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..20).collect::<Vec<_>>());
    }

    #[test]
    fn capacity_and_positions() {
        let mut b = ShuffleBuffer::new(2);
        b.push(0, 5, 'a');
        b.push(1, 0, 'b');
        assert!(!b.is_over());
        b.push(1, 1, 'c');
        assert!(b.is_over());
        assert_eq!(b.positions(), vec![(0, 5), (1, 0), (1, 1)]);
        // A zero capacity sends every sample on at once.
        let mut unbuffered = ShuffleBuffer::new(0);
        unbuffered.push(0, 0, 'x');
        assert!(unbuffered.is_over());
    }
}
