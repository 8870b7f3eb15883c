//! Custom candle ops with their own backward passes, for layers candle makes slow or cannot
//! differentiate.

use candle_core::{Layout, Result};

pub mod attention;
pub mod bias;
pub mod channel;
pub mod check;
pub mod conv_norm;
pub mod dense_conv;
pub mod depthwise;
pub mod fast_math;
// Without the `cuda` feature, only the tests run its programs (on the host emulation).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod gpu;
#[cfg(test)]
pub(crate) mod kernel_host;
pub mod layer_norm;
pub mod linear;
mod matmul;
pub mod mbconv;
pub mod pointwise;
pub mod residual;
pub mod softmax;
pub mod squeeze_excite;

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
/// with the `cuda` feature, on CUDA GPUs (`kernels/rows.cu`, `kernels/channels.cu`), in f32 or
/// f64 of one dtype.
pub fn has_kernels(x: &candle_core::Tensor, params: &[&candle_core::Tensor]) -> bool {
    (x.device().is_cpu() || (cfg!(feature = "cuda") && x.device().is_cuda())) && float_operands(x, params)
}

fn float_operands(x: &candle_core::Tensor, params: &[&candle_core::Tensor]) -> bool {
    matches!(x.dtype(), candle_core::DType::F32 | candle_core::DType::F64) && params.iter().all(|p| p.dtype() == x.dtype())
}

/// A three-operand op run outside candle's graph on detached operands and kept with them, so
/// that an op chaining several (`ops::mbconv`) runs their backward passes itself.
pub struct Stage<C> {
    op: C,
    args: [candle_core::Tensor; 3],
}

impl<C: candle_core::CustomOp3> Stage<C> {
    fn run(op: C, args: [&candle_core::Tensor; 3]) -> Result<(candle_core::Tensor, Self)> {
        let [a, b, c] = args.map(|t| t.detach().contiguous());
        let args = [a?, b?, c?];
        let y = args[0].apply_op3_no_bwd(&args[1], &args[2], &op)?;
        Ok((y, Stage { op, args }))
    }

    /// The gradients of the three operands, from the output's.
    pub fn backward(&self, grad: &candle_core::Tensor) -> Result<(candle_core::Tensor, candle_core::Tensor, candle_core::Tensor)> {
        let [a, b, c] = &self.args;
        let (Some(da), Some(db), Some(dc)) = self.op.bwd(a, b, c, grad, grad)? else {
            candle_core::bail!("{}: backward pass without every gradient", self.op.name())
        };
        Ok((da, db, dc))
    }
}

/// The dtype suffix of a CUDA kernel's name: `kernels/*.cu` instantiate each in f32 and f64.
#[cfg(any(test, feature = "cuda"))]
fn kernel_suffix<T: Float>() -> &'static str {
    if std::mem::size_of::<T>() == 4 {
        "f32"
    } else {
        "f64"
    }
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
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else { candle_core::bail!("{what} must be on the CPU") };
    f(contiguous(cpu.as_slice::<T>()?, layout, what)?)
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

/// f32 or f64. Per-element arithmetic runs in the storage's own precision (f32 math is about
/// twice as fast and vectorises twice as wide); constants are prepared in f64. `erf` is
/// `fast_math`'s in f32 (libm's scalar `erff` was 3.5% of a ViT-Ti step) and libm's in f64, the
/// precision the gradient checks run in; `exp` likewise (libm's `expf` is a scalar call, which
/// keeps SiLU and softmax loops from vectorising: with `fast_math::exp` and [`simd`], a B0
/// step's BatchNorm backward went from 273 to 147 ms).
pub(crate) trait Float:
    candle_core::WithDType
    + Copy
    + PartialOrd
    + Send
    + Sync
    + Default
    + 'static
    + std::ops::Add<Output = Self>
    + std::ops::AddAssign
    + std::ops::MulAssign
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
{
    fn f(self) -> f64;
    fn from(v: f64) -> Self;
    fn exp(self) -> Self;
    fn sqrt(self) -> Self;
    fn erf(self) -> Self;
    /// `(erf(x), e^(−x²))`.
    fn erf_and_gauss(self) -> (Self, Self);
}

