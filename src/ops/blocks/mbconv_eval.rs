//! An MBConv block's forward pass where nothing needs a gradient and every BatchNorm normalises
//! with its running statistics (embedding, scoring, evaluation), as one op.
//!
//! Such a BatchNorm is an affine map per channel, so it folds into the convolution before it: the
//! weights scaled per output channel, the shift (and SiLU) applied to each block of the output
//! while it is still in cache. Squeeze-excitation's factors scale the projection's weights per
//! image instead of the expanded tensor, and its spatial means are summed as the depthwise
//! output's planes are written. Run as the training path's stages, the block writes tensors of
//! its widest kind (the expanded channels) five times and reads them six (two convolutions' raw
//! outputs, two BatchNorms, the pooling, the channel scaling); here it writes two and reads two.

use candle_core::{Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::squeeze_excite::factors;
use crate::ops::kernels::channel_scale::scale_planes;
use crate::ops::kernels::depthwise::{self, Padding};
use crate::ops::kernels::pointwise;
use crate::ops::op::{Kernel, Op};
use crate::ops::{cpu_slices, output_buffer, simd, Float};

/// A BatchNorm with running statistics as the affine map it is: `scale·z + shift` per channel,
/// `scale = γ/√(var + ε)` and `shift = β − mean·scale`.
#[derive(Debug, Clone)]
pub struct Affine {
    pub scale: Vec<f64>,
    pub shift: Vec<f64>,
}

impl Affine {
    /// `weight` (`[C, per]`, one row per output channel) with each row scaled by its channel's
    /// factor.
    fn fold<T: Float>(&self, weight: &[T]) -> Vec<T> {
        let per = weight.len() / self.scale.len().max(1);
        weight.chunks(per.max(1)).zip(&self.scale).flat_map(|(row, &s)| row.iter().map(move |&w| T::from(w.f() * s))).collect()
    }

    fn shift<T: Float>(&self) -> Vec<T> {
        self.shift.iter().map(|&b| T::from(b)).collect()
    }

    /// That the map has one scale and one shift for each of the `channels` of its convolution.
    fn check(&self, what: &str, channels: usize) -> Result<()> {
        if self.scale.len() != channels || self.shift.len() != channels {
            candle_core::bail!(
                "MBConv block: the {what} BatchNorm has {} scales and {} shifts for {channels} channels",
                self.scale.len(),
                self.shift.len()
            );
        }
        Ok(())
    }
}

/// The block's weights (each contiguous) and its BatchNorms as [`Affine`] maps.
pub struct MbConvEval {
    /// The 1×1 expansion `[mid, in, 1, 1]`, absent when the expansion ratio is 1.
    pub expand: Option<(Tensor, Affine)>,
    /// `[mid, 1, k, k]`.
    pub depthwise: (Tensor, Affine),
    pub stride: usize,
    pub pad: Padding,
    /// Reduce weight `[R, mid]` and bias, expand weight `[mid, R]` and bias.
    pub excite: [Tensor; 4],
    /// The 1×1 projection `[out, mid, 1, 1]`.
    pub project: (Tensor, Affine),
    /// The input is added to the output (stride 1, as many channels out as in).
    pub residual: bool,
}

impl MbConvEval {
    fn weights(&self) -> Vec<&Tensor> {
        let mut all: Vec<&Tensor> = self.expand.iter().map(|(w, _)| w).collect();
        all.push(&self.depthwise.0);
        all.extend(&self.excite);
        all.push(&self.project.0);
        all
    }

    fn run<T: Float>(&self, x: &[T], [n, cin, h, w]: [usize; 4]) -> Result<Vec<T>> {
        let held: Vec<_> = self.weights().into_iter().map(|t| t.storage_and_layout()).collect();
        let slices = cpu_slices::<T>(&held, "MBConv weight")?;
        let (expand_w, rest) = slices.split_at(usize::from(self.expand.is_some()));
        let &[dw, w1, b1, w2, b2, wp] = rest else { candle_core::bail!("MBConv block: {} weights", slices.len()) };
        let expanded = match (&self.expand, expand_w) {
            (Some((_, norm)), &[we]) => {
                Some(pointwise::forward_folded(x, (n, cin, h * w), &norm.fold(we), false, &norm.shift(), true, None))
            }
            _ => None,
        };
        let (dw_norm, k) = (&self.depthwise.1, self.depthwise.0.dim(2)?);
        let mid = dw_norm.scale.len();
        let input = expanded.as_deref().unwrap_or(x);
        let (hidden, means, [ho, wo]) =
            depthwise::forward_folded(input, [n, mid, h, w], &dw_norm.fold(dw), (k, self.stride, self.pad), &dw_norm.shift())?;
        drop(expanded);
        let gates = factors(n, &means, (w1, b1), (w2, b2))?;
        let norm = &self.project.1;
        // `out_dims` has checked every part against the block's channels.
        let out = norm.scale.len();
        let folded = norm.fold(wp);
        let plane = ho * wo;
        // The factors scale whichever is smaller: the projection's weights, one copy per image
        // (early blocks: large planes, few channels out), or the planes themselves.
        let (input, weights, per_image) = if out <= plane {
            let gates: Vec<T> = gates.into_iter().map(T::from).collect();
            (hidden, per_image_weights(&folded, &gates, mid), true)
        } else {
            (scale_planes(&hidden, &gates, None, plane), folded, false)
        };
        let residual = self.residual.then_some(x);
        Ok(pointwise::forward_folded(&input, (n, mid, plane), &weights, per_image, &norm.shift(), false, residual))
    }

    fn out_dims(&self, x: &[usize]) -> Result<[usize; 4]> {
        let &[n, c, h, w] = x else { candle_core::bail!("MBConv block: input {x:?} is not [N, C, H, W]") };
        let (wd, k) = (&self.depthwise.0, self.depthwise.0.dim(2)?);
        let pad = self.pad;
        let (hp, wp) = (h + pad.top + pad.bottom, w + pad.left + pad.right);
        if self.stride == 0 || hp < k || wp < k {
            candle_core::bail!("MBConv block: {k}x{k} depthwise kernel at stride {} does not fit {h}x{w}", self.stride);
        }
        let mid = match &self.expand {
            Some((we, norm)) => {
                let mid = we.dim(0)?;
                if we.dim(1)? != c || we.elem_count() != mid * c {
                    candle_core::bail!("MBConv block: expansion {:?} for {c} channels in", we.dims());
                }
                norm.check("expansion", mid)?;
                mid
            }
            None => c,
        };
        if wd.dims() != [mid, 1, k, k] {
            candle_core::bail!("MBConv block: depthwise kernel {:?} for {mid} channels", wd.dims());
        }
        self.depthwise.1.check("depthwise", mid)?;
        let (projection, out) = (&self.project.0, self.project.0.dim(0)?);
        if projection.elem_count() != out * mid {
            candle_core::bail!("MBConv block: projection {:?} for {mid} channels in", projection.dims());
        }
        self.project.1.check("projection", out)?;
        let dims = [n, out, (hp - k) / self.stride + 1, (wp - k) / self.stride + 1];
        if self.residual && dims[..] != x[..] {
            candle_core::bail!("MBConv block: a shortcut from {x:?} to {dims:?}");
        }
        Ok(dims)
    }
}

/// `w` `[out, c]` with column `j` scaled by `gates[i·c + j]`, for every image `i`: `[n, out, c]`.
fn per_image_weights<T: Float>(w: &[T], gates: &[T], c: usize) -> Vec<T> {
    let per = w.len();
    // SAFETY: each image's chunk is written in full, row by row.
    let mut out = unsafe { output_buffer::<T>(gates.len() / c.max(1) * per) };
    out.par_chunks_mut(per.max(1)).zip(gates.par_chunks(c.max(1))).for_each(|(o, g)| {
        simd(
            #[inline(always)]
            || {
                for (orow, wrow) in o.chunks_mut(c).zip(w.chunks(c)) {
                    for ((ov, &wv), &gv) in orow.iter_mut().zip(wrow).zip(g) {
                        *ov = wv * gv;
                    }
                }
            },
        )
    });
    out
}

impl Kernel<1> for MbConvEval {
    const NAME: &'static str = "mbconv-eval";
    const PROFILE: &'static str = "op/mbconv-eval";
    type Geometry = [usize; 4];

    fn geometry(&self, [x]: [&Layout; 1]) -> Result<(Self::Geometry, Shape)> {
        let out = self.out_dims(x.dims())?;
        let &[n, c, h, w] = x.dims() else { unreachable!("checked by out_dims") };
        Ok(([n, c, h, w], Shape::from(out.to_vec())))
    }

    fn cpu<T: Float>(&self, &dims: &Self::Geometry, [x]: [&[T]; 1]) -> Result<Vec<T>> {
        self.run(x, dims)
    }
}

/// The block on `x` `[N, C, H, W]`. CPU, f32 / f64 (`ops::fusable`), nothing tracking a gradient.
pub fn mbconv_eval(x: &Tensor, block: MbConvEval) -> Result<Tensor> {
    let block = MbConvEval {
        expand: block.expand.map(|(w, a)| w.contiguous().map(|w| (w, a))).transpose()?,
        depthwise: (block.depthwise.0.contiguous()?, block.depthwise.1),
        excite: [
            block.excite[0].contiguous()?,
            block.excite[1].contiguous()?,
            block.excite[2].contiguous()?,
            block.excite[3].contiguous()?,
        ],
        project: (block.project.0.contiguous()?, block.project.1),
        ..block
    };
    x.contiguous()?.apply_op1_no_bwd(&Op(block))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn t(seed: u64, shape: &[usize]) -> Tensor {
        crate::util::rng::randn(seed, 0.0, 0.3, shape, DType::F32, &Device::Cpu).unwrap()
    }

    fn affine(channels: usize) -> Affine {
        Affine { scale: (0..channels).map(|i| 1.0 + 0.1 * i as f64).collect(), shift: vec![0.05; channels] }
    }

    /// 4 channels in and out, expanded to 8, squeezed to 2, 3×3 depthwise.
    fn block() -> MbConvEval {
        MbConvEval {
            expand: Some((t(1, &[8, 4, 1, 1]), affine(8))),
            depthwise: (t(2, &[8, 1, 3, 3]), affine(8)),
            stride: 1,
            pad: Padding::same(3),
            excite: [t(3, &[2, 8]), t(4, &[2]), t(5, &[8, 2]), t(6, &[8])],
            project: (t(7, &[4, 8, 1, 1]), affine(4)),
            residual: true,
        }
    }

    /// Weights and BatchNorms that do not fit each other are an error naming the part, where
    /// they would otherwise fold silently wrong or index past a buffer.
    #[test]
    fn parts_that_do_not_fit_are_refused_by_name() {
        let x = t(8, &[2, 4, 6, 6]);
        assert_eq!(mbconv_eval(&x, block()).unwrap().dims(), [2, 4, 6, 6]);
        type Breaks = fn(&mut MbConvEval);
        let broken: [(&str, Breaks); 7] = [
            ("expansion BatchNorm", |b| b.expand.as_mut().unwrap().1 = affine(7)),
            ("expansion BatchNorm", |b| b.expand.as_mut().unwrap().1.shift.pop().map(drop).unwrap()),
            ("depthwise BatchNorm", |b| b.depthwise.1 = affine(9)),
            ("depthwise kernel", |b| b.depthwise.0 = t(9, &[8, 1, 3, 5])),
            ("projection BatchNorm", |b| b.project.1 = affine(3)),
            ("projection", |b| b.project.0 = t(10, &[4, 6, 1, 1])),
            ("expansion", |b| b.expand.as_mut().unwrap().0 = t(11, &[8, 3, 1, 1])),
        ];
        for (what, breaks) in broken {
            let mut b = block();
            breaks(&mut b);
            let e = mbconv_eval(&x, b).unwrap_err().to_string();
            assert!(e.contains(what), "{what}: {e}");
        }
    }
}
