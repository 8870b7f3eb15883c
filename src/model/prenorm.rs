//! The pre-norm transformer encoder CLIP and SigLIP share, with Hugging Face's names
//! (`encoder.layers.N.{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}`)
//! and the activation their configs name.

use std::sync::Arc;

use candle_core::{Result, Tensor, D};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::layers::{attention_branch, linear, mlp_branch, positions, pre_norm_layer_at, scaled_normal, LayerNorm, Linear, Mask, Norm};
use super::recompute::Checkpointing;
use crate::ops::kernels::bias_act::Activation;

/// The MLP's activation, by the name a Hugging Face config gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Act {
    /// `x·σ(1.702·x)`: OpenAI's CLIP (`quick_gelu`).
    QuickGelu,
    /// GELU with the exact erf (`gelu`): LAION's open_clip models.
    Gelu,
    /// GELU's tanh approximation (`gelu_pytorch_tanh`, `gelu_new`): SigLIP.
    GeluTanh,
}

impl Act {
    /// The activation a config's `hidden_act` names.
    pub fn from_hf(name: &str) -> std::result::Result<Act, String> {
        match name {
            "quick_gelu" => Ok(Act::QuickGelu),
            "gelu" => Ok(Act::Gelu),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Ok(Act::GeluTanh),
            other => Err(format!("hidden_act {other:?} is not supported (quick_gelu, gelu, gelu_pytorch_tanh)")),
        }
    }

    pub fn hf_name(self) -> &'static str {
        match self {
            Act::QuickGelu => "quick_gelu",
            Act::Gelu => "gelu",
            Act::GeluTanh => "gelu_pytorch_tanh",
        }
    }

    /// The fused ops' form of it.
    pub fn activation(self) -> Activation {
        match self {
            Act::QuickGelu => Activation::QuickGelu,
            Act::Gelu => Activation::GeluErf,
            Act::GeluTanh => Activation::GeluTanh,
        }
    }
}

/// An encoder's sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncoderConfig {
    pub width: usize,
    pub layers: usize,
    pub heads: usize,
    pub mlp_dim: usize,
    pub layer_norm_eps: f64,
    pub act: Act,
}

impl EncoderConfig {
    /// FLOPs of one sequence of `tokens` through every layer.
    pub fn flops(&self, tokens: f64) -> f64 {
        let (d, m) = (self.width as f64, self.mlp_dim as f64);
        self.layers as f64 * (8.0 * tokens * d * d + 4.0 * tokens * tokens * d + 4.0 * tokens * d * m)
    }
}

pub(crate) struct Mlp {
    pub fc1: Linear,
    pub fc2: Linear,
    pub act: Act,
}

