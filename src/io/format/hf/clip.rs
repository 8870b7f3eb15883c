//! Hugging Face `CLIPModel` directories: the config as align's model sizes and back, the weights
//! (align's CLIP towers use transformers' names), the tokenizer and the image processor.

use std::path::Path;

use anyhow::{bail, Result};
use serde_json::Value;

use super::files::{model_max_length, HfDir};
use super::model_dir::HfLayout;
use super::preprocess::read_dir_image_config;
use super::tower_config::{clip_towers, read, JointFields};
use super::towers::{tokenizer, tower_to_hf};
use crate::config::LossKind;
use crate::data::tokenizer::TextTokenizer;
use crate::io::format::config_error::ConfigError;
use crate::io::format::{ModelFiles, Usage};
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};
use crate::model::presets::{TemperatureKind, TextPooling};

/// The Hugging Face `CLIPModel` format.
pub struct HfClip;

impl HfLayout for HfClip {
    const CLASS: &'static str = "CLIPModel";
    const DESCRIBE: &'static str = "Hugging Face CLIPModel";
    const MODEL_TYPE: &'static str = "clip";

    fn spec_from(&self, config: &Value) -> std::result::Result<ModelSpec, String> {
        clip_spec_from_hf(config).map_err(|e| e.to_string())
    }

    fn config_of(&self, spec: &ModelSpec) -> std::result::Result<Value, String> {
        clip_spec_to_hf(spec)
    }

    fn tokenizer(&self, dir: &Path, spec: &ModelSpec, max_len: Option<usize>) -> Result<TextTokenizer> {
        tokenizer(dir, &spec.text, max_len)
    }

    fn usage(&self, dir: &Path, spec: &ModelSpec) -> Result<Usage> {
        Ok(Usage { image: tower_processor(dir, spec, "clip")?, text_len: model_max_length(dir, spec, usize::MAX), loss: LossKind::Softmax })
    }

    fn write(&self, m: &ModelFiles, out: &Path) -> Result<()> {
        export_hf_clip(m, out)
    }
}

/// The image preprocessing of a CLIP or SigLIP directory, which must crop to the size its vision
/// tower takes.
pub(crate) fn tower_processor(dir: &Path, spec: &ModelSpec, model_type: &str) -> Result<crate::data::transform::ImageConfig> {
    let Some(image) = read_dir_image_config(dir, Some(model_type))? else {
        bail!("{} has no preprocessor_config.json: align takes a checkpoint's image preprocessing from it", dir.display());
    };
    if image.image_size != spec.image.image_size() {
        bail!(
            "{}: the image processor gives {} px images but the vision tower takes {} px",
            dir.display(),
            image.image_size,
            spec.image.image_size()
        );
    }
    Ok(image)
}

/// A `CLIPConfig` JSON as align's model sizes.
pub fn clip_spec_from_hf(c: &Value) -> Result<ModelSpec, ConfigError> {
    let (text, vision) = clip_towers(c)?;
    let (embed_dim, temperature_init) = read::<JointFields>(c, "config")?.sizes()?;
    Ok(ModelSpec {
        image: ImageSpec::Clip(vision),
        text: TextSpec::Clip(text),
        embed_dim,
        image_projection: true,
        text_projection_bias: false,
        text_projection_hidden: None,
        text_pooling: TextPooling::Cls,
        temperature: TemperatureKind::Clip,
        temperature_init,
        logit_bias: None,
    })
}

/// A `CLIPConfig` JSON for a model with CLIP's towers, projections and temperature.
pub fn clip_spec_to_hf(spec: &ModelSpec) -> Result<Value, String> {
    let (ImageSpec::Clip(v), TextSpec::Clip(t)) = (&spec.image, &spec.text) else {
        return Err("CLIPModel has CLIP's vision and text towers; this model does not".into());
    };
    if !spec.image_projection
        || spec.text_projection_bias
        || spec.text_projection_hidden.is_some()
        || spec.temperature != TemperatureKind::Clip
        || spec.logit_bias.is_some()
    {
        return Err("CLIPModel projects both towers without a bias and scales by exp(logit_scale): this model differs".into());
    }
    if !v.is_transformers_clip() {
        return Err("CLIPVisionModel has a LayerNorm before its encoder and pools the class token; this tower (open_clip's no_ln_pre or average pooling) does not".into());
    }
    if !t.is_transformers_clip() || t.pool.is_some_and(|p| p == crate::model::clip::TextPool::Eos && t.eos_token_id == 2) {
        return Err("CLIPTextModel is causal and pools at the end-of-text token; this text tower (open_clip's no_causal_mask or first/last pooling) is not".into());
    }
    let text = tower_to_hf(
        &t.encoder,
        serde_json::json!({"model_type": "clip_text_model", "vocab_size": t.vocab_size, "max_position_embeddings": t.max_position,
            "eos_token_id": t.eos_token_id, "projection_dim": spec.embed_dim}),
    );
    let vision = tower_to_hf(
        &v.encoder,
        serde_json::json!({"model_type": "clip_vision_model", "image_size": v.image_size, "patch_size": v.patch_size,
            "num_channels": 3, "projection_dim": spec.embed_dim}),
    );
    Ok(serde_json::json!({
        "architectures": ["CLIPModel"],
        "model_type": "clip",
        "projection_dim": spec.embed_dim,
        "logit_scale_init_value": (1.0 / spec.temperature_init).ln(),
        "text_config": text,
        "vision_config": vision,
    }))
}

