//! 1×1 convolution of NCHW tensors as one op: per image, `y[n] = W·x[n]` with W `[out, c]` and
//! x[n] `[c, h·w]`, so neither side is transposed or copied.
//!
//! As a broadcast matmul, candle's backward makes one weight gradient per image (`[n, out, c]`)
//! and sums them on one thread. Here the images' products accumulate into one weight gradient
//! per thread inside the matmul kernel, and the input gradient `Wᵀ·dy[n]` reads W transposed in place.

use candle_core::{DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::batch_norm::sigmoid;
use super::bf16_gemm::Scope;
use super::linear::sum_over_image_runs;
use super::matmul::{gemm_into, gemm_serial, gemm_shared, SharedDst};
use super::operands::{Dims as Product, Mat};
use crate::ops::op::{Kernel, Op};
use crate::ops::{output_buffer, simd, Float};

#[derive(Clone, Copy)]
pub(crate) struct Dims {
    n: usize,
    c: usize,
    out: usize,
    hw: usize,
}

fn dims(x: &[usize], w: &[usize]) -> Result<Dims> {
    match (x, w) {
        ([n, c, h, wd], [out, wc, 1, 1]) if c == wc => Ok(Dims { n: *n, c: *c, out: *out, hw: h * wd }),
        _ => candle_core::bail!("1x1 convolution: input {x:?} and weight {w:?} do not fit ([N, C, H, W] and [O, C, 1, 1])"),
    }
}

struct Forward;

impl Forward {
    fn run<T: Float>(d: Dims, x: &[T], w: &[T]) -> Vec<T> {
        // SAFETY: each image's product fills its own output plane block.
        let mut y = unsafe { output_buffer::<T>(d.n * d.out * d.hw) };
        let product = Product { m: d.out, n: d.hw, k: d.c };
        for (yn, xn) in y.chunks_mut(d.out * d.hw).zip(x.chunks(d.c * d.hw)) {
            gemm_into(yn, d.hw, product, Mat::rows(w, 0, d.c), Mat::rows(xn, 0, d.hw), false);
        }
        y
    }
}

impl Kernel<2> for Forward {
    const NAME: &'static str = "pointwise-conv2d";
    const PROFILE: &'static str = "op/pointwise";
    type Geometry = Dims;

    fn geometry(&self, [x, w]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        let d = dims(x.dims(), w.dims())?;
        let (_, _, h, wd) = x.shape().dims4()?;
        Ok((d, Shape::from((d.n, d.out, h, wd))))
    }

    fn cpu<T: Float>(&self, &d: &Self::Geometry, [x, w]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(Self::run(d, x, w))
    }

    fn backward(&self, [x, w]: [&Tensor; 2], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let (dx, dw) = backward(x, w, grad)?;
        Ok([Some(dx), Some(dw)])
    }
}

/// The 1×1 convolution with a BatchNorm that normalises with running statistics folded in:
/// `y[i] = act(W[i]·x[i] + shift (+ residual[i]))` for images `i` of `x` `[n, c, hw]`, with
/// `shift` `[out]` what the BatchNorm adds and SiLU as `act` when `silu`. `weights` is one
/// `[out, c]` matrix, or one per image (`per_image`: squeeze-excitation's factors folded in too).
///
/// Each task is one image's product over a block of columns small enough that its output is
/// still in cache when the shift, the residual and the activation are applied to it.
pub(crate) fn forward_folded<T: Float>(
    x: &[T],
    (n, c, hw): (usize, usize, usize),
    weights: &[T],
    per_image: bool,
    shift: &[T],
    silu: bool,
    residual: Option<&[T]>,
) -> Vec<T> {
    let out = shift.len();
    assert_eq!(x.len(), n * c * hw, "1x1 convolution: input of the wrong size");
    assert_eq!(weights.len(), if per_image { n } else { 1 } * out * c, "1x1 convolution: weights of the wrong size");
    assert!(residual.is_none_or(|r| r.len() == n * out * hw), "1x1 convolution: residual of the wrong size");
    // About 256 KB of output per block (an L2 cache holds it with the block's input), in whole
    // vectors of columns.
    let cols = ((64 * 1024 / out.max(1)) / 16 * 16).max(64).min(hw.max(1));
    let blocks = hw.div_ceil(cols);
    // SAFETY: every (image, block) task's product writes its block, and the task then finishes it.
    let mut y = unsafe { output_buffer::<T>(n * out * hw) };
    let dst = SharedDst::new(&mut y);
    let scope = Scope::current();
    (0..n * blocks).into_par_iter().for_each(|task| {
        let (i, j0) = (task / blocks, (task % blocks) * cols);
        let width = cols.min(hw - j0);
        let w = if per_image { &weights[i * out * c..(i + 1) * out * c] } else { weights };
        let base = i * out * hw + j0;
        let d = Product { m: out, n: width, k: c };
        // SAFETY: the tasks' blocks are disjoint.
        scope.run(|| unsafe { gemm_shared(&dst, base, hw, d, Mat::rows(w, 0, c), Mat::rows(x, i * c * hw + j0, hw)) });
        for (o, &b) in shift.iter().enumerate() {
            let at = base + o * hw;
            // SAFETY: this task's own block.
            let row = unsafe { dst.slice_mut(at, width) };
            let r = residual.map(|r| &r[at..at + width]);
            simd(
                #[inline(always)]
                || shift_act(row, b, r, silu),
            );
        }
    });
    y
}

/// `row ← act(row + shift (+ residual))`.
#[inline(always)]
fn shift_act<T: Float>(row: &mut [T], shift: T, residual: Option<&[T]>, silu: bool) {
    match residual {
        Some(r) => {
            for (v, &x) in row.iter_mut().zip(r) {
                *v = *v + shift + x;
            }
        }
        None => {
            for v in row.iter_mut() {
                *v += shift;
            }
        }
    }
    if silu {
        for v in row.iter_mut() {
            let z = *v;
            *v = z * sigmoid(z);
        }
    }
}

/// The forward pass as a graph leaf (no backward recorded): for ops that differentiate through
/// it themselves. `x` and `w` are contiguous f32 or f64 of one dtype.
pub(crate) fn forward_detached(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.apply_op2_no_bwd(w, &Op(Forward))
}

/// The gradients of the input and of the weight, given the output's.
pub(crate) fn backward(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
    let grad = grad.contiguous()?;
    let dx = w.apply_op2_no_bwd(&grad, &Op(GradInput { input: x.dims().to_vec() }))?;
    let dw = x.apply_op2_no_bwd(&grad, &Op(GradWeight { weight: w.dims().to_vec() }))?;
    Ok((dx, dw))
}

/// `dx[n] = Wᵀ·dy[n]`. Arguments: the weight and the output gradient.
struct GradInput {
    input: Vec<usize>,
}

impl Kernel<2> for GradInput {
    const NAME: &'static str = "pointwise-conv2d-grad-input";
    const PROFILE: &'static str = "op/pointwise-grad";
    type Geometry = Dims;

    fn geometry(&self, [w, dy]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        let d = dims(&self.input, w.dims())?;
        if dy.dims() != [d.n, d.out, self.input[2], self.input[3]] {
            candle_core::bail!("1x1 convolution backward: gradient {:?} does not fit input {:?}", dy.dims(), self.input);
        }
        Ok((d, Shape::from(self.input.clone())))
    }

    fn cpu<T: Float>(&self, &d: &Self::Geometry, [w, dy]: [&[T]; 2]) -> Result<Vec<T>> {
        // SAFETY: each image's product fills its own block.
        let mut dx = unsafe { output_buffer(d.n * d.c * d.hw) };
        let product = Product { m: d.c, n: d.hw, k: d.out };
        for (dxn, dyn_) in dx.chunks_mut(d.c * d.hw).zip(dy.chunks(d.out * d.hw)) {
            gemm_into(dxn, d.hw, product, Mat::transposed(w, 0, d.c), Mat::rows(dyn_, 0, d.hw), false);
        }
        Ok(dx)
    }
}

/// `dW = Σ_n dy[n]·x[n]ᵀ`, accumulated in place. Arguments: the input and the output gradient.
struct GradWeight {
    weight: Vec<usize>,
}

impl Kernel<2> for GradWeight {
    const NAME: &'static str = "pointwise-conv2d-grad-weight";
    const PROFILE: &'static str = "op/pointwise-grad";
    type Geometry = Dims;

    fn geometry(&self, [x, dy]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        let d = dims(x.dims(), &self.weight)?;
        let (_, _, h, wd) = x.shape().dims4()?;
        if dy.dims() != [d.n, d.out, h, wd] {
            candle_core::bail!("1x1 convolution backward: gradient {:?} does not fit input {:?}", dy.dims(), x.dims());
        }
        Ok((d, Shape::from(self.weight.clone())))
    }

    fn cpu<T: Float>(&self, &d: &Self::Geometry, [x, dy]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(grad_weight(d, x, dy))
    }
}

/// `dW = Σ_n dy[n]·x[n]ᵀ`, the images split into one run per thread, each accumulating its own
/// partial `dW` on its thread, the partials added at the end (`linear::sum_over_image_runs`).
fn grad_weight<T: Float>(d: Dims, x: &[T], dy: &[T]) -> Vec<T> {
    let product = Product { m: d.out, n: d.c, k: d.hw };
    sum_over_image_runs(
        d.n,
        d.out * d.c,
        || (),
        |dw, _, img, accumulate| {
            let (xn, dyn_) = (&x[img * d.c * d.hw..], &dy[img * d.out * d.hw..]);
            gemm_serial(dw, d.c, product, Mat::rows(dyn_, 0, d.hw), Mat::transposed(xn, 0, d.hw), accumulate);
        },
    )
}

/// 1×1 convolution without bias: `x` `[N, C, H, W]`, `w` `[O, C, 1, 1]` → `[N, O, H, W]`.
pub fn pointwise_conv2d(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() || !matches!(x.dtype(), DType::F32 | DType::F64) || x.dtype() != w.dtype() {
        return composite(x, w);
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, Op(Forward))
}

/// The same as a batched matmul of candle primitives: what GPUs and other dtypes run, and what
/// the tests hold the op to.
pub fn composite(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (n, c, h, wd) = x.dims4()?;
    let out = w.dim(0)?;
    let y = w.reshape((out, c))?.broadcast_matmul(&x.reshape((n, c, h * wd))?)?;
    y.reshape((n, out, h, wd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{check_fd, max_abs, max_diff};
    use candle_core::{Device, Var};

    fn silu(z: f64) -> f64 {
        z / (1.0 + (-z).exp())
    }

    /// The folded convolution against its definition computed in f64 loops: one weight matrix and
    /// one per image, with and without SiLU and a residual, with 1100 channels out (column blocks
    /// of 64, the last one partial) and with 5 (one block).
    #[test]
    fn the_folded_convolution_is_the_product_then_the_shift_residual_and_activation() {
        let dev = Device::Cpu;
        let values = |seed, len| crate::util::rng::randn(seed, 0.0, 1.0, len, DType::F64, &dev).unwrap().to_vec1::<f64>().unwrap();
        for (n, c, out, hw) in [(2, 3, 1100, 150), (3, 5, 5, 9)] {
            let x = values(170, n * c * hw);
            let shift = values(171, out);
            for per_image in [false, true] {
                let w = values(172, if per_image { n } else { 1 } * out * c);
                for (silu_on, residual) in [(false, false), (true, false), (false, true)] {
                    if residual && out != c {
                        continue;
                    }
                    let r = residual.then_some(&x[..]);
                    let check = |ours: Vec<f64>, tol: f64| {
                        for i in 0..n {
                            let wi = if per_image { &w[i * out * c..(i + 1) * out * c] } else { &w[..] };
                            for o in 0..out {
                                for j in 0..hw {
                                    let mut z = shift[o] + (0..c).map(|k| wi[o * c + k] * x[(i * c + k) * hw + j]).sum::<f64>();
                                    if let Some(r) = r {
                                        z += r[(i * out + o) * hw + j];
                                    }
                                    let want = if silu_on { silu(z) } else { z };
                                    let got = ours[(i * out + o) * hw + j];
                                    assert!(
                                        (got - want).abs() <= tol * (1.0 + want.abs()),
                                        "{n}x{c}->{out}x{hw} per image {per_image} silu {silu_on} residual {residual}: {got} vs {want}"
                                    );
                                }
                            }
                        }
                    };
                    check(forward_folded(&x, (n, c, hw), &w, per_image, &shift, silu_on, r), 1e-12);
                    let f = |v: &[f64]| v.iter().map(|&v| v as f32).collect::<Vec<f32>>();
                    let (xf, rf) = (f(&x), residual.then(|| f(&x)));
                    let ours = forward_folded(&xf, (n, c, hw), &f(&w), per_image, &f(&shift), silu_on, rf.as_deref());
                    check(ours.into_iter().map(|v| v as f64).collect(), 2e-6);
                }
            }
        }
    }

    fn inputs(dtype: DType, (n, c, o, h, w): (usize, usize, usize, usize, usize)) -> (Var, Var, Tensor) {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&crate::util::rng::randn(160, 0.0, 1.0, (n, c, h, w), dtype, &dev).unwrap()).unwrap();
        let wt = Var::from_tensor(&crate::util::rng::randn(161, 0.0, 0.5, (o, c, 1, 1), dtype, &dev).unwrap()).unwrap();
        let up = crate::util::rng::randn(162, 0.0, 1.0, (n, o, h, w), dtype, &dev).unwrap();
        (x, wt, up)
    }

    /// On one and on three threads: the weight gradient's images are split into one run per
    /// thread (5 images on 3 threads: runs of 2, 2, 1).
    #[test]
    fn matches_the_batched_matmul_forward_and_backward() {
        for (dtype, tol, threads) in [(DType::F64, 1e-12, 1), (DType::F64, 1e-12, 3), (DType::F32, 1e-5, 3)] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| check_against_matmul(dtype, tol));
        }
    }

    fn check_against_matmul(dtype: DType, tol: f64) {
        for shape in [(3, 5, 7, 4, 6), (1, 16, 3, 1, 1), (2, 1, 9, 5, 3), (5, 4, 6, 3, 3)] {
            let (x, w, up) = inputs(dtype, shape);
            let ours = pointwise_conv2d(&x, &w).unwrap();
            let reference = composite(&x, &w).unwrap();
            assert!(max_diff(&ours, &reference) <= tol * max_abs(&reference), "{dtype:?} {shape:?} forward");
            let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&x, &w] {
                let (a, b) = (g1.get(v).unwrap(), g2.get(v).unwrap());
                assert_eq!(a.dims(), v.dims());
                assert!(max_diff(a, b) <= tol * max_abs(b), "{dtype:?} {shape:?} gradient");
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let (x, w, up) = inputs(DType::F64, (2, 3, 4, 3, 5));
        let grads = (pointwise_conv2d(&x, &w).unwrap() * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let loss = |x: &Tensor, w: &Tensor| (pointwise_conv2d(x, w).unwrap() * &up).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        let err_x = check_fd(|t| loss(t, &w), &x, grads.get(&x).unwrap(), &[0, 7, 29, 89]);
        let err_w = check_fd(|t| loss(&x, t), &w, grads.get(&w).unwrap(), &[0, 5, 11]);
        assert!(err_x < 1e-7 && err_w < 1e-7, "{err_x} {err_w}");
    }

    #[test]
    fn shapes_that_do_not_fit_are_errors() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((1, 3, 2, 2), DType::F32, &dev).unwrap();
        let err = pointwise_conv2d(&x, &Tensor::zeros((4, 2, 1, 1), DType::F32, &dev).unwrap()).unwrap_err().to_string();
        assert!(err.contains("do not fit"), "{err}");
        assert!(pointwise_conv2d(&x, &Tensor::zeros((4, 3, 3, 3), DType::F32, &dev).unwrap()).is_err());
    }
}
