//! EfficientNet image tower (Tan & Le 2019) as ALIGN uses it: MBConv blocks with squeeze-and-
//! excitation, SiLU, stochastic depth, and the global average of the last block's output as the
//! image feature (no head, no top convolution). Parameter names are Hugging Face
//! `AlignVisionModel`'s, so `kakaobrain/align-base`'s vision tower (B7) maps one to one.
//!
//! Layout facts that matter for a faithful port:
//! - the stem pads only right and bottom by one, then runs a "valid" 3×3 stride-2 convolution;
//! - stride-2 depthwise convolutions pad `(k/2 − 1, k/2)` on (top/left, bottom/right) unless the
//!   block is listed in `depthwise_padding` (then `k/2` on every side); stride 1 pads `k/2`;
//! - the squeeze-excite width is the block's *input* width × 0.25;
//! - the residual is added in every block but the first of each stage.

use std::sync::Arc;

use candle_core::{Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::batch_norm::BatchNorm2d;
use super::recompute::Checkpointing;
use super::Ctx;
use crate::ops::blocks::conv_norm::Conv;
use crate::ops::blocks::mbconv::{mbconv, ConvParams, MbConvParams, MbConvStages, Shortcut};
use crate::ops::blocks::mbconv_eval::{mbconv_eval, MbConvEval};
use crate::ops::blocks::squeeze_excite::{self, SqueezeExciteStage};
use crate::ops::kernels::channel_scale::channel_scale;
use crate::ops::kernels::depthwise::Padding;
use crate::ops::kernels::spatial_mean::spatial_mean;
use crate::ops::kernels::stochastic_depth::scaled_residual;
use crate::util::rng::Rng;

/// The most blocks and the widest layer an EfficientNet config may derive (L2, the largest, has
/// 88 blocks and 5,504 channels at its head).
const MAX_BLOCKS: usize = 1024;
const MAX_CHANNELS: usize = 1 << 16;

/// The base (B0) network's stages, which compound scaling widens and deepens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stages {
    pub kernel_sizes: Vec<usize>,
    pub strides: Vec<usize>,
    pub repeats: Vec<usize>,
    pub expand_ratios: Vec<usize>,
    pub in_channels: Vec<usize>,
    pub out_channels: Vec<usize>,
}

impl Default for Stages {
    fn default() -> Self {
        Stages {
            kernel_sizes: vec![3, 3, 5, 3, 5, 5, 3],
            strides: vec![1, 2, 2, 2, 1, 2, 1],
            repeats: vec![1, 2, 2, 3, 3, 4, 1],
            expand_ratios: vec![1, 6, 6, 6, 6, 6, 6],
            in_channels: vec![32, 16, 24, 40, 80, 112, 192],
            out_channels: vec![16, 24, 40, 80, 112, 192, 320],
        }
    }
}

