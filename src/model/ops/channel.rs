//! Per-channel ops of convolutional towers on NCHW tensors, each one pass over the data with its
//! own backward: batch moments, BatchNorm with an optional SiLU, channel scaling (squeeze-and-
//! excitation) and spatial means.
//!
//! Composed from candle primitives these take several full-size temporaries each, and their
//! backward passes reduce broadcast gradients through candle's strided slow path; on
//! EfficientNet-B0 that made the backward pass 14× the forward (profile in issue 5's note).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{contiguous, float_dispatch, float_dispatch2, Float};

fn nchw(l: &Layout) -> Result<(usize, usize, usize)> {
    match l.dims() {
        [n, c, h, w] => Ok((*n, *c, h * w)),
        d => candle_core::bail!("expected an NCHW tensor, got {d:?}"),
    }
}

/// Sums over (N, H, W) per channel of `f(n, c, index)`, in f64, one task per channel.
fn per_channel_sums<const K: usize>(n: usize, c: usize, hw: usize, f: impl Fn(usize, usize, usize) -> [f64; K] + Sync) -> Vec<[f64; K]> {
    (0..c)
        .into_par_iter()
        .map(|ch| {
            let mut acc = [0.0f64; K];
            for b in 0..n {
                let base = (b * c + ch) * hw;
                for i in base..base + hw {
                    let v = f(b, ch, i);
                    for k in 0..K {
                        acc[k] += v[k];
                    }
                }
            }
            acc
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Batch moments

struct Moments;

impl CustomOp1 for Moments {
    fn name(&self) -> &'static str {
        "channel-moments"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let _profile = crate::util::profile::region("op/channel");
        let (n, c, hw) = nchw(l)?;
        let m = (n * hw).max(1) as f64;
        let out = float_dispatch!(s, l, "channel moments", |x| {
            let sums = per_channel_sums::<2>(n, c, hw, |_, _, i| {
                let v = x[i].f();
                [v, v * v]
            });
            let mut out = vec![Float::from(0.0); 2 * c];
            for (ch, [s1, s2]) in sums.into_iter().enumerate() {
                let mean = s1 / m;
                out[ch] = Float::from(mean);
                out[c + ch] = Float::from((s2 / m - mean * mean).max(0.0));
            }
            out
        });
        Ok((out, Shape::from((2, c))))
    }
}

/// Per-channel mean and biased variance over (N, H, W): `[2, C]`. Not differentiable (the
/// BatchNorm op accounts for the statistics' dependence on the input itself).
pub fn channel_moments(x: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return composite::channel_moments(x);
    }
    if !matches!(x.dtype(), DType::F32 | DType::F64) {
        return channel_moments(&x.to_dtype(DType::F32)?);
    }
    x.contiguous()?.apply_op1_no_bwd(&Moments)
}

// ---------------------------------------------------------------------------------------------
// BatchNorm (+ SiLU)

/// `y = act(γ·(x − μ)·r + β)` with per-channel μ and r = 1/√(σ² + ε) given. With `batch_stats`,
/// μ and σ² are the batch's own and the backward pass differentiates through them.
#[derive(Clone)]
struct BatchNormAct {
    mean: Vec<f64>,
    inv_std: Vec<f64>,
    batch_stats: bool,
    silu: bool,
}

fn sigmoid<T: Float>(z: T) -> T {
    T::from(1.0) / (T::from(1.0) + (-z).exp())
}

impl BatchNormAct {
    fn apply<T: Float>(&self, x: &[T], gamma: &[T], beta: &[T], c: usize, hw: usize) -> Vec<T> {
        let mut out = vec![T::default(); x.len()];
        out.par_chunks_mut(hw).zip(x.par_chunks(hw)).enumerate().for_each(|(p, (o, xp))| {
            let ch = p % c;
            let a = gamma[ch].f() * self.inv_std[ch];
            let (a, b) = (T::from(a), T::from(beta[ch].f() - a * self.mean[ch]));
            for (ov, &xv) in o.iter_mut().zip(xp) {
                let z = a * xv + b;
                *ov = if self.silu { z * sigmoid(z) } else { z };
            }
        });
        out
    }

    /// dz = dy·act'(z), recomputing z from x.
    #[inline(always)]
    fn dz<T: Float>(&self, z: T, dy: T) -> T {
        if self.silu {
            let s = sigmoid(z);
            dy * s * (T::from(1.0) + z * (T::from(1.0) - s))
        } else {
            dy
        }
    }
}

impl CustomOp3 for BatchNormAct {
    fn name(&self) -> &'static str {
        "batch-norm-act"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let _profile = crate::util::profile::region("op/batch-norm");
        let (_, c, hw) = nchw(l1)?;
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(g), CpuStorage::F32(b)) => {
                CpuStorage::F32(self.apply(contiguous(x, l1, "x")?, contiguous(g, l2, "gamma")?, contiguous(b, l3, "beta")?, c, hw))
            }
            (CpuStorage::F64(x), CpuStorage::F64(g), CpuStorage::F64(b)) => {
                CpuStorage::F64(self.apply(contiguous(x, l1, "x")?, contiguous(g, l2, "gamma")?, contiguous(b, l3, "beta")?, c, hw))
            }
            _ => candle_core::bail!("batch norm supports f32 and f64 with matching dtypes"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let gamma_v: Vec<f64> = gamma.to_dtype(DType::F64)?.to_vec1()?;
        let beta_v: Vec<f64> = beta.to_dtype(DType::F64)?.to_vec1()?;
        let grad = grad.contiguous()?;
        let sums = x.apply_op2_no_bwd(&grad, &BnParamGrads { op: self.clone(), gamma: gamma_v.clone(), beta: beta_v.clone() })?;
        let sums_v: Vec<Vec<f64>> = sums.to_dtype(DType::F64)?.to_vec2()?;
        let gx = x.apply_op2_no_bwd(
            &grad,
            &BnInputGrad { op: self.clone(), gamma: gamma_v, beta: beta_v, sum_dz_xhat: sums_v[0].clone(), sum_dz: sums_v[1].clone() },
        )?;
        let dgamma = sums.get(0)?.to_dtype(gamma.dtype())?;
        let dbeta = sums.get(1)?.to_dtype(gamma.dtype())?;
        Ok((Some(gx), Some(dgamma), Some(dbeta)))
    }
}

