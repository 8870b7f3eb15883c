//! Hugging Face `SiglipModel` directories: the config as align's model sizes and back, the
//! weights (the scale and bias stored as `[1]` tensors), the SentencePiece tokenizer and the image
//! processor.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::Tensor;
use serde_json::Value;

use super::clip::tower_processor;
use super::files::{model_max_length, HfDir};
use super::model_dir::HfLayout;
use super::tower_config::siglip_towers;
use super::towers::{tokenizer, tower_to_hf};
use crate::config::LossKind;
use crate::data::tokenizer::TextTokenizer;
use crate::io::format::config_error::ConfigError;
use crate::io::format::{ModelFiles, Usage};
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};
use crate::model::presets::{TemperatureKind, TextPooling};
use crate::model::siglip::SiglipTextConfig;

/// The Hugging Face `SiglipModel` format.
pub struct HfSiglip;

impl HfLayout for HfSiglip {
    const CLASS: &'static str = "SiglipModel";
    const DESCRIBE: &'static str = "Hugging Face SiglipModel";
    const MODEL_TYPE: &'static str = "siglip";

    fn spec_from(&self, config: &Value) -> std::result::Result<ModelSpec, String> {
        siglip_spec_from_hf(config).map_err(|e| e.to_string())
    }

    fn spec_in(&self, dir: &Path, config: &Value) -> std::result::Result<ModelSpec, String> {
        let mut spec = siglip_spec_from_hf(config).map_err(|e| e.to_string())?;
        if let TextSpec::Siglip(t) = &mut spec.text {
            t.masked = tokenizer_returns_mask(dir);
        }
        Ok(spec)
    }

    fn config_of(&self, spec: &ModelSpec) -> std::result::Result<Value, String> {
        siglip_spec_to_hf(spec)
    }

    fn tokenizer(&self, dir: &Path, spec: &ModelSpec, max_len: Option<usize>) -> Result<TextTokenizer> {
        tokenizer(dir, &spec.text, max_len)
    }

    fn usage(&self, dir: &Path, spec: &ModelSpec) -> Result<Usage> {
        Ok(Usage {
            image: tower_processor(dir, spec, "siglip")?,
            text_len: model_max_length(dir, spec, usize::MAX),
            loss: LossKind::Sigmoid,
        })
    }

    fn write(&self, m: &ModelFiles, out: &Path) -> Result<()> {
        export_hf_siglip(m, out)
    }
}

/// Whether transformers' tokenizer of the directory returns an attention mask, which
/// `SiglipModel` then applies: its `model_input_names` as `tokenizer_config.json` gives them, else
/// the class's (transformers 5 lists `attention_mask` for every tokenizer class, SigLIP's
/// included). Without a tokenizer config, none: the SentencePiece model as SigLIP was trained.
pub fn tokenizer_returns_mask(dir: &Path) -> bool {
    let Ok(c) = super::files::read_json(&dir.join("tokenizer_config.json")) else { return false };
    match c.get("model_input_names").and_then(Value::as_array) {
        Some(names) => names.iter().any(|n| n == "attention_mask"),
        None => true,
    }
}

/// A `SiglipConfig` JSON as align's model sizes.
pub fn siglip_spec_from_hf(c: &Value) -> Result<ModelSpec, ConfigError> {
    let (text, vision) = siglip_towers(c)?;
    let width = vision.encoder.width;
    joint_spec(ImageSpec::Siglip(vision), width, text).map_err(ConfigError::Invalid)
}

/// SigLIP's (and SigLIP 2's) joint model: no image projection, the text head as the projection,
/// a log-parameterised scale and a bias; the two towers' outputs must be as wide.
pub(super) fn joint_spec(image: ImageSpec, image_width: usize, text: SiglipTextConfig) -> Result<ModelSpec, String> {
    if image_width != text.projection {
        return Err(format!("the image embedding is {image_width} wide and the text embedding {}: they must match", text.projection));
    }
    Ok(ModelSpec {
        embed_dim: text.projection,
        image,
        text: TextSpec::Siglip(text),
        image_projection: false,
        text_projection_bias: false,
        text_projection_hidden: None,
        text_pooling: TextPooling::Cls,
        temperature: TemperatureKind::Clip,
        // SigLIP's initial scale and bias; the checkpoint's values replace them.
        temperature_init: 0.1,
        logit_bias: Some(-10.0),
    })
}

