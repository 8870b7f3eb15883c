//! `h · s` with one factor per (image, channel) plane (squeeze-and-excitation's excitation), and
//! the per-plane dot product its backward pass needs.

use candle_core::{DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::nchw::{nchw_pair, nchw_planes};
use crate::ops::gpu::{Limits, Program};
use crate::ops::op::{GpuPlan, Kernel, Op};
use crate::ops::{lane_dot, output_buffer, simd, Float};

pub(crate) struct ChannelScale;

impl Kernel<2> for ChannelScale {
    const NAME: &'static str = "channel-scale";
    const PROFILE: &'static str = "op/channel";
    type Geometry = (usize, usize, usize);

    fn geometry(&self, [l1, l2]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        Ok((nchw_planes(l1, l2, "channel scale")?, l1.shape().clone()))
    }

    fn cpu<T: Float>(&self, &(_, _, hw): &Self::Geometry, [h, s]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(scale_planes(h, &s.iter().map(|v| v.f()).collect::<Vec<_>>(), None, hw))
    }

    fn gpu(&self, &dims: &Self::Geometry, _elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(Some(GpuPlan::new(Program::channel_scale(dims, limits))))
    }

    fn backward(&self, [h, s]: [&Tensor; 2], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let grad = grad.contiguous()?;
        let dh = grad.apply_op2_no_bwd(s, &Op(ChannelScale))?;
        let ds = h.apply_op2_no_bwd(&grad, &Op(DotPerPlane))?.reshape(s.dims())?;
        Ok([Some(dh), Some(ds)])
    }
}

/// `out[plane] = a[plane] · f[plane]` (+ `add[plane]`), plane by plane.
pub(crate) fn scale_planes<T: Float>(a: &[T], f: &[f64], add: Option<&[f64]>, hw: usize) -> Vec<T> {
    // SAFETY: the loop below writes every element.
    let mut out = unsafe { output_buffer::<T>(a.len()) };
    out.par_chunks_mut(hw).zip(a.par_chunks(hw)).enumerate().for_each(|(p, (o, ap))| {
        let (fv, cv) = (T::from(f[p]), T::from(add.map_or(0.0, |c| c[p])));
        simd(
            #[inline(always)]
            || {
                for (ov, &av) in o.iter_mut().zip(ap) {
                    *ov = av * fv + cv;
                }
            },
        )
    });
    out
}

/// `Σ_hw a·b` per (n, c) plane: `[N, C]`.
pub(crate) struct DotPerPlane;

impl Kernel<2> for DotPerPlane {
    const NAME: &'static str = "dot-per-plane";
    const PROFILE: &'static str = "op/channel";
    type Geometry = (usize, usize, usize);

    fn geometry(&self, [l1, l2]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        let dims = nchw_pair(l1, l2, "channel scale backward")?;
        Ok((dims, Shape::from((dims.0, dims.1))))
    }

    fn cpu<T: Float>(&self, &(_, _, hw): &Self::Geometry, [a, b]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(a.par_chunks(hw).zip(b.par_chunks(hw)).map(|(x, y)| simd(|| lane_dot(x, y))).collect())
    }

    fn gpu(&self, &dims: &Self::Geometry, _elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(Some(GpuPlan::new(Program::dot_per_plane(dims, limits))))
    }
}

/// `h · s` with `h` `[N, C, H, W]` and `s` `[N, C]` (one factor per image and channel).
pub fn channel_scale(h: &Tensor, s: &Tensor) -> Result<Tensor> {
    if !h.device().is_cpu() && !crate::ops::has_kernels(h, &[s]) {
        return composed(h, s);
    }
    if !matches!(h.dtype(), DType::F32 | DType::F64) {
        return channel_scale(&h.to_dtype(DType::F32)?, &s.to_dtype(DType::F32)?)?.to_dtype(h.dtype());
    }
    let (n, c, _, _) = h.dims4()?;
    h.contiguous()?.apply_op2(&s.reshape((n, c))?.contiguous()?, Op(ChannelScale))
}

/// The composition of candle ops: the fallback and the tests' reference.
pub fn composed(h: &Tensor, s: &Tensor) -> Result<Tensor> {
    let (n, c, _, _) = h.dims4()?;
    h.broadcast_mul(&s.reshape((n, c, 1, 1))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::max_diff;
    use candle_core::{Device, Var};

    #[test]
    fn matches_the_composition_forward_and_backward() {
        let dev = Device::Cpu;
        let h = Var::from_tensor(&crate::util::rng::randn(108, 0.0, 1.0, (2, 3, 4, 5), DType::F64, &dev).unwrap()).unwrap();
        let s = Var::from_tensor(&crate::util::rng::randn(109, 0.0, 1.0, (2, 3), DType::F64, &dev).unwrap()).unwrap();
        let ours = channel_scale(h.as_tensor(), s.as_tensor()).unwrap();
        let reference = composed(h.as_tensor(), s.as_tensor()).unwrap();
        assert!(max_diff(&ours, &reference) < 1e-12);
        let up = crate::util::rng::randn(110, 0.0, 1.0, ours.dims(), DType::F64, &dev).unwrap();
        let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&h, &s] {
            assert!(max_diff(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap()) < 1e-12);
        }
    }
}