impl Stages {
    fn validate(&self) -> std::result::Result<(), String> {
        let n = self.kernel_sizes.len();
        if n == 0
            || [self.strides.len(), self.repeats.len(), self.expand_ratios.len(), self.in_channels.len(), self.out_channels.len()]
                .iter()
                .any(|&l| l != n)
        {
            return Err(
                "EfficientNet stage lists (kernels, strides, repeats, expand ratios, channels) must have one entry per stage".into()
            );
        }
        if self.strides.iter().any(|s| !matches!(s, 1 | 2)) || self.kernel_sizes.iter().any(|k| k % 2 == 0) {
            return Err("EfficientNet strides must be 1 or 2 and kernels odd".into());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EfficientNetConfig {
    pub image_size: usize,
    pub width_coefficient: f64,
    pub depth_coefficient: f64,
    pub depth_divisor: usize,
    pub se_ratio: f64,
    pub bn_eps: f64,
    /// PyTorch convention (TF decay 0.99 = 0.01).
    pub bn_momentum: f64,
    /// Use running statistics while training (ALIGN's fine-tuning).
    pub bn_frozen: bool,
    /// Stochastic-depth rate of the last block (linearly smaller for earlier blocks).
    pub drop_path: f64,
    /// Blocks whose stride-2 depthwise convolution pads symmetrically.
    pub depthwise_padding: Vec<usize>,
    /// Which depthwise convolution runs (benchmarks compare them).
    #[serde(default)]
    pub depthwise: DepthwiseImpl,
    #[serde(default)]
    pub stages: Stages,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DepthwiseImpl {
    /// Our single custom op (`ops::depthwise`).
    #[default]
    Fused,
    /// candle's grouped `conv2d`: one small convolution per channel.
    Candle,
}

impl EfficientNetConfig {
    /// The preset whose width and depth coefficients a config has, if any.
    pub fn preset_name(c: &EfficientNetConfig) -> Option<&'static str> {
        crate::model::presets::EFFICIENTNET_PRESETS.iter().copied().find(|name| {
            EfficientNetConfig::preset(name, c.image_size)
                .is_some_and(|p| p.width_coefficient == c.width_coefficient && p.depth_coefficient == c.depth_coefficient)
        })
    }

    /// `efficientnet-b0` … `efficientnet-b7` and `efficientnet-l2` (width, depth coefficients as
    /// published; the image size is ALIGN's choice, 289 for every variant, unless configured).
    pub fn preset(name: &str, image_size: usize) -> Option<Self> {
        let (w, d) = match name {
            "efficientnet-b0" => (1.0, 1.0),
            "efficientnet-b1" => (1.0, 1.1),
            "efficientnet-b2" => (1.1, 1.2),
            "efficientnet-b3" => (1.2, 1.4),
            "efficientnet-b4" => (1.4, 1.8),
            "efficientnet-b5" => (1.6, 2.2),
            "efficientnet-b6" => (1.8, 2.6),
            "efficientnet-b7" => (2.0, 3.1),
            "efficientnet-l2" => (4.3, 5.3),
            _ => return None,
        };
        Some(EfficientNetConfig {
            image_size,
            width_coefficient: w,
            depth_coefficient: d,
            depth_divisor: 8,
            se_ratio: 0.25,
            bn_eps: 1e-3,
            bn_momentum: 0.01,
            bn_frozen: false,
            drop_path: 0.2,
            depthwise_padding: Vec::new(),
            depthwise: DepthwiseImpl::Fused,
            stages: Stages::default(),
        })
    }

    /// The architecture the overrides name. Their training settings (`drop_path`, `bn_frozen`)
    /// apply to a pretrained tower as much as to a new one, so a run sets them where it starts,
    /// not here.
    pub fn with(mut self, o: &super::presets::EfficientNetOverrides) -> Self {
        if let Some(v) = o.width_coefficient {
            self.width_coefficient = v;
        }
        if let Some(v) = o.depth_coefficient {
            self.depth_coefficient = v;
        }
        if let Some(v) = o.bn_momentum {
            self.bn_momentum = v;
        }
        if let Some(v) = o.bn_eps {
            self.bn_eps = v;
        }
        if let Some(v) = &o.depthwise_padding {
            self.depthwise_padding = v.clone();
        }
        self
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        for (name, v) in [("width_coefficient", self.width_coefficient), ("depth_coefficient", self.depth_coefficient)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("EfficientNet {name} is {v}; it must be a positive number (B0: 1.0, B7: 2.0 / 3.1)"));
            }
        }
        if !(0.0..1.0).contains(&self.drop_path) || !(0.0..=1.0).contains(&self.bn_momentum) {
            return Err(format!("drop_path {} must be in [0, 1) and bn_momentum {} in [0, 1]", self.drop_path, self.bn_momentum));
        }
        self.stages.validate()?;
        // The sizes the coefficients derive are bounded like the sizes a file states: a
        // coefficient of 1e4 would otherwise plan tens of thousands of blocks before any check.
        let blocks: usize = self.stages.repeats.iter().map(|&r| self.round_repeats(r)).sum();
        if blocks > MAX_BLOCKS {
            return Err(format!(
                "EfficientNet depth_coefficient {} makes {blocks} blocks, beyond any real model (L2 has 88; at most {MAX_BLOCKS})",
                self.depth_coefficient
            ));
        }
        let widest = self.stages.in_channels.iter().chain(&self.stages.out_channels).chain([&1280]).map(|&c| self.round_filters(c)).max();
        if widest.is_some_and(|w| w > MAX_CHANNELS) {
            return Err(format!(
                "EfficientNet width_coefficient {} makes layers {} channels wide, beyond any real model (L2: 5504; at most {MAX_CHANNELS})",
                self.width_coefficient,
                widest.unwrap_or(0)
            ));
        }
        if self.image_size < 32 {
            return Err(format!("EfficientNet needs images of at least 32 px (five stride-2 stages), got {}", self.image_size));
        }
        Ok(())
    }

    /// Channels scaled by the width coefficient, rounded to the divisor, never down by over 10%.
    pub fn round_filters(&self, c: usize) -> usize {
        let d = self.depth_divisor as f64;
        let scaled = c as f64 * self.width_coefficient;
        let mut out = d.max(((scaled + d / 2.0) / d).floor() * d);
        if out < 0.9 * scaled {
            out += d;
        }
        out as usize
    }

    pub fn round_repeats(&self, r: usize) -> usize {
        (self.depth_coefficient * r as f64).ceil() as usize
    }

    /// Width of the image feature: the last stage's output channels.
    pub fn width(&self) -> usize {
        self.round_filters(*self.stages.out_channels.last().expect("validated stages"))
    }

    pub fn num_blocks(&self) -> usize {
        self.stages.repeats.iter().map(|&r| self.round_repeats(r)).sum()
    }
}

fn conv_weight(vb: &VarBuilder, out: usize, inp: usize, k: usize) -> Result<Tensor> {
    // He (fan-out) normal, as EfficientNet initialises convolutions.
    let std = (2.0 / (out * k * k) as f64).sqrt();
    vb.get_with_hints((out, inp, k, k), "weight", Init::Randn { mean: 0.0, stdev: std })
}

struct Block {
    expand: Option<(Tensor, BatchNorm2d)>,
    dw_weight: Tensor,
    dw_norm: BatchNorm2d,
    stride: usize,
    pad: Padding,
    se_reduce: (Tensor, Tensor),
    se_expand: (Tensor, Tensor),
    project: Tensor,
    project_bn: BatchNorm2d,
    residual: bool,
    drop_path: f64,
    index: usize,
    depthwise: DepthwiseImpl,
}

impl Block {
    #[allow(clippy::too_many_arguments)]
    fn new(
        c: &EfficientNetConfig,
        index: usize,
        in_dim: usize,
        out_dim: usize,
        k: usize,
        stride: usize,
        expand_ratio: usize,
        first: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        let mid = in_dim * expand_ratio;
        let bn = |ch: usize, vb: VarBuilder| BatchNorm2d::new(ch, c.bn_eps, c.bn_momentum, c.bn_frozen, vb);
        let expand = if expand_ratio != 1 {
            let e = vb.pp("expansion");
            Some((conv_weight(&e.pp("expand_conv"), mid, in_dim, 1)?, bn(mid, e.pp("expand_bn"))?))
        } else {
            None
        };
        let dw = vb.pp("depthwise_conv");
        let pad = if stride == 2 {
            if c.depthwise_padding.contains(&index) {
                Padding::same(k)
            } else {
                Padding { top: k / 2 - 1, bottom: k / 2, left: k / 2 - 1, right: k / 2 }
            }
        } else {
            Padding::same(k)
        };
        let se_dim = ((in_dim as f64 * c.se_ratio) as usize).max(1);
        let se = vb.pp("squeeze_excite");
        let se_conv = |name: &str, out: usize, inp: usize| -> Result<(Tensor, Tensor)> {
            let v = se.pp(name);
            Ok((conv_weight(&v, out, inp, 1)?, v.get_with_hints(out, "bias", Init::Const(0.0))?))
        };
        let p = vb.pp("projection");
        Ok(Block {
            expand,
            dw_weight: conv_weight(&dw.pp("depthwise_conv"), mid, 1, k)?,
            dw_norm: bn(mid, dw.pp("depthwise_norm"))?,
            stride,
            pad,
            se_reduce: se_conv("reduce", se_dim, mid)?,
            se_expand: se_conv("expand", mid, se_dim)?,
            project: conv_weight(&p.pp("project_conv"), out_dim, mid, 1)?,
            project_bn: bn(out_dim, p.pp("project_bn"))?,
            residual: !first && stride == 1 && in_dim == out_dim,
            drop_path: 0.0,
            index,
            depthwise: c.depthwise,
        })
    }

    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let params = self.params();
        if self.depthwise == DepthwiseImpl::Fused && crate::ops::fusable(x, &params.tensors()) {
            let nothing_tracked = !x.track_op() && params.tensors().iter().all(|t| !t.track_op());
            if nothing_tracked && !ctx.train {
                return self.forward_eval(x);
            }
            self.forward_fused(x, &params, ctx)
        } else {
            self.forward_composed(x, ctx)
        }
    }

