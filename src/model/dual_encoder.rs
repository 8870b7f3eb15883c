//! The dual encoder: an image tower and a text tower, linear projections to a shared embedding
//! space, L2 normalisation, and the learnable temperature.

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::bert::Bert;
use super::clip::{ClipText, ClipTextConfig, ClipVision, ClipVisionConfig};
use super::efficientnet::{EfficientNet, EfficientNetConfig};
use super::init::LINEAR_DEFAULT;
use super::layers::{l2_normalize, linear, Linear};
use super::naflex::{NaflexVision, NaflexVisionConfig};
use super::presets::{BertConfig, TemperatureKind, TextPooling, VitConfig};
use super::recompute::{Checkpointing, GradSink};
use super::siglip::{SiglipText, SiglipTextConfig, SiglipVision, SiglipVisionConfig};
use super::vit::Vit;
use super::Ctx;

/// Concrete sizes of everything, resolved from the config, tokenizer and data settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub image: ImageSpec,
    pub text: TextSpec,
    pub embed_dim: usize,
    /// Without a projection the image tower's width must equal `embed_dim` (ALIGN's EfficientNet).
    pub image_projection: bool,
    /// Whether the text projection has a bias (ALIGN's does, CLIP's does not). SigLIP's text
    /// tower ends in its own head and has no projection.
    #[serde(default = "yes")]
    pub text_projection_bias: bool,
    /// Two bias-free linear layers through this width with an exact GELU between them instead of
    /// one (open_clip's `hf_proj_type = "mlp"` after a Hugging Face text tower).
    #[serde(default)]
    pub text_projection_hidden: Option<usize>,
    pub text_pooling: TextPooling,
    pub temperature: TemperatureKind,
    /// σ at initialisation (ALIGN 1.0; CLIP 0.07, i.e. logit scale ln(1/0.07)).
    pub temperature_init: f64,
    /// The sigmoid loss's learnable logit bias at initialisation (SigLIP: −10), kept with the
    /// model as `logit_bias`; none for softmax-trained models.
    #[serde(default)]
    pub logit_bias: Option<f64>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ImageSpec {
    Vit(VitConfig),
    EfficientNet(EfficientNetConfig),
    /// CLIP's vision transformer.
    Clip(ClipVisionConfig),
    /// SigLIP's vision transformer with its attention-pooling head.
    Siglip(SiglipVisionConfig),
    /// SigLIP 2's NaFlex vision transformer: images as variable patch grids.
    Naflex(NaflexVisionConfig),
}

impl ImageSpec {
    /// The width of the tower's pooled output.
    pub fn width(&self) -> usize {
        match self {
            ImageSpec::Vit(c) => c.width,
            ImageSpec::EfficientNet(c) => c.width(),
            ImageSpec::Clip(c) => c.encoder.width,
            ImageSpec::Siglip(c) => c.encoder.width,
            ImageSpec::Naflex(c) => c.encoder.width,
        }
    }

    /// The side of the square the tower sees; a NaFlex tower's nominal one, its position grid
    /// in pixels.
    pub fn image_size(&self) -> usize {
        match self {
            ImageSpec::Vit(c) => c.image_size,
            ImageSpec::EfficientNet(c) => c.image_size,
            ImageSpec::Clip(c) => c.image_size,
            ImageSpec::Siglip(c) => c.image_size,
            ImageSpec::Naflex(c) => c.position_grid * c.patch_size,
        }
    }
}

/// The text tower's sizes. Checkpoints written before CLIP and SigLIP towers existed hold a bare
/// BERT config, which still reads as one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "TextSpecRepr")]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TextSpec {
    Bert(BertConfig),
    /// CLIP's causal text transformer, pooled at the end-of-text token.
    Clip(ClipTextConfig),
    /// SigLIP's text transformer, its last position through its head.
    Siglip(SiglipTextConfig),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TextSpecRepr {
    Tagged(TaggedTextSpec),
    Bert(BertConfig),
}

