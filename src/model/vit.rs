//! Vision Transformer image tower with Hugging Face `ViTModel` parameter names.
//!
//! The patch embedding is stored as HF's convolution weight `[width, 3, p, p]` but computed as a
//! reshape + matmul: identical numbers, and several times faster than candle's conv2d backward.

use std::sync::Arc;

use candle_core::{Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use super::layers::{attention_branch, linear, mlp_branch, pre_norm_layer_at, scaled_normal, LayerNorm, Linear, Mask, Norm};
use super::presets::{ImagePooling, VitConfig};
use super::recompute::Checkpointing;
use super::{Ctx, Masking};
use crate::ops::kernels::bias_act::Activation;
use crate::ops::kernels::linear::linear_bias;
use crate::util::rng::Rng;

struct Block {
    norm1: LayerNorm,
    query: Linear,
    key: Linear,
    value: Linear,
    proj: Linear,
    norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    heads: usize,
}

impl Block {
    fn new(c: &VitConfig, vb: VarBuilder) -> Result<Self> {
        let w = c.width;
        let att = vb.pp("attention").pp("attention");
        Ok(Block {
            norm1: LayerNorm::new(w, c.layer_norm_eps, vb.pp("layernorm_before"))?,
            query: linear(w, w, true, scaled_normal(w), att.pp("query"))?,
            key: linear(w, w, true, scaled_normal(w), att.pp("key"))?,
            value: linear(w, w, true, scaled_normal(w), att.pp("value"))?,
            proj: linear(w, w, true, scaled_normal(w), vb.pp("attention").pp("output").pp("dense"))?,
            norm2: LayerNorm::new(w, c.layer_norm_eps, vb.pp("layernorm_after"))?,
            fc1: linear(w, c.mlp_dim, true, scaled_normal(w), vb.pp("intermediate").pp("dense"))?,
            fc2: linear(c.mlp_dim, w, true, scaled_normal(c.mlp_dim), vb.pp("output").pp("dense"))?,
            heads: c.heads,
        })
    }

    /// Pre-norm block.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x =
            attention_branch(x, Norm::Pre, &self.norm1, [&self.query, &self.key, &self.value, &self.proj], self.heads, &Mask::default())?;
        mlp_branch(&x, Norm::Pre, &self.norm2, &self.fc1, &self.fc2, Activation::GeluErf)
    }

    /// [`Block::forward`] at the class token (position 0) of each image only: `[batch, width]`.
    fn forward_cls(&self, x: &Tensor) -> Result<Tensor> {
        let proj = [&self.query, &self.key, &self.value, &self.proj];
        let at = vec![0; x.dim(0)?];
        pre_norm_layer_at(x, &at, &self.norm1, proj, self.heads, &Mask::default(), &self.norm2, [&self.fc1, &self.fc2], Activation::GeluErf)
    }
}

pub struct Vit {
    patch_weight: Tensor,
    patch_bias: Tensor,
    cls_token: Tensor,
    pos: Tensor,
    blocks: Vec<Arc<Block>>,
    norm: LayerNorm,
    /// With `ImagePooling::Pooler`.
    pooler: Option<Linear>,
    pub config: VitConfig,
    /// Each block a checkpointed segment when on.
    pub checkpointing: Checkpointing,
}

impl Vit {
    pub fn new(c: &VitConfig, vb: VarBuilder) -> Result<Self> {
        let e = vb.pp("embeddings");
        let p = c.patch_size;
        let proj = e.pp("patch_embeddings").pp("projection");
        Ok(Vit {
            patch_weight: proj.get_with_hints((c.width, 3, p, p), "weight", scaled_normal(3 * p * p))?,
            patch_bias: proj.get_with_hints(c.width, "bias", Init::Const(0.0))?,
            cls_token: e.get_with_hints((1, 1, c.width), "cls_token", scaled_normal(c.width))?,
            pos: e.get_with_hints((1, c.num_patches() + 1, c.width), "position_embeddings", scaled_normal(c.width))?,
            blocks: (0..c.depth).map(|i| Ok(Arc::new(Block::new(c, vb.pp("encoder").pp("layer").pp(i))?))).collect::<Result<_>>()?,
            norm: LayerNorm::new(c.width, c.layer_norm_eps, vb.pp("layernorm"))?,
            pooler: match c.pool {
                ImagePooling::Pooler => Some(linear(c.width, c.width, true, scaled_normal(c.width), vb.pp("pooler").pp("dense"))?),
                _ => None,
            },
            config: c.clone(),
            checkpointing: Checkpointing::default(),
        })
    }