    fn params(&self) -> MbConvParams<'_> {
        fn conv<'a>(w: &'a Tensor, bn: &'a BatchNorm2d) -> ConvParams<'a> {
            let (gamma, beta) = bn.affine();
            ConvParams { w, gamma, beta }
        }
        MbConvParams {
            expand: self.expand.as_ref().map(|(w, bn)| conv(w, bn)),
            depthwise: conv(&self.dw_weight, &self.dw_norm),
            excite: [&self.se_reduce.0, &self.se_reduce.1, &self.se_expand.0, &self.se_expand.1],
            project: conv(&self.project, &self.project_bn),
        }
    }

    /// The block where nothing needs a gradient, its BatchNorms folded into the convolutions
    /// (`ops::mbconv_eval`).
    fn forward_eval(&self, x: &Tensor) -> Result<Tensor> {
        let block = MbConvEval {
            expand: self.expand.as_ref().map(|(w, bn)| Ok::<_, candle_core::Error>((w.clone(), bn.running_affine()?))).transpose()?,
            depthwise: (self.dw_weight.clone(), self.dw_norm.running_affine()?),
            stride: self.stride,
            pad: self.pad,
            excite: [self.se_reduce.0.clone(), self.se_reduce.1.clone(), self.se_expand.0.clone(), self.se_expand.1.clone()],
            project: (self.project.clone(), self.project_bn.running_affine()?),
            residual: self.residual,
        };
        mbconv_eval(x, block)
    }

    /// The block as one graph node (`ops::mbconv`).
    fn forward_fused(&self, x: &Tensor, params: &MbConvParams, ctx: &Ctx) -> Result<Tensor> {
        let mut h = x.detach();
        let expand = match &self.expand {
            Some((w, bn)) => {
                let (out, stage) = bn.conv_stage(Conv::Pointwise, &h, w, ctx, true)?;
                h = out;
                Some(stage)
            }
            None => None,
        };
        let conv = Conv::Depthwise { stride: self.stride, pad: self.pad };
        let (h, depthwise) = self.dw_norm.conv_stage(conv, &h, &self.dw_weight, ctx, true)?;
        let [w1, b1, w2, b2] = params.excite;
        let (h, excite) = SqueezeExciteStage::squeeze_excite(&h, (&w1.flatten_from(1)?, b1), (&w2.flatten_from(1)?, b2))?;
        let (branch, project) = self.project_bn.conv_stage(Conv::Pointwise, &h, &self.project, ctx, false)?;
        let shortcut = match (self.residual, ctx.train && self.drop_path > 0.0) {
            (false, _) => Shortcut::None,
            (true, false) => Shortcut::Identity,
            (true, true) => Shortcut::Scaled(drop_path_factors(x.dim(0)?, self.drop_path, ctx.seed, self.index)),
        };
        mbconv(x, params, MbConvStages { expand, depthwise, excite, project, shortcut }, branch)
    }

    /// The block as a chain of ops (each fused where it can be): where [`Block::forward_fused`]
    /// cannot run, and its reference in tests.
    fn forward_composed(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let mut h = x.clone();
        if let Some((w, bn)) = &self.expand {
            h = bn.conv_forward_act(Conv::Pointwise, &h, w, ctx, true)?;
        }
        h = match self.depthwise {
            DepthwiseImpl::Fused => {
                self.dw_norm.conv_forward_act(Conv::Depthwise { stride: self.stride, pad: self.pad }, &h, &self.dw_weight, ctx, true)?
            }
            DepthwiseImpl::Candle => self.dw_norm.forward_act(
                &crate::ops::kernels::depthwise::composed(&h, &self.dw_weight, self.stride, self.pad)?,
                ctx,
                true,
            )?,
        };
        // Squeeze-and-excitation on [N, C] vectors: the 1×1 convolutions are plain matmuls.
        let ((w1, b1), (w2, b2)) = (&self.se_reduce, &self.se_expand);
        let (w1, w2) = (w1.flatten_from(1)?, w2.flatten_from(1)?);
        h = if crate::ops::fusable(&h, &[&w1, b1, &w2, b2]) {
            squeeze_excite::squeeze_excite(&h, (&w1, b1), (&w2, b2))?
        } else {
            let s = spatial_mean(&h)?.matmul(&w1.t()?)?.broadcast_add(b1)?.silu()?;
            let s = candle_nn::ops::sigmoid(&s.matmul(&w2.t()?)?.broadcast_add(b2)?)?;
            channel_scale(&h, &s)?
        };
        h = self.project_bn.conv_forward_act(Conv::Pointwise, &h, &self.project, ctx, false)?;
        if !self.residual {
            return Ok(h);
        }
        if ctx.train && self.drop_path > 0.0 {
            return scaled_residual(&h, &drop_path_factors(h.dim(0)?, self.drop_path, ctx.seed, self.index), x);
        }
        h + x
    }
}

