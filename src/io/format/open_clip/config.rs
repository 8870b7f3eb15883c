//! `open_clip_config.json` as open_clip declares it: `model_cfg` with its `vision_cfg` and
//! `text_cfg` (the `CLIPVisionCfg` and `CLIPTextCfg` dataclasses of open_clip's `model.py`) and
//! `preprocess_cfg` (`PreprocessCfg` of its `transform.py`), as serde structs with open_clip 3.x's
//! defaults for absent keys. A `null` reads as an absent key (open_clip writes `null` for an
//! unset option); keys align has no use for are ignored.

use serde::Deserialize;
use serde_json::Value;

use crate::io::format::config_error::ConfigError;

/// `model_cfg`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct ModelCfg {
    pub embed_dim: usize,
    pub quick_gelu: bool,
    /// `ln(1 / 0.07)`, CLIP's initial temperature.
    pub init_logit_scale: f64,
    pub init_logit_bias: Option<f64>,
    /// The text tower's keys under `text.` (`CustomTextCLIP`) instead of the top level.
    pub custom_text: bool,
    /// CoCa's captioning decoder.
    pub multimodal_cfg: Option<Value>,
    pub vision_cfg: Option<VisionCfg>,
    pub text_cfg: Option<TextCfg>,
}

impl Default for ModelCfg {
    fn default() -> Self {
        ModelCfg {
            embed_dim: 512,
            quick_gelu: false,
            init_logit_scale: (1.0f64 / 0.07).ln(),
            init_logit_bias: None,
            custom_text: false,
            multimodal_cfg: None,
            vision_cfg: None,
            text_cfg: None,
        }
    }
}

/// A transformer's depth, or a ModifiedResNet's blocks per stage.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Layers {
    Depth(usize),
    ResNet(Vec<usize>),
}

/// A square side, or `[height, width]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Side {
    Square(usize),
    Pair(Vec<usize>),
}

/// `act_kwargs`: the GELU's approximation.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ActKwargs {
    pub approximate: Option<String>,
}

/// `norm_kwargs`: the LayerNorm's ε (PyTorch's default 1e-5).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct NormKwargs {
    pub eps: f64,
}

impl Default for NormKwargs {
    fn default() -> Self {
        NormKwargs { eps: 1e-5 }
    }
}

/// The options of open_clip's attention block that change its arithmetic; align builds the plain
/// block only.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct BlockOptions {
    pub block_type: Option<String>,
    pub qk_norm: bool,
    pub scaled_cosine_attn: bool,
    pub scale_heads: bool,
    pub scale_attn_inner: bool,
    pub scale_attn: bool,
    pub scale_fc: bool,
}

/// `vision_cfg` (`CLIPVisionCfg`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct VisionCfg {
    pub layers: Layers,
    pub width: usize,
    pub head_width: usize,
    pub mlp_ratio: f64,
    pub patch_size: usize,
    pub image_size: Side,
    pub ls_init_value: Option<f64>,
    pub patch_dropout: f64,
    pub attentional_pool: bool,
    pub no_ln_pre: bool,
    pub pos_embed_type: String,
    pub final_ln_after_pool: bool,
    pub pool_type: String,
    pub output_tokens: bool,
    pub act_kwargs: ActKwargs,
    pub norm_kwargs: NormKwargs,
    #[serde(flatten)]
    pub block: BlockOptions,
    pub timm_model_name: Option<String>,
    /// The pooling open_clip asks of a timm trunk (`avg` by default, `map` for SigLIP's).
    pub timm_pool: String,
    /// What follows a timm trunk: `linear` (a projection), `mlp` or `none`.
    pub timm_proj: String,
    pub timm_proj_bias: bool,
}

