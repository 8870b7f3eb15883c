//! Stochastic depth on a residual branch: `h·keep[n] + x`, each sample's branch scaled by its own
//! factor (0 drops it) and added to the shortcut in one pass. Composed, the scaled branch is one
//! more activation-sized tensor per block, kept until the backward pass ends, and one more pass
//! each way.

use candle_core::{Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::channel_scale::ChannelScale;
use super::nchw::nchw;
use crate::ops::gpu::{Limits, Program, SideBuf};
use crate::ops::op::{GpuPlan, Kernel, Op};
use crate::ops::{output_buffer, simd, Float};

pub(crate) struct StochasticDepth {
    keep: Vec<f64>,
}

impl Kernel<2> for StochasticDepth {
    const NAME: &'static str = "scaled-residual";
    const PROFILE: &'static str = "op/channel";
    type Geometry = (usize, usize, usize);

    fn geometry(&self, [l1, l2]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        if l1.dims() != l2.dims() || l1.dims().len() != 4 || l1.dims()[0] != self.keep.len() {
            candle_core::bail!("scaled residual: branch {:?}, shortcut {:?}, {} sample factors", l1.dims(), l2.dims(), self.keep.len());
        }
        Ok((nchw(l1)?, l1.shape().clone()))
    }

    fn cpu<T: Float>(&self, _: &Self::Geometry, [h, x]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(scaled_sum(h, &self.keep, x))
    }

    fn gpu(&self, &dims: &Self::Geometry, _elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(Some(GpuPlan::new(Program::scaled_residual(dims, limits)).with_side(SideBuf::F64(self.keep.clone()))))
    }

    fn backward(&self, _: [&Tensor; 2], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let grad = grad.contiguous()?;
        Ok([Some(scale_samples(&grad, &self.keep)?), Some(grad)])
    }
}

/// `h·keep[n] + x` on slices, one factor per sample.
pub(crate) fn scaled_sum<T: Float>(h: &[T], keep: &[f64], x: &[T]) -> Vec<T> {
    let per_sample = (h.len() / keep.len().max(1)).max(1);
    // SAFETY: the loop below writes every element.
    let mut out = unsafe { output_buffer::<T>(h.len()) };
    out.par_chunks_mut(per_sample).zip(h.par_chunks(per_sample).zip(x.par_chunks(per_sample))).enumerate().for_each(
        |(n, (o, (hs, xs)))| {
            let k = T::from(keep[n]);
            simd(
                #[inline(always)]
                || {
                    for (o, (&hv, &xv)) in o.iter_mut().zip(hs.iter().zip(xs)) {
                        *o = hv * k + xv;
                    }
                },
            )
        },
    );
    out
}

/// `g·keep[n]` for NCHW `g` outside the graph: the channel scaling with one factor per plane.
pub(crate) fn scale_samples(g: &Tensor, keep: &[f64]) -> Result<Tensor> {
    let (n, c, _, _) = g.dims4()?;
    let planes: Vec<f64> = keep.iter().flat_map(|&k| std::iter::repeat_n(k, c)).collect();
    let factors = Tensor::from_vec(planes, (n, c), g.device())?.to_dtype(g.dtype())?;
    g.contiguous()?.apply_op2_no_bwd(&factors, &Op(ChannelScale))
}

/// `h·keep[n] + x` for NCHW `h` and `x` of one shape, `keep` one factor per sample (stochastic
/// depth: 0 or 1/(1−p)).
pub fn scaled_residual(h: &Tensor, keep: &[f64], x: &Tensor) -> Result<Tensor> {
    if !crate::ops::has_kernels(h, &[x]) {
        return composed(h, keep, x);
    }
    h.contiguous()?.apply_op2(&x.contiguous()?, Op(StochasticDepth { keep: keep.to_vec() }))
}

/// The composition of candle ops: the fallback and the tests' reference.
pub fn composed(h: &Tensor, keep: &[f64], x: &Tensor) -> Result<Tensor> {
    let mut shape = vec![1; h.rank()];
    shape[0] = keep.len();
    let keep = Tensor::from_slice(keep, shape, h.device())?.to_dtype(h.dtype())?;
    h.broadcast_mul(&keep)? + x
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::max_diff;
    use candle_core::{DType, Device, Var};

    #[test]
    fn matches_the_composition_forward_and_backward() {
        let dev = Device::Cpu;
        for dtype in [DType::F64, DType::F32] {
            let h = Var::from_tensor(&crate::util::rng::randn(190, 0.0, 1.0, (3, 4, 5, 6), dtype, &dev).unwrap()).unwrap();
            let x = Var::from_tensor(&crate::util::rng::randn(191, 0.0, 1.0, (3, 4, 5, 6), dtype, &dev).unwrap()).unwrap();
            let keep = [1.25, 0.0, 1.25];
            let ours = scaled_residual(&h, &keep, &x).unwrap();
            let reference = composed(&h, &keep, &x).unwrap();
            assert!(max_diff(&ours, &reference) < 1e-6);
            let up = crate::util::rng::randn(192, 0.0, 1.0, ours.dims(), dtype, &dev).unwrap();
            let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&h, &x] {
                assert!(max_diff(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap()) < 1e-6);
            }
            // The dropped sample's branch gets exactly no gradient.
            let dropped = g1.get(h.as_tensor()).unwrap().get(1).unwrap().abs().unwrap().sum_all().unwrap();
            assert_eq!(dropped.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(), 0.0);
        }
        let wrong =
            scaled_residual(&Tensor::zeros((2, 3), DType::F32, &dev).unwrap(), &[1.0], &Tensor::zeros((2, 3), DType::F32, &dev).unwrap());
        assert!(wrong.unwrap_err().to_string().contains("1 sample factors"));
    }
}
