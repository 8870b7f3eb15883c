//! CLIP's towers with Hugging Face `CLIPModel` parameter names: the text transformer (causal,
//! pre-norm, pooled at the end-of-text token) and the vision transformer (class embedding,
//! pre-LayerNorm, the class token's final state after `post_layernorm`).

use candle_core::{Module, Result, Tensor};
use candle_nn::{Embedding, Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::layers::{scaled_normal, LayerNorm, Mask};
use super::prenorm::{Encoder, EncoderConfig};
use crate::ops::kernels::linear::linear_no_bias;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClipTextConfig {
    pub vocab_size: usize,
    pub max_position: usize,
    pub encoder: EncoderConfig,
    pub eos_token_id: u32,
    /// Each token sees only those before it (CLIP); without, every token sees every other and
    /// the padding too, unmasked, as open_clip runs its bidirectional towers (CLIPA).
    #[serde(default = "yes")]
    pub causal: bool,
    /// The position pooled; absent, transformers' rule for CLIP (`pools_at_highest_id`).
    #[serde(default)]
    pub pool: Option<TextPool>,
}

fn yes() -> bool {
    true
}

/// Which position's final state is the text's: open_clip's `pool_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TextPool {
    /// The highest id of each row (CLIP's end-of-text token is its vocabulary's last).
    Argmax,
    /// The first `eos_token_id` of each row (the first position when there is none).
    Eos,
    First,
    Last,
}

impl ClipTextConfig {
    /// OpenAI's configs say `eos_token_id = 2` although the end-of-text token is the vocabulary's
    /// last; transformers then pools at the highest id of each row, which is that token.
    pub fn pools_at_highest_id(&self) -> bool {
        self.pooling() == TextPool::Argmax
    }

    pub fn pooling(&self) -> TextPool {
        match self.pool {
            Some(p) => p,
            None if self.eos_token_id == 2 => TextPool::Argmax,
            None => TextPool::Eos,
        }
    }

    /// Whether this is the tower transformers' `CLIPTextModel` runs: causal, pooled at the end.
    pub fn is_transformers_clip(&self) -> bool {
        self.causal && matches!(self.pooling(), TextPool::Argmax | TextPool::Eos)
    }

    /// Whether padding never changes the pooled state: a causal tower pooled at or before the
    /// end of the text.
    pub fn ignores_padding(&self) -> bool {
        self.causal && self.pooling() != TextPool::Last
    }
}

/// Which of the vision transformer's outputs is the image's: open_clip's `pool_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VisionPool {
    /// The class token (CLIP).
    #[default]
    Tok,
    /// The mean of the patch tokens, the class token left out (CLIPA).
    Avg,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClipVisionConfig {
    pub image_size: usize,
    pub patch_size: usize,
    pub encoder: EncoderConfig,
    /// The LayerNorm before the encoder (`pre_layrnorm`, open_clip's `ln_pre`); CLIPA has none.
    #[serde(default = "yes")]
    pub pre_norm: bool,
    #[serde(default)]
    pub pool: VisionPool,
    /// The final LayerNorm on the pooled vector instead of on every token (open_clip's
    /// `final_ln_after_pool`): the same for the class token, not for a mean.
    #[serde(default)]
    pub norm_after_pool: bool,
}

impl ClipVisionConfig {
    /// A CLIP vision tower as transformers builds it.
    pub fn new(image_size: usize, patch_size: usize, encoder: EncoderConfig) -> Self {
        ClipVisionConfig { image_size, patch_size, encoder, pre_norm: true, pool: VisionPool::Tok, norm_after_pool: false }
    }

    pub fn num_patches(&self) -> usize {
        (self.image_size / self.patch_size).pow(2)
    }

    /// Whether this is the tower transformers' `CLIPVisionModel` runs.
    pub fn is_transformers_clip(&self) -> bool {
        self.pre_norm && self.pool == VisionPool::Tok
    }
}

pub struct ClipText {
    token: Embedding,
    position: Embedding,
    pub encoder: Encoder,
    final_norm: LayerNorm,
    pub config: ClipTextConfig,
}

impl ClipText {
    pub fn new(c: &ClipTextConfig, vb: VarBuilder) -> Result<Self> {
        let e = vb.pp("embeddings");
        let w = c.encoder.width;
        let emb = |n: usize, name: &str| -> Result<Embedding> {
            Ok(Embedding::new(e.get_with_hints((n, w), &format!("{name}.weight"), scaled_normal(w))?, w))
        };
        Ok(ClipText {
            token: emb(c.vocab_size, "token_embedding")?,
            position: emb(c.max_position, "position_embedding")?,
            encoder: Encoder::new(&c.encoder, vb.pp("encoder"))?,
            final_norm: LayerNorm::new(w, c.encoder.layer_norm_eps, vb.pp("final_layer_norm"))?,
            config: c.clone(),
        })
    }

    /// `[b, L, width]` after `final_layer_norm`: each token sees itself, the tokens before it and
    /// no padding.
    pub fn hidden_states(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (x, encoder_mask) = self.embed(ids, mask)?;
        self.final_norm.forward(&self.encoder.forward(&x, &encoder_mask)?)
    }