#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum TaggedTextSpec {
    Bert(BertConfig),
    Clip(ClipTextConfig),
    Siglip(SiglipTextConfig),
}

impl From<TextSpecRepr> for TextSpec {
    fn from(r: TextSpecRepr) -> TextSpec {
        match r {
            TextSpecRepr::Bert(c) | TextSpecRepr::Tagged(TaggedTextSpec::Bert(c)) => TextSpec::Bert(c),
            TextSpecRepr::Tagged(TaggedTextSpec::Clip(c)) => TextSpec::Clip(c),
            TextSpecRepr::Tagged(TaggedTextSpec::Siglip(c)) => TextSpec::Siglip(c),
        }
    }
}

impl TextSpec {
    pub fn vocab_size(&self) -> usize {
        match self {
            TextSpec::Bert(c) => c.vocab_size,
            TextSpec::Clip(c) => c.vocab_size,
            TextSpec::Siglip(c) => c.vocab_size,
        }
    }

    /// The width of the tower's pooled output.
    pub fn width(&self) -> usize {
        match self {
            TextSpec::Bert(c) => c.hidden,
            TextSpec::Clip(c) => c.encoder.width,
            TextSpec::Siglip(c) => c.projection,
        }
    }

    /// The positions the tower has: the longest text it takes.
    pub fn max_position(&self) -> usize {
        match self {
            TextSpec::Bert(c) => c.max_position,
            TextSpec::Clip(c) => c.max_position,
            TextSpec::Siglip(c) => c.max_position,
        }
    }

    /// Whether padding never changes an embedding, so a batch may be cut to its longest text:
    /// BERT and CLIP mask their padding (CLIP's causal mask hides it from the end token too);
    /// SigLIP's text tower and open_clip's bidirectional ones attend to their padding, and a
    /// tower pooled at the last position pools a padding token.
    pub fn masks_padding(&self) -> bool {
        match self {
            TextSpec::Bert(_) => true,
            TextSpec::Clip(c) => c.ignores_padding(),
            TextSpec::Siglip(_) => false,
        }
    }

    /// The BERT config, where the tower is one.
    pub fn bert(&self) -> Option<&BertConfig> {
        match self {
            TextSpec::Bert(c) => Some(c),
            _ => None,
        }
    }
}

pub enum ImageTower {
    Vit(Vit),
    EfficientNet(EfficientNet),
    Clip(ClipVision),
    Siglip(SiglipVision),
    Naflex(NaflexVision),
}

impl ImageTower {
    pub fn pooled(&self, images: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        match self {
            ImageTower::Vit(v) => v.pooled(images, ctx),
            ImageTower::EfficientNet(e) => e.pooled(images, ctx),
            ImageTower::Clip(c) => c.pooled(images),
            ImageTower::Siglip(s) => s.pooled(images),
            ImageTower::Naflex(n) => n.pooled(images, ctx),
        }
    }
}

pub enum TextTower {
    Bert(Bert),
    Clip(ClipText),
    Siglip(SiglipText),
}

impl TextTower {
    fn new(spec: &TextSpec, pooling: TextPooling, vb: VarBuilder) -> Result<Self> {
        Ok(match spec {
            TextSpec::Bert(c) if pooling == TextPooling::Pooler => TextTower::Bert(Bert::new(c, vb.clone())?.with_pooler(vb)?),
            TextSpec::Bert(c) => TextTower::Bert(Bert::new(c, vb)?),
            TextSpec::Clip(c) => TextTower::Clip(ClipText::new(c, vb)?),
            TextSpec::Siglip(c) => TextTower::Siglip(SiglipText::new(c, vb)?),
        })
    }

    pub fn pooled(&self, ids: &Tensor, mask: &Tensor, pooling: TextPooling) -> Result<Tensor> {
        match self {
            TextTower::Bert(b) => b.pooled(ids, mask, pooling),
            TextTower::Clip(c) => c.pooled(ids, mask),
            TextTower::Siglip(s) => s.pooled(ids, mask),
        }
    }
}

