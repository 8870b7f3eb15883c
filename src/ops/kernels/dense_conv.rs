//! A dense (one-group) convolution of an input that needs no gradient, as im2col + gemm per
//! image: EfficientNet's stem (3 → 32+ channels, 3×3, stride 2) on the images.
//!
//! candle 0.11 convolves on the CPU with a direct loop, and its backward pass also computes the
//! images' gradient (a transposed convolution) that nothing uses. Here each image's patches are
//! unfolded into a `[c·k·k, ho·wo]` matrix on its thread and multiplied by the weight, and the
//! backward pass computes only the weight's gradient, per run of images on each thread as the
//! 1×1 convolution does.

use candle_core::{Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::bf16_gemm::Scope;
use super::linear::sum_over_image_runs;
use super::matmul::gemm_serial;
use super::operands::{Dims as Product, Mat};
use crate::ops::op::{Kernel, Op};
use crate::ops::{output_buffer, Float};

#[derive(Clone, Copy, Debug)]
struct Geometry {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    out: usize,
    k: usize,
    stride: usize,
    ho: usize,
    wo: usize,
}

impl Geometry {
    fn new(x: &[usize], w: &[usize], stride: usize) -> Result<Self> {
        match (x, w) {
            ([n, c, h, wd], [out, wc, k, k2]) if c == wc && k == k2 && stride > 0 && h >= k && wd >= k => {
                Ok(Geometry { n: *n, c: *c, h: *h, w: *wd, out: *out, k: *k, stride, ho: (h - k) / stride + 1, wo: (wd - k) / stride + 1 })
            }
            _ => candle_core::bail!("dense convolution: input {x:?}, weight {w:?} and stride {stride} do not fit"),
        }
    }

    /// Rows of the unfolded patches: `c·k·k`.
    fn patch(&self) -> usize {
        self.c * self.k * self.k
    }

    fn pixels(&self) -> usize {
        self.ho * self.wo
    }

    /// One image's patches as `[c·k·k, ho·wo]`, row `(ci·k + ky)·k + kx`.
    fn unfold<T: Float>(&self, x: &[T], cols: &mut [T]) {
        let p = self.pixels();
        for ci in 0..self.c {
            let plane = &x[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for ky in 0..self.k {
                for kx in 0..self.k {
                    let row = &mut cols[((ci * self.k + ky) * self.k + kx) * p..][..p];
                    for (oy, dst) in row.chunks_exact_mut(self.wo).enumerate() {
                        let src = &plane[(oy * self.stride + ky) * self.w + kx..];
                        for (ox, d) in dst.iter_mut().enumerate() {
                            *d = src[ox * self.stride];
                        }
                    }
                }
            }
        }
    }
}

struct Forward {
    stride: usize,
}

fn forward<T: Float>(g: Geometry, x: &[T], w: &[T]) -> Vec<T> {
    let (kk, p) = (g.patch(), g.pixels());
    // SAFETY: each image's product overwrites its own block.
    let mut y = unsafe { output_buffer::<T>(g.n * g.out * p) };
    let scope = Scope::current();
    y.par_chunks_mut(g.out * p).zip(x.par_chunks(g.c * g.h * g.w)).for_each(|(yn, xn)| {
        // SAFETY: `unfold` writes every element of the patch matrix.
        let mut cols = unsafe { output_buffer::<T>(kk * p) };
        g.unfold(xn, &mut cols);
        scope.run(|| gemm_serial(yn, p, Product { m: g.out, n: p, k: kk }, Mat::rows(w, 0, kk), Mat::rows(&cols, 0, p), false));
    });
    y
}

impl Kernel<2> for Forward {
    const NAME: &'static str = "dense-conv2d";
    const PROFILE: &'static str = "op/dense-conv";
    type Geometry = Geometry;

    fn geometry(&self, [x, w]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        let g = Geometry::new(x.dims(), w.dims(), self.stride)?;
        Ok((g, Shape::from((g.n, g.out, g.ho, g.wo))))
    }

    fn cpu<T: Float>(&self, &g: &Self::Geometry, [x, w]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(forward(g, x, w))
    }

    /// Only the weight's gradient: [`conv2d_untracked`] takes inputs that need none.
    fn backward(&self, [x, w]: [&Tensor; 2], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let dw = x.apply_op2_no_bwd(&grad.contiguous()?, &Op(GradWeight { stride: self.stride, weight: w.dims().to_vec() }))?;
        Ok([None, Some(dw)])
    }
}

/// `dW = Σ_n dy[n]·cols[n]ᵀ`. Arguments: the input and the output gradient.
struct GradWeight {
    stride: usize,
    weight: Vec<usize>,
}

/// The images split into one run per thread, each run accumulating its own partial `dW`
/// (`out × c·k·k`, small) over its images' long sums (`k = ho·wo`), with its own patch matrix
/// (`linear::sum_over_image_runs`).
fn grad_weight<T: Float>(g: Geometry, x: &[T], dy: &[T]) -> Vec<T> {
    let (kk, p) = (g.patch(), g.pixels());
    // SAFETY: `unfold` writes every element of a run's patch matrix before the product reads it.
    let cols = || unsafe { output_buffer::<T>(kk * p) };
    sum_over_image_runs(g.n, g.out * kk, cols, |dw, cols, img, accumulate| {
        g.unfold(&x[img * g.c * g.h * g.w..][..g.c * g.h * g.w], cols);
        let dyn_ = &dy[img * g.out * p..][..g.out * p];
        gemm_serial(dw, kk, Product { m: g.out, n: kk, k: p }, Mat::rows(dyn_, 0, p), Mat::transposed(cols, 0, p), accumulate);
    })
}

impl Kernel<2> for GradWeight {
    const NAME: &'static str = "dense-conv2d-grad-weight";
    const PROFILE: &'static str = "op/dense-conv-grad";
    type Geometry = Geometry;

    fn geometry(&self, [x, dy]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        let g = Geometry::new(x.dims(), &self.weight, self.stride)?;
        if dy.dims() != [g.n, g.out, g.ho, g.wo] {
            candle_core::bail!("dense convolution backward: gradient {:?} for output {:?}", dy.dims(), [g.n, g.out, g.ho, g.wo]);
        }
        Ok((g, Shape::from(self.weight.clone())))
    }

    fn cpu<T: Float>(&self, &g: &Self::Geometry, [x, dy]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(grad_weight(g, x, dy))
    }
}

/// `x` (`[N, C, H, W]`, no padding added) convolved with `w` (`[O, C, k, k]`) at `stride`, as
/// candle's `conv2d(w, 0, stride, 1, 1)` computes it; differentiable in `w` only. Where the op
/// does not apply (an input that needs its gradient, other devices or dtypes) it is candle's.
pub fn conv2d_untracked(x: &Tensor, w: &Tensor, stride: usize) -> Result<Tensor> {
    if x.track_op() || !crate::ops::fusable(x, &[w]) {
        return x.conv2d(w, 0, stride, 1, 1);
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, Op(Forward { stride }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{check_fd, max_abs, max_diff};
    use candle_core::{DType, Device, Var};

    #[test]
    fn matches_candles_convolution_forward_and_in_the_weight_gradient() {
        let dev = Device::Cpu;
        // The stem's shape at a small size (odd sides cut so the stride tiles them), a 5×5
        // kernel at stride 1, and more images than threads so runs hold several.
        for (n, c, h, w, out, k, stride) in [(5, 3, 17, 15, 8, 3, 2), (3, 2, 9, 10, 4, 5, 1)] {
            for dtype in [DType::F64, DType::F32] {
                let x = crate::util::rng::randn(230, 0.0, 1.0, (n, c, h, w), dtype, &dev).unwrap();
                let wv = Var::from_tensor(&crate::util::rng::randn(231, 0.0, 0.5, (out, c, k, k), dtype, &dev).unwrap()).unwrap();
                let ours = conv2d_untracked(&x, &wv, stride).unwrap();
                let reference = x.conv2d(wv.as_tensor(), 0, stride, 1, 1).unwrap();
                let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
                assert!(max_diff(&ours, &reference) < tol * max_abs(&reference), "{dtype:?} k{k}");
                let up = crate::util::rng::randn(232, 0.0, 1.0, ours.dims(), dtype, &dev).unwrap();
                let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
                let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
                let (a, b) = (g1.get(wv.as_tensor()).unwrap(), g2.get(wv.as_tensor()).unwrap());
                assert!(max_diff(a, b) < tol * max_abs(b), "{dtype:?} k{k}: {}", max_diff(a, b) / max_abs(b));
            }
        }
    }

    #[test]
    fn the_weight_gradient_matches_finite_differences() {
        let dev = Device::Cpu;
        let x = crate::util::rng::randn(233, 0.0, 1.0, (2, 2, 7, 7), DType::F64, &dev).unwrap();
        let w0 = crate::util::rng::randn(234, 0.0, 0.5, (3, 2, 3, 3), DType::F64, &dev).unwrap();
        let up = crate::util::rng::randn(235, 0.0, 1.0, (2, 3, 3, 3), DType::F64, &dev).unwrap();
        let loss = |w: &Tensor| (conv2d_untracked(&x, w, 2).unwrap() * &up).unwrap().sum_all().unwrap();
        let wv = Var::from_tensor(&w0).unwrap();
        let grads = loss(wv.as_tensor()).backward().unwrap();
        let all: Vec<usize> = (0..54).collect();
        assert!(check_fd(|t| loss(t).to_scalar::<f64>().unwrap(), &w0, grads.get(wv.as_tensor()).unwrap(), &all) < 1e-7);
    }

    #[test]
    fn a_tracked_input_keeps_candles_convolution_and_its_gradient() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&crate::util::rng::randn(236, 0.0, 1.0, (1, 2, 5, 5), DType::F64, &dev).unwrap()).unwrap();
        let w = crate::util::rng::randn(237, 0.0, 0.5, (2, 2, 3, 3), DType::F64, &dev).unwrap();
        let grads = conv2d_untracked(x.as_tensor(), &w, 1).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(grads.get(x.as_tensor()).is_some());
    }
}
