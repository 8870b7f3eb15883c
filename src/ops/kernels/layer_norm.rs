//! LayerNorm over the last dimension as one op with its own backward.
//!
//! candle's fused `layer_norm` has no backward at all (candle 0.11), and the composition from
//! mean / subtract / square / divide / scale / shift takes eight full-size temporaries forward and
//! more backward, with the weight and bias gradients reduced through candle's one-threaded
//! strided sum. Here the forward is one pass per row; the backward one pass per row for the input
//! gradient, with the weight and bias gradients summed per block of rows in parallel.

use candle_core::{DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::ops::gpu::rows::layer_norm_fits;
use crate::ops::gpu::{Limits, Program};
use crate::ops::op::{GpuPlan, Kernel, Op};
use crate::ops::{lane_dot, lane_sum, output_buffer, row_block, simd, Float, LANES};

/// Mean and 1/√(var + ε) of a row, the variance from the centred values (two passes; the row
/// is in L1 for the second).
#[inline(always)]
fn row_stats<T: Float>(x: &[T], eps: f64) -> (T, T) {
    let d = T::from(x.len() as f64);
    let mean = lane_sum(x) / d;
    let mut acc = [T::default(); LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            acc[l] += (c[l] - mean) * (c[l] - mean);
        }
    }
    let sq = chunks.remainder().iter().fold(lane_sum(&acc), |s, &v| s + (v - mean) * (v - mean));
    let inv_std = T::from(1.0) / (sq / d + T::from(eps)).sqrt();
    (mean, inv_std)
}

pub(crate) struct LayerNormOp {
    pub eps: f64,
}

impl LayerNormOp {
    pub(crate) fn run<T: Float>(&self, x: &[T], w: &[T], b: &[T]) -> Vec<T> {
        let d = w.len();
        // SAFETY: the loop below writes every element.
        let mut out = unsafe { output_buffer::<T>(x.len()) };
        let block = row_block(x.len() / d) * d;
        out.par_chunks_mut(block).zip(x.par_chunks(block)).for_each(|(o, x)| {
            simd(
                #[inline(always)]
                || {
                    for (orow, xrow) in o.chunks_mut(d).zip(x.chunks(d)) {
                        self.row_into(xrow, w, b, orow);
                    }
                },
            )
        });
        out
    }

    /// One row normalised into `out`, the numbers [`LayerNormOp::run`] writes for it: for an op
    /// that consumes the rows as they are made (packing or quantizing them for the products that
    /// read them) instead of reading a stored output back.
    pub(crate) fn normalize_row(&self, x: &[f32], w: &[f32], b: &[f32], out: &mut [f32]) {
        simd(
            #[inline(always)]
            || self.row_into(x, w, b, out),
        )
    }

    #[inline(always)]
    fn row_into<T: Float>(&self, x: &[T], w: &[T], b: &[T], out: &mut [T]) {
        let (mean, r) = row_stats(x, self.eps);
        for (((o, &x), &w), &b) in out.iter_mut().zip(x).zip(w).zip(b) {
            *o = (x - mean) * r * w + b;
        }
    }
}

fn check_shapes(lx: &Layout, lw: &Layout, lb: &Layout) -> Result<usize> {
    let d = lx.dims().last().copied().unwrap_or(0);
    if d == 0 || lw.dims() != [d] || lb.dims() != [d] {
        candle_core::bail!("layer norm of {:?} needs weight and bias of [{d}], got {:?} and {:?}", lx.dims(), lw.dims(), lb.dims());
    }
    Ok(d)
}

impl Kernel<3> for LayerNormOp {
    const NAME: &'static str = "layer-norm";
    const PROFILE: &'static str = "op/layer-norm";
    /// Rows, and values per row.
    type Geometry = (usize, usize);

    fn geometry(&self, [x, w, b]: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        let d = check_shapes(x, w, b)?;
        Ok(((x.shape().elem_count() / d, d), x.shape().clone()))
    }

    fn cpu<T: Float>(&self, _: &Self::Geometry, [x, w, b]: [&[T]; 3]) -> Result<Vec<T>> {
        Ok(self.run(x, w, b))
    }

    fn gpu(&self, &(rows, d): &Self::Geometry, elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(Some(GpuPlan::new(Program::layer_norm(rows, d, self.eps, elem, limits))))
    }

    fn backward(&self, [x, w, _b]: [&Tensor; 3], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let d = w.dim(0)?;
        let n = x.elem_count() / d;
        // One storage holding [dx (n·d) | dw (d) | db (d)]; the three gradients are views of it.
        let all = x.apply_op3_no_bwd(w, &grad.contiguous()?, &Op(LayerNormGrad { eps: self.eps }))?;
        let dx = all.narrow(0, 0, n * d)?.reshape(x.shape())?;
        Ok([Some(dx), Some(all.narrow(0, n * d, d)?), Some(all.narrow(0, n * d + d, d)?)])
    }
}

