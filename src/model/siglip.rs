//! SigLIP's towers with Hugging Face `SiglipModel` parameter names: the vision transformer (no
//! class token; every token through `post_layernorm`, then the attention-pooling head, a learned
//! probe attending over them) and the text transformer (bidirectional, unmasked, its last
//! position through `final_layer_norm` and a linear head).

use candle_core::{Module, Result, Tensor};
use candle_nn::{Embedding, VarBuilder};
use serde::{Deserialize, Serialize};

use super::layers::{linear, scaled_normal, LayerNorm, Linear, Mask};
use super::prenorm::{masked_attention, Encoder, EncoderConfig, Mlp};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SiglipTextConfig {
    pub vocab_size: usize,
    pub max_position: usize,
    pub encoder: EncoderConfig,
    /// The head's output width (`projection_size`), the text embedding's.
    pub projection: usize,
    /// Padding is hidden from attention (transformers does so when the checkpoint's tokenizer
    /// returns an attention mask); SigLIP itself was trained attending to it. Either way the
    /// last position is pooled, padding or not.
    #[serde(default)]
    pub masked: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SiglipVisionConfig {
    pub image_size: usize,
    pub patch_size: usize,
    pub encoder: EncoderConfig,
}

impl SiglipVisionConfig {
    pub fn num_patches(&self) -> usize {
        (self.image_size / self.patch_size).pow(2)
    }
}

pub struct SiglipText {
    token: Embedding,
    position: Embedding,
    pub encoder: Encoder,
    final_norm: LayerNorm,
    head: Linear,
    pub config: SiglipTextConfig,
}

impl SiglipText {
    pub fn new(c: &SiglipTextConfig, vb: VarBuilder) -> Result<Self> {
        let e = vb.pp("embeddings");
        let w = c.encoder.width;
        let emb = |n: usize, name: &str| -> Result<Embedding> {
            Ok(Embedding::new(e.get_with_hints((n, w), &format!("{name}.weight"), scaled_normal(w))?, w))
        };
        Ok(SiglipText {
            token: emb(c.vocab_size, "token_embedding")?,
            position: emb(c.max_position, "position_embedding")?,
            encoder: Encoder::new(&c.encoder, vb.pp("encoder"))?,
            final_norm: LayerNorm::new(w, c.encoder.layer_norm_eps, vb.pp("final_layer_norm"))?,
            head: linear(w, c.projection, true, scaled_normal(w), vb.pp("head"))?,
            config: c.clone(),
        })
    }

    /// `[b, L, width]` after `final_layer_norm`. SigLIP was trained on text padded to its full
    /// length without a mask, so the padding takes part in attention, unless the tower is
    /// `masked`.
    pub fn hidden_states(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, l) = ids.dims2()?;
        if l > self.config.max_position {
            candle_core::bail!("SigLIP's text tower takes at most {} tokens, got {l}", self.config.max_position);
        }
        let positions = Tensor::arange(0u32, l as u32, ids.device())?;
        let x = self.token.forward(ids)?.broadcast_add(&self.position.forward(&positions)?)?;
        let key_bias = if self.config.masked { Some(Mask::padding(mask)?.reshape((b, l))?) } else { None };
        self.final_norm.forward(&self.encoder.forward(&x, &Mask { key_bias, causal: false })?)
    }

    /// The head applied to the last position's state (`[b, projection]`).
    pub fn pooled(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let h = self.hidden_states(ids, mask)?;
        let l = h.dim(1)?;
        self.head.forward(&h.narrow(1, l - 1, 1)?.squeeze(1)?)
    }
}

/// Multihead attention pooling: a learned probe attends over the tokens, then a residual MLP.
/// PyTorch's `nn.MultiheadAttention` keeps q, k and v in one `in_proj_weight` `[3w, w]`.
pub(crate) struct PoolingHead {
    probe: Tensor,
    in_proj_weight: Tensor,
    in_proj_bias: Tensor,
    out_proj: Linear,
    norm: LayerNorm,
    mlp: Mlp,
    heads: usize,
}

