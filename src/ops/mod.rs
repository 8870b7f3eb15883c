//! align's own ops: layers candle makes slow or cannot differentiate, each with its own backward
//! pass, on the CPU and (with `--features cuda`) on CUDA GPUs.
//!
//! - `kernels/`: one op per file, one pass over the data each (LayerNorm, the attention softmax,
//!   bias + GELU, column sums, BatchNorm, channel scaling, spatial means, stochastic depth,
//!   depthwise / 1×1 / dense convolution, linear layers).
//! - `blocks/`: ops that chain kernels into a whole block and run its backward pass themselves
//!   (attention, the transformer's sub-layers, MBConv, squeeze-and-excitation, conv + BatchNorm).
//! - `gemm_layout`: the operand layouts a GPU product takes as they lie.
//! - `op`: the plumbing every op shares, written once ([`op::Kernel`] → candle's custom ops).
//! - `gpu/`: the one GPU launch path: launch plans per `.cu` file, their PTX, the CUDA executor
//!   and the tests' host emulation of the CUDA sources.
//!
//! Nothing here knows about towers, files or training.

use candle_core::{Layout, Result};

pub mod blocks;
pub(crate) mod fast_math;
mod float;
pub mod gemm_layout;
pub mod gpu;
pub mod kernels;
pub(crate) mod op;
pub mod pool;
mod simd;

pub(crate) use float::Float;
pub(crate) use simd::{lane_dot, lane_max, lane_sum, simd, LANES};

fn contiguous<'a, T>(data: &'a [T], l: &Layout, what: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{what} must be contiguous"),
    }
}

/// Whether the CPU kernels here can run an op on `x` and its `params`: all on the CPU, in f32
/// or f64, in one dtype. Elsewhere (GPUs, bf16) the layers compose candle ops.
pub fn fusable(x: &candle_core::Tensor, params: &[&candle_core::Tensor]) -> bool {
    x.device().is_cpu() && float_operands(x, params)
}

/// Whether the per-op kernels run on `x` and `params`: the row-wise ops (LayerNorm, the
/// attention softmax, bias + GELU, column sums) and the per-channel ops (batch moments, BatchNorm
/// with SiLU, channel scaling, spatial means, the scaled residual). They exist on the CPU and,
/// with the `cuda` feature and unless `ALIGN_KERNELS=candle` ([`gpu_kernels`]), on CUDA GPUs
/// (`kernels/rows.cu`, `kernels/channels.cu`), in f32 or f64 of one dtype.
pub fn has_kernels(x: &candle_core::Tensor, params: &[&candle_core::Tensor]) -> bool {
    (x.device().is_cpu() || (x.device().is_cuda() && gpu_kernels() == GpuKernels::Align)) && float_operands(x, params)
}

/// Whose ops run on CUDA GPUs: align's kernels (`kernels/*.cu`, the depthwise convolution and
/// the optimizer update; the default, since every one matched the CPU on an H200 in
/// `scripts/gpu-proof.sh`, as did training on them), or candle's own ops composed
/// (`ALIGN_KERNELS=candle`, the fallback). Either way the CPU runs align's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuKernels {
    Candle,
    Align,
}

/// The choice `ALIGN_KERNELS` makes (None: unset), and a warning for a value that is neither.
fn kernels_from_env(value: Option<&str>) -> (GpuKernels, Option<String>) {
    match value {
        None | Some("") | Some("align") => (GpuKernels::Align, None),
        Some("candle") => (GpuKernels::Candle, None),
        Some(other) => {
            (GpuKernels::Align, Some(format!("ALIGN_KERNELS={other:?} is neither \"align\" nor \"candle\"; using align's kernels on GPUs")))
        }
    }
}

static GPU_KERNELS: std::sync::OnceLock<std::sync::atomic::AtomicBool> = std::sync::OnceLock::new();

fn gpu_kernels_flag() -> &'static std::sync::atomic::AtomicBool {
    GPU_KERNELS.get_or_init(|| {
        let (choice, warning) = kernels_from_env(std::env::var("ALIGN_KERNELS").ok().as_deref());
        if let Some(w) = warning {
            crate::util::log::warn(w);
        }
        std::sync::atomic::AtomicBool::new(choice == GpuKernels::Align)
    })
}

/// The ops CUDA GPUs run (`ALIGN_KERNELS`; never align's in a build without `cuda`).
pub fn gpu_kernels() -> GpuKernels {
    if cfg!(feature = "cuda") && gpu_kernels_flag().load(std::sync::atomic::Ordering::Relaxed) {
        GpuKernels::Align
    } else {
        GpuKernels::Candle
    }
}

/// Chooses the ops CUDA GPUs run for the rest of the process, over `ALIGN_KERNELS`
/// (`align bench ops` checks align's kernels whatever the environment says).
pub fn set_gpu_kernels(k: GpuKernels) {
    gpu_kernels_flag().store(k == GpuKernels::Align, std::sync::atomic::Ordering::Relaxed);
}