/// Stochastic depth's per-sample factors: each residual branch dropped with probability `p`, the
/// kept ones scaled by 1/(1−p). They come from (seed, block), so a resumed run draws the same.
fn drop_path_factors(n: usize, p: f64, seed: u64, block: usize) -> Vec<f64> {
    let mut rng = Rng::derived(seed, &[0x0044_5041_5448, block as u64]);
    let keep = 1.0 - p;
    (0..n).map(|_| if rng.bernoulli(keep) { 1.0 / keep } else { 0.0 }).collect()
}

pub struct EfficientNet {
    stem: Tensor,
    stem_bn: BatchNorm2d,
    blocks: Vec<Arc<Block>>,
    pub config: EfficientNetConfig,
    /// Each MBConv block a checkpointed segment when on.
    pub checkpointing: Checkpointing,
}

/// One depthwise layer of the network: channels, input side, kernel, stride, padding.
#[derive(Debug, Clone, Copy)]
pub struct DepthwiseLayer {
    pub channels: usize,
    pub input: usize,
    pub kernel: usize,
    pub stride: usize,
    pub pad: Padding,
}

impl EfficientNet {
    /// The depthwise layers in order, for benchmarks.
    pub fn depthwise_layers(&self) -> Vec<DepthwiseLayer> {
        let mut side = (self.config.image_size + 1 - 3) / 2 + 1;
        self.blocks
            .iter()
            .map(|b| {
                let l = DepthwiseLayer {
                    channels: b.dw_weight.dim(0).unwrap_or(0),
                    input: side,
                    kernel: b.dw_weight.dim(2).unwrap_or(0),
                    stride: b.stride,
                    pad: b.pad,
                };
                side = (side + b.pad.top + b.pad.bottom - l.kernel) / b.stride + 1;
                l
            })
            .collect()
    }