impl Float for f32 {
    fn f(self) -> f64 {
        self as f64
    }
    fn from(v: f64) -> Self {
        v as f32
    }
    fn exp(self) -> Self {
        fast_math::exp(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn erf(self) -> Self {
        fast_math::erf(self)
    }
    fn erf_and_gauss(self) -> (Self, Self) {
        fast_math::erf_and_gauss(self)
    }
}

impl Float for f64 {
    fn f(self) -> f64 {
        self
    }
    fn from(v: f64) -> Self {
        v
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn erf(self) -> Self {
        candle_core::cpu::erf::erf_f64(self)
    }
    fn erf_and_gauss(self) -> (Self, Self) {
        (Float::erf(self), (-self * self).exp())
    }
}

/// Runs `$body` with `$x` bound to the contiguous f32 or f64 slice of a storage; the result is
/// wrapped back into a storage of the same type.
macro_rules! float_dispatch {
    ($s:expr, $l:expr, $what:expr, |$x:ident| $body:expr) => {
        match $s {
            CpuStorage::F32(d) => {
                let $x = super::contiguous(d, $l, $what)?;
                CpuStorage::F32($body)
            }
            CpuStorage::F64(d) => {
                let $x = super::contiguous(d, $l, $what)?;
                CpuStorage::F64($body)
            }
            _ => candle_core::bail!("{} supports f32 and f64", $what),
        }
    };
}

macro_rules! float_dispatch2 {
    ($s1:expr, $l1:expr, $s2:expr, $l2:expr, $what:expr, |$a:ident, $b:ident| $body:expr) => {
        match ($s1, $s2) {
            (CpuStorage::F32(d1), CpuStorage::F32(d2)) => {
                let ($a, $b) = (super::contiguous(d1, $l1, $what)?, super::contiguous(d2, $l2, $what)?);
                CpuStorage::F32($body)
            }
            (CpuStorage::F64(d1), CpuStorage::F64(d2)) => {
                let ($a, $b) = (super::contiguous(d1, $l1, $what)?, super::contiguous(d2, $l2, $what)?);
                CpuStorage::F64($body)
            }
            _ => candle_core::bail!("{} supports f32 and f64 with matching dtypes", $what),
        }
    };
}

macro_rules! float_dispatch3 {
    ($s1:expr, $l1:expr, $s2:expr, $l2:expr, $s3:expr, $l3:expr, $what:expr, |$a:ident, $b:ident, $c:ident| $body:expr) => {
        match ($s1, $s2, $s3) {
            (CpuStorage::F32(d1), CpuStorage::F32(d2), CpuStorage::F32(d3)) => {
                let ($a, $b, $c) =
                    (super::contiguous(d1, $l1, $what)?, super::contiguous(d2, $l2, $what)?, super::contiguous(d3, $l3, $what)?);
                CpuStorage::F32($body)
            }
            (CpuStorage::F64(d1), CpuStorage::F64(d2), CpuStorage::F64(d3)) => {
                let ($a, $b, $c) =
                    (super::contiguous(d1, $l1, $what)?, super::contiguous(d2, $l2, $what)?, super::contiguous(d3, $l3, $what)?);
                CpuStorage::F64($body)
            }
            _ => candle_core::bail!("{} supports f32 and f64 with matching dtypes", $what),
        }
    };
}

pub(crate) use {float_dispatch, float_dispatch2, float_dispatch3};

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

#[cfg(target_arch = "x86_64")]
mod cpu {
    use std::arch::is_x86_feature_detected as has;

    pub fn has_avx512() -> bool {
        // `ALIGN_NO_AVX512=1` keeps the 8-wide code, to compare the two on one machine.
        static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *YES.get_or_init(|| {
            std::env::var_os("ALIGN_NO_AVX512").is_none()
                && has!("avx512f")
                && has!("avx512bw")
                && has!("avx512dq")
                && has!("avx512vl")
                && has_avx2()
        })
    }

    pub fn has_avx2() -> bool {
        has!("avx2") && has!("fma")
    }
}

/// Independent partial sums in the reductions below: enough for a loop to vectorise (one running
/// sum is a chain the compiler may not reorder; 16 f32 are two AVX2 registers) and shorter
/// chains than one running sum, so less rounding.
const LANES: usize = 16;

/// Σ x in lane-wise partial sums.
#[inline(always)]
fn lane_sum<T: Float>(x: &[T]) -> T {
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
fn lane_max<T: Float>(x: &[T]) -> T {
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
fn lane_dot<T: Float>(a: &[T], b: &[T]) -> T {
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

/// Row blocks for reductions over rows: enough blocks to keep every thread busy, each long
/// enough that its partial sums cost little next to the pass itself.
fn row_block(rows: usize) -> usize {
    rows.div_ceil(4 * rayon::current_num_threads()).max(16)
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