/// Σ dz·x̂ and Σ dz per channel: the γ and β gradients. `[2, C]`.
struct BnParamGrads {
    op: BatchNormAct,
    gamma: Vec<f64>,
    beta: Vec<f64>,
}

impl BnParamGrads {
    fn sums<T: Float>(&self, x: &[T], dy: &[T], n: usize, c: usize, hw: usize) -> Vec<[f64; 2]> {
        let op = &self.op;
        per_channel_sums::<2>(n, c, hw, |_, ch, i| {
            let xhat = (x[i] - T::from(op.mean[ch])) * T::from(op.inv_std[ch]);
            let dz = op.dz(T::from(self.gamma[ch]) * xhat + T::from(self.beta[ch]), dy[i]);
            [(dz * xhat).f(), dz.f()]
        })
    }
}

impl CustomOp2 for BnParamGrads {
    fn name(&self) -> &'static str {
        "batch-norm-act-param-grads"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let _profile = crate::util::profile::region("op/batch-norm-grad");
        let (n, c, hw) = nchw(l1)?;
        let out = float_dispatch2!(s1, l1, s2, l2, "batch norm backward", |x, dy| {
            let sums = self.sums(x, dy, n, c, hw);
            let mut out = vec![Float::from(0.0); 2 * c];
            for (ch, [a, b]) in sums.into_iter().enumerate() {
                out[ch] = Float::from(a);
                out[c + ch] = Float::from(b);
            }
            out
        });
        Ok((out, Shape::from((2, c))))
    }
}

struct BnInputGrad {
    op: BatchNormAct,
    gamma: Vec<f64>,
    beta: Vec<f64>,
    sum_dz_xhat: Vec<f64>,
    sum_dz: Vec<f64>,
}

impl BnInputGrad {
    fn run<T: Float>(&self, x: &[T], dy: &[T], n: usize, c: usize, hw: usize) -> Vec<T> {
        let m = (n * hw) as f64;
        let op = &self.op;
        let mut gx = vec![T::default(); x.len()];
        gx.par_chunks_mut(hw).enumerate().for_each(|(p, out)| {
            let ch = p % c;
            let (g, r) = (self.gamma[ch], op.inv_std[ch]);
            let (gt, rt, mean, beta) = (T::from(g), T::from(r), T::from(op.mean[ch]), T::from(self.beta[ch]));
            // dx = g·r/m · (m·dz − Σdz − x̂·Σdz·x̂) with batch statistics, g·r·dz without.
            let (k, mt, sdz, sdzx) = if op.batch_stats {
                (T::from(g * r / m), T::from(m), T::from(self.sum_dz[ch]), T::from(self.sum_dz_xhat[ch]))
            } else {
                (T::from(g * r), T::from(1.0), T::from(0.0), T::from(0.0))
            };
            let base = p * hw;
            for (j, o) in out.iter_mut().enumerate() {
                let xhat = (x[base + j] - mean) * rt;
                let dz = op.dz(gt * xhat + beta, dy[base + j]);
                *o = k * (mt * dz - sdz - xhat * sdzx);
            }
        });
        gx
    }
}

