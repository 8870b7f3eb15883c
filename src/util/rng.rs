//! Deterministic random numbers whose whole state is a couple of integers.
//!
//! Resuming a run exactly means every random draw (shard order, shuffle buffer, crops, flips,
//! weight init) must be reproducible from something small enough to store in a checkpoint. We
//! therefore avoid thread-local generators: every stream is a SplitMix64 counter, and streams for
//! independent purposes are derived by hashing a seed together with the purpose's coordinates
//! (epoch, rank, worker, sample index, tensor name...).

use serde::{Deserialize, Serialize};

/// The SplitMix64 finaliser: a bijective 64-bit mixer with good avalanche behaviour.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hashes a seed and a list of coordinates into one well-mixed 64-bit value.
pub fn derive_seed(seed: u64, parts: &[u64]) -> u64 {
    let mut h = mix64(seed ^ 0x9e37_79b9_7f4a_7c15);
    for &p in parts {
        h = mix64(h ^ p.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(0x632b_e59b_d9b4_e019));
    }
    h
}

/// Stable 64-bit hash of a string (FNV-1a followed by a mix), for seeding per tensor name.
pub fn hash_str(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h)
}

/// A SplitMix64 generator. Its state is one `u64`, so it serialises trivially.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rng {
    pub state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn derived(seed: u64, parts: &[u64]) -> Self {
        Self::new(derive_seed(seed, parts))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.state)
    }

    /// Uniform in [0, 1) with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next_f64()
    }

    /// Uniform integer in [0, n). Uses Lemire's multiply-shift; the bias is below 2^-32 for the
    /// sizes we draw (buffer and shard indices).
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "Rng::below(0)");
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    pub fn bernoulli(&mut self, p: f64) -> bool {
        self.next_f64() < p
    }

    /// Standard normal by Box-Muller (one value per call; simplicity over speed).
    pub fn normal(&mut self) -> f64 {
        let u1 = (self.next_f64()).max(f64::MIN_POSITIVE);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

/// A tensor of normal samples from a seeded stream: candle's own `randn` draws from an unseeded
/// generator on the CPU, which makes numerical tests flaky.
pub fn randn<S: Into<candle_core::Shape>>(
    seed: u64,
    mean: f64,
    std: f64,
    shape: S,
    dtype: candle_core::DType,
    device: &candle_core::Device,
) -> candle_core::Result<candle_core::Tensor> {
    let shape = shape.into();
    let mut rng = Rng::new(seed);
    let v: Vec<f64> = (0..shape.elem_count()).map(|_| mean + std * rng.normal()).collect();
    candle_core::Tensor::from_vec(v, shape, device)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_gives_same_stream_and_different_seeds_differ() {
        let a: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::new(7);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::new(7);
                move |_| r.next_u64()
            })
            .collect();
        let c = Rng::new(8).next_u64();
        assert_eq!(a, b);
        assert_ne!(a[0], c);
    }

    #[test]
    fn uniform_and_normal_have_the_right_moments() {
        let mut r = Rng::new(1);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| r.next_f64()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.005, "uniform mean {mean}");
        let zs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let m = zs.iter().sum::<f64>() / n as f64;
        let v = zs.iter().map(|z| (z - m) * (z - m)).sum::<f64>() / n as f64;
        assert!(m.abs() < 0.01 && (v - 1.0).abs() < 0.02, "normal mean {m} var {v}");
    }

    #[test]
    fn below_covers_every_value_and_nothing_else() {
        let mut r = Rng::new(3);
        let mut seen = [0usize; 5];
        for _ in 0..10_000 {
            seen[r.below(5)] += 1;
        }
        assert!(seen.iter().all(|&c| c > 1500), "{seen:?}");
    }

    #[test]
    fn derived_streams_depend_on_every_coordinate() {
        let base = derive_seed(1, &[2, 3]);
        assert_ne!(base, derive_seed(1, &[3, 2]));
        assert_ne!(base, derive_seed(2, &[2, 3]));
        assert_eq!(base, derive_seed(1, &[2, 3]));
    }
}
