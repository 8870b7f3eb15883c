//! 1×1 convolution of NCHW tensors as one op: per image, `y[n] = W·x[n]` with W `[out, c]` and
//! x[n] `[c, h·w]`, so neither side is transposed or copied.
//!
//! As a broadcast matmul, candle's backward makes one weight gradient per image (`[n, out, c]`)
//! and sums them on one thread. Here the images' products accumulate into one weight gradient
//! per thread inside the matmul kernel, and the input gradient `Wᵀ·dy[n]` reads W transposed in place.

use candle_core::{DType, Layout, Result, Shape, Tensor};

use super::linear::sum_over_image_runs;
use super::matmul::{gemm_into, gemm_serial};
use super::operands::{Dims as Product, Mat};
use crate::ops::op::{Kernel, Op};
use crate::ops::{output_buffer, Float};

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