    /// Multiply-adds ×2 of one image's forward pass: the stem, and per block the expansion,
    /// depthwise, squeeze-and-excitation and projection convolutions (normalisations and
    /// activations are negligible and not counted).
    pub fn forward_flops(&self) -> f64 {
        let mut side = ((self.config.image_size + 1 - 3) / 2 + 1) as f64;
        let mut flops = 2.0 * side * side * self.stem.dim(0).unwrap_or(0) as f64 * 3.0 * 9.0;
        for (b, l) in self.blocks.iter().zip(self.depthwise_layers()) {
            let dims = |t: &Tensor| t.dims().to_vec();
            let mid = l.channels as f64;
            if let Some((w, _)) = &b.expand {
                let d = dims(w);
                flops += 2.0 * side * side * (d[0] * d[1]) as f64;
            }
            let out_side = ((l.input + l.pad.top + l.pad.bottom - l.kernel) / l.stride + 1) as f64;
            flops += 2.0 * out_side * out_side * mid * (l.kernel * l.kernel) as f64;
            let se = dims(&b.se_reduce.0)[0] as f64;
            flops += 2.0 * 2.0 * mid * se;
            flops += 2.0 * out_side * out_side * mid * dims(&b.project)[0] as f64;
            side = out_side;
        }
        flops
    }

    pub fn new(c: &EfficientNetConfig, vb: VarBuilder) -> Result<Self> {
        let emb = vb.pp("embeddings");
        let stem_out = c.round_filters(32);
        let stem = conv_weight(&emb.pp("convolution"), stem_out, 3, 3)?;
        let stem_bn = BatchNorm2d::new(stem_out, c.bn_eps, c.bn_momentum, c.bn_frozen, emb.pp("batchnorm"))?;
        let total = c.num_blocks();
        let mut blocks = Vec::with_capacity(total);
        let enc = vb.pp("encoder").pp("blocks");
        let st = &c.stages;
        for s in 0..st.kernel_sizes.len() {
            let (in_dim, out_dim) = (c.round_filters(st.in_channels[s]), c.round_filters(st.out_channels[s]));
            for j in 0..c.round_repeats(st.repeats[s]) {
                let i = blocks.len();
                let stride = if j == 0 { st.strides[s] } else { 1 };
                let bin = if j == 0 { in_dim } else { out_dim };
                let mut b = Block::new(c, i, bin, out_dim, st.kernel_sizes[s], stride, st.expand_ratios[s], j == 0, enc.pp(i))?;
                b.drop_path = c.drop_path * i as f64 / total as f64;
                blocks.push(Arc::new(b));
            }
        }
        Ok(EfficientNet { stem, stem_bn, blocks, config: c.clone(), checkpointing: Checkpointing::default() })
    }

    /// Global average of the last block's output: `[batch, width]`.
    pub fn pooled(&self, images: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let (_, _, h, w) = images.dims4()?;
        // Right/bottom padding by one, then a valid 3×3 stride-2 convolution. The unused last
        // row/column is cut so the stride tiles the input exactly (candle's conv backward needs it).
        let ho = (h + 1 - 3) / 2 + 1;
        let wo = (w + 1 - 3) / 2 + 1;
        let x = images.pad_with_zeros(2, 0, 1)?.pad_with_zeros(3, 0, 1)?;
        let x = x.narrow(2, 0, 2 * (ho - 1) + 3)?.narrow(3, 0, 2 * (wo - 1) + 3)?;
        // The CPU has no bf16 convolution kernel: there the stem runs in f32.
        let stem = if x.device().is_cpu() && matches!(x.dtype(), candle_core::DType::BF16 | candle_core::DType::F16) {
            let f = candle_core::DType::F32;
            crate::ops::kernels::dense_conv::conv2d_untracked(&x.to_dtype(f)?, &self.stem.to_dtype(f)?, 2)?.to_dtype(x.dtype())?
        } else {
            crate::ops::kernels::dense_conv::conv2d_untracked(&x, &self.stem, 2)?
        };
        let mut x = self.stem_bn.forward_act(&stem, ctx, true)?;
        for b in &self.blocks {
            let (b, ctx) = (b.clone(), *ctx);
            x = self
                .checkpointing
                .run(&x, Arc::new(move |x, again| b.forward(x, &Ctx { update_stats: ctx.update_stats && !again, ..ctx })))?;
        }
        spatial_mean(&x)
    }
}

