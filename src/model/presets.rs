//! Tower sizes: named presets plus free-form overrides, resolved once into concrete configs.

use serde::{Deserialize, Serialize};

/// How the text tower's states become one vector before the projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TextPooling {
    /// The final hidden state of `[CLS]` (ALIGN, BERT).
    Cls,
    /// The mean over non-padding tokens (CC12M's text encoder).
    Mean,
    /// BERT's pooler, `tanh(dense([CLS] state))` (`text_model.pooler.dense`), as
    /// `VisionTextDualEncoderModel` embeds texts.
    Pooler,
}

/// How a ViT's states become one vector before the projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ImagePooling {
    /// The class token's final state.
    Cls,
    /// Global average of the patch tokens.
    Gap,
    /// ViT's pooler, `tanh(dense(class token))` (`vision_model.pooler.dense`), as
    /// `VisionTextDualEncoderModel` embeds images.
    Pooler,
}

/// How the learnable temperature is parameterised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TemperatureKind {
    /// ALIGN: logits = x·y / σ, σ learned directly (Hugging Face's `temperature`).
    Align,
    /// CLIP: logits = x·y · exp(s), s learned (`logit_scale`), exp(s) clamped at 100.
    Clip,
}

/// Optional overrides on top of a ViT preset (any field left out keeps the preset's value).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct VitOverrides {
    /// Side of a square patch, in pixels.
    pub patch_size: Option<usize>,
    /// Token width (hidden size).
    pub width: Option<usize>,
    /// Transformer layers.
    pub depth: Option<usize>,
    /// Attention heads per layer (dividing `width`).
    pub heads: Option<usize>,
    /// The MLP's hidden width as a multiple of `width`.
    pub mlp_ratio: Option<f64>,
    /// `cls` (the class token), `gap` (mean of the patch tokens) or `pooler` (transformers' ViT
    /// pooler).
    pub pool: Option<ImagePooling>,
    /// ε of every LayerNorm.
    pub layer_norm_eps: Option<f64>,
    /// FLIP's patch dropout: the fraction of patch tokens each training image drops (0.5 keeps
    /// half; the class token always stays). Evaluation sees every token. Also applies to a
    /// SigLIP 2 NaFlex tower, where each image drops that fraction of its own patches.
    pub patch_dropout: Option<f64>,
}

