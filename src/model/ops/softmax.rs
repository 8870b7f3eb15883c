//! Softmax over the last dimension as one op with its own backward, for attention. candle's
//! composed softmax (max, subtract, exp, sum, divide, each a full-size temporary, and as many
//! backward nodes) is the largest part of the ViT's attention; its fused `softmax_last_dim` has no
//! backward at all (see CANDLE-NOTES). Forward: one pass per row; backward: one pass per row,
//! `dx = y·(dy − Σ y·dy)`.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

#[cfg(feature = "cuda")]
use super::gpu;
use super::gpu::{Limits, Program};
use super::{float_dispatch, float_dispatch2, lane_dot, lane_max, lane_sum, last_dim, output_buffer, simd, Float};

/// `row ← softmax(scale·row + bias)` in place; `bias` (a padding mask) may be absent.
///
/// Plain `for` loops: iterator adaptors (`for_each`, `fold`) are calls the compiler may leave
/// outlined, and an outlined loop is compiled without [`simd`]'s wider instruction set (the exp
/// pass ran 4 wide, 5% of a ViT-Ti step).
#[inline(always)]
pub(super) fn softmax_row_in_place<T: Float>(row: &mut [T], scale: T, bias: Option<&[f32]>) {
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
pub(super) fn softmax_grad_row<T: Float>(out: &mut [T], y: &[T], g: &[T], scale: T) {
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
struct Softmax {
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

    /// The GPU launches for scores laid out as `l`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn program(&self, l: &Layout, elem: usize, limits: &Limits) -> Program {
        let d = last_dim(l);
        Program::softmax(l.shape().elem_count() / d, d, self.scale, self.key_bias.as_ref().map(|(_, rows)| *rows), elem, limits)
    }

    fn bias_of(&self, row: usize, d: usize) -> Option<&[f32]> {
        self.key_bias.as_ref().map(|(b, rows_per_batch)| {
            let batch = row / rows_per_batch;
            &b[batch * d..(batch + 1) * d]
        })
    }
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "softmax-last-dim"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let _profile = crate::util::profile::region("op/softmax");
        let d = last_dim(l);
        let out = float_dispatch!(s, l, "softmax", |x| self.run(x, d));
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let program = self.program(l, gpu::cuda::elem_size(s), &gpu::GPU);
        let bias = self.key_bias.as_ref().map(|(b, _)| gpu::Side::F32(b));
        Ok((gpu::cuda::run(&program, &[(s, l)], bias)?, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(y.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxGrad { scale: self.scale })?))
    }
}

struct SoftmaxGrad {
    scale: f64,
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "softmax-last-dim-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let _profile = crate::util::profile::region("op/softmax-grad");
        let d = last_dim(l1);
        let out = float_dispatch2!(s1, l1, s2, l2, "softmax backward", |y, g| softmax_grad(y, g, d, self.scale));
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        if l1.dims() != l2.dims() {
            candle_core::bail!("softmax backward: gradient {:?} for output {:?}", l2.dims(), l1.dims());
        }
        let d = last_dim(l1);
        let program = Program::softmax_grad(l1.shape().elem_count() / d, d, self.scale, gpu::cuda::elem_size(s1), &gpu::GPU);
        Ok((gpu::cuda::run(&program, &[(s1, l1), (s2, l2)], None)?, l1.shape().clone()))
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
    if !super::has_kernels(x, &[]) {
        let z = if scale == 1.0 { x.clone() } else { (x * scale)? };
        let z = match key_bias {
            Some(b) => {
                let mut shape = vec![batch];
                shape.extend(std::iter::repeat_n(1, dims.len() - 2));
                shape.push(keys);
                z.broadcast_add(&b.to_dtype(z.dtype())?.reshape(shape)?)?
            }
            None => z,
        };
        return candle_nn::ops::softmax(&z, D::Minus1);
    }
    let key_bias = match key_bias {
        Some(b) => Some((b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, x.elem_count() / keys.max(1) / batch.max(1))),
        None => None,
    };
    x.contiguous()?.apply_op1(Softmax { scale, key_bias })
}

#[cfg(test)]
mod tests {
    use super::super::testing::{check_fd, max_diff};
    use super::*;
    use candle_core::{Device, Var};

    /// The composition attention used before this op: scale, broadcast mask, candle's softmax.
    fn composed(x: &Tensor, scale: f64, key_bias: Option<&Tensor>) -> Tensor {
        let z = (x * scale).unwrap();
        let z = match key_bias {
            Some(b) => z.broadcast_add(&b.unsqueeze(1).unwrap().unsqueeze(1).unwrap()).unwrap(),
            None => z,
        };
        candle_nn::ops::softmax(&z, D::Minus1).unwrap()
    }

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
                let reference = composed(&x, scale, bias);
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
    use super::super::gpu::{run_on_host, Program, Side, SMALL_GRID};
    use super::super::kernel_host::{assert_close, to_f32, values};
    use super::*;

    #[test]
    fn the_gpu_kernels_match_the_cpu_op_in_the_host_emulation() {
        // Scores [2 batch, 3 heads, 5 queries, keys]: a padding mask per batch element serves
        // 15 rows; 300 keys are more than a block's threads.
        for keys in [17, 300] {
            let rows = 2 * 3 * 5;
            let mask: Vec<f32> = (0..2 * keys).map(|i| if i % keys > keys - 3 - i / keys { -1e9 } else { 0.0 }).collect();
            let x = values(190, 0.0, 3.0, rows * keys);
            let dy = values(191, 0.0, 1.0, rows * keys);
            let layout = Layout::contiguous((2, 3, 5, keys));
            for (scale, bias) in [(1.0, None), (0.125, Some(mask.clone()))] {
                let op = Softmax { scale, key_bias: bias.clone().map(|b| (b, 15)) };
                let what = format!("{keys} keys, scale {scale}");
                let y = op.run(&x, keys);
                assert_close(&run_on_host(&op.program(&layout, 8, &SMALL_GRID), &[&x], bias.as_deref().map(Side::F32)), &y, 1e-12, &what);
                let grad = Program::softmax_grad(rows, keys, scale, 8, &SMALL_GRID);
                assert_close(&run_on_host(&grad, &[&y, &dy], None), &softmax_grad(&y, &dy, keys, scale), 1e-12, &what);
                let (x, dy) = (to_f32(&x), to_f32(&dy));
                let y = op.run(&x, keys);
                assert_close(&run_on_host(&op.program(&layout, 4, &SMALL_GRID), &[&x], bias.as_deref().map(Side::F32)), &y, 1e-6, &what);
                let grad = Program::softmax_grad(rows, keys, scale, 4, &SMALL_GRID);
                assert_close(&run_on_host(&grad, &[&y, &dy], None), &softmax_grad(&y, &dy, keys, scale), 1e-6, &what);
            }
        }
    }
}
