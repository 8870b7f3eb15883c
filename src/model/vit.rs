//! Vision Transformer image tower with Hugging Face `ViTModel` parameter names.
//!
//! The patch embedding is stored as HF's convolution weight `[width, 3, p, p]` but computed as a
//! reshape + matmul: identical numbers, and several times faster than candle's conv2d backward.

use std::sync::Arc;

use candle_core::{Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use super::layers::{attention_branch, linear, mlp_branch, scaled_normal, LayerNorm, Linear, Norm};
use super::presets::{ImagePooling, VitConfig};
use super::recompute::Checkpointing;
use crate::ops::kernels::linear::linear_bias;

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
        let x = attention_branch(x, Norm::Pre, &self.norm1, [&self.query, &self.key, &self.value, &self.proj], self.heads, None)?;
        mlp_branch(&x, Norm::Pre, &self.norm2, &self.fc1, &self.fc2)
    }
}

pub struct Vit {
    patch_weight: Tensor,
    patch_bias: Tensor,
    cls_token: Tensor,
    pos: Tensor,
    blocks: Vec<Arc<Block>>,
    norm: LayerNorm,
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
            config: c.clone(),
            checkpointing: Checkpointing::default(),
        })
    }

    /// `[b, 3, H, W]` → `[b, patches, 3·p·p]` with each patch flattened as (channel, row, col),
    /// the order of the convolution weight.
    fn patchify(&self, x: &Tensor) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        let p = self.config.patch_size;
        let (gh, gw) = (h / p, w / p);
        x.reshape((b, c, gh, p, gw, p))?.permute((0, 2, 4, 1, 3, 5))?.contiguous()?.reshape((b, gh * gw, c * p * p))
    }

    /// Final hidden states `[b, 1 + patches, width]` after the last LayerNorm (Hugging Face's
    /// `last_hidden_state`).
    pub fn hidden_states(&self, images: &Tensor) -> Result<Tensor> {
        let (b, _, h, w) = images.dims4()?;
        if h != self.config.image_size || w != self.config.image_size {
            candle_core::bail!("ViT expects {}x{} images, got {h}x{w}", self.config.image_size, self.config.image_size);
        }
        let width = self.config.width;
        let weight = self.patch_weight.reshape((width, ()))?;
        let patches = self.patchify(images)?;
        let (np, pd) = (patches.dim(1)?, patches.dim(2)?);
        // One 2-D product over all patches of the batch (a broadcast weight would get one
        // gradient per image, summed on one thread); the pixels get no gradient.
        let tokens = linear_bias(&patches.reshape((b * np, pd))?, &weight, &self.patch_bias)?.reshape((b, np, width))?;
        let cls = self.cls_token.broadcast_as((b, 1, width))?;
        let mut x = Tensor::cat(&[&cls, &tokens], 1)?.broadcast_add(&self.pos)?;
        for block in &self.blocks {
            let block = block.clone();
            x = self.checkpointing.run(&x, Arc::new(move |x, _| block.forward(x)))?;
        }
        self.norm.forward(&x)
    }

    pub fn pooled(&self, images: &Tensor) -> Result<Tensor> {
        let x = self.hidden_states(images)?;
        match self.config.pool {
            ImagePooling::Cls => x.narrow(1, 0, 1)?.squeeze(1),
            ImagePooling::Gap => x.narrow(1, 1, self.config.num_patches())?.mean(1),
        }
    }
}

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
        };
        let vm = candle_nn::VarMap::new();
        let vit = Vit::new(&cfg, crate::model::init::SeededVars::builder(&vm, 1, &dev)).unwrap();
        let x = crate::util::rng::randn(101, 0.0, 1.0, (2, 3, 8, 8), candle_core::DType::F32, &dev).unwrap();
        let via_matmul = vit.patchify(&x).unwrap().broadcast_matmul(&vit.patch_weight.reshape((5, ())).unwrap().t().unwrap()).unwrap();
        let via_conv = x.conv2d(&vit.patch_weight, 0, 4, 1, 1).unwrap().flatten_from(2).unwrap().transpose(1, 2).unwrap();
        let diff = (via_matmul - via_conv).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "{diff}");
    }
}