/// With x̂ = (x − μ)·r and ĝ = dy·w per row: dx = r·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)),
/// dw = Σ_rows dy·x̂, db = Σ_rows dy.
pub(crate) struct LayerNormGrad {
    pub eps: f64,
}

impl LayerNormGrad {
    pub(crate) fn run<T: Float>(&self, x: &[T], w: &[T], dy: &[T]) -> Vec<T> {
        let d = w.len();
        let n = x.len() / d;
        // SAFETY: the row loop writes every element of dx; the parameter sums are zeroed here.
        let mut out = unsafe { output_buffer::<T>(x.len() + 2 * d) };
        let (dx, params) = out.split_at_mut(n * d);
        params.fill(T::default());
        let block = row_block(n) * d;
        let inv_d = T::from(1.0 / d as f64);
        let partial: Vec<Vec<T>> = dx
            .par_chunks_mut(block)
            .zip(x.par_chunks(block))
            .zip(dy.par_chunks(block))
            .map(|((dx, x), dy)| {
                let mut acc = vec![T::default(); 2 * d];
                let (dw, db) = acc.split_at_mut(d);
                let mut gh = vec![T::default(); d];
                simd(
                    #[inline(always)]
                    || {
                        for ((dxrow, xrow), grow) in dx.chunks_mut(d).zip(x.chunks(d)).zip(dy.chunks(d)) {
                            let (mean, r) = row_stats(xrow, self.eps);
                            // x̂ waits in dx's row and ĝ in a scratch row, so the sums vectorise.
                            for (((o, &xv), (&g, &wv)), ((dwv, dbv), ghv)) in
                                dxrow.iter_mut().zip(xrow).zip(grow.iter().zip(w)).zip(dw.iter_mut().zip(db.iter_mut()).zip(gh.iter_mut()))
                            {
                                let xhat = (xv - mean) * r;
                                *o = xhat;
                                *ghv = g * wv;
                                *dwv += g * xhat;
                                *dbv += g;
                            }
                            let (mg, mgx) = (lane_sum(&gh) * inv_d, lane_dot(&gh, dxrow) * inv_d);
                            for (o, &g) in dxrow.iter_mut().zip(&gh) {
                                *o = r * (g - mg - *o * mgx);
                            }
                        }
                    },
                );
                acc
            })
            .collect();
        for p in partial {
            params.iter_mut().zip(p).for_each(|(s, v)| *s += v);
        }
        out
    }
}

impl Kernel<3> for LayerNormGrad {
    const NAME: &'static str = "layer-norm-grad";
    const PROFILE: &'static str = "op/layer-norm-grad";
    type Geometry = (usize, usize);

    fn geometry(&self, [x, w, dy]: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        let d = check_shapes(x, w, w)?;
        if dy.dims() != x.dims() {
            candle_core::bail!("layer norm gradient of shape {:?} for an input of shape {:?}", dy.dims(), x.dims());
        }
        let n = x.shape().elem_count();
        Ok(((n / d, d), Shape::from(n + 2 * d)))
    }

    fn cpu<T: Float>(&self, _: &Self::Geometry, [x, w, dy]: [&[T]; 3]) -> Result<Vec<T>> {
        Ok(self.run(x, w, dy))
    }

    fn gpu(&self, &(rows, d): &Self::Geometry, elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(Some(GpuPlan::new(Program::layer_norm_grad(rows, d, self.eps, elem, limits)?)))
    }
}

/// `(x − mean) / √(var + eps) · weight + bias` over the last dimension, differentiable in all
/// three. One op in f32 / f64 where `ops::has_kernels` says so (the CPU, CUDA GPUs); elsewhere
/// (bf16, rows too wide for the GPU backward's shared memory) [`composed`].
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let width = x.dims().last().copied().unwrap_or(0);
    if crate::ops::has_kernels(x, &[weight, bias]) && (x.device().is_cpu() || layer_norm_fits(width, x.dtype().size_in_bytes())) {
        return x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, Op(LayerNormOp { eps }));
    }
    let _profile = crate::util::profile::region("op/layer-norm");
    composed(x, weight, bias, eps)
}