/// Optional overrides on top of an EfficientNet preset.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct EfficientNetOverrides {
    /// Channel multiplier of every stage (EfficientNet's compound scaling).
    pub width_coefficient: Option<f64>,
    /// Block-count multiplier of every stage.
    pub depth_coefficient: Option<f64>,
    /// Stochastic-depth rate of the last block.
    pub drop_path: Option<f64>,
    /// PyTorch convention: TensorFlow's decay 0.99 is 0.01.
    pub bn_momentum: Option<f64>,
    /// ε of every batch normalisation.
    pub bn_eps: Option<f64>,
    /// Running statistics while training, never updated (ALIGN fine-tuning).
    pub bn_frozen: Option<bool>,
    /// Block indices whose stride-2 depthwise convolution pads symmetrically.
    pub depthwise_padding: Option<Vec<usize>>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct BertOverrides {
    /// Hidden size.
    pub hidden: Option<usize>,
    /// Transformer layers.
    pub layers: Option<usize>,
    /// Attention heads per layer (dividing `hidden`).
    pub heads: Option<usize>,
    /// The feed-forward layer's hidden width.
    pub intermediate: Option<usize>,
    /// Positions the position embedding holds, in tokens (at least `text.max_len`).
    pub max_position: Option<usize>,
    /// Token types (segments) of the type embedding.
    pub type_vocab: Option<usize>,
    /// ε of every LayerNorm.
    pub layer_norm_eps: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VitConfig {
    pub image_size: usize,
    pub patch_size: usize,
    pub width: usize,
    pub depth: usize,
    pub heads: usize,
    pub mlp_dim: usize,
    pub pool: ImagePooling,
    pub layer_norm_eps: f64,
    /// The fraction of patch tokens dropped in training (FLIP); 0 keeps all.
    #[serde(default)]
    pub patch_dropout: f64,
}

impl VitConfig {
    /// `vit-ti16`, `vit-s16`, `vit-b32`, `vit-b16`, `vit-l14` (Dosovitskiy et al.; DeiT for Ti).
    pub fn preset(name: &str, image_size: usize) -> Option<Self> {
        let (patch, width, depth, heads) = match name {
            "vit-ti16" => (16, 192, 12, 3),
            "vit-s16" => (16, 384, 12, 6),
            "vit-b32" => (32, 768, 12, 12),
            "vit-b16" => (16, 768, 12, 12),
            "vit-l14" => (14, 1024, 24, 16),
            "vit" => (16, 768, 12, 12),
            _ => return None,
        };
        Some(VitConfig {
            image_size,
            patch_size: patch,
            width,
            depth,
            heads,
            mlp_dim: 4 * width,
            pool: ImagePooling::Cls,
            layer_norm_eps: 1e-12,
            patch_dropout: 0.0,
        })
    }

    /// The architecture the overrides name. Their training setting (`patch_dropout`) applies to a
    /// pretrained tower as much as to a new one, so a run sets it where it starts, not here.
    pub fn with(mut self, o: &VitOverrides) -> Self {
        if let Some(v) = o.patch_size {
            self.patch_size = v;
        }
        if let Some(v) = o.width {
            self.width = v;
            self.mlp_dim = 4 * v;
        }
        if let Some(v) = o.depth {
            self.depth = v;
        }
        if let Some(v) = o.heads {
            self.heads = v;
        }
        if let Some(r) = o.mlp_ratio {
            self.mlp_dim = (self.width as f64 * r).round() as usize;
        }
        if let Some(p) = o.pool {
            self.pool = p;
        }
        if let Some(e) = o.layer_norm_eps {
            self.layer_norm_eps = e;
        }
        self
    }

    pub fn num_patches(&self) -> usize {
        (self.image_size / self.patch_size).pow(2)
    }

    /// The patch tokens a training image keeps under patch dropout (open_clip's rounding: the
    /// floor, at least one).
    pub fn kept_patches(&self) -> usize {
        ((self.num_patches() as f64 * (1.0 - self.patch_dropout)) as usize).max(1)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.patch_size == 0 || !self.image_size.is_multiple_of(self.patch_size) {
            return Err(format!("image_size {} is not a multiple of patch_size {}", self.image_size, self.patch_size));
        }
        if self.heads == 0 || !self.width.is_multiple_of(self.heads) {
            return Err(format!("ViT width {} is not divisible by heads {}", self.width, self.heads));
        }
        if self.depth == 0 || self.mlp_dim == 0 {
            return Err("ViT depth and MLP size must be positive".into());
        }
        if !(0.0..1.0).contains(&self.patch_dropout) {
            return Err(format!("model.vit.patch_dropout {} is not in [0, 1): it is the fraction of patches dropped", self.patch_dropout));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub max_position: usize,
    pub type_vocab: usize,
    pub layer_norm_eps: f64,
    /// RoBERTa's embeddings (XLM-RoBERTa, open_clip's multilingual text towers): positions count
    /// from this padding id + 1 over the tokens that are not padding, every padding token at the
    /// padding id's position, and any token of this id is padding, hidden from attention and the
    /// mean. Absent: BERT's positions 0, 1, … and the tokenizer's mask.
    #[serde(default)]
    pub pad_token_id: Option<u32>,
}

impl BertConfig {
    /// The standard Google BERT sizes (Turc et al. 2019 for the small ones).
    pub fn preset(name: &str, vocab_size: usize) -> Option<Self> {
        let (layers, hidden, heads) = match name {
            "bert-tiny" => (2, 128, 2),
            "bert-mini" => (4, 256, 4),
            "bert-small" => (4, 512, 8),
            "bert-medium" => (8, 512, 8),
            "bert-base" | "bert" => (12, 768, 12),
            "bert-large" => (24, 1024, 16),
            _ => return None,
        };
        Some(BertConfig {
            vocab_size,
            hidden,
            layers,
            heads,
            intermediate: 4 * hidden,
            max_position: 512,
            type_vocab: 2,
            layer_norm_eps: 1e-12,
            pad_token_id: None,
        })
    }

    pub fn with(mut self, o: &BertOverrides) -> Self {
        if let Some(v) = o.hidden {
            self.hidden = v;
            self.intermediate = 4 * v;
        }
        if let Some(v) = o.layers {
            self.layers = v;
        }
        if let Some(v) = o.heads {
            self.heads = v;
        }
        if let Some(v) = o.intermediate {
            self.intermediate = v;
        }
        if let Some(v) = o.max_position {
            self.max_position = v;
        }
        if let Some(v) = o.type_vocab {
            self.type_vocab = v;
        }
        if let Some(v) = o.layer_norm_eps {
            self.layer_norm_eps = v;
        }
        self
    }

    pub fn validate(&self, max_len: usize) -> Result<(), String> {
        if self.heads == 0 || !self.hidden.is_multiple_of(self.heads) {
            return Err(format!("BERT hidden {} is not divisible by heads {}", self.hidden, self.heads));
        }
        if max_len > self.max_position {
            return Err(format!("text max_len {max_len} exceeds BERT max_position {}", self.max_position));
        }
        if self.vocab_size == 0 || self.layers == 0 {
            return Err("BERT vocab_size and layers must be positive".into());
        }
        Ok(())
    }
}

pub const EFFICIENTNET_PRESETS: [&str; 9] = [
    "efficientnet-b0",
    "efficientnet-b1",
    "efficientnet-b2",
    "efficientnet-b3",
    "efficientnet-b4",
    "efficientnet-b5",
    "efficientnet-b6",
    "efficientnet-b7",
    "efficientnet-l2",
];
pub const VIT_PRESETS: [&str; 5] = ["vit-ti16", "vit-s16", "vit-b32", "vit-b16", "vit-l14"];
pub const BERT_PRESETS: [&str; 6] = ["bert-tiny", "bert-mini", "bert-small", "bert-medium", "bert-base", "bert-large"];