/// Writes a model with CLIP's architecture as a Hugging Face `CLIPModel` directory: config,
/// weights, the tokenizer files and the processor config, for `CLIPModel.from_pretrained`,
/// `AutoProcessor` and the zero-shot pipeline.
fn export_hf_clip(m: &ModelFiles, out: &Path) -> Result<()> {
    let mut config = clip_spec_to_hf(m.spec).map_err(anyhow::Error::msg)?;
    // The special tokens' ids, which transformers checks against the vocabulary.
    let id = |t: &str| m.tokenizer.inner().token_to_id(t);
    if let (Some(bos), Some(end)) = (id("<|startoftext|>"), id(crate::data::tokenizer::CLIP_END)) {
        config["text_config"]["bos_token_id"] = bos.into();
        config["text_config"]["pad_token_id"] = end.into();
    }
    let end = crate::data::tokenizer::CLIP_END;
    HfDir {
        config,
        tensors: m.tensors.clone(),
        tokenizer_class: "CLIPTokenizer",
        specials: &[("bos_token", "<|startoftext|>"), ("eos_token", end), ("pad_token", end), ("unk_token", end)],
        tokenizer_extra: Value::Null,
        image_processor: "CLIPImageProcessor",
        processor: "CLIPProcessor",
    }
    .write(m.tokenizer, &m.usage.image, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::prenorm::Act;

    #[test]
    fn missing_keys_take_transformers_defaults() {
        let spec = clip_spec_from_hf(&serde_json::json!({"text_config": {}, "vision_config": {"patch_size": 16}})).unwrap();
        let (ImageSpec::Clip(v), TextSpec::Clip(t)) = (&spec.image, &spec.text) else { panic!("{spec:?}") };
        assert_eq!((v.image_size, v.patch_size, v.encoder.width, v.encoder.act), (224, 16, 768, Act::QuickGelu));
        assert_eq!((t.vocab_size, t.max_position, t.encoder.width, t.eos_token_id), (49408, 77, 512, 49407));
        assert_eq!(spec.embed_dim, 512);
        assert!((spec.temperature_init - 0.07).abs() < 1e-4, "{}", spec.temperature_init);
        let e =
            clip_spec_from_hf(&serde_json::json!({"text_config": {"hidden_act": "relu"}, "vision_config": {}})).unwrap_err().to_string();
        assert!(e.contains("text_config") && e.contains("relu"), "{e}");
    }

    /// Broken configs are errors naming the field, never a default tower or an allocation of
    /// whatever size the file says.
    #[test]
    fn broken_configs_name_the_field() {
        let cases = [
            (serde_json::json!({"text_config": {}}), "vision_config"),
            (serde_json::json!({"text_config": {}, "vision_config": {}, "projection_dim": "sixteen"}), "projection_dim"),
            (
                serde_json::json!({"text_config": {}, "vision_config": {}, "projection_dim": 1_000_000_000u64}),
                "projection_dim is 1000000000",
            ),
            (serde_json::json!({"text_config": {"vocab_size": 1_000_000_000_000u64}, "vision_config": {}}), "text_config.vocab_size"),
            (serde_json::json!({"text_config": {}, "vision_config": {"image_size": 1_000_000}}), "vision_config.image_size"),
            (serde_json::json!({"text_config": {"layer_norm_eps": -1.0}, "vision_config": {}}), "layer_norm_eps"),
            (serde_json::json!({"text_config": {"num_attention_heads": 0}, "vision_config": {}}), "num_attention_heads is 0"),
        ];
        for (c, want) in cases {
            let e = clip_spec_from_hf(&c).unwrap_err().to_string();
            assert!(e.contains(want), "{c}: {e}");
        }
    }
}