/// LayerNorm composed from candle ops, with the statistics in f32 for lower precisions: the
/// fallback, and the reference the op's tests hold it to.
pub fn composed(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = if dtype == DType::F32 || dtype == DType::F64 { x.clone() } else { x.to_dtype(DType::F32)? };
    let mean = xf.mean_keepdim(D::Minus1)?;
    let centered = xf.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed.to_dtype(dtype)?.broadcast_mul(weight)?.broadcast_add(bias)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{check_fd, max_abs, max_diff};
    use candle_core::{Device, Var};

    #[test]
    fn matches_the_composition_forward_and_backward() {
        let dev = Device::Cpu;
        for dtype in [DType::F64, DType::F32] {
            // 2 × 300 rows: several row blocks; offset mean so centring matters.
            let x = Var::from_tensor(&crate::util::rng::randn(170, 3.0, 2.0, (2, 300, 48), dtype, &dev).unwrap()).unwrap();
            let w = Var::from_tensor(&crate::util::rng::randn(171, 1.0, 0.5, 48, dtype, &dev).unwrap()).unwrap();
            let b = Var::from_tensor(&crate::util::rng::randn(172, 0.0, 0.5, 48, dtype, &dev).unwrap()).unwrap();
            let up = crate::util::rng::randn(173, 0.0, 1.0, (2, 300, 48), dtype, &dev).unwrap();
            let ours = layer_norm(&x, &w, &b, 1e-5).unwrap();
            let reference = composed(&x, &w, &b, 1e-5).unwrap();
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            assert!(max_diff(&ours, &reference) < tol * max_abs(&reference), "{dtype:?}");
            let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&x, &w, &b] {
                let (a, r) = (g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap());
                assert_eq!(a.dims(), r.dims());
                assert!(max_diff(a, r) < tol * max_abs(r), "{dtype:?} {}", max_diff(a, r) / max_abs(r));
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let dev = Device::Cpu;
        let x0 = crate::util::rng::randn(174, 0.5, 1.0, (3, 5), DType::F64, &dev).unwrap();
        let w0 = crate::util::rng::randn(175, 1.0, 0.5, 5, DType::F64, &dev).unwrap();
        let b0 = crate::util::rng::randn(176, 0.0, 0.5, 5, DType::F64, &dev).unwrap();
        let up = crate::util::rng::randn(177, 0.0, 1.0, (3, 5), DType::F64, &dev).unwrap();
        let loss = |x: &Tensor, w: &Tensor, b: &Tensor| {
            (layer_norm(x, w, b, 1e-3).unwrap() * &up).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
        };
        let (x, w, b) = (Var::from_tensor(&x0).unwrap(), Var::from_tensor(&w0).unwrap(), Var::from_tensor(&b0).unwrap());
        let grads = (layer_norm(&x, &w, &b, 1e-3).unwrap() * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let all: Vec<usize> = (0..15).collect();
        assert!(check_fd(|t| loss(t, &w0, &b0), &x0, grads.get(x.as_tensor()).unwrap(), &all) < 1e-7);
        assert!(check_fd(|t| loss(&x0, t, &b0), &w0, grads.get(w.as_tensor()).unwrap(), &[0, 1, 2, 3, 4]) < 1e-7);
        assert!(check_fd(|t| loss(&x0, &w0, t), &b0, grads.get(b.as_tensor()).unwrap(), &[0, 1, 2, 3, 4]) < 1e-7);
    }
}

#[cfg(test)]
mod gpu_tests {
    use super::*;
    use crate::ops::gpu::host::{assert_close, to_f32, values};
    use crate::ops::gpu::{run_on_host, Program, SMALL_GRID};

    #[test]
    fn the_gpu_kernels_match_the_cpu_op_in_the_host_emulation() {
        let eps = 1e-5;
        // Rows wider than a block (300 > 256 threads), narrower than one (20 of 32), and enough
        // rows for chunks of two in the parameter gradients' partial sums.
        for (rows, cols) in [(37, 300), (600, 20)] {
            let x = values(180, 2.0, 1.5, rows * cols);
            let w = values(181, 1.0, 0.5, cols);
            let b = values(182, 0.0, 0.5, cols);
            let dy = values(183, 0.0, 1.0, rows * cols);
            let forward = Program::layer_norm(rows, cols, eps, 8, &SMALL_GRID);
            let backward = Program::layer_norm_grad(rows, cols, eps, 8, &SMALL_GRID).unwrap();
            let what = format!("{rows}x{cols}");
            assert_close(&run_on_host(&forward, &[&x, &w, &b], None), &LayerNormOp { eps }.run(&x, &w, &b), 1e-12, &what);
            assert_close(&run_on_host(&backward, &[&x, &w, &dy], None), &LayerNormGrad { eps }.run(&x, &w, &dy), 1e-12, &what);
            let (x, w, b, dy) = (to_f32(&x), to_f32(&w), to_f32(&b), to_f32(&dy));
            let forward = Program::layer_norm(rows, cols, eps, 4, &SMALL_GRID);
            let backward = Program::layer_norm_grad(rows, cols, eps, 4, &SMALL_GRID).unwrap();
            assert_close(&run_on_host(&forward, &[&x, &w, &b], None), &LayerNormOp { eps }.run(&x, &w, &b), 1e-5, &what);
            assert_close(&run_on_host(&backward, &[&x, &w, &dy], None), &LayerNormGrad { eps }.run(&x, &w, &dy), 1e-5, &what);
        }
    }
}
