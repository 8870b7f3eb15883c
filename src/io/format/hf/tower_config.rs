//! The `config.json` of the transformers classes align reads, as types: `CLIPConfig` with its
//! `CLIPTextConfig` and `CLIPVisionConfig`, `SiglipConfig` with its `SiglipTextConfig` and
//! `SiglipVisionConfig`, `BertConfig`, `ViTConfig`, and `AlignConfig` with its `AlignVisionConfig`
//! (transformers' `configuration_*.py`), each with the class's defaults. transformers writes only the values that differ from those
//! into older files, so an absent key (or a `null`) takes the class default; keys align has no
//! use for are ignored. Each converts to align's sizes by checking every size against its bounds.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::io::format::config_error::ConfigError;
use crate::io::limits::{check_eps, check_key};
use crate::model::clip::{ClipTextConfig, ClipVisionConfig};
use crate::model::naflex::NaflexVisionConfig;
use crate::model::prenorm::{Act, EncoderConfig};
use crate::model::siglip::{SiglipTextConfig, SiglipVisionConfig};

/// The transformer encoder's fields, as every tower config names them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncoderFields {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub layer_norm_eps: f64,
    pub hidden_act: String,
}

impl EncoderFields {
    /// A class's defaults: width, MLP width, layers, heads, LayerNorm ε and activation.
    fn class(
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        eps: f64,
        act: &str,
    ) -> Self {
        EncoderFields {
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            layer_norm_eps: eps,
            hidden_act: act.into(),
        }
    }

    /// The encoder these fields describe, every size within its bounds.
    pub fn encoder(&self, ctx: &str) -> Result<EncoderConfig, ConfigError> {
        let e = EncoderConfig {
            width: size(self.hidden_size, ctx, "hidden_size")?,
            layers: size(self.num_hidden_layers, ctx, "num_hidden_layers")?,
            heads: size(self.num_attention_heads, ctx, "num_attention_heads")?,
            mlp_dim: size(self.intermediate_size, ctx, "intermediate_size")?,
            layer_norm_eps: self.layer_norm_eps,
            act: Act::from_hf(&self.hidden_act).map_err(|e| ConfigError::Invalid(format!("{ctx}: {e}")))?,
        };
        if !e.width.is_multiple_of(e.heads) {
            return Err(ConfigError::Invalid(format!(
                "{ctx}: hidden_size {} is not divisible by num_attention_heads {}",
                e.width, e.heads
            )));
        }
        check_eps(e.layer_norm_eps, &format!("{ctx}.layer_norm_eps"))?;
        Ok(e)
    }
}

fn size(n: usize, ctx: &str, key: &str) -> Result<usize, ConfigError> {
    Ok(check_key(n, ctx, key)?)
}

/// What joins the towers in `CLIPConfig` and `VisionTextDualEncoderConfig`: the embedding's
/// width and the initial logit scale (the log of 1/0.07).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JointFields {
    pub projection_dim: usize,
    pub logit_scale_init_value: f64,
}

impl Default for JointFields {
    fn default() -> Self {
        JointFields { projection_dim: 512, logit_scale_init_value: 2.6592 }
    }
}

impl JointFields {
    /// The embedding's width within bounds, and the initial temperature.
    pub fn sizes(&self) -> Result<(usize, f64), ConfigError> {
        if !self.logit_scale_init_value.is_finite() {
            return Err(ConfigError::Invalid(format!("config.logit_scale_init_value is {}", self.logit_scale_init_value)));
        }
        Ok((size(self.projection_dim, "config", "projection_dim")?, (-self.logit_scale_init_value).exp()))
    }
}

/// `CLIPTextConfig` besides its encoder's fields.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClipTextFields {
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub eos_token_id: usize,
}

impl Default for ClipTextFields {
    fn default() -> Self {
        ClipTextFields { vocab_size: 49408, max_position_embeddings: 77, eos_token_id: 49407 }
    }
}

/// `CLIPVisionConfig` besides its encoder's fields.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClipVisionFields {
    pub image_size: usize,
    pub patch_size: usize,
    pub num_channels: usize,
}

impl Default for ClipVisionFields {
    fn default() -> Self {
        ClipVisionFields { image_size: 224, patch_size: 32, num_channels: 3 }
    }
}

/// `SiglipTextConfig` besides its encoder's fields.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SiglipTextFields {
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    /// The text head's output width; transformers' default is the hidden size.
    pub projection_size: Option<usize>,
}

impl Default for SiglipTextFields {
    fn default() -> Self {
        SiglipTextFields { vocab_size: 32000, max_position_embeddings: 64, projection_size: None }
    }
}