impl Default for VisionCfg {
    fn default() -> Self {
        VisionCfg {
            layers: Layers::Depth(12),
            width: 768,
            head_width: 64,
            mlp_ratio: 4.0,
            patch_size: 16,
            image_size: Side::Square(224),
            ls_init_value: None,
            patch_dropout: 0.0,
            attentional_pool: false,
            no_ln_pre: false,
            pos_embed_type: "learnable".into(),
            final_ln_after_pool: false,
            pool_type: "tok".into(),
            output_tokens: false,
            act_kwargs: ActKwargs::default(),
            norm_kwargs: NormKwargs::default(),
            block: BlockOptions::default(),
            timm_model_name: None,
            timm_pool: "avg".into(),
            timm_proj: "linear".into(),
            timm_proj_bias: false,
        }
    }
}

/// `text_cfg` (`CLIPTextCfg`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct TextCfg {
    pub context_length: usize,
    pub vocab_size: usize,
    pub width: usize,
    pub heads: usize,
    pub layers: usize,
    pub mlp_ratio: f64,
    pub ls_init_value: Option<f64>,
    pub embed_cls: bool,
    pub no_causal_mask: bool,
    pub pool_type: String,
    /// The end token `pool_type = "eos"` pools at.
    pub eos_id: u32,
    pub proj_bias: bool,
    pub proj_type: String,
    pub output_tokens: bool,
    pub act_kwargs: ActKwargs,
    pub norm_kwargs: NormKwargs,
    #[serde(flatten)]
    pub block: BlockOptions,
    pub hf_model_name: Option<String>,
    /// After a Hugging Face text tower: `mlp` (open_clip's default) or `linear`.
    pub hf_proj_type: String,
    /// How a Hugging Face text tower's states become one: `mean_pooler` (open_clip's default).
    pub hf_pooler_type: String,
}

impl Default for TextCfg {
    fn default() -> Self {
        TextCfg {
            context_length: 77,
            vocab_size: 49408,
            width: 512,
            heads: 8,
            layers: 12,
            mlp_ratio: 4.0,
            ls_init_value: None,
            embed_cls: false,
            no_causal_mask: false,
            pool_type: "argmax".into(),
            eos_id: 2,
            proj_bias: false,
            proj_type: "linear".into(),
            output_tokens: false,
            act_kwargs: ActKwargs::default(),
            norm_kwargs: NormKwargs::default(),
            block: BlockOptions::default(),
            hf_model_name: None,
            hf_proj_type: "mlp".into(),
            hf_pooler_type: "mean_pooler".into(),
        }
    }
}

/// One number for every channel, or one per channel.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum PerChannel {
    All(f64),
    Each(Vec<f64>),
}

/// `preprocess_cfg` (`PreprocessCfg`); its `size` is the model's image size, which open_clip
/// takes from `vision_cfg`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct PreprocessCfg {
    pub mode: String,
    pub mean: PerChannel,
    pub std: PerChannel,
    pub interpolation: String,
    pub resize_mode: String,
    pub fill_color: f64,
}

pub const OPENAI_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
pub const OPENAI_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

impl Default for PreprocessCfg {
    fn default() -> Self {
        PreprocessCfg {
            mode: "RGB".into(),
            mean: PerChannel::Each(OPENAI_MEAN.to_vec()),
            std: PerChannel::Each(OPENAI_STD.to_vec()),
            interpolation: "bicubic".into(),
            resize_mode: "shortest".into(),
            fill_color: 0.0,
        }
    }
}

/// A JSON object without its `null` members, at every depth.
fn without_nulls(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(m.iter().filter(|(_, x)| !x.is_null()).map(|(k, x)| (k.clone(), without_nulls(x))).collect()),
        other => other.clone(),
    }
}

/// Reads `section` (`model_cfg`, `preprocess_cfg`) into its struct; a value of the wrong type is
/// an error naming its key.
pub fn read<T: serde::de::DeserializeOwned>(v: &Value, section: &str) -> Result<T, ConfigError> {
    let v = without_nulls(v);
    serde_path_to_error::deserialize(v)
        .map_err(|e| ConfigError::Type { key: format!("{section}.{}", e.path()), message: e.inner().to_string() })
}