impl Mlp {
    pub fn new(c: &EncoderConfig, vb: VarBuilder) -> Result<Self> {
        Ok(Mlp {
            fc1: linear(c.width, c.mlp_dim, true, scaled_normal(c.width), vb.pp("fc1"))?,
            fc2: linear(c.mlp_dim, c.width, true, scaled_normal(c.mlp_dim), vb.pp("fc2"))?,
            act: c.act,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        super::layers::mlp(&self.fc1, &self.fc2, x, self.act.activation())
    }
}

struct Layer {
    norm1: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    norm2: LayerNorm,
    mlp: Mlp,
    heads: usize,
}

impl Layer {
    fn new(c: &EncoderConfig, vb: VarBuilder) -> Result<Self> {
        let w = c.width;
        let att = vb.pp("self_attn");
        Ok(Layer {
            norm1: LayerNorm::new(w, c.layer_norm_eps, vb.pp("layer_norm1"))?,
            q: linear(w, w, true, scaled_normal(w), att.pp("q_proj"))?,
            k: linear(w, w, true, scaled_normal(w), att.pp("k_proj"))?,
            v: linear(w, w, true, scaled_normal(w), att.pp("v_proj"))?,
            out: linear(w, w, true, scaled_normal(w), att.pp("out_proj"))?,
            norm2: LayerNorm::new(w, c.layer_norm_eps, vb.pp("layer_norm2"))?,
            mlp: Mlp::new(c, vb.pp("mlp"))?,
            heads: c.heads,
        })
    }

    /// `x + attn(ln1(x))`, then `x + mlp(ln2(x))`, the attention masked as `mask` says.
    fn forward(&self, x: &Tensor, mask: &Mask) -> Result<Tensor> {
        let x = attention_branch(x, Norm::Pre, &self.norm1, [&self.q, &self.k, &self.v, &self.out], self.heads, mask)?;
        mlp_branch(&x, Norm::Pre, &self.norm2, &self.mlp.fc1, &self.mlp.fc2, self.mlp.act.activation())
    }

    /// [`Layer::forward`] at position `at[i]` of each row `i` only: `[batch, width]`.
    fn forward_at(&self, x: &Tensor, mask: &Mask, at: &[usize]) -> Result<Tensor> {
        let proj = [&self.q, &self.k, &self.v, &self.out];
        pre_norm_layer_at(
            x,
            at,
            &self.norm1,
            proj,
            self.heads,
            mask,
            &self.norm2,
            [&self.mlp.fc1, &self.mlp.fc2],
            self.mlp.act.activation(),
        )
    }
}

/// Multi-head attention of `q` over `k`, `v` (`[b, Lq or Lk, width]`) with `bias` added to the
/// scores, from candle primitives (the softmax that keeps its gradient).
pub(crate) fn masked_attention(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, bias: &Tensor) -> Result<Tensor> {
    let (b, lq, d) = q.dims3()?;
    let lk = k.dim(1)?;
    let hd = d / heads;
    let split = |t: &Tensor, l: usize| t.reshape((b, l, heads, hd))?.transpose(1, 2)?.contiguous();
    let (q, k, v) = (split(q, lq)?, split(k, lk)?, split(v, lk)?);
    let scores = (q.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?.broadcast_add(&bias.to_dtype(q.dtype())?)?;
    let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
    probs.matmul(&v)?.transpose(1, 2)?.reshape((b, lq, d))
}

pub struct Encoder {
    layers: Vec<Arc<Layer>>,
    pub checkpointing: Checkpointing,
}

impl Encoder {
    /// The layers under `vb` (`…encoder`): `layers.0`, `layers.1`, ….
    pub fn new(c: &EncoderConfig, vb: VarBuilder) -> Result<Self> {
        let layers = (0..c.layers).map(|i| Ok(Arc::new(Layer::new(c, vb.pp("layers").pp(i))?))).collect::<Result<_>>()?;
        Ok(Encoder { layers, checkpointing: Checkpointing::default() })
    }

    /// Every layer on `x` `[batch, len, width]`, each attention masked as `mask` says.
    pub fn forward(&self, x: &Tensor, mask: &Mask) -> Result<Tensor> {
        let mut x = x.clone();
        for layer in &self.layers {
            let (layer, mask) = (layer.clone(), mask.clone());
            x = self.checkpointing.run(&x, Arc::new(move |x, _| layer.forward(x, &mask)))?;
        }
        Ok(x)
    }

    /// [`Encoder::forward`]'s output at position `at[i]` of each row `i` only, `[batch, width]`:
    /// the last layer runs for those positions alone (`layers::pre_norm_layer_at`).
    pub fn forward_at(&self, x: &Tensor, mask: &Mask, at: &[usize]) -> Result<Tensor> {
        let Some((last, rest)) = self.layers.split_last() else { return positions(x, at) };
        let mut x = x.clone();
        for layer in rest {
            let (layer, mask) = (layer.clone(), mask.clone());
            x = self.checkpointing.run(&x, Arc::new(move |x, _| layer.forward(x, &mask)))?;
        }
        last.forward_at(&x, mask, at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn activations_by_hand() {
        let x = Tensor::new(&[-1.0f64, 0.5, 2.0], &Device::Cpu).unwrap();
        // Through the fused bias + activation op the towers run, with a zero bias.
        let zero = Tensor::zeros(3, candle_core::DType::F64, &Device::Cpu).unwrap();
        let got = |a: Act| crate::ops::kernels::bias_act::bias_act(&x, &zero, a.activation()).unwrap().to_vec1::<f64>().unwrap();
        let sig = |z: f64| 1.0 / (1.0 + (-z).exp());
        let quick: Vec<f64> = [-1.0f64, 0.5, 2.0].iter().map(|&v| v * sig(1.702 * v)).collect();
        // GELU(x) = x·Φ(x): Φ(−1) = 0.158655254, Φ(0.5) = 0.691462461, Φ(2) = 0.977249868.
        let erf = [-0.158_655_254, 0.345_731_231, 1.954_499_736];
        let tanh: Vec<f64> = [-1.0f64, 0.5, 2.0]
            .iter()
            .map(|&v| 0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh()))
            .collect();
        for (act, want) in [(Act::QuickGelu, quick.as_slice()), (Act::Gelu, &erf[..]), (Act::GeluTanh, tanh.as_slice())] {
            for (g, w) in got(act).iter().zip(want) {
                assert!((g - w).abs() < 1e-8, "{act:?}: {g} vs {w}");
            }
        }
        assert_eq!(Act::from_hf("gelu_new"), Ok(Act::GeluTanh));
        assert!(Act::from_hf("relu").unwrap_err().contains("relu"));
    }
}
