//! BatchNorm with given statistics, its affine map and an optional SiLU as one op, forward and
//! backward (with batch statistics the backward pass differentiates through them).

use candle_core::{DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::nchw::{channel_totals, nchw, nchw_pair, per_channel, per_channel_mean};
use crate::ops::gpu::{Limits, Program, SideBuf};
use crate::ops::op::{GpuPlan, Kernel, Op};
use crate::ops::{output_buffer, simd, with_cpu_slice, Float, LANES};

/// `y = act(γ·(x − μ)·r + β)` with per-channel μ and r = 1/√(σ² + ε) given. With `batch_stats`,
/// μ and σ² are the batch's own and the backward pass differentiates through them.
#[derive(Clone)]
pub(crate) struct BatchNormAct {
    mean: Vec<f64>,
    inv_std: Vec<f64>,
    batch_stats: bool,
    silu: bool,
}

#[inline(always)]
pub(crate) fn sigmoid<T: Float>(z: T) -> T {
    T::from(1.0) / (T::from(1.0) + (-z).exp())
}

impl BatchNormAct {
    pub(crate) fn new(stats: &Statistics, silu: bool) -> Self {
        BatchNormAct {
            mean: stats.mean.to_vec(),
            inv_std: stats.var.iter().map(|v| 1.0 / (v + stats.eps).sqrt()).collect(),
            batch_stats: stats.from_batch,
            silu,
        }
    }

    /// `(n, c, h·w)` of the input, checking γ, β and the statistics against its channels.
    fn check(&self, x: &Layout, gamma: &Layout, beta: &Layout) -> Result<(usize, usize, usize)> {
        let dims = nchw(x)?;
        per_channel(dims.1, &[gamma.dims(), beta.dims(), &[self.mean.len()], &[self.inv_std.len()]], "batch norm")?;
        Ok(dims)
    }

    /// `[μ (c) | 1/√(σ² + ε) (c)]`: the GPU kernels' side buffer.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn side(&self) -> SideBuf {
        SideBuf::F64(self.mean.iter().chain(&self.inv_std).copied().collect())
    }

    /// `z = a·x + b` per channel: the normalisation and affine map folded together.
    fn affine<T: Float>(&self, gamma: &[T], beta: &[T], ch: usize) -> (T, T) {
        let a = gamma[ch].f() * self.inv_std[ch];
        (T::from(a), T::from(beta[ch].f() - a * self.mean[ch]))
    }

    pub(crate) fn apply<T: Float>(&self, x: &[T], gamma: &[T], beta: &[T], c: usize, hw: usize) -> Vec<T> {
        // SAFETY: the loop below writes every element.
        let mut out = unsafe { output_buffer::<T>(x.len()) };
        out.par_chunks_mut(hw).zip(x.par_chunks(hw)).enumerate().for_each(|(p, (o, xp))| {
            let (a, b) = self.affine(gamma, beta, p % c);
            simd(
                #[inline(always)]
                || {
                    for (ov, &xv) in o.iter_mut().zip(xp) {
                        let z = a * xv + b;
                        *ov = if self.silu { z * sigmoid(z) } else { z };
                    }
                },
            )
        });
        out
    }

    /// dz = dy·act'(z).
    #[inline(always)]
    fn dz<T: Float>(&self, z: T, dy: T) -> T {
        if self.silu {
            let s = sigmoid(z);
            dy * s * (T::from(1.0) + z * (T::from(1.0) - s))
        } else {
            dy
        }
    }

    /// The whole backward pass on slices: dx, and Σdz·x̂ and Σdz per channel (the γ and β
    /// gradients), appended to dx's buffer. Two passes over each (n, c) plane: the first writes dz
    /// into dx's place and sums it (one `exp` per element), the second turns dz into dx in place.
    pub(crate) fn gradients<T: Float>(&self, x: &[T], dy: &[T], gamma: &[T], beta: &[T], (n, c, hw): (usize, usize, usize)) -> Vec<T> {
        // SAFETY: the first pass writes every dz, the last lines the 2·c sums.
        let mut buf = unsafe { output_buffer::<T>(x.len() + 2 * c) };
        let gx = &mut buf[..x.len()];
        let plane_sums: Vec<[f64; 2]> = gx
            .par_chunks_mut(hw)
            .zip(x.par_chunks(hw).zip(dy.par_chunks(hw)))
            .enumerate()
            .map(|(p, (o, (xp, dyp)))| {
                let ch = p % c;
                let (a, b) = self.affine(gamma, beta, ch);
                let (mean, r) = (T::from(self.mean[ch]), T::from(self.inv_std[ch]));
                simd(
                    #[inline(always)]
                    || {
                        let (mut s_dz, mut s_dzx) = ([T::default(); LANES], [T::default(); LANES]);
                        let mut rest = [0.0f64; 2];
                        let mut oc = o.chunks_exact_mut(LANES);
                        let (mut xc, mut dc) = (xp.chunks_exact(LANES), dyp.chunks_exact(LANES));
                        for ((ov, xv), dv) in (&mut oc).zip(&mut xc).zip(&mut dc) {
                            for l in 0..LANES {
                                let dz = self.dz(a * xv[l] + b, dv[l]);
                                ov[l] = dz;
                                s_dz[l] += dz;
                                s_dzx[l] += dz * ((xv[l] - mean) * r);
                            }
                        }
                        for ((ov, &xv), &dv) in oc.into_remainder().iter_mut().zip(xc.remainder()).zip(dc.remainder()) {
                            let dz = self.dz(a * xv + b, dv);
                            *ov = dz;
                            rest[0] += (dz * ((xv - mean) * r)).f();
                            rest[1] += dz.f();
                        }
                        [rest[0] + s_dzx.iter().map(|v| v.f()).sum::<f64>(), rest[1] + s_dz.iter().map(|v| v.f()).sum::<f64>()]
                    },
                )
            })
            .collect();
        let sums = channel_totals(plane_sums, c);
        let m = (n * hw) as f64;
        gx.par_chunks_mut(hw).zip(x.par_chunks(hw)).enumerate().for_each(|(p, (o, xp))| {
            let ch = p % c;
            let (g, r) = (gamma[ch].f(), self.inv_std[ch]);
            // dx = g·r/m · (m·dz − Σdz − x̂·Σdz·x̂) with batch statistics, g·r·dz without.
            if self.batch_stats {
                let (k, mean, rt) = (T::from(g * r / m), T::from(self.mean[ch]), T::from(r));
                let (mt, sdz, sdzx) = (T::from(m), T::from(sums[ch][1]), T::from(sums[ch][0]));
                simd(
                    #[inline(always)]
                    || {
                        for (ov, &xv) in o.iter_mut().zip(xp) {
                            *ov = k * (mt * *ov - sdz - (xv - mean) * rt * sdzx);
                        }
                    },
                )
            } else {
                let k = T::from(g * r);
                simd(
                    #[inline(always)]
                    || {
                        for ov in o.iter_mut() {
                            *ov = k * *ov;
                        }
                    },
                )
            }
        });
        for (ch, [dzx, dz]) in sums.into_iter().enumerate() {
            buf[x.len() + ch] = T::from(dzx);
            buf[x.len() + c + ch] = T::from(dz);
        }
        buf
    }
}