impl CustomOp2 for BnInputGrad {
    fn name(&self) -> &'static str {
        "batch-norm-act-input-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let _profile = crate::util::profile::region("op/batch-norm-grad");
        let (n, c, hw) = nchw(l1)?;
        let out = float_dispatch2!(s1, l1, s2, l2, "batch norm backward", |x, dy| self.run(x, dy, n, c, hw));
        Ok((out, l1.shape().clone()))
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
    if !x.device().is_cpu() {
        return composite::batch_norm_act(x, stats, gamma, beta, silu);
    }
    let dtype = x.dtype();
    let cd = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let op = BatchNormAct {
        mean: stats.mean.to_vec(),
        inv_std: stats.var.iter().map(|v| 1.0 / (v + stats.eps).sqrt()).collect(),
        batch_stats: stats.from_batch,
        silu,
    };
    let y = x.to_dtype(cd)?.contiguous()?.apply_op3(&gamma.to_dtype(cd)?.contiguous()?, &beta.to_dtype(cd)?.contiguous()?, op)?;
    y.to_dtype(dtype)
}

// ---------------------------------------------------------------------------------------------
// Channel scaling (squeeze-and-excitation) and spatial means

struct ChannelScale;

impl CustomOp2 for ChannelScale {
    fn name(&self) -> &'static str {
        "channel-scale"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let _profile = crate::util::profile::region("op/channel");
        let (_, _, hw) = nchw(l1)?;
        let out = float_dispatch2!(s1, l1, s2, l2, "channel scale", |h, s| {
            let mut out = vec![Float::from(0.0); h.len()];
            out.par_chunks_mut(hw).zip(h.par_chunks(hw)).enumerate().for_each(|(p, (o, hp))| {
                let sv = s[p].f();
                for (ov, hv) in o.iter_mut().zip(hp) {
                    *ov = Float::from(hv.f() * sv);
                }
            });
            out
        });
        Ok((out, l1.shape().clone()))
    }

    fn bwd(&self, h: &Tensor, s: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let dh = grad.apply_op2_no_bwd(s, &ChannelScale)?;
        let ds = h.apply_op2_no_bwd(&grad, &DotPerPlane)?.reshape(s.dims())?;
        Ok((Some(dh), Some(ds)))
    }
}

/// `Σ_hw a·b` per (n, c) plane: `[N, C]`.
struct DotPerPlane;

impl CustomOp2 for DotPerPlane {
    fn name(&self) -> &'static str {
        "dot-per-plane"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let _profile = crate::util::profile::region("op/channel");
        let (n, c, hw) = nchw(l1)?;
        let out = float_dispatch2!(s1, l1, s2, l2, "channel scale backward", |a, b| {
            a.par_chunks(hw)
                .zip(b.par_chunks(hw))
                .map(|(x, y)| Float::from(x.iter().zip(y).map(|(p, q)| p.f() * q.f()).sum::<f64>()))
                .collect()
        });
        Ok((out, Shape::from((n, c))))
    }
}

/// `h · s` with `h` `[N, C, H, W]` and `s` `[N, C]` (one factor per image and channel).
pub fn channel_scale(h: &Tensor, s: &Tensor) -> Result<Tensor> {
    if !h.device().is_cpu() {
        return composite::channel_scale(h, s);
    }
    if !matches!(h.dtype(), DType::F32 | DType::F64) {
        return channel_scale(&h.to_dtype(DType::F32)?, &s.to_dtype(DType::F32)?)?.to_dtype(h.dtype());
    }
    let (n, c, _, _) = h.dims4()?;
    h.contiguous()?.apply_op2(&s.reshape((n, c))?.contiguous()?, ChannelScale)
}

struct SpatialMean;

impl CustomOp1 for SpatialMean {
    fn name(&self) -> &'static str {
        "spatial-mean"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let _profile = crate::util::profile::region("op/channel");
        let (n, c, hw) = nchw(l)?;
        let out = float_dispatch!(s, l, "spatial mean", |x| x
            .par_chunks(hw)
            .map(|p| Float::from(p.iter().map(|v| v.f()).sum::<f64>() / hw as f64))
            .collect());
        Ok((out, Shape::from((n, c))))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (_, _, h, w) = x.dims4()?;
        let ones = Tensor::ones(x.dims(), x.dtype(), x.device())?;
        Ok(Some(ones.apply_op2_no_bwd(&(grad.contiguous()? / (h * w) as f64)?, &ChannelScale)?))
    }
}

/// Mean over H and W: `[N, C, H, W]` → `[N, C]`.
pub fn spatial_mean(x: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return composite::spatial_mean(x);
    }
    if !matches!(x.dtype(), DType::F32 | DType::F64) {
        return spatial_mean(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype());
    }
    x.contiguous()?.apply_op1(SpatialMean)
}