/// `SiglipVisionConfig` besides its encoder's fields.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SiglipVisionFields {
    pub image_size: usize,
    pub patch_size: usize,
    pub num_channels: usize,
    /// Whether the tower ends in its attention-pooling head (the image embedding).
    pub vision_use_head: bool,
}

impl Default for SiglipVisionFields {
    fn default() -> Self {
        SiglipVisionFields { image_size: 224, patch_size: 16, num_channels: 3, vision_use_head: true }
    }
}

/// `Siglip2VisionConfig` besides its encoder's fields.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Siglip2VisionFields {
    pub num_patches: usize,
    pub patch_size: usize,
    pub num_channels: usize,
    pub vision_use_head: bool,
}

impl Default for Siglip2VisionFields {
    fn default() -> Self {
        Siglip2VisionFields { num_patches: 256, patch_size: 16, num_channels: 3, vision_use_head: true }
    }
}

/// `BertConfig` (and `AlignTextConfig`, whose defaults are the same).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BertFields {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub hidden_act: String,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f64,
    pub position_embedding_type: String,
}

impl Default for BertFields {
    fn default() -> Self {
        BertFields {
            vocab_size: 30522,
            hidden_size: 768,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            intermediate_size: 3072,
            hidden_act: "gelu".into(),
            max_position_embeddings: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            position_embedding_type: "absolute".into(),
        }
    }
}

/// `ViTConfig`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VitFields {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub hidden_act: String,
    pub layer_norm_eps: f64,
    pub image_size: usize,
    pub patch_size: usize,
    pub num_channels: usize,
}

impl Default for VitFields {
    fn default() -> Self {
        VitFields {
            hidden_size: 768,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            intermediate_size: 3072,
            hidden_act: "gelu".into(),
            layer_norm_eps: 1e-12,
            image_size: 224,
            patch_size: 16,
            num_channels: 3,
        }
    }
}

/// `AlignVisionConfig` (EfficientNet-B7 at 600 px by default, as transformers has it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AlignVisionFields {
    pub num_channels: usize,
    pub image_size: usize,
    pub width_coefficient: f64,
    pub depth_coefficient: f64,
    pub depth_divisor: usize,
    pub kernel_sizes: Vec<usize>,
    pub in_channels: Vec<usize>,
    pub out_channels: Vec<usize>,
    pub depthwise_padding: Vec<usize>,
    pub strides: Vec<usize>,
    pub num_block_repeats: Vec<usize>,
    pub expand_ratios: Vec<usize>,
    pub squeeze_expansion_ratio: f64,
    pub hidden_act: String,
    pub pooling_type: String,
    pub batch_norm_eps: f64,
    /// TensorFlow's decay (0.99), which transformers passes to PyTorch as the momentum.
    pub batch_norm_momentum: f64,
    pub drop_connect_rate: f64,
}

impl Default for AlignVisionFields {
    fn default() -> Self {
        AlignVisionFields {
            num_channels: 3,
            image_size: 600,
            width_coefficient: 2.0,
            depth_coefficient: 3.1,
            depth_divisor: 8,
            kernel_sizes: vec![3, 3, 5, 3, 5, 5, 3],
            in_channels: vec![32, 16, 24, 40, 80, 112, 192],
            out_channels: vec![16, 24, 40, 80, 112, 192, 320],
            depthwise_padding: Vec::new(),
            strides: vec![1, 2, 2, 2, 1, 2, 1],
            num_block_repeats: vec![1, 2, 2, 3, 3, 4, 1],
            expand_ratios: vec![1, 6, 6, 6, 6, 6, 6],
            squeeze_expansion_ratio: 0.25,
            hidden_act: "swish".into(),
            pooling_type: "mean".into(),
            batch_norm_eps: 1e-3,
            batch_norm_momentum: 0.99,
            drop_connect_rate: 0.2,
        }
    }
}

/// What `AlignConfig` adds to its towers: the embedding's width and the initial temperature.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AlignJointFields {
    pub projection_dim: usize,
    pub temperature_init_value: f64,
}

impl Default for AlignJointFields {
    fn default() -> Self {
        AlignJointFields { projection_dim: 640, temperature_init_value: 1.0 }
    }
}

/// `config` (a section called `ctx` in messages) over `T`'s defaults: its keys replace the
/// defaults', except `null`s; a value of the wrong type is an error naming its key.
pub fn read<T: Serialize + DeserializeOwned + Default>(config: &Value, ctx: &str) -> Result<T, ConfigError> {
    read_over(config, ctx, T::default())
}