impl Kernel<3> for BatchNormAct {
    const NAME: &'static str = "batch-norm-act";
    const PROFILE: &'static str = "op/batch-norm";
    type Geometry = (usize, usize, usize);

    fn geometry(&self, [x, gamma, beta]: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        Ok((self.check(x, gamma, beta)?, x.shape().clone()))
    }

    fn cpu<T: Float>(&self, &(_, c, hw): &Self::Geometry, [x, g, b]: [&[T]; 3]) -> Result<Vec<T>> {
        Ok(self.apply(x, g, b, c, hw))
    }

    fn gpu(&self, &dims: &Self::Geometry, _elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(Some(GpuPlan::new(Program::batch_norm_act(dims, self.silu, limits)).with_side(self.side())))
    }

    fn backward(&self, [x, gamma, beta]: [&Tensor; 3], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let grad = grad.contiguous()?;
        let out = x.apply_op2_no_bwd(&grad, &Op(BnGrad { op: self.clone(), gamma: gamma.clone(), beta: beta.clone() }))?;
        let c = gamma.dim(0)?;
        let gx = out.narrow(0, 0, x.elem_count())?.reshape(x.dims())?;
        let sums = out.narrow(0, x.elem_count(), 2 * c)?.reshape((2, c))?;
        Ok([Some(gx), Some(sums.get(0)?.to_dtype(gamma.dtype())?), Some(sums.get(1)?.to_dtype(gamma.dtype())?)])
    }
}

