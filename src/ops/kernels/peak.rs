//! How close the product kernels come to the CPU: the rate of each precision's multiply-add
//! instruction issued back to back on every thread (512-bit `vfmadd231ps`, `vdpbf16ps` or
//! `vpdpbusd` into independent accumulators, nothing read from memory), against the rate of the
//! kernel that products of that precision take, packing and quantization included. The first is
//! a ceiling no product can pass; their ratio is the share of the machine a product uses.

use std::time::Instant;

use super::operands::{Dims, Mat};

/// The operands a product multiplies: the three precisions of the product kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
    Int8,
}

/// Independent accumulators per thread: enough to cover the instructions' latency (4-6 cycles)
/// at two issued a cycle, and few enough to stay in registers.
const CHAINS: usize = 12;

/// Instructions per chain between clock reads.
const BURST: usize = 20_000;

/// The operands of the timed f32 and bf16 loops: 2⁻¹⁰ (bf16 `0x3a80`), so that every sum is
/// exact and the test can check the count.
const SMALL: f32 = 1.0 / 1024.0;

/// Multiply-adds one 512-bit instruction of the precision does.
fn macs_per_instruction(p: Precision) -> usize {
    match p {
        Precision::F32 => 16,
        Precision::Bf16 => 32,
        Precision::Int8 => 64,
    }
}

/// Whether this CPU has the precision's instruction (AVX-512 F; BF16; VNNI).
pub fn available(p: Precision) -> bool {
    match p {
        Precision::F32 => avx512f(),
        Precision::Bf16 => super::bf16_gemm::available(),
        Precision::Int8 => super::int8_gemm::available(),
    }
}

fn avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        !crate::ops::simd::avx512_disabled() && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Multiply-adds per second of the precision's instruction on `threads` threads at once, each
/// issuing for about `seconds`; `None` where the CPU lacks it.
pub fn instruction_peak(p: Precision, threads: usize, seconds: f64) -> Option<f64> {
    if !available(p) {
        return None;
    }
    let per_burst = (CHAINS * BURST * macs_per_instruction(p)) as f64;
    let rates: Vec<f64> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(move || {
                    let start = Instant::now();
                    let mut bursts = 0u64;
                    let mut sink = 0f32;
                    while bursts == 0 || start.elapsed().as_secs_f64() < seconds {
                        // SAFETY: `available` holds for the precision.
                        sink += unsafe { burst(p) };
                        bursts += 1;
                    }
                    std::hint::black_box(sink);
                    bursts as f64 * per_burst / start.elapsed().as_secs_f64()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("peak thread")).collect()
    });
    Some(rates.iter().sum())
}

/// [`BURST`] rounds of [`CHAINS`] instructions; returns something of the sums so that they are
/// computed.
///
/// # Safety
/// The CPU must have the precision's instruction ([`available`]).
unsafe fn burst(p: Precision) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        match p {
            Precision::F32 => burst_f32(),
            Precision::Bf16 => burst_bf16(),
            Precision::Int8 => burst_int8(),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = p;
        unreachable!("no product instructions are timed off x86-64")
    }
}

