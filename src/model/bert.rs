//! BERT text tower with Hugging Face `BertModel` parameter names, pooled by `[CLS]` or the mean.

use std::sync::Arc;

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{Embedding, VarBuilder};

use super::layers::{attention_branch, linear, mlp_branch, scaled_normal, LayerNorm, Linear, Mask, Norm};
use super::presets::{BertConfig, TextPooling};
use super::recompute::Checkpointing;
use crate::ops::kernels::bias_act::Activation;

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    out_norm: LayerNorm,
    heads: usize,
}

impl Layer {
    fn new(c: &BertConfig, vb: VarBuilder) -> Result<Self> {
        let h = c.hidden;
        let sa = vb.pp("attention").pp("self");
        let ao = vb.pp("attention").pp("output");
        Ok(Layer {
            query: linear(h, h, true, scaled_normal(h), sa.pp("query"))?,
            key: linear(h, h, true, scaled_normal(h), sa.pp("key"))?,
            value: linear(h, h, true, scaled_normal(h), sa.pp("value"))?,
            attn_out: linear(h, h, true, scaled_normal(h), ao.pp("dense"))?,
            attn_norm: LayerNorm::new(h, c.layer_norm_eps, ao.pp("LayerNorm"))?,
            intermediate: linear(h, c.intermediate, true, scaled_normal(h), vb.pp("intermediate").pp("dense"))?,
            output: linear(c.intermediate, h, true, scaled_normal(c.intermediate), vb.pp("output").pp("dense"))?,
            out_norm: LayerNorm::new(h, c.layer_norm_eps, vb.pp("output").pp("LayerNorm"))?,
            heads: c.heads,
        })
    }

    /// Post-norm block, as BERT has it.
    fn forward(&self, x: &Tensor, mask_bias: &Tensor) -> Result<Tensor> {
        let proj = [&self.query, &self.key, &self.value, &self.attn_out];
        let mask = Mask { key_bias: Some(mask_bias.clone()), causal: false };
        let x = attention_branch(x, Norm::Post, &self.attn_norm, proj, self.heads, &mask)?;
        mlp_branch(&x, Norm::Post, &self.out_norm, &self.intermediate, &self.output, Activation::GeluErf)
    }
}

pub struct Bert {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    emb_norm: LayerNorm,
    layers: Vec<Arc<Layer>>,
    /// `pooler.dense`, for `TextPooling::Pooler`.
    pooler: Option<Linear>,
    pub config: BertConfig,
    /// Each layer a checkpointed segment when on.
    pub checkpointing: Checkpointing,
}

impl Bert {
    pub fn new(c: &BertConfig, vb: VarBuilder) -> Result<Self> {
        let e = vb.pp("embeddings");
        let emb = |n: usize, name: &str| -> Result<Embedding> {
            Ok(Embedding::new(e.get_with_hints((n, c.hidden), &format!("{name}.weight"), scaled_normal(c.hidden))?, c.hidden))
        };
        let layers = (0..c.layers).map(|i| Ok(Arc::new(Layer::new(c, vb.pp("encoder").pp("layer").pp(i))?))).collect::<Result<Vec<_>>>()?;
        Ok(Bert {
            word: emb(c.vocab_size, "word_embeddings")?,
            position: emb(c.max_position, "position_embeddings")?,
            token_type: emb(c.type_vocab, "token_type_embeddings")?,
            emb_norm: LayerNorm::new(c.hidden, c.layer_norm_eps, e.pp("LayerNorm"))?,
            layers,
            pooler: None,
            config: c.clone(),
            checkpointing: Checkpointing::default(),
        })
    }

    /// Final hidden states `[batch, len, hidden]` for token ids and a 0/1 attention mask (both
    /// `[batch, len]`, u32).
    /// The mask attention and the mean use: the tokenizer's, or RoBERTa's (every token that is not
    /// the padding id).
    fn effective_mask(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        match self.config.pad_token_id {
            Some(pad) => ids.ne(pad)?.to_dtype(DType::U32),
            None => Ok(mask.clone()),
        }
    }

    /// Position ids `[b, L]`: 0, 1, … (BERT), or RoBERTa's, counted over the tokens that are not
    /// padding from the padding id + 1, each padding token at the padding id.
    fn positions(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, l) = ids.dims2()?;
        match self.config.pad_token_id {
            None => Tensor::arange(0u32, l as u32, ids.device())?.unsqueeze(0)?.broadcast_as((b, l))?.contiguous(),
            Some(pad) => {
                let rows: Vec<Vec<u32>> = mask.to_vec2()?;
                let pos: Vec<u32> = rows
                    .iter()
                    .flat_map(|r| {
                        let mut count = 0;
                        r.iter()
                            .map(|&m| {
                                count += m;
                                count * m + pad
                            })
                            .collect::<Vec<u32>>()
                    })
                    .collect();
                Tensor::from_vec(pos, (b, l), ids.device())
            }
        }
    }

    pub fn hidden_states(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (_b, l) = ids.dims2()?;
        let mask = &self.effective_mask(ids, mask)?;
        let positions = self.positions(ids, mask)?;
        let types = Tensor::zeros(l, DType::U32, ids.device())?;
        let x =
            self.word.forward(ids)?.broadcast_add(&self.position.forward(&positions)?)?.broadcast_add(&self.token_type.forward(&types)?)?;
        let mut x = self.emb_norm.forward(&x)?;
        // Padding gets a large negative score so it receives no attention.
        let keep = mask.to_dtype(x.dtype())?;
        let bias = ((keep - 1.0)? * 1e9)?;
        for layer in &self.layers {
            let (layer, bias) = (layer.clone(), bias.clone());
            x = self.checkpointing.run(&x, Arc::new(move |x, _| layer.forward(x, &bias)))?;
        }
        Ok(x)
    }

    /// Adds BERT's pooler (`pooler.dense` under `vb`), which `TextPooling::Pooler` applies.
    pub fn with_pooler(mut self, vb: VarBuilder) -> Result<Self> {
        let h = self.config.hidden;
        self.pooler = Some(linear(h, h, true, scaled_normal(h), vb.pp("pooler").pp("dense"))?);
        Ok(self)
    }

    pub fn pooled(&self, ids: &Tensor, mask: &Tensor, pooling: TextPooling) -> Result<Tensor> {
        let h = self.hidden_states(ids, mask)?;
        let mask = &self.effective_mask(ids, mask)?;
        match pooling {
            TextPooling::Cls => h.narrow(1, 0, 1)?.squeeze(1),
            TextPooling::Pooler => match &self.pooler {
                Some(p) => p.forward(&h.narrow(1, 0, 1)?.squeeze(1)?)?.tanh(),
                None => candle_core::bail!("BERT pooled by its pooler has no pooler weights"),
            },
            TextPooling::Mean => {
                let m = mask.to_dtype(h.dtype())?.unsqueeze(D::Minus1)?;
                let sum = h.broadcast_mul(&m)?.sum(1)?;
                sum.broadcast_div(&m.sum(1)?.clamp(1.0, f64::INFINITY)?)
            }
        }
    }
}