/// [`read`] over the given defaults (an encoder's, which differ by class).
pub fn read_over<T: Serialize + DeserializeOwned>(config: &Value, ctx: &str, defaults: T) -> Result<T, ConfigError> {
    let Value::Object(given) = config else {
        return Err(ConfigError::Invalid(format!("{ctx} is not an object")));
    };
    let mut merged = serde_json::to_value(defaults).expect("a config's defaults serialise");
    let fields = merged.as_object_mut().expect("a config is an object");
    fields.extend(given.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())));
    serde_path_to_error::deserialize(merged)
        .map_err(|e| ConfigError::Type { key: format!("{ctx}.{}", e.path()), message: e.inner().to_string() })
}

/// A tower's sub-config, which must be there: transformers would silently build its default
/// tower, whose weights then do not fit.
pub fn sub<'a>(c: &'a Value, key: &str) -> Result<&'a Value, ConfigError> {
    c.get(key).filter(|v| v.is_object()).ok_or_else(|| ConfigError::Invalid(format!("config.json has no {key} (the tower's sizes)")))
}

/// A tower's sub-config read by its class: the class's own fields, and its encoder's over the
/// class's `encoder` defaults.
fn tower<T: Serialize + DeserializeOwned + Default>(
    c: &Value,
    key: &str,
    encoder: EncoderFields,
) -> Result<(T, EncoderConfig), ConfigError> {
    let v = sub(c, key)?;
    Ok((read(v, key)?, read_over(v, key, encoder)?.encoder(key)?))
}

fn three_channels(n: usize, ctx: &str) -> Result<(), ConfigError> {
    if n != 3 {
        return Err(ConfigError::Invalid(format!("{ctx}.num_channels must be 3")));
    }
    Ok(())
}

fn patches(image_size: usize, patch_size: usize) -> Result<(), ConfigError> {
    if !image_size.is_multiple_of(patch_size) {
        return Err(ConfigError::Invalid(format!("vision_config: image_size {image_size} is not a multiple of patch_size {patch_size}")));
    }
    Ok(())
}

/// CLIP's towers (`CLIPTextConfig`, `CLIPVisionConfig`) of a `CLIPConfig`.
pub fn clip_towers(c: &Value) -> Result<(ClipTextConfig, ClipVisionConfig), ConfigError> {
    let (t, encoder) = tower::<ClipTextFields>(c, "text_config", EncoderFields::class(512, 2048, 12, 8, 1e-5, "quick_gelu"))?;
    let text = ClipTextConfig {
        vocab_size: size(t.vocab_size, "text_config", "vocab_size")?,
        max_position: size(t.max_position_embeddings, "text_config", "max_position_embeddings")?,
        encoder,
        eos_token_id: size(t.eos_token_id, "text_config", "eos_token_id")? as u32,
        causal: true,
        pool: None,
    };
    let (v, encoder) = tower::<ClipVisionFields>(c, "vision_config", EncoderFields::class(768, 3072, 12, 12, 1e-5, "quick_gelu"))?;
    three_channels(v.num_channels, "vision_config")?;
    let vision = ClipVisionConfig::new(
        size(v.image_size, "vision_config", "image_size")?,
        size(v.patch_size, "vision_config", "patch_size")?,
        encoder,
    );
    patches(vision.image_size, vision.patch_size)?;
    Ok((text, vision))
}

/// SigLIP's towers (`SiglipTextConfig`, `SiglipVisionConfig`) of a `SiglipConfig`.
pub fn siglip_towers(c: &Value) -> Result<(SiglipTextConfig, SiglipVisionConfig), ConfigError> {
    let text = siglip_text(c)?;
    let (v, encoder) = tower::<SiglipVisionFields>(c, "vision_config", siglip_encoder())?;
    if !v.vision_use_head {
        return Err(ConfigError::Invalid(
            "vision_config.vision_use_head is false: SigLIP's image embedding is its pooling head's output".into(),
        ));
    }
    three_channels(v.num_channels, "vision_config")?;
    let vision = SiglipVisionConfig {
        image_size: size(v.image_size, "vision_config", "image_size")?,
        patch_size: size(v.patch_size, "vision_config", "patch_size")?,
        encoder,
    };
    patches(vision.image_size, vision.patch_size)?;
    Ok((text, vision))
}

fn siglip_encoder() -> EncoderFields {
    EncoderFields::class(768, 3072, 12, 12, 1e-6, "gelu_pytorch_tanh")
}

