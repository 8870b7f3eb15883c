//! The rate of each precision's multiply-add instruction issued back to back on one thread
//! (512-bit `vfmadd231ps`, `vdpbf16ps` or `vpdpbusd` into independent accumulators, nothing
//! read from memory): a ceiling no product of that precision can pass, and what the bf16 kernel
//! compares to choose how it multiplies.

use std::time::Instant;

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

/// Multiply-adds per second of the precision's instruction issued back to back on the calling
/// thread for about `seconds` (one burst of [`BURST`] rounds if 0).
///
/// # Safety
/// The CPU must have the precision's instruction.
pub unsafe fn thread_rate(p: Precision, seconds: f64) -> f64 {
    let per_burst = (CHAINS * BURST * macs_per_instruction(p)) as f64;
    let start = Instant::now();
    let mut bursts = 0u64;
    let mut sink = 0f32;
    while bursts == 0 || start.elapsed().as_secs_f64() < seconds {
        sink += burst(p);
        bursts += 1;
    }
    std::hint::black_box(sink);
    bursts as f64 * per_burst / start.elapsed().as_secs_f64()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The timed loops do the multiply-adds they count: a burst's sum is exactly the count times
    /// one product (2⁻²⁰ in f32 and bf16, whose partial sums are all exact; 1 in int8).
    #[test]
    fn bursts_compute_what_they_count() {
        for p in [Precision::F32, Precision::Bf16, Precision::Int8] {
            if !crate::ops::kernels::peak::available(p) {
                eprintln!("skipped {p:?}: this CPU lacks its instruction");
                continue;
            }
            let one = if p == Precision::Int8 { 1.0 } else { (SMALL as f64).powi(2) };
            let want = one * (CHAINS * BURST * macs_per_instruction(p)) as f64;
            assert_eq!(unsafe { burst(p) } as f64, want, "{p:?}");
        }
    }
}