impl Module for EfficientNet {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.pooled(xs, &Ctx::EVAL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::init::SeededVars;
    use candle_core::DType;
    use candle_core::{Device, Var};
    use candle_nn::VarMap;

    fn tiny() -> EfficientNetConfig {
        let mut c = EfficientNetConfig::preset("efficientnet-b0", 32).unwrap();
        c.width_coefficient = 0.25;
        c.depth_coefficient = 0.5;
        c.drop_path = 0.0;
        c
    }

    /// A bf16 view over f32 variables (mixed precision) computes the same features to bf16
    /// accuracy, and its gradients reach the f32 variables.
    #[test]
    fn a_bf16_view_tracks_the_f32_network_and_trains_its_variables() {
        let dev = Device::Cpu;
        let vm = VarMap::new();
        let full = EfficientNet::new(&tiny(), SeededVars::builder(&vm, 1, &dev)).unwrap();
        let half = EfficientNet::new(&tiny(), SeededVars::builder_dtype(&vm, 1, DType::BF16, &dev)).unwrap();
        let x = crate::util::rng::randn(120, 0.0, 1.0, (2, 3, 32, 32), DType::F32, &dev).unwrap();
        let a = full.pooled(&x, &Ctx::EVAL).unwrap();
        let b = half.pooled(&x.to_dtype(DType::BF16).unwrap(), &Ctx::EVAL).unwrap().to_dtype(DType::F32).unwrap();
        let rel = ((&a - &b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()
            / a.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap())
        .sqrt();
        assert!(rel < 0.05, "bf16 features differ by {rel}");
        let loss = half
            .pooled(&x.to_dtype(DType::BF16).unwrap(), &Ctx::train(0))
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let data = vm.data().lock().unwrap();
        let stem = &data["embeddings.convolution.weight"];
        let g = grads.get(stem.as_tensor()).expect("the f32 stem weight gets a gradient");
        assert_eq!(g.dtype(), DType::F32);
        assert!(g.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);
    }

    /// Finite differences (f64) against backprop for two entries of every trainable variable,
    /// in training mode (batch statistics) and in evaluation mode (running statistics).
    #[test]
    fn gradients_of_every_variable_match_finite_differences() {
        let dev = Device::Cpu;
        let vm = VarMap::new();
        let net = EfficientNet::new(&tiny(), SeededVars::builder_dtype(&vm, 1, DType::F64, &dev)).unwrap();
        let x = crate::util::rng::randn(102, 0.0, 1.0, (2, 3, 32, 32), candle_core::DType::F64, &dev).unwrap();
        let up = crate::util::rng::randn(103, 0.0, 1.0, (2, tiny().width()), candle_core::DType::F64, &dev).unwrap();
        let mut vars = crate::model::batch_norm::trainable_vars(&vm);
        // In name order, so the entries checked do not depend on the hash map's.
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for ctx in [Ctx::train(0), Ctx::EVAL] {
            let loss = || (net.pooled(&x, &ctx).unwrap() * &up).unwrap().sum_all().unwrap();
            let grads = loss().backward().unwrap();
            let mut rng = Rng::new(3);
            for (name, var) in &vars {
                let g = grads
                    .get(var.as_tensor())
                    .unwrap_or_else(|| panic!("{name} has no gradient"))
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap();
                let base = var.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
                for _ in 0..2 {
                    let k = rng.below(base.len());
                    let eval = |d: f64| {
                        let mut v = base.clone();
                        v[k] += d;
                        var.set(&Tensor::from_vec(v, var.shape(), &dev).unwrap()).unwrap();
                        loss().to_scalar::<f64>().unwrap()
                    };
                    // Richardson extrapolation of two central differences cancels their h² error:
                    // BatchNorm over a two-image batch makes some entries curved enough that a
                    // plain central difference at h = 1e-6 is off by 1e-3 relative (it converges to
                    // the backprop value as h shrinks).
                    let central = |h: f64| (eval(h) - eval(-h)) / (2.0 * h);
                    let fd = (4.0 * central(5e-7) - central(1e-6)) / 3.0;
                    var.set(&Tensor::from_vec(base.clone(), var.shape(), &dev).unwrap()).unwrap();
                    // Roundoff at this step size is about 1e-6 on this loss scale.
                    let tol = 1e-5 + 1e-4 * fd.abs().max(g[k].abs());
                    assert!((fd - g[k]).abs() < tol, "{ctx:?} {name}[{k}]: backprop {} vs finite difference {fd}", g[k]);
                }
            }
        }
    }

    #[test]
    fn parameter_names_follow_hugging_face() {
        let vm = VarMap::new();
        let c = EfficientNetConfig::preset("efficientnet-b0", 64).unwrap();
        EfficientNet::new(&c, SeededVars::builder(&vm, 0, &Device::Cpu).pp("vision_model")).unwrap();
        let names = vm.data().lock().unwrap().keys().cloned().collect::<std::collections::BTreeSet<_>>();
        for n in [
            "vision_model.embeddings.convolution.weight",
            "vision_model.embeddings.batchnorm.running_var",
            "vision_model.encoder.blocks.0.depthwise_conv.depthwise_conv.weight",
            "vision_model.encoder.blocks.0.squeeze_excite.reduce.bias",
            "vision_model.encoder.blocks.1.expansion.expand_conv.weight",
            "vision_model.encoder.blocks.1.expansion.expand_bn.weight",
            "vision_model.encoder.blocks.15.projection.project_bn.running_mean",
            "vision_model.encoder.blocks.15.projection.project_conv.weight",
        ] {
            assert!(names.contains(n), "missing {n}");
        }
        // The first block has expand ratio 1: no expansion layer.
        assert!(!names.iter().any(|n| n.starts_with("vision_model.encoder.blocks.0.expansion")));
        assert!(!names.iter().any(|n| n.starts_with("vision_model.encoder.blocks.16.")));
        // Squeeze-excite width comes from the block's input width: block 1 has 16 in, 96 expanded.
        let data = vm.data().lock().unwrap();
        assert_eq!(data["vision_model.encoder.blocks.1.squeeze_excite.reduce.weight"].dims(), &[4, 96, 1, 1]);
    }

    /// Everything a block computes: its output, then the gradient of its input, then per variable
    /// (in name order) its gradient (none for running statistics) and its value after the step.
    fn run_block(case: usize, fused: bool, ctx: Ctx) -> Vec<(String, Tensor)> {
        // (in, out, kernel, stride, expand ratio, first of its stage, stochastic depth)
        let (inp, out, k, stride, ratio, first, drop) =
            [(8, 8, 3, 1, 6, false, 0.0), (8, 8, 5, 1, 4, false, 0.5), (8, 12, 5, 2, 1, true, 0.0)][case];
        let (dev, f64) = (Device::Cpu, DType::F64);
        let vm = VarMap::new();
        let mut block = Block::new(&tiny(), 3, inp, out, k, stride, ratio, first, SeededVars::builder_dtype(&vm, 9, f64, &dev)).unwrap();
        block.drop_path = drop;
        let mut vars: Vec<(String, Var)> = vm.data().lock().unwrap().iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        // Random values everywhere (γ = 1, β = 0 and zero biases would hide mix-ups).
        for (j, (name, v)) in vars.iter().enumerate() {
            let r = crate::util::rng::randn(700 + j as u64, 0.0, 0.5, v.shape(), f64, &dev).unwrap();
            v.set(&if name.ends_with("running_var") { (r.abs().unwrap() + 0.5).unwrap() } else { r }).unwrap();
        }
        let x = Var::from_tensor(&crate::util::rng::randn(600 + case as u64, 0.0, 1.0, (3, inp, 9, 9), f64, &dev).unwrap()).unwrap();
        let y = if fused { block.forward_fused(x.as_tensor(), &block.params(), &ctx) } else { block.forward_composed(x.as_tensor(), &ctx) }
            .unwrap();
        let up = crate::util::rng::randn(650, 0.0, 1.0, y.dims(), f64, &dev).unwrap();
        let grads = (&y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let mut all = vec![("output".to_string(), y), ("input gradient".to_string(), grads.get(x.as_tensor()).unwrap().clone())];
        for (name, v) in vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                all.push((format!("{name} gradient"), g.clone()));
            }
            all.push((name, v.as_tensor().clone()));
        }
        all
    }

    /// The block as one op (`ops::mbconv`) against the chain of ops it replaces: output, the
    /// gradients of the input and of every parameter, and the running statistics afterwards, for
    /// a block with expansion and shortcut, one with stochastic depth too, and a strided one
    /// with neither; with batch statistics and with running ones.
    #[test]
    fn the_block_as_one_op_matches_the_chain_of_ops() {
        for case in 0..3 {
            for ctx in [Ctx::train(5), Ctx::EVAL] {
                let (fused, chain) = (run_block(case, true, ctx), run_block(case, false, ctx));
                let names = |a: &[(String, Tensor)]| a.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
                assert_eq!(names(&fused), names(&chain), "case {case} {ctx:?}: the same gradients exist");
                assert!(names(&fused).iter().filter(|n| n.ends_with("gradient")).count() >= 10);
                for ((name, a), (_, b)) in fused.iter().zip(&chain) {
                    let d = crate::ops::testing::max_diff(a, b);
                    let scale = crate::ops::testing::max_abs(b).max(1e-3);
                    assert!(d / scale < 1e-11, "case {case} {ctx:?} {name}: differs by {d} (scale {scale})");
                }
            }
        }
    }

    /// The forward-only block (BatchNorms folded into the convolutions) against the block as one
    /// op with running statistics, on the three blocks of `run_block` (expansion and shortcut; a
    /// 5×5 kernel; strided without either) at two image sizes, in f64 and in f32.
    #[test]
    fn the_forward_only_block_matches_the_block_with_running_statistics() {
        let dev = Device::Cpu;
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            for (case, (inp, out, k, stride, ratio, first)) in
                [(8, 8, 3, 1, 6, false), (8, 8, 5, 1, 4, false), (8, 12, 5, 2, 1, true)].into_iter().enumerate()
            {
                let vm = VarMap::new();
                let block =
                    Block::new(&tiny(), 3, inp, out, k, stride, ratio, first, SeededVars::builder_dtype(&vm, 9, dtype, &dev)).unwrap();
                for (j, (name, v)) in vm.data().lock().unwrap().iter().enumerate() {
                    let r = crate::util::rng::randn(720 + j as u64, 0.0, 0.5, v.shape(), dtype, &dev).unwrap();
                    v.set(&if name.ends_with("running_var") { (r.abs().unwrap() + 0.5).unwrap() } else { r }).unwrap();
                }
                // 9×9: squeeze-excitation scales the projection's weights; 2×2 (fewer pixels than
                // channels out): the planes.
                for size in [9, 2] {
                    let x = crate::util::rng::randn(610 + case as u64, 0.0, 1.0, (3, inp, size, size), dtype, &dev).unwrap();
                    let ours = block.forward_eval(&x).unwrap();
                    let reference = block.forward_fused(&x, &block.params(), &Ctx::EVAL).unwrap();
                    assert_eq!(ours.dims(), reference.dims());
                    let d = crate::ops::testing::max_diff(&ours, &reference);
                    let scale = crate::ops::testing::max_abs(&reference);
                    assert!(d <= tol * scale, "case {case} {dtype:?} {size}x{size}: differs by {d} (scale {scale})");
                }
            }
        }
    }