/// Half-precision values to f32 (f32 and f64 unchanged): embeddings leave the towers, and
/// enter the normalisation and the loss, at full precision.
pub fn widen(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::BF16 | DType::F16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// CLIP clamps the logit scale at 100 (σ ≥ 0.01).
pub const CLIP_MAX_LOGIT_SCALE: f64 = 100.0;

/// Where the image side's graph can start: a frozen tower's output needs none, so training keeps
/// no activations for it and runs no backward pass through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImageGraph {
    #[default]
    Whole,
    /// Only the projection trains: the graph starts at the tower's pooled output.
    FromProjection,
    /// Nothing trains.
    None,
}

/// The text side's projection to the shared space.
enum TextProjection {
    Linear(Linear),
    /// `linear → GELU → linear`, open_clip's `mlp` projection.
    Mlp(Linear, Linear),
}

impl TextProjection {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            TextProjection::Linear(p) => p.forward(x),
            TextProjection::Mlp(a, b) => b.forward(&a.forward(x)?.gelu_erf()?),
        }
    }
}

pub struct DualEncoder {
    pub image: ImageTower,
    pub text: TextTower,
    visual_projection: Option<Linear>,
    /// None for SigLIP, whose text head is its projection.
    text_projection: Option<TextProjection>,
    /// σ (ALIGN) or s = ln(logit scale) (CLIP); a 0-d variable.
    temperature: Tensor,
    /// The sigmoid loss's b (0-d), when the model has one.
    logit_bias: Option<Tensor>,
    pub spec: ModelSpec,
    checkpoint_grads: Option<Arc<GradSink>>,
    /// Where a locked image side's graph starts (LiT).
    image_graph: ImageGraph,
}

/// `pass`, forward passes through the towers on `device`, run where they run fastest
/// (`ops::pool::compute_on`; `ops::pool::on_compute_pool` says why, and what `pass` must not
/// wait for). Here for the layers that may not reach `ops` themselves.
pub fn forward_pass<R: Send>(device: &candle_core::Device, pass: impl FnOnce() -> R + Send) -> R {
    crate::ops::pool::compute_on(device, pass)
}

impl DualEncoder {
    pub fn new(spec: &ModelSpec, vb: VarBuilder) -> Result<Self> {
        let image = match &spec.image {
            ImageSpec::Vit(c) => ImageTower::Vit(Vit::new(c, vb.pp("vision_model"))?),
            ImageSpec::EfficientNet(c) => ImageTower::EfficientNet(EfficientNet::new(c, vb.pp("vision_model"))?),
            ImageSpec::Clip(c) => ImageTower::Clip(ClipVision::new(c, vb.pp("vision_model"))?),
            ImageSpec::Siglip(c) => ImageTower::Siglip(SiglipVision::new(c, vb.pp("vision_model"))?),
            ImageSpec::Naflex(c) => ImageTower::Naflex(NaflexVision::new(c, vb.pp("vision_model"))?),
        };
        let text = TextTower::new(&spec.text, spec.text_pooling, vb.pp("text_model"))?;
        let width = spec.image.width();
        let visual_projection = if spec.image_projection {
            Some(linear(width, spec.embed_dim, false, LINEAR_DEFAULT, vb.pp("visual_projection"))?)
        } else {
            if width != spec.embed_dim {
                candle_core::bail!("image tower width {width} differs from embed_dim {} and image_projection is off", spec.embed_dim);
            }
            None
        };
        let text_projection = match &spec.text {
            TextSpec::Siglip(c) if c.projection != spec.embed_dim => {
                candle_core::bail!("SigLIP's text head gives {} wide embeddings, not embed_dim {}", c.projection, spec.embed_dim)
            }
            TextSpec::Siglip(_) => None,
            t => Some(match spec.text_projection_hidden {
                None => TextProjection::Linear(linear(
                    t.width(),
                    spec.embed_dim,
                    spec.text_projection_bias,
                    LINEAR_DEFAULT,
                    vb.pp("text_projection"),
                )?),
                Some(h) => {
                    let p = vb.pp("text_projection");
                    TextProjection::Mlp(
                        linear(t.width(), h, false, LINEAR_DEFAULT, p.pp("0"))?,
                        linear(h, spec.embed_dim, false, LINEAR_DEFAULT, p.pp("2"))?,
                    )
                }
            }),
        };
        let temperature = match spec.temperature {
            TemperatureKind::Align => vb.get_with_hints((), "temperature", Init::Const(spec.temperature_init))?,
            TemperatureKind::Clip => vb.get_with_hints((), "logit_scale", Init::Const((1.0 / spec.temperature_init).ln()))?,
        };
        let logit_bias = spec.logit_bias.map(|b| vb.get_with_hints((), "logit_bias", Init::Const(b))).transpose()?;
        Ok(DualEncoder {
            image,
            text,
            visual_projection,
            text_projection,
            temperature,
            logit_bias,
            spec: spec.clone(),
            checkpoint_grads: None,
            image_graph: ImageGraph::Whole,
        })
    }