impl PoolingHead {
    pub(crate) fn new(c: &EncoderConfig, vb: VarBuilder) -> Result<Self> {
        let w = c.width;
        let att = vb.pp("attention");
        Ok(PoolingHead {
            probe: vb.get_with_hints((1, 1, w), "probe", scaled_normal(w))?,
            in_proj_weight: att.get_with_hints((3 * w, w), "in_proj_weight", scaled_normal(w))?,
            in_proj_bias: att.get_with_hints(3 * w, "in_proj_bias", candle_nn::Init::Const(0.0))?,
            out_proj: linear(w, w, true, scaled_normal(w), att.pp("out_proj"))?,
            norm: LayerNorm::new(w, c.layer_norm_eps, vb.pp("layernorm"))?,
            mlp: Mlp::new(c, vb.pp("mlp"))?,
            heads: c.heads,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let none = Tensor::zeros((1, 1, 1, 1), x.dtype(), x.device())?;
        self.forward_masked(x, &none)
    }

    /// The probe attending over `x` with `bias` (`[b or 1, 1, 1, tokens]`) added to its scores:
    /// large and negative where a token is padding.
    pub(crate) fn forward_masked(&self, x: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let (b, _, w) = x.dims3()?;
        let project = |t: &Tensor, i: usize| -> Result<Tensor> {
            let (wt, bias) = (self.in_proj_weight.narrow(0, i * w, w)?, self.in_proj_bias.narrow(0, i * w, w)?);
            t.broadcast_matmul(&wt.t()?)?.broadcast_add(&bias)
        };
        let probe = self.probe.broadcast_as((b, 1, w))?;
        let a = masked_attention(&project(&probe, 0)?, &project(x, 1)?, &project(x, 2)?, self.heads, bias)?;
        let a = self.out_proj.forward(&a)?;
        let y = (&a + self.mlp.forward(&self.norm.forward(&a)?)?)?;
        y.squeeze(1)
    }
}

pub struct SiglipVision {
    patch_weight: Tensor,
    patch_bias: Tensor,
    position: Tensor,
    pub encoder: Encoder,
    post_norm: LayerNorm,
    head: PoolingHead,
    pub config: SiglipVisionConfig,
}

impl SiglipVision {
    pub fn new(c: &SiglipVisionConfig, vb: VarBuilder) -> Result<Self> {
        let e = vb.pp("embeddings");
        let (w, p) = (c.encoder.width, c.patch_size);
        let pe = e.pp("patch_embedding");
        Ok(SiglipVision {
            patch_weight: pe.get_with_hints((w, 3, p, p), "weight", scaled_normal(3 * p * p))?,
            patch_bias: pe.get_with_hints(w, "bias", candle_nn::Init::Const(0.0))?,
            position: e.pp("position_embedding").get_with_hints((c.num_patches(), w), "weight", scaled_normal(w))?,
            encoder: Encoder::new(&c.encoder, vb.pp("encoder"))?,
            post_norm: LayerNorm::new(w, c.encoder.layer_norm_eps, vb.pp("post_layernorm"))?,
            head: PoolingHead::new(&c.encoder, vb.pp("head"))?,
            config: c.clone(),
        })
    }

    /// `[b, patches, width]` after `post_layernorm` (Hugging Face's `last_hidden_state`).
    pub fn hidden_states(&self, images: &Tensor) -> Result<Tensor> {
        let (b, _, h, w) = images.dims4()?;
        let (size, p) = (self.config.image_size, self.config.patch_size);
        if h != size || w != size {
            candle_core::bail!("SigLIP's vision tower expects {size}x{size} images, got {h}x{w}");
        }
        let width = self.config.encoder.width;
        let patches = super::vit::patchify(images, p)?;
        let np = patches.dim(1)?;
        let tokens = crate::ops::kernels::linear::linear_bias(
            &patches.reshape((b * np, ()))?,
            &self.patch_weight.reshape((width, ()))?,
            &self.patch_bias,
        )?;
        let x = tokens.reshape((b, np, width))?.broadcast_add(&self.position.unsqueeze(0)?)?;
        self.post_norm.forward(&self.encoder.forward(&x, &Mask::default())?)
    }

    /// The attention-pooling head's output (`[b, width]`), SigLIP's image embedding.
    pub fn pooled(&self, images: &Tensor) -> Result<Tensor> {
        self.head.forward(&self.hidden_states(images)?)
    }
}