    /// A network whose weights are plain tensors (a loaded checkpoint) runs its blocks forward
    /// only in evaluation and gives the features the same network as variables gives.
    #[test]
    fn a_network_of_plain_tensors_evaluates_as_the_trainable_one_does() {
        let dev = Device::Cpu;
        let vm = VarMap::new();
        let trainable = EfficientNet::new(&tiny(), SeededVars::builder_dtype(&vm, 4, DType::F64, &dev)).unwrap();
        let mut plain = std::collections::HashMap::new();
        for (j, (name, v)) in vm.data().lock().unwrap().iter().enumerate() {
            let r = crate::util::rng::randn(740 + j as u64, 0.0, 0.3, v.shape(), DType::F64, &dev).unwrap();
            v.set(&if name.ends_with("running_var") { (r.abs().unwrap() + 0.5).unwrap() } else { r }).unwrap();
            plain.insert(name.clone(), v.as_tensor().detach());
        }
        let loaded = EfficientNet::new(&tiny(), VarBuilder::from_tensors(plain, DType::F64, &dev)).unwrap();
        let x = crate::util::rng::randn(131, 0.0, 1.0, (2, 3, 32, 32), DType::F64, &dev).unwrap();
        crate::util::profile::enable(true);
        let _ = crate::util::profile::take();
        let ours = loaded.pooled(&x, &Ctx::EVAL).unwrap();
        let regions = crate::util::profile::take();
        crate::util::profile::enable(false);
        let reference = trainable.pooled(&x, &Ctx::EVAL).unwrap();
        let d = crate::ops::testing::max_diff(&ours, &reference);
        assert!(d <= 1e-12 * crate::ops::testing::max_abs(&reference), "differs by {d}");
        assert!(regions.contains_key("op/mbconv-eval"), "the loaded network's blocks ran forward only: {regions:?}");
    }

