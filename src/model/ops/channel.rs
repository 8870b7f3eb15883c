//! Per-channel ops of convolutional towers on NCHW tensors, each one pass over the data with its
//! own backward: batch moments, BatchNorm with an optional SiLU, channel scaling (squeeze-and-
//! excitation) and spatial means.
//!
//! Composed from candle primitives these take several full-size temporaries each, and their
//! backward passes reduce broadcast gradients through candle's strided slow path; on
//! EfficientNet-B0 that made the backward pass 14× the forward (profile in issue 5's note).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

#[cfg(feature = "cuda")]
use super::gpu::{self, Program};
use super::{float_dispatch, float_dispatch2, float_dispatch3, lane_dot, lane_sum, output_buffer, simd, with_cpu_slice, Float, LANES};

fn nchw(l: &Layout) -> Result<(usize, usize, usize)> {
    match l.dims() {
        [n, c, h, w] => Ok((*n, *c, h * w)),
        d => candle_core::bail!("expected an NCHW tensor, got {d:?}"),
    }
}

/// `(n, c, h·w)` of NCHW `l1` and a second operand `l2` of the same shape.
fn nchw_pair(l1: &Layout, l2: &Layout, what: &str) -> Result<(usize, usize, usize)> {
    let dims = nchw(l1)?;
    if l2.dims() != l1.dims() {
        candle_core::bail!("{what}: operands of shapes {:?} and {:?}", l1.dims(), l2.dims());
    }
    Ok(dims)
}

/// `(n, c, h·w)` of NCHW `l1` and a second operand `l2` with one value per plane (`[N, C]`).
fn nchw_planes(l1: &Layout, l2: &Layout, what: &str) -> Result<(usize, usize, usize)> {
    let dims = nchw(l1)?;
    if l2.shape().elem_count() != dims.0 * dims.1 {
        candle_core::bail!("{what}: {:?} is not one value per plane of {:?}", l2.dims(), l1.dims());
    }
    Ok(dims)
}

/// Checks that each of `dims` is one value per channel.
fn per_channel(c: usize, dims: &[&[usize]], what: &str) -> Result<()> {
    if let Some(d) = dims.iter().find(|d| **d != [c]) {
        candle_core::bail!("{what}: {d:?} for {c} channels");
    }
    Ok(())
}

