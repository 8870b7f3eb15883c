//! The mean of each (image, channel) plane of an NCHW tensor (squeeze-and-excitation's squeeze).

use candle_core::{DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::nchw::nchw;
use crate::ops::gpu::{Limits, Program};
use crate::ops::op::{GpuPlan, Kernel, Op};
use crate::ops::{lane_sum, simd, Float};

pub(crate) struct SpatialMean;

impl Kernel<1> for SpatialMean {
    const NAME: &'static str = "spatial-mean";
    const PROFILE: &'static str = "op/channel";
    type Geometry = (usize, usize, usize);

    fn geometry(&self, [l]: [&Layout; 1]) -> Result<(Self::Geometry, Shape)> {
        let dims = nchw(l)?;
        Ok((dims, Shape::from((dims.0, dims.1))))
    }

    fn cpu<T: Float>(&self, &(_, _, hw): &Self::Geometry, [x]: [&[T]; 1]) -> Result<Vec<T>> {
        Ok(x.par_chunks(hw).map(|p| T::from(simd(|| lane_sum(p)).f() / hw as f64)).collect())
    }

    fn gpu(&self, &dims: &Self::Geometry, _elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(Some(GpuPlan::new(Program::spatial_mean(dims, limits))))
    }

    fn backward(&self, [x]: [&Tensor; 1], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 1]> {
        let (n, c, h, w) = x.dims4()?;
        // A broadcast view: the gradient store adds it to the input's other gradient (the
        // channel scaling's) without a full-size tensor of its own.
        Ok([Some((grad / (h * w) as f64)?.reshape((n, c, 1, 1))?.broadcast_as(x.dims())?)])
    }
}

/// Mean over H and W: `[N, C, H, W]` → `[N, C]`.
pub fn spatial_mean(x: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() && !crate::ops::has_kernels(x, &[]) {
        return composed(x);
    }
    if !matches!(x.dtype(), DType::F32 | DType::F64) {
        return spatial_mean(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype());
    }
    x.contiguous()?.apply_op1(Op(SpatialMean))
}

/// The composition of candle ops: the fallback and the tests' reference.
pub fn composed(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    // Low-precision sums over large planes lose digits; accumulate in f32.
    let wide = if dtype == DType::F64 { x.clone() } else { x.to_dtype(DType::F32)? };
    wide.flatten_from(2)?.mean(2)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{max_abs, max_diff};
    use candle_core::{Device, Var};

    #[test]
    fn matches_the_composition_forward_and_backward() {
        let dev = Device::Cpu;
        let h = Var::from_tensor(&crate::util::rng::randn(108, 0.0, 1.0, (2, 3, 4, 5), DType::F64, &dev).unwrap()).unwrap();
        let ours = spatial_mean(h.as_tensor()).unwrap();
        let reference = composed(h.as_tensor()).unwrap();
        assert!(max_diff(&ours, &reference) < 1e-12 * max_abs(&reference).max(1.0));
        let up = crate::util::rng::randn(111, 0.0, 1.0, (2, 3), DType::F64, &dev).unwrap();
        let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(max_diff(g1.get(h.as_tensor()).unwrap(), g2.get(h.as_tensor()).unwrap()) < 1e-12);
    }
}
