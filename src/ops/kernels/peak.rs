//! How close the product kernels come to the CPU: the rate of each precision's multiply-add
//! instruction issued back to back on every thread (512-bit `vfmadd231ps`, `vdpbf16ps` or
//! `vpdpbusd` into independent accumulators, nothing read from memory), against the rate of the
//! kernel that products of that precision take, packing and quantization included. The first is
//! a ceiling no product can pass; their ratio is the share of the machine a product uses.

use std::time::Instant;

use super::issue_rate::thread_rate;
pub use super::issue_rate::Precision;
use super::operands::{Dims, Mat};

/// The instruction a precision's products run on here: bf16 products run on f32 FMAs where the
/// CPU issues those faster (`bf16_gemm::tile_kernel`).
pub fn kernel_instruction(p: Precision) -> Precision {
    match p {
        Precision::Bf16 if available(p) && super::bf16_gemm::tile_kernel() == super::bf16_gemm::TileKernel::Fma => Precision::F32,
        p => p,
    }
}

/// The 512-bit instruction of a precision's products.
pub fn instruction_name(p: Precision) -> &'static str {
    match p {
        Precision::F32 => "vfmadd231ps",
        Precision::Bf16 => "vdpbf16ps",
        Precision::Int8 => "vpdpbusd",
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
    let rates: Vec<f64> = std::thread::scope(|s| {
        // SAFETY: `available` holds for the precision.
        let workers: Vec<_> = (0..threads.max(1)).map(|_| s.spawn(move || unsafe { thread_rate(p, seconds) })).collect();
        workers.into_iter().map(|w| w.join().expect("peak thread")).collect()
    });
    Some(rates.iter().sum())
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