    /// With `on`, checkpoints every transformer block and MBConv block of both towers
    /// (activation checkpointing): their activations are recomputed in the backward pass instead
    /// of kept. The parameter gradients of the recomputed blocks then arrive through
    /// [`DualEncoder::take_checkpoint_grads`], not the loss's own gradient store.
    pub fn with_grad_checkpointing(mut self, on: bool) -> Self {
        if !on {
            return self;
        }
        let sink = Arc::new(GradSink::default());
        let c = Checkpointing::on(sink.clone());
        match &mut self.image {
            ImageTower::Vit(v) => v.checkpointing = c.clone(),
            ImageTower::EfficientNet(e) => e.checkpointing = c.clone(),
            ImageTower::Clip(v) => v.encoder.checkpointing = c.clone(),
            ImageTower::Siglip(v) => v.encoder.checkpointing = c.clone(),
            ImageTower::Naflex(v) => v.encoder.checkpointing = c.clone(),
        }
        match &mut self.text {
            TextTower::Bert(t) => t.checkpointing = c,
            TextTower::Clip(t) => t.encoder.checkpointing = c,
            TextTower::Siglip(t) => t.encoder.checkpointing = c,
        }
        self.checkpoint_grads = Some(sink);
        self
    }

    /// Detaches the frozen part of a locked image side (LiT): no activations kept, no backward
    /// pass through it.
    pub fn with_image_graph(mut self, graph: ImageGraph) -> Self {
        self.image_graph = graph;
        self
    }

    /// The gradient stores of the blocks recomputed since the last call (empty when
    /// checkpointing is off).
    pub fn take_checkpoint_grads(&self) -> Vec<GradStore> {
        self.checkpoint_grads.as_ref().map(|s| s.take()).unwrap_or_default()
    }

    /// The dtype the towers compute in: their weights' (bf16 for a mixed-precision view built
    /// with `SeededVars::builder_dtype(.., BF16, ..)` over f32 variables).
    pub fn compute_dtype(&self) -> DType {
        self.temperature.dtype()
    }

    /// L2-normalised image embeddings `[batch, embed_dim]` for `[batch, 3, S, S]` images.
    pub fn image_embeddings(&self, images: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let _profile = crate::util::profile::region("forward/image");
        let pooled = self.image.pooled(&images.to_dtype(self.compute_dtype())?, ctx)?;
        let pooled = if self.image_graph == ImageGraph::FromProjection { pooled.detach() } else { pooled };
        let x = match &self.visual_projection {
            Some(p) => p.forward(&pooled)?,
            None => pooled,
        };
        let x = if self.image_graph == ImageGraph::None { x.detach() } else { x };
        l2_normalize(&widen(&x)?)
    }