    fn patchify(&self, x: &Tensor) -> Result<Tensor> {
        patchify(x, self.config.patch_size)
    }

    /// Final hidden states `[b, 1 + tokens, width]` after the last LayerNorm (Hugging Face's
    /// `last_hidden_state`): every patch, or under patch dropout (a training `ctx` with masking
    /// and a positive rate) the patches each image keeps.
    pub fn hidden_states(&self, images: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let mut x = self.tokens(images, ctx)?;
        for block in &self.blocks {
            x = self.run_block(block, &x)?;
        }
        self.norm.forward(&x)
    }

    fn run_block(&self, block: &Arc<Block>, x: &Tensor) -> Result<Tensor> {
        let block = block.clone();
        self.checkpointing.run(x, Arc::new(move |x, _| block.forward(x)))
    }

    /// The first block's input: the class token and the embedded patches (those patch dropout
    /// keeps), with their positions.
    fn tokens(&self, images: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let (b, _, h, w) = images.dims4()?;
        if h != self.config.image_size || w != self.config.image_size {
            candle_core::bail!("ViT expects {}x{} images, got {h}x{w}", self.config.image_size, self.config.image_size);
        }
        let width = self.config.width;
        let weight = self.patch_weight.reshape((width, ()))?;
        let patches = self.patchify(images)?;
        let (np, pd) = (patches.dim(1)?, patches.dim(2)?);
        let patches = patches.reshape((b * np, pd))?;
        let patch_pos = self.pos.narrow(1, 1, np)?.squeeze(0)?;
        // One 2-D product over all patches of the batch (a broadcast weight would get one
        // gradient per image, summed on one thread); the pixels get no gradient.
        let embed = |p: &Tensor| linear_bias(p, &weight, &self.patch_bias);
        let tokens = match (ctx.train && self.config.patch_dropout > 0.0, ctx.masking) {
            // Dropped patches are left out before the embedding: they cost nothing at all.
            (true, Some(m)) => {
                let (rows, positions) = self.kept_rows(b, m, patches.device())?;
                let kept = embed(&patches.index_select(&rows, 0)?)? + patch_pos.index_select(&positions, 0)?;
                kept?.reshape((b, self.config.kept_patches(), width))?
            }
            _ => embed(&patches)?.reshape((b, np, width))?.broadcast_add(&patch_pos)?,
        };
        let cls = self.cls_token.broadcast_add(&self.pos.narrow(1, 0, 1)?)?.broadcast_as((b, 1, width))?;
        Tensor::cat(&[&cls, &tokens], 1)
    }

    /// The final LayerNorm's output at the class token, `[b, width]`: the last block runs for
    /// that token only.
    fn class_state(&self, images: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let mut x = self.tokens(images, ctx)?;
        let Some((last, rest)) = self.blocks.split_last() else { return self.norm.forward(&x.narrow(1, 0, 1)?.squeeze(1)?) };
        for block in rest {
            x = self.run_block(block, &x)?;
        }
        self.norm.forward(&last.forward_cls(&x)?)
    }

    /// The rows of the flattened `[b · patches]` patch matrix that patch dropout keeps, and each
    /// one's patch position: for each image, `kept_patches` distinct patches drawn from its own
    /// stream (a partial Fisher-Yates shuffle), in ascending order.
    fn kept_rows(&self, b: usize, m: Masking, device: &candle_core::Device) -> Result<(Tensor, Tensor)> {
        let np = self.config.num_patches();
        let keep = self.config.kept_patches();
        let mut rows = Vec::with_capacity(b * keep);
        let mut positions = Vec::with_capacity(b * keep);
        let mut order: Vec<u32> = Vec::with_capacity(np);
        for i in 0..b {
            let kept = kept_patches(m, i, np, keep, &mut order);
            rows.extend(kept.iter().map(|&p| (i * np) as u32 + p));
            positions.extend_from_slice(kept);
        }
        Ok((Tensor::from_vec(rows, b * keep, device)?, Tensor::from_vec(positions, b * keep, device)?))
    }

