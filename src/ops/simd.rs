//! Wide element loops: AVX-512 or AVX2 code picked at run time, and reductions in lane-wise
//! partial sums that vectorise.

use super::Float;

/// Runs `f` inside a function compiled for AVX-512 (16 wide) or AVX2 and FMA (8 wide) when the
/// CPU has them, so the element loops inlined into it vectorise with fused multiply-adds. The
/// crate is built for baseline x86-64 (SSE2, 4 wide) so the binary runs on any x86-64; this picks
/// the wider code at run time, per call, as gemm does for its matmul kernels. Call it inside each
/// parallel task: code in rayon's closures is compiled on its own and does not inherit the
/// features.
#[inline(always)]
pub(crate) fn simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if cpu::has_avx512() {
            #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
            unsafe fn wide512<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: the CPU has the features `wide512` is compiled for (`has_avx512`).
            return unsafe { wide512(f) };
        }
        if cpu::has_avx2() {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn wide<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: the CPU has the features `wide` is compiled for (`has_avx2`).
            return unsafe { wide(f) };
        }
    }
    f()
}

/// Whether `ALIGN_NO_AVX512` is set: every AVX-512 path (the 16-wide loops, the bf16 and int8
/// products, the instruction peaks) then stays off, so one machine shows what a CPU with AVX2
/// only runs, both to compare the two and to test the refusals such a CPU gives.
pub(crate) fn avx512_disabled() -> bool {
    static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *YES.get_or_init(|| std::env::var_os("ALIGN_NO_AVX512").is_some())
}

#[cfg(target_arch = "x86_64")]
mod cpu {
    use std::arch::is_x86_feature_detected as has;

    pub fn has_avx512() -> bool {
        static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *YES.get_or_init(|| {
            !super::avx512_disabled() && has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") && has_avx2()
        })
    }

    pub fn has_avx2() -> bool {
        has!("avx2") && has!("fma")
    }
}

/// Independent partial sums in the reductions below: enough for a loop to vectorise (one running
/// sum is a chain the compiler may not reorder; 16 f32 are two AVX2 registers) and shorter
/// chains than one running sum, so less rounding.
pub(crate) const LANES: usize = 16;

/// Σ x in lane-wise partial sums.
#[inline(always)]
pub(crate) fn lane_sum<T: Float>(x: &[T]) -> T {
    let mut acc = [T::default(); LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    let rest = chunks.remainder().iter().fold(T::default(), |s, &v| s + v);
    acc.iter().fold(rest, |s, &v| s + v)
}

/// The largest element (−∞ for an empty slice) in lane-wise partial maxima.
#[inline(always)]
pub(crate) fn lane_max<T: Float>(x: &[T]) -> T {
    let mut acc = [T::from(f64::NEG_INFINITY); LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    let mut m = T::from(f64::NEG_INFINITY);
    for &v in chunks.remainder().iter().chain(&acc) {
        m = if v > m { v } else { m };
    }
    m
}

/// Σ a·b in lane-wise partial sums.
#[inline(always)]
pub(crate) fn lane_dot<T: Float>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::default(); LANES];
    let (mut ac, mut bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (av, bv) in (&mut ac).zip(&mut bc) {
        for l in 0..LANES {
            acc[l] += av[l] * bv[l];
        }
    }
    let rest = ac.remainder().iter().zip(bc.remainder()).fold(T::default(), |s, (&p, &q)| s + p * q);
    acc.iter().fold(rest, |s, &v| s + v)
}
