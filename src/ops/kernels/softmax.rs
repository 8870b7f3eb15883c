//! Softmax over the last dimension as one op with its own backward, for attention. candle's
//! composed softmax (max, subtract, exp, sum, divide, each a full-size temporary, and as many
//! backward nodes) is the largest part of the ViT's attention; its fused `softmax_last_dim` has no
//! backward at all (candle 0.11). Forward: one pass per row; backward: one pass per row,
//! `dx = y·(dy − Σ y·dy)`.

use candle_core::{DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::ops::gpu::{Limits, Program, SideBuf};
use crate::ops::op::{GpuPlan, Kernel, Op};
use crate::ops::{lane_dot, lane_max, lane_sum, last_dim, output_buffer, simd, Float};

/// `row ← softmax(scale·row + bias)` in place; `bias` (a padding mask) may be absent.
///
/// Plain `for` loops: iterator adaptors (`for_each`, `fold`) are calls the compiler may leave
/// outlined, and an outlined loop is compiled without [`simd`]'s wider instruction set (the exp
/// pass ran 4 wide, 5% of a ViT-Ti step).
#[inline(always)]
pub(crate) fn softmax_row_in_place<T: Float>(row: &mut [T], scale: T, bias: Option<&[f32]>) {
    match bias {
        Some(b) => {
            for (v, &b) in row.iter_mut().zip(b) {
                *v = scale * *v + T::from(b as f64);
            }
        }
        None => {
            for v in row.iter_mut() {
                *v = scale * *v;
            }
        }
    }
    let m = lane_max(row);
    for v in row.iter_mut() {
        *v = (*v - m).exp();
    }
    let inv = T::from(1.0) / lane_sum(row);
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// The gradient of `softmax(scale·x + bias)` with respect to x, from its output `y` and the
/// output's gradient `g`: `scale·y·(g − Σ y·g)`.
#[inline(always)]
pub(crate) fn softmax_grad_row<T: Float>(out: &mut [T], y: &[T], g: &[T], scale: T) {
    let dot = lane_dot(y, g);
    for ((o, &yv), &gv) in out.iter_mut().zip(y).zip(g) {
        *o = scale * yv * (gv - dot);
    }
}

fn softmax_grad<T: Float>(y: &[T], dy: &[T], d: usize, scale: f64) -> Vec<T> {
    // SAFETY: softmax_grad_row writes every element of each row.
    let mut out = unsafe { output_buffer::<T>(y.len()) };
    out.par_chunks_mut(d).zip(y.par_chunks(d)).zip(dy.par_chunks(d)).for_each(|((o, y), g)| {
        simd(
            #[inline(always)]
            || softmax_grad_row(o, y, g, T::from(scale)),
        )
    });
    out
}

/// `softmax(scale·x + key_bias)` over the last dimension. `key_bias` (f32, one value per batch
/// element and key) is a constant: it gets no gradient.
pub(crate) struct Softmax {
    scale: f64,
    /// `[batch, keys]` and the number of rows (heads × queries) per batch element.
    key_bias: Option<(Vec<f32>, usize)>,
}

impl Softmax {
    fn run<T: Float>(&self, x: &[T], d: usize) -> Vec<T> {
        let mut out = x.to_vec();
        let scale = T::from(self.scale);
        out.par_chunks_mut(d).enumerate().for_each(|(row, o)| {
            let bias = self.bias_of(row, d);
            simd(
                #[inline(always)]
                || softmax_row_in_place(o, scale, bias),
            )
        });
        out
    }

    fn bias_of(&self, row: usize, d: usize) -> Option<&[f32]> {
        self.key_bias.as_ref().map(|(b, rows_per_batch)| {
            let batch = row / rows_per_batch;
            &b[batch * d..(batch + 1) * d]
        })
    }
}

impl Kernel<1> for Softmax {
    const NAME: &'static str = "softmax-last-dim";
    const PROFILE: &'static str = "op/softmax";
    /// Rows, and values per row.
    type Geometry = (usize, usize);

    fn geometry(&self, [l]: [&Layout; 1]) -> Result<(Self::Geometry, Shape)> {
        let d = last_dim(l);
        Ok(((l.shape().elem_count() / d, d), l.shape().clone()))
    }

    fn cpu<T: Float>(&self, &(_, d): &Self::Geometry, [x]: [&[T]; 1]) -> Result<Vec<T>> {
        Ok(self.run(x, d))
    }

    fn gpu(&self, &(rows, d): &Self::Geometry, elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        let program = Program::softmax(rows, d, self.scale, self.key_bias.as_ref().map(|(_, rows)| *rows), elem, limits);
        let plan = GpuPlan::new(program);
        Ok(Some(match &self.key_bias {
            Some((b, _)) => plan.with_side(SideBuf::F32(b.clone())),
            None => plan,
        }))
    }

    fn backward(&self, _: [&Tensor; 1], y: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 1]> {
        Ok([Some(y.apply_op2_no_bwd(&grad.contiguous()?, &Op(SoftmaxGrad { scale: self.scale }))?)])
    }
}

pub(crate) struct SoftmaxGrad {
    scale: f64,
}

impl Kernel<2> for SoftmaxGrad {
    const NAME: &'static str = "softmax-last-dim-grad";
    const PROFILE: &'static str = "op/softmax-grad";
    type Geometry = (usize, usize);

    fn geometry(&self, [y, dy]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        if y.dims() != dy.dims() {
            candle_core::bail!("softmax backward: gradient {:?} for output {:?}", dy.dims(), y.dims());
        }
        let d = last_dim(y);
        Ok(((y.shape().elem_count() / d, d), y.shape().clone()))
    }

    fn cpu<T: Float>(&self, &(_, d): &Self::Geometry, [y, g]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(softmax_grad(y, g, d, self.scale))
    }

    fn gpu(&self, &(rows, d): &Self::Geometry, elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(Some(GpuPlan::new(Program::softmax_grad(rows, d, self.scale, elem, limits))))
    }
}

/// `softmax(scale·x + key_bias)` over the last dimension of `x` (`[batch, .., keys]`), with
/// `key_bias` (`[batch, keys]`, e.g. 0 for tokens and −1e9 for padding) added to every row of its
/// batch element: attention's scaling and padding mask inside the softmax's own pass, forward and
/// backward. Differentiable in `x` only. One op in f32 / f64 where `ops::has_kernels` says
/// so (the CPU, CUDA GPUs); composed elsewhere.
pub fn scaled_masked_softmax(x: &Tensor, scale: f64, key_bias: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims();
    let (batch, keys) = (dims.first().copied().unwrap_or(1), dims.last().copied().unwrap_or(1));
    if let Some(b) = key_bias {
        if b.dims() != [batch, keys] {
            candle_core::bail!("key bias of shape {:?} for scores of shape {dims:?}", b.dims());
        }
    }
    if !crate::ops::has_kernels(x, &[]) {
        return composed(x, scale, key_bias);
    }
    let key_bias = match key_bias {
        Some(b) => Some((b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, x.elem_count() / keys.max(1) / batch.max(1))),
        None => None,
    };
    x.contiguous()?.apply_op1(Op(Softmax { scale, key_bias }))
}

/// The scaled, masked softmax composed from candle ops: the fallback, and the reference the op's
/// tests hold it to.
pub fn composed(x: &Tensor, scale: f64, key_bias: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims();
    let z = if scale == 1.0 { x.clone() } else { (x * scale)? };
    let z = match key_bias {
        Some(b) => {
            let mut shape = vec![dims.first().copied().unwrap_or(1)];
            shape.extend(std::iter::repeat_n(1, dims.len().saturating_sub(2)));
            shape.push(dims.last().copied().unwrap_or(1));
            z.broadcast_add(&b.to_dtype(z.dtype())?.reshape(shape)?)?
        }
        None => z,
    };
    candle_nn::ops::softmax(&z, D::Minus1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{check_fd, max_diff};
    use candle_core::{Device, Var};

    #[test]
    fn matches_candles_composed_softmax_forward_and_backward() {
        let dev = Device::Cpu;
        for dtype in [DType::F64, DType::F32] {
            // A padding mask whose -1e9 must give exact zeros, not NaNs; batch element 1 keeps
            // fewer keys than element 0.
            let mask: Vec<f64> = (0..2 * 17).map(|i| if i % 17 > 12 + i / 17 { -1e9 } else { 0.0 }).collect();
            let mask = Tensor::from_vec(mask, (2, 17), &dev).unwrap().to_dtype(dtype).unwrap();
            for (scale, bias) in [(1.0, None), (0.125, Some(&mask))] {
                let x = Var::from_tensor(&crate::util::rng::randn(150, 0.0, 3.0, (2, 3, 5, 17), dtype, &dev).unwrap()).unwrap();
                let ours = scaled_masked_softmax(&x, scale, bias).unwrap();
                let reference = composed(&x, scale, bias).unwrap();
                let tol = if dtype == DType::F64 { 1e-12 } else { 1e-6 };
                assert!(max_diff(&ours, &reference) < tol, "{dtype:?} scale {scale}");
                if bias.is_some() {
                    let zero = |b: usize, from: usize| {
                        ours.narrow(0, b, 1).unwrap().narrow(3, from, 17 - from).unwrap().abs().unwrap().sum_all().unwrap()
                    };
                    for (b, from) in [(0, 13), (1, 14)] {
                        assert_eq!(zero(b, from).to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(), 0.0);
                    }
                }
                let up = crate::util::rng::randn(151, 0.0, 1.0, ours.dims(), dtype, &dev).unwrap();
                let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
                let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
                assert!(max_diff(g1.get(x.as_tensor()).unwrap(), g2.get(x.as_tensor()).unwrap()) < tol * 10.0);
            }
        }
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let dev = Device::Cpu;
        let x0 = crate::util::rng::randn(152, 0.0, 1.0, (2, 1, 2, 4), DType::F64, &dev).unwrap();
        let mask = Tensor::new(&[[0.0f64, 0.0, 0.0, -1e9], [0.0, -1e9, 0.0, 0.0]], &dev).unwrap();
        let up = crate::util::rng::randn(153, 0.0, 1.0, (2, 1, 2, 4), DType::F64, &dev).unwrap();
        let loss = |x: &Tensor| (scaled_masked_softmax(x, 0.5, Some(&mask)).unwrap() * &up).unwrap().sum_all().unwrap();
        let x = Var::from_tensor(&x0).unwrap();
        let grads = loss(x.as_tensor()).backward().unwrap();
        let all: Vec<usize> = (0..16).collect();
        let f = |t: &Tensor| loss(t).to_scalar::<f64>().unwrap();
        assert!(check_fd(f, &x0, grads.get(x.as_tensor()).unwrap(), &all) < 1e-7);
    }
}

#[cfg(test)]
mod gpu_tests {
    use super::*;
    use crate::ops::gpu::host::{assert_close, to_f32, values};
    use crate::ops::gpu::{run_on_host, SMALL_GRID};

    /// The op's own GPU plan (program and side buffer) run in the host emulation.
    fn run_on_host_op<T: Float + crate::ops::gpu::host::Pod>(op: &Softmax, rows: usize, keys: usize, elem: usize, x: &[&[T]]) -> Vec<T> {
        let plan = op.gpu(&(rows, keys), elem, &SMALL_GRID).unwrap().unwrap();
        run_on_host(&plan.program, x, plan.side.as_ref())
    }

    #[test]
    fn the_gpu_kernels_match_the_cpu_op_in_the_host_emulation() {
        // Scores [2 batch, 3 heads, 5 queries, keys]: a padding mask per batch element serves
        // 15 rows; 300 keys are more than a block's threads.
        for keys in [17, 300] {
            let rows = 2 * 3 * 5;
            let mask: Vec<f32> = (0..2 * keys).map(|i| if i % keys > keys - 3 - i / keys { -1e9 } else { 0.0 }).collect();
            let x = values(190, 0.0, 3.0, rows * keys);
            let dy = values(191, 0.0, 1.0, rows * keys);
            for (scale, bias) in [(1.0, None), (0.125, Some(mask.clone()))] {
                let op = Softmax { scale, key_bias: bias.clone().map(|b| (b, 15)) };
                let what = format!("{keys} keys, scale {scale}");
                let y = op.run(&x, keys);
                assert_close(&run_on_host_op(&op, rows, keys, 8, &[&x]), &y, 1e-12, &what);
                let grad = Program::softmax_grad(rows, keys, scale, 8, &SMALL_GRID);
                assert_close(&run_on_host(&grad, &[&y, &dy], None), &softmax_grad(&y, &dy, keys, scale), 1e-12, &what);
                let (x, dy) = (to_f32(&x), to_f32(&dy));
                let y = op.run(&x, keys);
                assert_close(&run_on_host_op(&op, rows, keys, 4, &[&x]), &y, 1e-6, &what);
                let grad = Program::softmax_grad(rows, keys, scale, 4, &SMALL_GRID);
                assert_close(&run_on_host(&grad, &[&y, &dy], None), &softmax_grad(&y, &dy, keys, scale), 1e-6, &what);
            }
        }
    }
}