/// The backward pass as one op of (x, dy): dx flattened, then Σdz·x̂ and Σdz per channel, in one
/// buffer (a custom op has one output). γ and β are read from their tensors in the op.
pub(crate) struct BnGrad {
    pub op: BatchNormAct,
    pub gamma: Tensor,
    pub beta: Tensor,
}

impl BnGrad {
    /// `(n, c, h·w)` of the input, checking the gradient, γ, β and the statistics against it.
    fn check(&self, x: &Layout, dy: &Layout) -> Result<(usize, usize, usize)> {
        let dims = nchw_pair(x, dy, "batch norm backward")?;
        let stats = [self.op.mean.len()];
        per_channel(dims.1, &[self.gamma.dims(), self.beta.dims(), &stats], "batch norm backward")?;
        Ok(dims)
    }
}

impl Kernel<2> for BnGrad {
    const NAME: &'static str = "batch-norm-act-grad";
    const PROFILE: &'static str = "op/batch-norm-grad";
    type Geometry = (usize, usize, usize);

    fn geometry(&self, [x, dy]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        let dims = self.check(x, dy)?;
        Ok((dims, Shape::from(x.shape().elem_count() + 2 * dims.1)))
    }

    fn cpu<T: Float>(&self, &dims: &Self::Geometry, [x, dy]: [&[T]; 2]) -> Result<Vec<T>> {
        with_cpu_slice(&self.gamma, "batch norm's gamma", |gamma| {
            with_cpu_slice(&self.beta, "batch norm's beta", |beta| Ok(self.op.gradients(x, dy, gamma, beta, dims)))
        })
    }

    fn gpu(&self, &dims: &Self::Geometry, _elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        // γ and β side by side, the kernel's third operand.
        let gb = Tensor::cat(&[&self.gamma, &self.beta], 0)?;
        let program = Program::batch_norm_act_grad(dims, self.op.silu, self.op.batch_stats, limits);
        Ok(Some(GpuPlan::new(program).with_side(self.op.side()).with_extra(vec![gb])))
    }
}

/// Per-channel normalisation statistics for [`batch_norm_act`].
pub struct Statistics<'a> {
    pub mean: &'a [f64],
    pub var: &'a [f64],
    pub eps: f64,
    /// The batch's own statistics (the gradient flows through them) rather than running ones.
    pub from_batch: bool,
}

/// BatchNorm with the given statistics, affine `gamma` / `beta`, and an optional SiLU, as one op.
pub fn batch_norm_act(x: &Tensor, stats: &Statistics, gamma: &Tensor, beta: &Tensor, silu: bool) -> Result<Tensor> {
    if !x.device().is_cpu() && !crate::ops::has_kernels(x, &[gamma, beta]) {
        return composed(x, stats, gamma, beta, silu);
    }
    let dtype = x.dtype();
    let cd = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let op = BatchNormAct::new(stats, silu);
    let y = x.to_dtype(cd)?.contiguous()?.apply_op3(&gamma.to_dtype(cd)?.contiguous()?, &beta.to_dtype(cd)?.contiguous()?, Op(op))?;
    y.to_dtype(dtype)
}