    #[test]
    fn stochastic_depth_is_reproducible_and_keeps_the_expectation() {
        let a = drop_path_factors(4000, 0.25, 7, 3);
        assert_eq!(a, drop_path_factors(4000, 0.25, 7, 3));
        assert_ne!(a, drop_path_factors(4000, 0.25, 7, 4), "each block draws its own");
        let mean = a.iter().sum::<f64>() / a.len() as f64;
        assert!((mean - 1.0).abs() < 0.05, "{mean}");
        assert!(a.iter().all(|&v| v == 0.0 || (v - 4.0 / 3.0).abs() < 1e-12));
    }

    #[test]
    fn compound_scaling_matches_the_published_widths_and_depths() {
        let b0 = EfficientNetConfig::preset("efficientnet-b0", 224).unwrap();
        assert_eq!((b0.width(), b0.num_blocks(), b0.round_filters(32)), (320, 16, 32));
        let b7 = EfficientNetConfig::preset("efficientnet-b7", 289).unwrap();
        // kakaobrain/align-base: 55 blocks, 640-wide features, a 64-channel stem.
        assert_eq!((b7.width(), b7.num_blocks(), b7.round_filters(32)), (640, 55, 64));
        let l2 = EfficientNetConfig::preset("efficientnet-l2", 289).unwrap();
        // ALIGN §6: "L2 uses 1376".
        assert_eq!(l2.width(), 1376);
        let b3 = EfficientNetConfig::preset("efficientnet-b3", 300).unwrap();
        assert_eq!(b3.width(), 384);
    }
}