/// The same ops composed from candle primitives, which have kernels on every device: what GPUs
/// run (the fused CPU ops above have no CUDA kernels yet) and what the tests hold the fused ops to.
pub mod composite {
    use candle_core::{DType, Result, Tensor};

    use super::Statistics;

    /// Mean over N, H and W, keeping `[1, C, 1, 1]`.
    fn per_channel_mean(x: &Tensor) -> Result<Tensor> {
        x.mean_keepdim(3)?.mean_keepdim(2)?.mean_keepdim(0)
    }

    pub fn channel_moments(x: &Tensor) -> Result<Tensor> {
        let x = x.detach();
        let m = per_channel_mean(&x)?;
        let v = per_channel_mean(&x.broadcast_sub(&m)?.sqr()?)?;
        Tensor::stack(&[m.flatten_all()?, v.flatten_all()?], 0)
    }

    pub fn batch_norm_act(x: &Tensor, stats: &Statistics, gamma: &Tensor, beta: &Tensor, silu: bool) -> Result<Tensor> {
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

    pub fn channel_scale(h: &Tensor, s: &Tensor) -> Result<Tensor> {
        let (n, c, _, _) = h.dims4()?;
        h.broadcast_mul(&s.reshape((n, c, 1, 1))?)
    }

    pub fn spatial_mean(x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        // Low-precision sums over large planes lose digits; accumulate in f32.
        let wide = if dtype == DType::F64 { x.clone() } else { x.to_dtype(DType::F32)? };
        wide.flatten_from(2)?.mean(2)?.to_dtype(dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn close(a: &Tensor, b: &Tensor, tol: f64) {
        let d = (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
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
                let m = channel_moments(x.as_tensor()).unwrap().to_vec2::<f64>().unwrap();
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
            let reference = composite::batch_norm_act(x.as_tensor(), &stats_ref, gamma.as_tensor(), beta.as_tensor(), silu).unwrap();
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
            let m = channel_moments(x.as_tensor()).unwrap().to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
            let (mean, var) = if batch_stats { (m[0].clone(), m[1].clone()) } else { (vec![0.2; 6], vec![1.7; 6]) };
            let stats = Statistics { mean: &mean, var: &var, eps: 1e-3, from_batch: batch_stats };
            let ours = batch_norm_act(x.as_tensor(), &stats, gamma.as_tensor(), beta.as_tensor(), true).unwrap();
            let reference = composite::batch_norm_act(x.as_tensor(), &stats, gamma.as_tensor(), beta.as_tensor(), true).unwrap();
            close(&ours, &reference, 1e-4);
            let up = crate::util::rng::randn(143, 0.0, 1.0, ours.dims(), DType::F32, &dev).unwrap();
            let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&x, &gamma, &beta] {
                close(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap(), 1e-3);
            }
        }
    }

    #[test]
    fn channel_scale_and_spatial_mean_match_the_composed_ops() {
        let dev = Device::Cpu;
        let h = Var::from_tensor(&crate::util::rng::randn(108, 0.0, 1.0, (2, 3, 4, 5), candle_core::DType::F64, &dev).unwrap()).unwrap();
        let s = Var::from_tensor(&crate::util::rng::randn(109, 0.0, 1.0, (2, 3), candle_core::DType::F64, &dev).unwrap()).unwrap();
        let ours = channel_scale(h.as_tensor(), s.as_tensor()).unwrap();
        let reference = composite::channel_scale(h.as_tensor(), s.as_tensor()).unwrap();
        close(&ours, &reference, 1e-12);
        let up = crate::util::rng::randn(110, 0.0, 1.0, ours.dims(), candle_core::DType::F64, &dev).unwrap();
        let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&h, &s] {
            close(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap(), 1e-12);
        }
        let ours = spatial_mean(h.as_tensor()).unwrap();
        let reference = composite::spatial_mean(h.as_tensor()).unwrap();
        close(&ours, &reference, 1e-12);
        let up = crate::util::rng::randn(111, 0.0, 1.0, (2, 3), candle_core::DType::F64, &dev).unwrap();
        let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
        close(g1.get(h.as_tensor()).unwrap(), g2.get(h.as_tensor()).unwrap(), 1e-12);
    }

    #[test]
    fn moments_by_hand() {
        let x = Tensor::new(&[[[[1.0f32, 3.0]], [[2.0, 2.0]]], [[[5.0, 7.0]], [[2.0, 6.0]]]], &Device::Cpu).unwrap();
        let m = channel_moments(&x).unwrap().to_vec2::<f32>().unwrap();
        // Channel 0: 1,3,5,7 → mean 4, var 5; channel 1: 2,2,2,6 → mean 3, var 3.
        assert_eq!(m, vec![vec![4.0, 3.0], vec![5.0, 3.0]]);
        assert_eq!(composite::channel_moments(&x).unwrap().to_vec2::<f32>().unwrap(), m);
    }
}