/// The weights with the scale and bias as the `[1]` tensors `SiglipModel` and `Siglip2Model` keep.
pub(super) fn with_vector_scales(tensors: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    let mut tensors = tensors.clone();
    for name in ["logit_scale", "logit_bias"] {
        if let Some(t) = tensors.get(name) {
            let one = t.reshape(1)?;
            tensors.insert(name.to_string(), one);
        }
    }
    Ok(tensors)
}

/// A `SiglipConfig` JSON for a model with SigLIP's towers, scale and bias.
pub fn siglip_spec_to_hf(spec: &ModelSpec) -> Result<Value, String> {
    let (ImageSpec::Siglip(v), TextSpec::Siglip(t)) = (&spec.image, &spec.text) else {
        return Err("SiglipModel has SigLIP's vision and text towers; this model does not".into());
    };
    if spec.image_projection || spec.temperature != TemperatureKind::Clip || spec.logit_bias.is_none() {
        return Err("SiglipModel has no image projection and scales by exp(logit_scale) plus a bias: this model differs".into());
    }
    let text = tower_to_hf(
        &t.encoder,
        serde_json::json!({"model_type": "siglip_text_model", "vocab_size": t.vocab_size, "max_position_embeddings": t.max_position,
            "projection_size": t.projection}),
    );
    let vision = tower_to_hf(
        &v.encoder,
        serde_json::json!({"model_type": "siglip_vision_model", "image_size": v.image_size, "patch_size": v.patch_size,
            "num_channels": 3, "vision_use_head": true}),
    );
    Ok(serde_json::json!({"architectures": ["SiglipModel"], "model_type": "siglip", "text_config": text, "vision_config": vision}))
}

/// Writes a model with SigLIP's architecture as a Hugging Face `SiglipModel` directory. The
/// tokenizer goes as a `tokenizer.json` (the SentencePiece pipeline with SigLIP's
/// canonicalisation) for `PreTrainedTokenizerFast`: align keeps no `spiece.model` in its
/// checkpoints, so `SiglipTokenizer` itself cannot be written.
fn export_hf_siglip(m: &ModelFiles, out: &Path) -> Result<()> {
    let mut config = siglip_spec_to_hf(m.spec).map_err(anyhow::Error::msg)?;
    if let Some(end) = m.tokenizer.inner().token_to_id(crate::data::tokenizer::SENTENCE_END) {
        config["text_config"]["eos_token_id"] = end.into();
        config["text_config"]["pad_token_id"] = end.into();
    }
    config["text_config"]["bos_token_id"] = Value::Null;
    let tensors = with_vector_scales(&m.tensors)?;
    let end = crate::data::tokenizer::SENTENCE_END;
    let masked = matches!(&m.spec.text, TextSpec::Siglip(t) if t.masked);
    let mut tokenizer_extra = if masked {
        serde_json::json!({"model_input_names": ["input_ids", "attention_mask"]})
    } else {
        // SigLIP was trained attending to its padding: the tokenizer must return no mask.
        serde_json::json!({"model_input_names": ["input_ids"]})
    };
    if m.tokenizer.pads_left() {
        tokenizer_extra["padding_side"] = "left".into();
    }
    HfDir {
        config,
        tensors,
        tokenizer_class: "PreTrainedTokenizerFast",
        specials: &[("eos_token", end), ("pad_token", end), ("unk_token", "<unk>")],
        tokenizer_extra,
        image_processor: "SiglipImageProcessor",
        processor: "SiglipProcessor",
    }
    .write(m.tokenizer, &m.usage.image, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_keys_take_transformers_defaults() {
        let s = siglip_spec_from_hf(&serde_json::json!({"text_config": {}, "vision_config": {}})).unwrap();
        assert_eq!((s.embed_dim, s.image.image_size(), s.logit_bias), (768, 224, Some(-10.0)));
        let e = siglip_spec_from_hf(&serde_json::json!({"vision_config": {}})).unwrap_err().to_string();
        assert!(e.contains("text_config"), "{e}");
    }
}