/// SigLIP 2's NaFlex towers (`Siglip2TextConfig`, `Siglip2VisionConfig`) of a `Siglip2Config`,
/// the vision tower taking up to `max_patches` patches (its processor's budget).
pub fn siglip2_towers(c: &Value, max_patches: usize) -> Result<(SiglipTextConfig, NaflexVisionConfig), ConfigError> {
    let text = siglip_text(c)?;
    let (v, encoder) = tower::<Siglip2VisionFields>(c, "vision_config", siglip_encoder())?;
    if !v.vision_use_head {
        return Err(ConfigError::Invalid(
            "vision_config.vision_use_head is false: SigLIP 2's image embedding is its pooling head's output".into(),
        ));
    }
    three_channels(v.num_channels, "vision_config")?;
    let positions = size(v.num_patches, "vision_config", "num_patches")?;
    let grid = (positions as f64).sqrt().round() as usize;
    if grid * grid != positions {
        return Err(ConfigError::Invalid(format!("vision_config.num_patches {positions} is not a square grid")));
    }
    let vision = NaflexVisionConfig {
        patch_size: size(v.patch_size, "vision_config", "patch_size")?,
        position_grid: grid,
        max_patches: size(max_patches, "preprocessor_config", "max_num_patches")?,
        encoder,
        patch_dropout: 0.0,
    };
    Ok((text, vision))
}

/// SigLIP's (and SigLIP 2's) text tower.
fn siglip_text(c: &Value) -> Result<SiglipTextConfig, ConfigError> {
    let (t, encoder) = tower::<SiglipTextFields>(c, "text_config", siglip_encoder())?;
    let text = SiglipTextConfig {
        vocab_size: size(t.vocab_size, "text_config", "vocab_size")?,
        max_position: size(t.max_position_embeddings, "text_config", "max_position_embeddings")?,
        projection: size(t.projection_size.unwrap_or(encoder.width), "text_config", "projection_size")?,
        encoder,
        masked: false,
    };
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// An old config names only what differs from the class: the rest is transformers' defaults.
    #[test]
    fn absent_keys_and_nulls_take_the_class_defaults() {
        let c = json!({"text_config": {"hidden_size": 64, "num_attention_heads": 4, "eos_token_id": null},
            "vision_config": {}, "projection_dim": null});
        let (t, v) = clip_towers(&c).unwrap();
        assert_eq!((t.encoder.width, t.encoder.heads, t.encoder.mlp_dim, t.eos_token_id, t.max_position), (64, 4, 2048, 49407, 77));
        assert_eq!((v.image_size, v.patch_size, v.encoder.width, v.encoder.act), (224, 32, 768, Act::QuickGelu));
        let j: JointFields = read(&c, "config").unwrap();
        assert_eq!((j.projection_dim, j.logit_scale_init_value), (512, 2.6592));
        let (t, v) = siglip_towers(&json!({"text_config": {}, "vision_config": {"image_size": 32, "patch_size": 8}})).unwrap();
        assert_eq!((t.vocab_size, t.max_position, t.projection, t.encoder.layer_norm_eps), (32000, 64, 768, 1e-6));
        assert_eq!((v.image_size, v.encoder.act), (32, Act::GeluTanh));
    }

    /// A wrong type names its key; sizes beyond bounds, missing towers and other channel counts are
    /// refused by name.
    #[test]
    fn bad_values_name_their_key() {
        let e = clip_towers(&json!({"text_config": {"vocab_size": "big"}, "vision_config": {}})).unwrap_err();
        assert_eq!(e.to_string(), "text_config.vocab_size: invalid type: string \"big\", expected usize");
        let e = siglip_towers(&json!({"text_config": {}, "vision_config": {"hidden_size": 1.5}})).unwrap_err().to_string();
        assert!(e.starts_with("vision_config.hidden_size:"), "{e}");
        let e = read::<JointFields>(&json!({"projection_dim": -1}), "config").unwrap_err().to_string();
        assert!(e.starts_with("config.projection_dim:"), "{e}");
        let e = siglip_towers(&json!({"text_config": {"vocab_size": 1u64 << 30}, "vision_config": {}})).unwrap_err().to_string();
        assert!(e.contains("text_config.vocab_size is 1073741824"), "{e}");
        assert!(siglip_towers(&json!({"text_config": {}})).unwrap_err().to_string().contains("no vision_config"));
        let e = clip_towers(&json!({"text_config": {}, "vision_config": {"num_channels": 1}})).unwrap_err().to_string();
        assert!(e.contains("vision_config.num_channels must be 3"), "{e}");
    }
}