    /// The embedded tokens and what each may attend to.
    fn embed(&self, ids: &Tensor, mask: &Tensor) -> Result<(Tensor, Mask)> {
        let (b, l) = ids.dims2()?;
        if l > self.config.max_position {
            candle_core::bail!("CLIP's text tower takes at most {} tokens, got {l}", self.config.max_position);
        }
        let dev = ids.device();
        let positions = Tensor::arange(0u32, l as u32, dev)?;
        let x = self.token.forward(ids)?.broadcast_add(&self.position.forward(&positions)?)?;
        if !self.config.causal {
            return Ok((x, Mask::default()));
        }
        Ok((x, Mask { key_bias: Some(Mask::padding(mask)?.reshape((b, l))?), causal: true }))
    }

    /// The pooled position's final state of each row: the end-of-text token at the row's
    /// highest id (OpenAI's configs) or at its first `eos_token_id`, as transformers pools, or
    /// the first or last position. The last layer runs at that position only.
    pub fn pooled(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let l = ids.dim(1)?;
        let rows: Vec<Vec<u32>> = ids.to_vec2()?;
        let eos = self.config.eos_token_id;
        let pool = self.config.pooling();
        let at: Vec<usize> = rows
            .iter()
            .map(|r| match pool {
                // The first of the highest ids, as torch's argmax returns.
                TextPool::Argmax => r.iter().enumerate().fold(0, |best, (j, &t)| if t > r[best] { j } else { best }),
                // transformers falls back to the last position, open_clip to the first;
                // a configuration with an end token always has one in each row.
                TextPool::Eos if self.config.pool.is_none() => r.iter().position(|&t| t == eos).unwrap_or(l - 1),
                TextPool::Eos => r.iter().position(|&t| t == eos).unwrap_or(0),
                TextPool::First => 0,
                TextPool::Last => l - 1,
            })
            .collect();
        let (x, encoder_mask) = self.embed(ids, mask)?;
        self.final_norm.forward(&self.encoder.forward_at(&x, &encoder_mask, &at)?)
    }
}

pub struct ClipVision {
    patch_weight: Tensor,
    class_embedding: Tensor,
    position: Tensor,
    pre_norm: Option<LayerNorm>,
    pub encoder: Encoder,
    post_norm: LayerNorm,
    pub config: ClipVisionConfig,
}

impl ClipVision {
    pub fn new(c: &ClipVisionConfig, vb: VarBuilder) -> Result<Self> {
        let e = vb.pp("embeddings");
        let (w, p) = (c.encoder.width, c.patch_size);
        let eps = c.encoder.layer_norm_eps;
        Ok(ClipVision {
            patch_weight: e.pp("patch_embedding").get_with_hints((w, 3, p, p), "weight", scaled_normal(3 * p * p))?,
            class_embedding: e.get_with_hints(w, "class_embedding", Init::Randn { mean: 0.0, stdev: (w as f64).powf(-0.5) })?,
            position: e.pp("position_embedding").get_with_hints((c.num_patches() + 1, w), "weight", scaled_normal(w))?,
            // Hugging Face's spelling.
            pre_norm: c.pre_norm.then(|| LayerNorm::new(w, eps, vb.pp("pre_layrnorm"))).transpose()?,
            encoder: Encoder::new(&c.encoder, vb.pp("encoder"))?,
            post_norm: LayerNorm::new(w, eps, vb.pp("post_layernorm"))?,
            config: c.clone(),
        })
    }

    /// The encoder's output `[b, 1 + patches, width]` (Hugging Face's `last_hidden_state`, before
    /// `post_layernorm`).
    pub fn hidden_states(&self, images: &Tensor) -> Result<Tensor> {
        self.encoder.forward(&self.tokens(images)?, &Mask::default())
    }

    /// The encoder's input: the class token and the embedded patches, with their positions.
    fn tokens(&self, images: &Tensor) -> Result<Tensor> {
        let (b, _, h, w) = images.dims4()?;
        let (size, p) = (self.config.image_size, self.config.patch_size);
        if h != size || w != size {
            candle_core::bail!("CLIP's vision tower expects {size}x{size} images, got {h}x{w}");
        }
        let width = self.config.encoder.width;
        let patches = super::vit::patchify(images, p)?;
        let np = patches.dim(1)?;
        let tokens = linear_no_bias(&patches.reshape((b * np, ()))?, &self.patch_weight.reshape((width, ()))?)?.reshape((b, np, width))?;
        let cls = self.class_embedding.reshape((1, 1, width))?.broadcast_as((b, 1, width))?;
        let x = Tensor::cat(&[&cls, &tokens], 1)?.broadcast_add(&self.position.unsqueeze(0)?)?;
        match &self.pre_norm {
            Some(n) => n.forward(&x),
            None => Ok(x),
        }
    }

    pub fn pooled(&self, images: &Tensor) -> Result<Tensor> {
        match (self.config.pool, self.config.norm_after_pool) {
            // A LayerNorm acts on each token alone: before or after picking one is the same. The
            // last layer runs for the class token only.
            (VisionPool::Tok, _) => {
                let x = self.tokens(images)?;
                let at = vec![0; x.dim(0)?];
                self.post_norm.forward(&self.encoder.forward_at(&x, &Mask::default(), &at)?)
            }
            (VisionPool::Avg, true) => self.post_norm.forward(&patch_mean(&self.hidden_states(images)?)?),
            (VisionPool::Avg, false) => patch_mean(&self.post_norm.forward(&self.hidden_states(images)?)?),
        }
    }
}

/// The mean over the patch tokens of `[b, 1 + patches, w]`, the class token left out.
fn patch_mean(h: &Tensor) -> Result<Tensor> {
    let n = h.dim(1)? - 1;
    h.narrow(1, 1, n)?.mean(1)
}