    pub fn pooled(&self, images: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        match self.config.pool {
            ImagePooling::Cls => self.class_state(images, ctx),
            ImagePooling::Gap => {
                let x = self.hidden_states(images, ctx)?;
                x.narrow(1, 1, x.dim(1)? - 1)?.mean(1)
            }
            ImagePooling::Pooler => match &self.pooler {
                Some(p) => p.forward(&self.class_state(images, ctx)?)?.tanh(),
                None => candle_core::bail!("a ViT pooled by its pooler has no pooler weights"),
            },
        }
    }
}

/// Which `keep` of its `n` patches row `i` of a batch keeps under patch dropout `m`: distinct
/// patches drawn from the row's own stream (a partial Fisher-Yates shuffle), in ascending order.
/// A row keeps the same patches in whatever tower, rank or micro-batch it meets.
pub(crate) fn kept_patches(m: Masking, i: usize, n: usize, keep: usize, order: &mut Vec<u32>) -> &[u32] {
    let mut rng = Rng::derived(m.seed, &[PATCH_DROPOUT_STREAM, m.first_row + i as u64]);
    order.clear();
    order.extend(0..n as u32);
    for k in 0..keep {
        let j = k + rng.below(n - k);
        order.swap(k, j);
    }
    let kept = &mut order[..keep];
    kept.sort_unstable();
    kept
}

/// `[b, 3, H, W]` → `[b, patches, 3·p·p]` with each patch flattened as (channel, row, col), the
/// order of a `p`×`p` stride-`p` convolution's weight.
pub(crate) fn patchify(x: &Tensor, p: usize) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let (gh, gw) = (h / p, w / p);
    x.reshape((b, c, gh, p, gw, p))?.permute((0, 2, 4, 1, 3, 5))?.contiguous()?.reshape((b, gh * gw, c * p * p))
}