/// Per-plane pairs of sums (planes in NCHW order) added up per channel.
fn channel_totals(plane_sums: Vec<[f64; 2]>, c: usize) -> Vec<[f64; 2]> {
    let mut sums = vec![[0.0f64; 2]; c];
    for (p, [a, b]) in plane_sums.into_iter().enumerate() {
        sums[p % c][0] += a;
        sums[p % c][1] += b;
    }
    sums
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
        let out = float_dispatch!(s, l, "channel moments", |x| moments(x, n, c, hw));
        Ok((out, Shape::from((2, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = nchw(l)?;
        Ok((gpu::cuda::run(&Program::channel_moments(dims, &gpu::GPU), &[(s, l)], None)?, Shape::from((2, dims.1))))
    }
}

/// Per-channel mean and biased variance, `[means…, variances…]`.
fn moments<T: Float>(x: &[T], n: usize, c: usize, hw: usize) -> Vec<T> {
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
    if super::has_kernels(x, &[]) {
        return x.contiguous()?.apply_op1_no_bwd(&Moments);
    }
    if x.device().is_cpu() {
        return channel_moments(&x.to_dtype(DType::F32)?);
    }
    composite::channel_moments(x)
}

// ---------------------------------------------------------------------------------------------
// BatchNorm (+ SiLU)

/// `y = act(γ·(x − μ)·r + β)` with per-channel μ and r = 1/√(σ² + ε) given. With `batch_stats`,
/// μ and σ² are the batch's own and the backward pass differentiates through them.
#[derive(Clone)]
pub(super) struct BatchNormAct {
    mean: Vec<f64>,
    inv_std: Vec<f64>,
    batch_stats: bool,
    silu: bool,
}

#[inline(always)]
pub(super) fn sigmoid<T: Float>(z: T) -> T {
    T::from(1.0) / (T::from(1.0) + (-z).exp())
}

impl BatchNormAct {
    pub(super) fn new(stats: &Statistics, silu: bool) -> Self {
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
    fn side(&self) -> Vec<f64> {
        self.mean.iter().chain(&self.inv_std).copied().collect()
    }

    /// `z = a·x + b` per channel: the normalisation and affine map folded together.
    fn affine<T: Float>(&self, gamma: &[T], beta: &[T], ch: usize) -> (T, T) {
        let a = gamma[ch].f() * self.inv_std[ch];
        (T::from(a), T::from(beta[ch].f() - a * self.mean[ch]))
    }

    pub(super) fn apply<T: Float>(&self, x: &[T], gamma: &[T], beta: &[T], c: usize, hw: usize) -> Vec<T> {
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
    fn backward<T: Float>(&self, x: &[T], dy: &[T], gamma: &[T], beta: &[T], (n, c, hw): (usize, usize, usize)) -> Vec<T> {
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
        let (_, c, hw) = self.check(l1, l2, l3)?;
        let out = float_dispatch3!(s1, l1, s2, l2, s3, l3, "batch norm", |x, g, b| self.apply(x, g, b, c, hw));
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let program = Program::batch_norm_act(self.check(l1, l2, l3)?, self.silu, &gpu::GPU);
        let side = self.side();
        Ok((gpu::cuda::run(&program, &[(s1, l1), (s2, l2), (s3, l3)], Some(gpu::Side::F64(&side)))?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let out = x.apply_op2_no_bwd(&grad, &BnGrad { op: self.clone(), gamma: gamma.clone(), beta: beta.clone() })?;
        let c = gamma.dim(0)?;
        let gx = out.narrow(0, 0, x.elem_count())?.reshape(x.dims())?;
        let sums = out.narrow(0, x.elem_count(), 2 * c)?.reshape((2, c))?;
        Ok((Some(gx), Some(sums.get(0)?.to_dtype(gamma.dtype())?), Some(sums.get(1)?.to_dtype(gamma.dtype())?)))
    }
}

/// The backward pass as one op of (x, dy): dx flattened, then Σdz·x̂ and Σdz per channel, in one
/// buffer (a custom op has one output). γ and β are read from their tensors in the op.
pub(super) struct BnGrad {
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

impl CustomOp2 for BnGrad {
    fn name(&self) -> &'static str {
        "batch-norm-act-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let _profile = crate::util::profile::region("op/batch-norm-grad");
        let dims = self.check(l1, l2)?;
        let c = dims.1;
        let out = float_dispatch2!(s1, l1, s2, l2, "batch norm backward", |x, dy| {
            with_cpu_slice(&self.gamma, "batch norm's gamma", |gamma| {
                with_cpu_slice(&self.beta, "batch norm's beta", |beta| Ok(self.op.backward(x, dy, gamma, beta, dims)))
            })?
        });
        Ok((out, Shape::from(l1.shape().elem_count() + 2 * c)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = self.check(l1, l2)?;
        // γ and β side by side, the kernel's third operand.
        let gb = Tensor::cat(&[&self.gamma, &self.beta], 0)?;
        let (storage, layout) = gb.storage_and_layout();
        let candle_core::Storage::Cuda(gb) = &*storage else { candle_core::bail!("batch norm's gamma and beta must be on the GPU") };
        let program = Program::batch_norm_act_grad(dims, self.op.silu, self.op.batch_stats, &gpu::GPU);
        let side = self.op.side();
        let out = gpu::cuda::run(&program, &[(s1, l1), (s2, l2), (gb, layout)], Some(gpu::Side::F64(&side)))?;
        Ok((out, Shape::from(l1.shape().elem_count() + 2 * dims.1)))
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
    if !x.device().is_cpu() && !super::has_kernels(x, &[gamma, beta]) {
        return composite::batch_norm_act(x, stats, gamma, beta, silu);
    }
    let dtype = x.dtype();
    let cd = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let op = BatchNormAct::new(stats, silu);
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
        let (_, _, hw) = nchw_planes(l1, l2, "channel scale")?;
        let out = float_dispatch2!(s1, l1, s2, l2, "channel scale", |h, s| {
            scale_planes(h, &s.iter().map(|v| v.f()).collect::<Vec<_>>(), None, hw)
        });
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
        let program = Program::channel_scale(nchw_planes(l1, l2, "channel scale")?, &gpu::GPU);
        Ok((gpu::cuda::run(&program, &[(s1, l1), (s2, l2)], None)?, l1.shape().clone()))
    }

    fn bwd(&self, h: &Tensor, s: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let dh = grad.apply_op2_no_bwd(s, &ChannelScale)?;
        let ds = h.apply_op2_no_bwd(&grad, &DotPerPlane)?.reshape(s.dims())?;
        Ok((Some(dh), Some(ds)))
    }
}

/// `out[plane] = a[plane] · f[plane]` (+ `add[plane]`), plane by plane.
pub(super) fn scale_planes<T: Float>(a: &[T], f: &[f64], add: Option<&[f64]>, hw: usize) -> Vec<T> {
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
struct DotPerPlane;

impl CustomOp2 for DotPerPlane {
    fn name(&self) -> &'static str {
        "dot-per-plane"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let _profile = crate::util::profile::region("op/channel");
        let (n, c, hw) = nchw_pair(l1, l2, "channel scale backward")?;
        let out = float_dispatch2!(s1, l1, s2, l2, "channel scale backward", |a, b| {
            a.par_chunks(hw).zip(b.par_chunks(hw)).map(|(x, y)| simd(|| lane_dot(x, y))).collect()
        });
        Ok((out, Shape::from((n, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = nchw_pair(l1, l2, "channel scale backward")?;
        Ok((gpu::cuda::run(&Program::dot_per_plane(dims, &gpu::GPU), &[(s1, l1), (s2, l2)], None)?, Shape::from((dims.0, dims.1))))
    }
}

/// `h · s` with `h` `[N, C, H, W]` and `s` `[N, C]` (one factor per image and channel).
pub fn channel_scale(h: &Tensor, s: &Tensor) -> Result<Tensor> {
    if !h.device().is_cpu() && !super::has_kernels(h, &[s]) {
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
            .map(|p| Float::from(simd(|| lane_sum(p)).f() / hw as f64))
            .collect());
        Ok((out, Shape::from((n, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = nchw(l)?;
        Ok((gpu::cuda::run(&Program::spatial_mean(dims, &gpu::GPU), &[(s, l)], None)?, Shape::from((dims.0, dims.1))))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (n, c, h, w) = x.dims4()?;
        // A broadcast view: the gradient store adds it to the input's other gradient (the
        // channel scaling's) without a full-size tensor of its own.
        Ok(Some((grad / (h * w) as f64)?.reshape((n, c, 1, 1))?.broadcast_as(x.dims())?))
    }
}

/// Mean over H and W: `[N, C, H, W]` → `[N, C]`.
pub fn spatial_mean(x: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() && !super::has_kernels(x, &[]) {
        return composite::spatial_mean(x);
    }
    if !matches!(x.dtype(), DType::F32 | DType::F64) {
        return spatial_mean(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype());
    }
    x.contiguous()?.apply_op1(SpatialMean)
}

// ---------------------------------------------------------------------------------------------
// Stochastic depth on a residual branch

/// `h·keep[n] + x`: each sample's residual branch scaled by its own factor (0 drops it), added to
/// the shortcut in one pass. Composed, the scaled branch is one more activation-sized tensor per
/// block, kept until the backward pass ends, and one more pass each way.
struct ScaledResidual {
    keep: Vec<f64>,
}

impl ScaledResidual {
    fn run<T: Float>(&self, h: &[T], x: &[T]) -> Vec<T> {
        scaled_sum(h, &self.keep, x)
    }
}

/// `h·keep[n] + x` on slices, one factor per sample.
pub(super) fn scaled_sum<T: Float>(h: &[T], keep: &[f64], x: &[T]) -> Vec<T> {
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

impl CustomOp2 for ScaledResidual {
    fn name(&self) -> &'static str {
        "scaled-residual"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let _profile = crate::util::profile::region("op/channel");
        if l1.dims() != l2.dims() || l1.dims().len() != 4 || l1.dims()[0] != self.keep.len() {
            candle_core::bail!("scaled residual: branch {:?}, shortcut {:?}, {} sample factors", l1.dims(), l2.dims(), self.keep.len());
        }
        let out = float_dispatch2!(s1, l1, s2, l2, "scaled residual", |h, x| self.run(h, x));
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
        if l1.dims() != l2.dims() || l1.dims().len() != 4 || l1.dims()[0] != self.keep.len() {
            candle_core::bail!("scaled residual: branch {:?}, shortcut {:?}, {} sample factors", l1.dims(), l2.dims(), self.keep.len());
        }
        let program = Program::scaled_residual(nchw(l1)?, &gpu::GPU);
        Ok((gpu::cuda::run(&program, &[(s1, l1), (s2, l2)], Some(gpu::Side::F64(&self.keep)))?, l1.shape().clone()))
    }

    fn bwd(&self, _h: &Tensor, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        Ok((Some(scale_samples(&grad, &self.keep)?), Some(grad)))
    }
}

/// `g·keep[n]` for NCHW `g` outside the graph: the channel scaling with one factor per plane.
pub(super) fn scale_samples(g: &Tensor, keep: &[f64]) -> Result<Tensor> {
    let (n, c, _, _) = g.dims4()?;
    let planes: Vec<f64> = keep.iter().flat_map(|&k| std::iter::repeat_n(k, c)).collect();
    let factors = Tensor::from_vec(planes, (n, c), g.device())?.to_dtype(g.dtype())?;
    g.contiguous()?.apply_op2_no_bwd(&factors, &ChannelScale)
}

/// `h·keep[n] + x` for NCHW `h` and `x` of one shape, `keep` one factor per sample (stochastic
/// depth: 0 or 1/(1−p)).
pub fn scaled_residual(h: &Tensor, keep: &[f64], x: &Tensor) -> Result<Tensor> {
    if !super::has_kernels(h, &[x]) {
        return composite::scaled_residual(h, keep, x);
    }
    h.contiguous()?.apply_op2(&x.contiguous()?, ScaledResidual { keep: keep.to_vec() })
}

/// The same ops composed from candle primitives, which have kernels on every device: what runs
/// where the ops above have no kernels (bf16 on a GPU, devices other than CUDA) and what the
/// tests hold the fused ops to.
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

    pub fn scaled_residual(h: &Tensor, keep: &[f64], x: &Tensor) -> Result<Tensor> {
        let mut shape = vec![1; h.rank()];
        shape[0] = keep.len();
        let keep = Tensor::from_slice(keep, shape, h.device())?.to_dtype(h.dtype())?;
        h.broadcast_mul(&keep)? + x
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

    /// A channel mean 1000× its spread: E[x²] − E[x]² in f32 would lose the variance entirely.
    #[test]
    fn f32_moments_keep_the_variance_of_a_channel_far_from_zero() {
        let dev = Device::Cpu;
        let x = (crate::util::rng::randn(150, 0.0, 1.0, (4, 3, 17, 19), DType::F64, &dev).unwrap() + 1000.0).unwrap();
        let ours = channel_moments(&x.to_dtype(DType::F32).unwrap()).unwrap().to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
        let xf = x.to_dtype(DType::F32).unwrap().to_dtype(DType::F64).unwrap();
        let reference = composite::channel_moments(&xf).unwrap().to_vec2::<f64>().unwrap();
        for ch in 0..3 {
            assert!((ours[0][ch] - reference[0][ch]).abs() < 1e-4, "mean {} vs {}", ours[0][ch], reference[0][ch]);
            assert!((ours[1][ch] / reference[1][ch] - 1.0).abs() < 1e-4, "variance {} vs {}", ours[1][ch], reference[1][ch]);
        }
    }

    #[test]
    fn scaled_residual_matches_the_composed_ops() {
        let dev = Device::Cpu;
        for dtype in [DType::F64, DType::F32] {
            let h = Var::from_tensor(&crate::util::rng::randn(190, 0.0, 1.0, (3, 4, 5, 6), dtype, &dev).unwrap()).unwrap();
            let x = Var::from_tensor(&crate::util::rng::randn(191, 0.0, 1.0, (3, 4, 5, 6), dtype, &dev).unwrap()).unwrap();
            let keep = [1.25, 0.0, 1.25];
            let ours = scaled_residual(&h, &keep, &x).unwrap();
            let reference = composite::scaled_residual(&h, &keep, &x).unwrap();
            close(&ours, &reference, 1e-6);
            let up = crate::util::rng::randn(192, 0.0, 1.0, ours.dims(), dtype, &dev).unwrap();
            let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&h, &x] {
                close(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap(), 1e-6);
            }
            // The dropped sample's branch gets exactly no gradient.
            let dropped = g1.get(h.as_tensor()).unwrap().get(1).unwrap().abs().unwrap().sum_all().unwrap();
            assert_eq!(dropped.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(), 0.0);
        }
        let wrong =
            scaled_residual(&Tensor::zeros((2, 3), DType::F32, &dev).unwrap(), &[1.0], &Tensor::zeros((2, 3), DType::F32, &dev).unwrap());
        assert!(wrong.unwrap_err().to_string().contains("1 sample factors"));
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

#[cfg(test)]
mod gpu_tests {
    use super::super::gpu::{run_on_host, Program, Side, SMALL_GRID};
    use super::super::kernel_host::{assert_close, to_f32, values, Pod};
    use super::*;

    /// Every per-channel program in the host emulation against the CPU kernels, in one dtype.
    fn check<T: Float + Pod>(dims: (usize, usize, usize), x: &[T], dy: &[T], gamma: &[T], beta: &[T], tol: f64) {
        let (n, c, hw) = dims;
        let limits = &SMALL_GRID;
        let what = format!("{n}x{c}x{hw} {}", std::mem::size_of::<T>() * 8);
        assert_close(&run_on_host(&Program::channel_moments(dims, limits), &[x], None), &moments(x, n, c, hw), tol, &what);
        let stats = moments(x, n, c, hw).iter().map(|v| v.f()).collect::<Vec<_>>();
        let (mean, var) = stats.split_at(c);
        for (from_batch, silu) in [(true, true), (true, false), (false, true)] {
            let op = BatchNormAct::new(&Statistics { mean, var, eps: 1e-3, from_batch }, silu);
            let side = op.side();
            let side = Some(Side::F64(&side));
            let what = format!("{what} batch statistics {from_batch}, SiLU {silu}");
            let forward = run_on_host(&Program::batch_norm_act(dims, silu, limits), &[x, gamma, beta], side);
            assert_close(&forward, &op.apply(x, gamma, beta, c, hw), tol, &what);
            let gb: Vec<T> = gamma.iter().chain(beta).copied().collect();
            let backward = run_on_host(&Program::batch_norm_act_grad(dims, silu, from_batch, limits), &[x, dy, &gb], side);
            assert_close(&backward, &op.backward(x, dy, gamma, beta, dims), tol, &what);
        }
        let s: Vec<T> = dy[..n * c].to_vec();
        let factors: Vec<f64> = s.iter().map(|v| v.f()).collect();
        assert_close(&run_on_host(&Program::channel_scale(dims, limits), &[x, &s], None), &scale_planes(x, &factors, None, hw), tol, &what);
        let dots: Vec<T> = x.chunks(hw).zip(dy.chunks(hw)).map(|(a, b)| lane_dot(a, b)).collect();
        assert_close(&run_on_host(&Program::dot_per_plane(dims, limits), &[x, dy], None), &dots, tol, &what);
        let means: Vec<T> = x.chunks(hw).map(|p| T::from(lane_sum(p).f() / hw as f64)).collect();
        assert_close(&run_on_host(&Program::spatial_mean(dims, limits), &[x], None), &means, tol, &what);
        let keep: Vec<f64> = (0..n).map(|i| if i % 2 == 0 { 1.25 } else { 0.0 }).collect();
        let residual = run_on_host(&Program::scaled_residual(dims, limits), &[x, dy], Some(Side::F64(&keep)));
        assert_close(&residual, &scaled_sum(x, &keep, dy), tol, &what);
    }

    #[test]
    fn the_gpu_kernels_match_the_cpu_ops_in_the_host_emulation() {
        // Planes larger than a block (300 > 256 threads) and smaller (7 of 32); more channels and
        // planes than the small grid's blocks; a mean far from zero for the shifted moments.
        for dims in [(3, 5, 300), (4, 9, 7)] {
            let len = dims.0 * dims.1 * dims.2;
            let x = values(220, 3.0, 2.0, len);
            let dy = values(221, 0.0, 1.0, len);
            let gamma = values(222, 1.0, 0.3, dims.1);
            let beta = values(223, 0.0, 0.3, dims.1);
            check(dims, &x, &dy, &gamma, &beta, 1e-12);
            check(dims, &to_f32(&x), &to_f32(&dy), &to_f32(&gamma), &to_f32(&beta), 2e-5);
        }
    }
}