fn float_operands(x: &candle_core::Tensor, params: &[&candle_core::Tensor]) -> bool {
    matches!(x.dtype(), candle_core::DType::F32 | candle_core::DType::F64) && params.iter().all(|p| p.dtype() == x.dtype())
}

/// Length of the last dimension (rows of a `[.., cols]` tensor), at least 1.
fn last_dim(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(1).max(1)
}

/// Borrows the contiguous CPU data of a tensor an op reads besides its inputs (a backward op's
/// saved operands, a layer's parameters) as `&[T]` for `f`; `T` must be the tensor's dtype.
fn with_cpu_slice<T: Float + candle_core::WithDType, R>(
    t: &candle_core::Tensor,
    what: &str,
    f: impl FnOnce(&[T]) -> Result<R>,
) -> Result<R> {
    let held = [t.storage_and_layout()];
    f(cpu_slices(&held, what)?[0])
}

/// [`with_cpu_slice`] for several tensors: `held` their `storage_and_layout()` guards, kept by
/// the caller while the slices are in use.
fn cpu_slices<'a, T: Float + candle_core::WithDType>(
    held: &'a [(candle_core::StorageRef<'_>, &Layout)],
    what: &str,
) -> Result<Vec<&'a [T]>> {
    held.iter()
        .map(|(storage, layout)| {
            let candle_core::Storage::Cpu(cpu) = &**storage else { candle_core::bail!("{what} must be on the CPU") };
            contiguous(cpu.as_slice::<T>()?, layout, what)
        })
        .collect()
}

/// A kernel's output buffer of `n` elements, left unfilled.
///
/// Zero-filling outputs that a kernel then overwrites cost 5–6% of a B0 step: the allocator's
/// calloc clears recycled memory with one thread, and the kernel streams over it again.
///
/// # Safety
/// The caller writes every element before anything reads it (each caller's comment says how).
#[allow(clippy::uninit_vec)]
unsafe fn output_buffer<T: Float>(n: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    v.set_len(n);
    v
}

/// Row blocks for reductions over rows: enough blocks to keep every thread busy, each long
/// enough that its partial sums cost little next to the pass itself.
fn row_block(rows: usize) -> usize {
    rows.div_ceil(4 * rayon::current_num_threads()).max(16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_runs_aligns_kernels_whatever_gpus_are_told() {
        let x = candle_core::Tensor::zeros(4, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        for choice in [GpuKernels::Candle, GpuKernels::Align] {
            set_gpu_kernels(choice);
            assert!(has_kernels(&x, &[]));
            // A build without CUDA has no GPU kernels to choose.
            assert_eq!(gpu_kernels() == GpuKernels::Align, cfg!(feature = "cuda") && choice == GpuKernels::Align);
        }
        set_gpu_kernels(GpuKernels::Candle);
        assert!(!has_kernels(&x.to_dtype(candle_core::DType::BF16).unwrap(), &[]));
    }

    #[test]
    fn gpus_run_aligns_kernels_unless_told_candle() {
        for unset in [None, Some("")] {
            assert_eq!(kernels_from_env(unset), (GpuKernels::Align, None));
        }
        assert_eq!(kernels_from_env(Some("align")), (GpuKernels::Align, None));
        assert_eq!(kernels_from_env(Some("candle")), (GpuKernels::Candle, None));
        let (choice, warning) = kernels_from_env(Some("Candle "));
        assert_eq!(choice, GpuKernels::Align);
        assert!(warning.unwrap().contains("\"Candle \" is neither"));
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use candle_core::{DType, Tensor};

    pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
    }

    pub fn max_abs(a: &Tensor) -> f64 {
        a.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
    }

    /// Central finite differences of `f` (a scalar function of one tensor) at a few positions,
    /// against the analytic gradient `g`. Returns the largest error relative to the largest
    /// gradient entry (a per-entry relative error would measure the rounding of the loss at
    /// entries whose gradient is near zero).
    pub fn check_fd(f: impl Fn(&Tensor) -> f64, x: &Tensor, g: &Tensor, positions: &[usize]) -> f64 {
        let flat = x.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let gf = g.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let h = 1e-6;
        let scale = gf.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-12);
        let mut worst = 0.0f64;
        for &i in positions {
            let mut plus = flat.clone();
            plus[i] += h;
            let mut minus = flat.clone();
            minus[i] -= h;
            let t = |v: Vec<f64>| Tensor::from_vec(v, x.dims(), x.device()).unwrap();
            let fd = (f(&t(plus)) - f(&t(minus))) / (2.0 * h);
            worst = worst.max((fd - gf[i]).abs() / scale);
        }
        worst
    }
}