/// Tags patch dropout's draws apart from the other streams a step's seed feeds.
const PATCH_DROPOUT_STREAM: u64 = 0x5041_5443_4844_524f;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn patch_matmul_equals_the_strided_convolution() {
        let dev = Device::Cpu;
        let cfg = VitConfig {
            image_size: 8,
            patch_size: 4,
            width: 5,
            depth: 1,
            heads: 1,
            mlp_dim: 8,
            pool: ImagePooling::Cls,
            layer_norm_eps: 1e-12,
            patch_dropout: 0.0,
        };
        let vm = candle_nn::VarMap::new();
        let vit = Vit::new(&cfg, crate::model::init::SeededVars::builder(&vm, 1, &dev)).unwrap();
        let x = crate::util::rng::randn(101, 0.0, 1.0, (2, 3, 8, 8), candle_core::DType::F32, &dev).unwrap();
        let via_matmul = vit.patchify(&x).unwrap().broadcast_matmul(&vit.patch_weight.reshape((5, ())).unwrap().t().unwrap()).unwrap();
        let via_conv = x.conv2d(&vit.patch_weight, 0, 4, 1, 1).unwrap().flatten_from(2).unwrap().transpose(1, 2).unwrap();
        let diff = (via_matmul - via_conv).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "{diff}");
    }

    /// A 16 px, patch-4 ViT (16 patches) dropping `rate` of them in training.
    fn masked_vit(rate: f64) -> (Vit, candle_nn::VarMap) {
        let cfg = VitConfig {
            image_size: 16,
            patch_size: 4,
            width: 8,
            depth: 2,
            heads: 2,
            mlp_dim: 16,
            pool: ImagePooling::Cls,
            layer_norm_eps: 1e-6,
            patch_dropout: rate,
        };
        let vm = candle_nn::VarMap::new();
        let vit = Vit::new(&cfg, crate::model::init::SeededVars::builder(&vm, 3, &Device::Cpu)).unwrap();
        (vit, vm)
    }

    fn masked(seed: u64, first_row: u64) -> Ctx {
        Ctx { masking: Some(Masking { seed, first_row }), ..Ctx::train(seed) }
    }

    fn rows_of(vit: &Vit, b: usize, ctx: Ctx) -> Vec<Vec<u32>> {
        let rows = vit.kept_rows(b, ctx.masking.unwrap(), &Device::Cpu).unwrap().0.to_vec1::<u32>().unwrap();
        rows.chunks(vit.config.kept_patches()).enumerate().map(|(i, c)| c.iter().map(|r| r - 16 * i as u32).collect()).collect()
    }

    #[test]
    fn kept_patches_differ_per_image_and_step_and_repeat_from_the_seed() {
        for (rate, keep) in [(0.5, 8), (0.75, 4), (0.9, 1), (0.99, 1)] {
            let (vit, _) = masked_vit(rate);
            assert_eq!(vit.config.kept_patches(), keep, "rate {rate}");
            let a = rows_of(&vit, 6, masked(11, 0));
            for r in &a {
                assert!(r.windows(2).all(|w| w[0] < w[1]) && r.iter().all(|&p| p < 16), "rate {rate}: {r:?}");
            }
            assert_eq!(a, rows_of(&vit, 6, masked(11, 0)), "the same seed draws the same patches");
            if keep > 1 {
                assert!(a.iter().skip(1).any(|r| r != &a[0]), "rate {rate}: every image kept {:?}", a[0]);
                assert_ne!(a, rows_of(&vit, 6, masked(12, 0)), "rate {rate}: another step drew the same patches");
            }
            // Row 2 of a batch starting at global row 0 is row 0 of one starting at row 2.
            assert_eq!(a[2..], rows_of(&vit, 4, masked(11, 2))[..]);
        }
        // Over many draws every patch is kept about equally often.
        let (vit, _) = masked_vit(0.5);
        let mut counts = [0usize; 16];
        rows_of(&vit, 2000, masked(5, 0)).iter().flatten().for_each(|&p| counts[p as usize] += 1);
        assert!(counts.iter().all(|&c| (900..1100).contains(&c)), "{counts:?}");
    }

    /// The masked forward pass equals the blocks run on the kept tokens alone, built here with a
    /// strided convolution and the positions picked by hand.
    #[test]
    fn patch_dropout_runs_the_blocks_on_the_kept_tokens_only() {
        let (vit, _) = masked_vit(0.75);
        let x = crate::util::rng::randn(7, 0.0, 1.0, (3, 3, 16, 16), candle_core::DType::F32, &Device::Cpu).unwrap();
        let ctx = masked(21, 40);
        let got = vit.hidden_states(&x, &ctx).unwrap();
        assert_eq!(got.dims(), &[3, 5, 8]);
        let kept = rows_of(&vit, 3, ctx);
        let all = x.conv2d(&vit.patch_weight, 0, 4, 1, 1).unwrap().flatten_from(2).unwrap().transpose(1, 2).unwrap();
        let all = all.broadcast_add(&vit.patch_bias).unwrap().broadcast_add(&vit.pos.narrow(1, 1, 16).unwrap()).unwrap();
        let cls = (vit.cls_token.squeeze(0).unwrap() + vit.pos.narrow(1, 0, 1).unwrap().squeeze(0).unwrap()).unwrap();
        for (i, rows) in kept.iter().enumerate() {
            let idx = Tensor::new(rows.as_slice(), &Device::Cpu).unwrap();
            let mut t = Tensor::cat(&[&cls, &all.get(i).unwrap().index_select(&idx, 0).unwrap()], 0).unwrap().unsqueeze(0).unwrap();
            for b in &vit.blocks {
                t = b.forward(&t).unwrap();
            }
            let want = vit.norm.forward(&t).unwrap().squeeze(0).unwrap();
            let diff = (got.get(i).unwrap() - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-5, "image {i}: {diff}");
        }
    }

    #[test]
    fn evaluation_sees_every_patch_whatever_the_rate() {
        let (vit, vm) = masked_vit(0.5);
        let mut plain_cfg = vit.config.clone();
        plain_cfg.patch_dropout = 0.0;
        let plain = Vit::new(&plain_cfg, candle_nn::VarBuilder::from_varmap(&vm, candle_core::DType::F32, &Device::Cpu)).unwrap();
        let x = crate::util::rng::randn(8, 0.0, 1.0, (2, 3, 16, 16), candle_core::DType::F32, &Device::Cpu).unwrap();
        let eval = vit.pooled(&x, &Ctx::EVAL).unwrap();
        assert_eq!(eval.to_vec2::<f32>().unwrap(), plain.pooled(&x, &Ctx::EVAL).unwrap().to_vec2::<f32>().unwrap());
        // A training pass without masking (the unmasked-tuning phase) sees every patch too.
        let unmasked = Ctx { masking: None, ..Ctx::train(4) };
        assert_eq!(vit.hidden_states(&x, &unmasked).unwrap().dims(), &[2, 17, 8]);
        assert_eq!(vit.hidden_states(&x, &masked(4, 0)).unwrap().dims(), &[2, 9, 8]);
    }
}