    /// L2-normalised text embeddings for token ids and attention mask (`[batch, len]`, u32).
    pub fn text_embeddings(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let _profile = crate::util::profile::region("forward/text");
        let pooled = self.text.pooled(ids, mask, self.spec.text_pooling)?;
        let x = match &self.text_projection {
            Some(p) => p.forward(&pooled)?,
            None => pooled,
        };
        l2_normalize(&widen(&x)?)
    }

    /// The factor logits are multiplied by: 1/σ (ALIGN) or min(exp(s), 100) (CLIP). 0-d, f32 or
    /// f64 (never lower: the logits and the loss are computed at full precision).
    pub fn logit_scale(&self) -> Result<Tensor> {
        let t = widen(&self.temperature)?;
        match self.spec.temperature {
            TemperatureKind::Align => t.recip(),
            TemperatureKind::Clip => t.exp()?.clamp(0.0, CLIP_MAX_LOGIT_SCALE),
        }
    }

    /// The sigmoid loss's logit bias b (0-d, f32 or f64), if the model has one.
    pub fn logit_bias(&self) -> Result<Option<Tensor>> {
        self.logit_bias.as_ref().map(widen).transpose()
    }

    /// FLOPs of one (image, caption) pair's forward pass, counted from the architecture (the
    /// matrix multiplications and convolutions; 2 per multiply-add). A training step costs about
    /// three times this per sample (forward, and backward for activations and weights), the
    /// figure model FLOPs utilisation is computed from.
    pub fn forward_flops_per_pair(&self, text_len: usize) -> f64 {
        let transformer = |tokens: f64, d: f64, m: f64, layers: usize| {
            layers as f64 * (8.0 * tokens * d * d + 4.0 * tokens * tokens * d + 4.0 * tokens * d * m)
        };
        let image = match &self.image {
            ImageTower::Vit(v) => {
                let c = &v.config;
                // A training pass under patch dropout embeds and encodes only the kept patches.
                let patches = if c.patch_dropout > 0.0 { c.kept_patches() } else { c.num_patches() } as f64;
                let (d, p) = (c.width as f64, c.patch_size as f64);
                2.0 * patches * 3.0 * p * p * d + transformer(patches + 1.0, d, c.mlp_dim as f64, c.depth)
            }
            ImageTower::EfficientNet(e) => e.forward_flops(),
            ImageTower::Clip(v) => {
                let c = &v.config;
                let (patches, p) = (c.num_patches() as f64, c.patch_size as f64);
                2.0 * patches * 3.0 * p * p * c.encoder.width as f64 + c.encoder.flops(patches + 1.0)
            }
            ImageTower::Siglip(v) => {
                let c = &v.config;
                let (patches, p, d) = (c.num_patches() as f64, c.patch_size as f64, c.encoder.width as f64);
                // The head: the probe's attention over the patches and its MLP.
                let head = 4.0 * patches * d * d + 4.0 * patches * d + 4.0 * d * c.encoder.mlp_dim as f64;
                2.0 * patches * 3.0 * p * p * d + c.encoder.flops(patches) + head
            }
            ImageTower::Naflex(v) => {
                // The full patch budget: the padding is computed too (at most the kept patches
                // under patch dropout).
                let c = &v.config;
                let patches = if c.patch_dropout > 0.0 { c.kept(c.max_patches) } else { c.max_patches };
                let (patches, d) = (patches as f64, c.encoder.width as f64);
                let head = 4.0 * patches * d * d + 4.0 * patches * d + 4.0 * d * c.encoder.mlp_dim as f64;
                2.0 * patches * c.patch_dim() as f64 * d + c.encoder.flops(patches) + head
            }
        };
        let l = text_len as f64;
        let text = match &self.spec.text {
            TextSpec::Bert(t) => transformer(l, t.hidden as f64, t.intermediate as f64, t.layers),
            TextSpec::Clip(t) => t.encoder.flops(l),
            TextSpec::Siglip(t) => t.encoder.flops(l) + 2.0 * t.encoder.width as f64 * t.projection as f64,
        };
        let width = self.spec.image.width() as f64;
        let e = self.spec.embed_dim as f64;
        let text_projection = match (&self.text_projection, self.spec.text_projection_hidden) {
            (None, _) => 0.0,
            (Some(_), None) => 2.0 * self.spec.text.width() as f64 * e,
            (Some(_), Some(h)) => 2.0 * self.spec.text.width() as f64 * h as f64 + 2.0 * h as f64 * e,
        };
        let projections = text_projection + if self.visual_projection.is_some() { 2.0 * width * e } else { 0.0 };
        image + text + projections
    }