/// [`BURST`] rounds of one instruction into each of [`CHAINS`] accumulators held in named
/// registers (an array of them was kept partly on the stack, and the loads and stores around
/// each instruction halved the rate), then the accumulators' sum.
#[cfg(target_arch = "x86_64")]
macro_rules! chains {
    ($zero:expr, $step:expr, $sum:expr) => {{
        let (mut c0, mut c1, mut c2, mut c3, mut c4, mut c5) = ($zero, $zero, $zero, $zero, $zero, $zero);
        let (mut c6, mut c7, mut c8, mut c9, mut c10, mut c11) = ($zero, $zero, $zero, $zero, $zero, $zero);
        for _ in 0..BURST {
            c0 = $step(c0);
            c1 = $step(c1);
            c2 = $step(c2);
            c3 = $step(c3);
            c4 = $step(c4);
            c5 = $step(c5);
            c6 = $step(c6);
            c7 = $step(c7);
            c8 = $step(c8);
            c9 = $step(c9);
            c10 = $step(c10);
            c11 = $step(c11);
        }
        [c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11].into_iter().map($sum).sum::<f32>()
    }};
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn burst_f32() -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (std::hint::black_box(_mm512_set1_ps(SMALL)), std::hint::black_box(_mm512_set1_ps(SMALL)));
    chains!(_mm512_setzero_ps(), |c| _mm512_fmadd_ps(a, b, c), |c| _mm512_reduce_add_ps(c))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn burst_bf16() -> f32 {
    use std::arch::x86_64::*;
    let pairs: __m512bh = std::mem::transmute(std::hint::black_box(_mm512_set1_epi32(0x3a80_3a80)));
    chains!(_mm512_setzero_ps(), |c| _mm512_dpbf16_ps(c, pairs, pairs), |c| _mm512_reduce_add_ps(c))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn burst_int8() -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (std::hint::black_box(_mm512_set1_epi8(1)), std::hint::black_box(_mm512_set1_epi8(1)));
    chains!(_mm512_setzero_si512(), |c| _mm512_dpbusd_epi32(c, a, b), |c| _mm512_reduce_add_epi32(c) as f32)
}

/// Multiply-adds per second of a linear layer's product `x·Wᵀ` (x `[m, k]`, W `[n, k]`, random)
/// as the forward-only commands run it at precision `p` on the thread pool, packing and
/// quantization included (int8's weight once, as those commands keep it): the median of `reps` calls after one warm-up. `None` where the CPU
/// lacks the precision's instructions (f32 runs everywhere, through gemm).
pub fn product_rate(p: Precision, (m, k, n): (usize, usize, usize), reps: usize) -> Option<f64> {
    if p != Precision::F32 && !available(p) {
        return None;
    }
    let cpu = candle_core::Device::Cpu;
    let random = |seed, len| -> Vec<f32> {
        crate::util::rng::randn(seed, 0.0, 1.0, &[len], candle_core::DType::F32, &cpu).and_then(|t| t.to_vec1()).expect("random operand")
    };
    let x = random(1, m * k);
    let w = crate::util::rng::randn(2, 0.0, 1.0, &[n * k], candle_core::DType::F32, &cpu).expect("random operand");
    // The forward-only commands hold an int8 model's weights frozen, quantized once: so does
    // this, and the warm-up call quantizes it.
    let _frozen = (p == Precision::Int8).then(|| super::frozen::freeze([&w]));
    let (storage, _) = w.storage_and_layout();
    let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(w)) = &*storage else { unreachable!("an f32 tensor on the CPU") };
    let mut y = vec![0f32; m * n];
    let d = Dims { m, n, k };
    let (xm, wm) = (Mat::rows(&x, 0, k), Mat::transposed(w, 0, k));
    let threads = rayon::current_num_threads();
    let mut once = || {
        let start = Instant::now();
        match p {
            Precision::F32 => super::matmul::gemm_into(&mut y, n, d, xm, wm, false),
            // SAFETY: `available` holds; `y` is m × n, rows n apart, and borrowed exclusively.
            Precision::Bf16 => unsafe { super::bf16_gemm::product(y.as_mut_ptr(), 0, n, d, xm, wm, false, threads, None) },
            // SAFETY: as above; x's rows are contiguous and W is read transposed, as int8 needs.
            Precision::Int8 => unsafe { super::int8_gemm::product(y.as_mut_ptr(), 0, n, d, xm, wm, false, threads, None) },
        }
        start.elapsed().as_secs_f64()
    };
    once();
    let mut times: Vec<f64> = (0..reps.max(1)).map(|_| once()).collect();
    times.sort_by(f64::total_cmp);
    Some((m * n * k) as f64 / times[times.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The timed loops do the multiply-adds they count: a burst's sum is exactly the count times
    /// one product (2⁻²⁰ in f32 and bf16, whose partial sums are all exact; 1 in int8).
    #[test]
    fn bursts_compute_what_they_count() {
        for p in [Precision::F32, Precision::Bf16, Precision::Int8] {
            if !available(p) {
                eprintln!("skipped {p:?}: this CPU lacks its instruction");
                continue;
            }
            let one = if p == Precision::Int8 { 1.0 } else { (SMALL as f64).powi(2) };
            let want = one * (CHAINS * BURST * macs_per_instruction(p)) as f64;
            assert_eq!(unsafe { burst(p) } as f64, want, "{p:?}");
        }
    }

    #[test]
    fn rates_are_positive_where_the_instructions_are() {
        for p in [Precision::F32, Precision::Bf16, Precision::Int8] {
            let peak = instruction_peak(p, 1, 0.01);
            assert_eq!(peak.is_some(), available(p));
            assert!(peak.is_none_or(|r| r > 0.0));
            let rate = product_rate(p, (30, 40, 50), 1);
            assert_eq!(rate.is_some(), p == Precision::F32 || available(p));
            assert!(rate.is_none_or(|r| r > 0.0));
        }
    }
}
