//! Per-channel batch mean and variance of an NCHW tensor in one pass (BatchNorm's statistics).

use candle_core::{DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::nchw::{channel_totals, nchw, per_channel_mean};
use crate::ops::gpu::{Limits, Program};
use crate::ops::op::{GpuPlan, Kernel, Op};
use crate::ops::{simd, Float, LANES};

pub(crate) struct Moments;

impl Kernel<1> for Moments {
    const NAME: &'static str = "channel-moments";
    const PROFILE: &'static str = "op/channel";
    type Geometry = (usize, usize, usize);

    fn geometry(&self, [l]: [&Layout; 1]) -> Result<(Self::Geometry, Shape)> {
        let dims = nchw(l)?;
        Ok((dims, Shape::from((2, dims.1))))
    }

    fn cpu<T: Float>(&self, &(n, c, hw): &Self::Geometry, [x]: [&[T]; 1]) -> Result<Vec<T>> {
        Ok(moments(x, n, c, hw))
    }

    fn gpu(&self, &dims: &Self::Geometry, _elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(Some(GpuPlan::new(Program::channel_moments(dims, limits))))
    }
}

/// Per-channel mean and biased variance, `[means…, variances…]`.
pub(crate) fn moments<T: Float>(x: &[T], n: usize, c: usize, hw: usize) -> Vec<T> {
    let m = (n * hw).max(1) as f64;
    // Sums of x − k with k the channel's first value: near the mean, so the variance
    // E[(x−k)²] − E[x−k]² does not cancel away digits when the mean is large.
    let shift = |ch: usize| if hw == 0 { 0.0 } else { x[ch * hw].f() };
    let plane_sums: Vec<[f64; 2]> = x
        .par_chunks(hw.max(1))
        .enumerate()
        .map(|(p, xp)| {
            let k = T::from(shift(p % c));
            simd(
                #[inline(always)]
                || {
                    let (mut s1, mut s2) = ([T::default(); LANES], [T::default(); LANES]);
                    let mut chunks = xp.chunks_exact(LANES);
                    for xv in &mut chunks {
                        for l in 0..LANES {
                            let d = xv[l] - k;
                            s1[l] += d;
                            s2[l] += d * d;
                        }
                    }
                    let rest = chunks.remainder().iter().map(|&v| (v - k).f());
                    let (r1, r2) = rest.fold((0.0, 0.0), |(a, b), d| (a + d, b + d * d));
                    [r1 + s1.iter().map(|v| v.f()).sum::<f64>(), r2 + s2.iter().map(|v| v.f()).sum::<f64>()]
                },
            )
        })
        .collect();
    let mut out = vec![T::default(); 2 * c];
    for (ch, [s1, s2]) in channel_totals(plane_sums, c).into_iter().enumerate() {
        let d = s1 / m;
        out[ch] = T::from(shift(ch) + d);
        out[c + ch] = T::from((s2 / m - d * d).max(0.0));
    }
    out
}

/// Per-channel mean and biased variance over (N, H, W): `[2, C]`. Not differentiable (the
/// BatchNorm op accounts for the statistics' dependence on the input itself).
pub fn channel_moments(x: &Tensor) -> Result<Tensor> {
    if crate::ops::has_kernels(x, &[]) {
        return x.contiguous()?.apply_op1_no_bwd(&Op(Moments));
    }
    if x.device().is_cpu() {
        return channel_moments(&x.to_dtype(DType::F32)?);
    }
    composed(x)
}

/// The composition of candle ops: the fallback and the tests' reference.
pub fn composed(x: &Tensor) -> Result<Tensor> {
    let x = x.detach();
    let m = per_channel_mean(&x)?;
    let v = per_channel_mean(&x.broadcast_sub(&m)?.sqr()?)?;
    Tensor::stack(&[m.flatten_all()?, v.flatten_all()?], 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A channel mean 1000× its spread: E[x²] − E[x]² in f32 would lose the variance entirely.
    #[test]
    fn f32_moments_keep_the_variance_of_a_channel_far_from_zero() {
        let dev = Device::Cpu;
        let x = (crate::util::rng::randn(150, 0.0, 1.0, (4, 3, 17, 19), DType::F64, &dev).unwrap() + 1000.0).unwrap();
        let ours = channel_moments(&x.to_dtype(DType::F32).unwrap()).unwrap().to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
        let xf = x.to_dtype(DType::F32).unwrap().to_dtype(DType::F64).unwrap();
        let reference = composed(&xf).unwrap().to_vec2::<f64>().unwrap();
        for ch in 0..3 {
            assert!((ours[0][ch] - reference[0][ch]).abs() < 1e-4, "mean {} vs {}", ours[0][ch], reference[0][ch]);
            assert!((ours[1][ch] / reference[1][ch] - 1.0).abs() < 1e-4, "variance {} vs {}", ours[1][ch], reference[1][ch]);
        }
    }

    #[test]
    fn moments_by_hand() {
        let x = Tensor::new(&[[[[1.0f32, 3.0]], [[2.0, 2.0]]], [[[5.0, 7.0]], [[2.0, 6.0]]]], &Device::Cpu).unwrap();
        let m = channel_moments(&x).unwrap().to_vec2::<f32>().unwrap();
        // Channel 0: 1,3,5,7 → mean 4, var 5; channel 1: 2,2,2,6 → mean 3, var 3.
        assert_eq!(m, vec![vec![4.0, 3.0], vec![5.0, 3.0]]);
        assert_eq!(composed(&x).unwrap().to_vec2::<f32>().unwrap(), m);
    }
}