    /// σ = 1 / logit scale, for reporting.
    pub fn temperature_value(&self) -> Result<f64> {
        Ok(1.0 / self.logit_scale()?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::init::SeededVars;
    use crate::model::presets::ImagePooling;
    use candle_core::{DType, Device, Tensor};

    pub fn tiny_spec() -> ModelSpec {
        ModelSpec {
            image: ImageSpec::Vit(VitConfig {
                image_size: 8,
                patch_size: 4,
                width: 16,
                depth: 1,
                heads: 2,
                mlp_dim: 32,
                pool: ImagePooling::Cls,
                layer_norm_eps: 1e-12,
                patch_dropout: 0.0,
            }),
            text: TextSpec::Bert(BertConfig {
                vocab_size: 30,
                hidden: 16,
                layers: 1,
                heads: 2,
                intermediate: 32,
                max_position: 16,
                type_vocab: 2,
                layer_norm_eps: 1e-12,
                pad_token_id: None,
            }),
            text_projection_bias: true,
            text_projection_hidden: None,
            embed_dim: 8,
            image_projection: true,
            text_pooling: TextPooling::Cls,
            temperature: TemperatureKind::Align,
            temperature_init: 1.0,
            logit_bias: None,
        }
    }

    #[test]
    fn embeddings_are_unit_vectors_and_every_variable_gets_a_gradient() {
        let dev = Device::Cpu;
        let vm = candle_nn::VarMap::new();
        let model = DualEncoder::new(&tiny_spec(), SeededVars::builder(&vm, 3, &dev)).unwrap();
        let images = crate::util::rng::randn(116, 0.0, 1.0, (3, 3, 8, 8), candle_core::DType::F32, &dev).unwrap();
        let ids = Tensor::new(&[[2u32, 7, 9, 3, 0], [2, 5, 3, 0, 0], [2, 11, 12, 13, 3]], &dev).unwrap();
        let mask = Tensor::new(&[[1u32, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], &dev).unwrap();
        let xi = model.image_embeddings(&images, &Ctx::EVAL).unwrap();
        let xt = model.text_embeddings(&ids, &mask).unwrap();
        for n in xi.sqr().unwrap().sum(1).unwrap().to_vec1::<f32>().unwrap() {
            assert!((n - 1.0).abs() < 1e-5);
        }
        let logits = xi.matmul(&xt.t().unwrap()).unwrap().broadcast_mul(&model.logit_scale().unwrap()).unwrap();
        let loss = candle_nn::loss::cross_entropy(&logits, &Tensor::new(&[0u32, 1, 2], &dev).unwrap()).unwrap();
        let grads = loss.backward().unwrap();
        let data = vm.data().lock().unwrap();
        let mut missing: Vec<&String> = data.iter().filter(|(_, v)| grads.get(v.as_tensor()).is_none()).map(|(k, _)| k).collect();
        missing.sort();
        // Unused rows of tables still get (zero) gradients; a missing entry means a broken graph.
        assert!(missing.is_empty(), "variables without gradient: {missing:?}");
        assert_eq!(model.temperature_value().unwrap(), 1.0);
        assert_eq!(data["temperature"].dtype(), DType::F32);
    }

    /// Central finite differences in f64 against backprop for a few entries of every variable of
    /// a tiny dual encoder under the contrastive loss: catches a wrong gradient anywhere in the
    /// towers (attention, LayerNorm, GELU, patch embedding, pooling, projections, temperature).
    #[test]
    fn gradients_of_every_variable_match_finite_differences() {
        let dev = Device::Cpu;
        for pool in [ImagePooling::Cls, ImagePooling::Gap] {
            let mut spec = tiny_spec();
            if let ImageSpec::Vit(v) = &mut spec.image {
                v.pool = pool;
            }
            spec.temperature_init = 0.3;
            let vm = candle_nn::VarMap::new();
            let model = DualEncoder::new(&spec, SeededVars::builder_dtype(&vm, 5, DType::F64, &dev)).unwrap();
            let images = crate::util::rng::randn(117, 0.0, 1.0, (3, 3, 8, 8), candle_core::DType::F64, &dev).unwrap();
            let ids = Tensor::new(&[[2u32, 7, 9, 3, 0], [2, 5, 3, 0, 0], [2, 11, 12, 13, 3]], &dev).unwrap();
            let mask = Tensor::new(&[[1u32, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], &dev).unwrap();
            let loss = || {
                let i = model.image_embeddings(&images, &Ctx::EVAL).unwrap();
                let t = model.text_embeddings(&ids, &mask).unwrap();
                // Both directions' cross-entropy of the scaled similarities: a scalar that depends
                // on every variable (the training loss itself is tested in `train::loss`).
                let logits = i.matmul(&t.t().unwrap()).unwrap().broadcast_mul(&model.logit_scale().unwrap()).unwrap();
                let labels = Tensor::new(&[0u32, 1, 2], &dev).unwrap();
                let ce = |l: &Tensor| candle_nn::loss::cross_entropy(l, &labels).unwrap();
                (ce(&logits) + ce(&logits.t().unwrap())).unwrap()
            };
            let grads = loss().backward().unwrap();
            let vars: Vec<(String, candle_core::Var)> = vm.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            let mut rng = crate::util::rng::Rng::new(1);
            for (name, var) in vars {
                let g = grads.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
                let base = var.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
                for _ in 0..3 {
                    let k = rng.below(base.len());
                    let eval = |delta: f64| {
                        let mut v = base.clone();
                        v[k] += delta;
                        var.set(&Tensor::from_vec(v, var.shape(), &dev).unwrap()).unwrap();
                        loss().to_scalar::<f64>().unwrap()
                    };
                    let h = 1e-5;
                    let fd = (eval(h) - eval(-h)) / (2.0 * h);
                    var.set(&Tensor::from_vec(base.clone(), var.shape(), &dev).unwrap()).unwrap();
                    let tol = 1e-6 + 1e-4 * fd.abs().max(g[k].abs());
                    assert!((fd - g[k]).abs() < tol, "{pool:?} {name}[{k}]: backprop {} vs finite difference {fd}", g[k]);
                }
            }
        }
    }

    #[test]
    fn clip_temperature_is_a_log_scale_clamped_at_100() {
        let dev = Device::Cpu;
        let mut spec = tiny_spec();
        spec.temperature = TemperatureKind::Clip;
        spec.temperature_init = 0.07;
        let vm = candle_nn::VarMap::new();
        let model = DualEncoder::new(&spec, SeededVars::builder(&vm, 3, &dev)).unwrap();
        let s = vm.data().lock().unwrap()["logit_scale"].clone();
        assert!((s.as_tensor().to_scalar::<f32>().unwrap() - (1.0f32 / 0.07).ln()).abs() < 1e-6);
        assert!((model.logit_scale().unwrap().to_scalar::<f32>().unwrap() - 1.0 / 0.07).abs() < 1e-3);
        assert!((model.temperature_value().unwrap() - 0.07).abs() < 1e-6);
        s.set(&Tensor::new(6.0f32, &dev).unwrap()).unwrap();
        assert_eq!(model.logit_scale().unwrap().to_scalar::<f32>().unwrap(), 100.0);
    }

    /// Checkpoints from before the CLIP and SigLIP towers hold the BERT config bare, without a
    /// `kind` and without `text_projection_bias`.
    #[test]
    fn specs_written_before_the_text_tower_kinds_still_read() {
        let spec = tiny_spec();
        let mut json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["text"]["kind"], "bert");
        json["text"].as_object_mut().unwrap().remove("kind");
        json.as_object_mut().unwrap().remove("text_projection_bias");
        assert_eq!(serde_json::from_value::<ModelSpec>(json).unwrap(), spec);
        let round = serde_json::to_string(&spec).unwrap();
        assert_eq!(serde_json::from_str::<ModelSpec>(&round).unwrap(), spec);
    }

    #[test]
    fn padding_does_not_change_the_text_embedding() {
        let dev = Device::Cpu;
        let vm = candle_nn::VarMap::new();
        let model = DualEncoder::new(&tiny_spec(), SeededVars::builder(&vm, 3, &dev)).unwrap();
        let short =
            model.text_embeddings(&Tensor::new(&[[2u32, 7, 3]], &dev).unwrap(), &Tensor::new(&[[1u32, 1, 1]], &dev).unwrap()).unwrap();
        let padded = model
            .text_embeddings(&Tensor::new(&[[2u32, 7, 3, 0, 0, 0]], &dev).unwrap(), &Tensor::new(&[[1u32, 1, 1, 0, 0, 0]], &dev).unwrap())
            .unwrap();
        let d = (short - padded).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(d < 1e-5, "{d}");
    }

    #[test]
    fn counted_flops_match_the_published_figures() {
        // Published multiply-adds at 224 px: ViT-B/16 17.6 G, EfficientNet-B0 0.39 G; BERT-base over 64 tokens by hand: 12·(4·64·768² + 2·64²·768 +
        // 2·64·768·3072) = 5.51 G. We count 2 FLOPs per multiply-add.
        let dev = Device::Cpu;
        let build = |image: &str, text: &str| {
            let image = match crate::model::efficientnet::EfficientNetConfig::preset(image, 224) {
                Some(e) => ImageSpec::EfficientNet(e),
                None => ImageSpec::Vit(VitConfig::preset(image, 224).unwrap()),
            };
            let spec = ModelSpec {
                image,
                text: TextSpec::Bert(BertConfig::preset(text, 30522).unwrap()),
                text_projection_bias: true,
                text_projection_hidden: None,
                embed_dim: 640,
                image_projection: true,
                text_pooling: TextPooling::Cls,
                temperature: TemperatureKind::Align,
                temperature_init: 1.0,
                logit_bias: None,
            };
            DualEncoder::new(&spec, candle_nn::VarBuilder::zeros(DType::F32, &dev)).unwrap()
        };
        let vit = build("vit-b16", "bert-base");
        let text = 2.0 * 5.51e9;
        let image = vit.forward_flops_per_pair(64) - text;
        assert!((image / 2.0 / 17.6e9 - 1.0).abs() < 0.02, "ViT-B/16: {:.2} GMACs", image / 2e9);
        let b0 = build("efficientnet-b0", "bert-base");
        let image = b0.forward_flops_per_pair(64) - text;
        // ALIGN's tower (Hugging Face AlignVisionModel) has no 1×1 head convolution to 1280
        // channels and no classifier: 0.39 G − 49·320·1280 − 1280·1000 = 0.368 G.
        assert!((image / 2.0 / 0.368e9 - 1.0).abs() < 0.02, "EfficientNet-B0: {:.3} GMACs", image / 2e9);
    }
}