/// The composition of candle ops: the fallback and the tests' reference.
pub fn composed(x: &Tensor, stats: &Statistics, gamma: &Tensor, beta: &Tensor, silu: bool) -> Result<Tensor> {
    let c = x.dim(1)?;
    let (mean, var) = if stats.from_batch {
        let m = per_channel_mean(x)?;
        let v = per_channel_mean(&x.broadcast_sub(&m)?.sqr()?)?;
        (m, v)
    } else {
        let host = |v: &[f64]| Tensor::from_slice(v, (1, c, 1, 1), x.device())?.to_dtype(x.dtype());
        (host(stats.mean)?, host(stats.var)?)
    };
    let inv_std = (var + stats.eps)?.sqrt()?.recip()?;
    let z = x.broadcast_sub(&mean)?.broadcast_mul(&inv_std)?;
    let z = z
        .broadcast_mul(&gamma.to_dtype(x.dtype())?.reshape((1, c, 1, 1))?)?
        .broadcast_add(&beta.to_dtype(x.dtype())?.reshape((1, c, 1, 1))?)?;
    if silu {
        z.silu()
    } else {
        Ok(z)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn close(a: &Tensor, b: &Tensor, tol: f64) {
        let d = crate::ops::testing::max_diff(a, b);
        assert!(d < tol, "max difference {d}");
    }

    #[test]
    fn batch_norm_act_matches_the_composed_ops_forward_and_backward() {
        let dev = Device::Cpu;
        for (batch_stats, silu) in [(true, true), (true, false), (false, true), (false, false)] {
            let x =
                Var::from_tensor(&crate::util::rng::randn(104, 0.5, 2.0, (3, 4, 5, 6), candle_core::DType::F64, &dev).unwrap()).unwrap();
            let gamma = Var::from_tensor(&crate::util::rng::randn(105, 1.0, 0.3, 4, candle_core::DType::F64, &dev).unwrap()).unwrap();
            let beta = Var::from_tensor(&crate::util::rng::randn(106, 0.0, 0.3, 4, candle_core::DType::F64, &dev).unwrap()).unwrap();
            let run_mean = Tensor::new(&[0.1f64, -0.2, 0.3, 0.0], &dev).unwrap();
            let run_var = Tensor::new(&[1.5f64, 0.5, 2.0, 1.0], &dev).unwrap();
            let (mean, var): (Vec<f64>, Vec<f64>) = if batch_stats {
                let m = super::super::moments::channel_moments(x.as_tensor()).unwrap().to_vec2::<f64>().unwrap();
                (m[0].clone(), m[1].clone())
            } else {
                (run_mean.to_vec1().unwrap(), run_var.to_vec1().unwrap())
            };
            let stats = Statistics { mean: &mean, var: &var, eps: 1e-3, from_batch: batch_stats };
            let ours = batch_norm_act(x.as_tensor(), &stats, gamma.as_tensor(), beta.as_tensor(), silu).unwrap();
            let stats_ref = Statistics {
                mean: &run_mean.to_vec1::<f64>().unwrap(),
                var: &run_var.to_vec1::<f64>().unwrap(),
                eps: 1e-3,
                from_batch: batch_stats,
            };
            let reference = composed(x.as_tensor(), &stats_ref, gamma.as_tensor(), beta.as_tensor(), silu).unwrap();
            close(&ours, &reference, 1e-10);
            let up = crate::util::rng::randn(107, 0.0, 1.0, ours.dims(), candle_core::DType::F64, &dev).unwrap();
            let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&x, &gamma, &beta] {
                close(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap(), 1e-9);
            }
        }
    }

    /// The f32 path computes per element in f32: still the composed ops' numbers to f32 accuracy.
    #[test]
    fn batch_norm_act_in_f32_matches_the_composed_ops() {
        let dev = Device::Cpu;
        for batch_stats in [true, false] {
            let x = Var::from_tensor(&crate::util::rng::randn(140, 0.5, 2.0, (4, 6, 7, 9), DType::F32, &dev).unwrap()).unwrap();
            let gamma = Var::from_tensor(&crate::util::rng::randn(141, 1.0, 0.3, 6, DType::F32, &dev).unwrap()).unwrap();
            let beta = Var::from_tensor(&crate::util::rng::randn(142, 0.0, 0.3, 6, DType::F32, &dev).unwrap()).unwrap();
            let m = super::super::moments::channel_moments(x.as_tensor()).unwrap().to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
            let (mean, var) = if batch_stats { (m[0].clone(), m[1].clone()) } else { (vec![0.2; 6], vec![1.7; 6]) };
            let stats = Statistics { mean: &mean, var: &var, eps: 1e-3, from_batch: batch_stats };
            let ours = batch_norm_act(x.as_tensor(), &stats, gamma.as_tensor(), beta.as_tensor(), true).unwrap();
            let reference = composed(x.as_tensor(), &stats, gamma.as_tensor(), beta.as_tensor(), true).unwrap();
            close(&ours, &reference, 1e-4);
            let up = crate::util::rng::randn(143, 0.0, 1.0, ours.dims(), DType::F32, &dev).unwrap();
            let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&x, &gamma, &beta] {
                close(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap(), 1e-3);
            }
        }
    }
}
