//! Hugging Face `VisionTextDualEncoderModel` directories with a `ViTModel` and a `BertModel`:
//! loading one, and writing align's ViT + BERT models as one. That model embeds each side by its
//! pooler (`tanh(dense([CLS]))`) and projects without a bias, so align's model must have been
//! built the same way (`model.vit.pool = "pooler"`, `model.text_pooling = "pooler"`,
//! `model.text_projection_bias = false`, `model.temperature = "clip"`) to be written as one.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use candle_core::Device;
use candle_nn::VarMap;
use serde_json::{json, Value};

use super::files::{f32_tensors, load_prefixed, read_json, read_tokenizer, read_weights, HfDir, BERT_SPECIALS};
use super::layout::{bert_from_hf, bert_to_hf, vit_from_hf};
use crate::config::Config;
use crate::data::tokenizer::TextTokenizer;
use crate::data::transform::ImageConfig;
use crate::io::load::LoadedModel;
use crate::model::dual_encoder::{DualEncoder, ImageSpec, ModelSpec, TextSpec};
use crate::model::init::SeededVars;
use crate::model::presets::{ImagePooling, TemperatureKind, TextPooling, VitConfig};

/// A `VisionTextDualEncoderConfig` JSON with ViT and BERT towers as align's model sizes.
pub fn vtde_spec_from_hf(c: &Value) -> Result<ModelSpec, String> {
    let (v, t) = (c.get("vision_config").ok_or("no vision_config")?, c.get("text_config").ok_or("no text_config")?);
    let kind = |x: &Value| x.get("model_type").and_then(Value::as_str).unwrap_or("").to_string();
    if kind(v) != "vit" || kind(t) != "bert" {
        return Err(format!(
            "align reads VisionTextDualEncoderModel with ViT and BERT towers; this one has {:?} and {:?}",
            kind(v),
            kind(t)
        ));
    }
    if v.get("pooler_act").and_then(Value::as_str).is_some_and(|a| a != "tanh") {
        return Err("vision_config.pooler_act must be tanh".into());
    }
    let mut vision = vit_from_hf(v)?;
    vision.pool = ImagePooling::Pooler;
    let scale = c.get("logit_scale_init_value").and_then(Value::as_f64).unwrap_or(2.6592);
    Ok(ModelSpec {
        image: ImageSpec::Vit(vision),
        text: TextSpec::Bert(bert_from_hf(t)?),
        embed_dim: c.get("projection_dim").and_then(Value::as_u64).unwrap_or(512) as usize,
        image_projection: true,
        text_projection_bias: false,
        text_pooling: TextPooling::Pooler,
        temperature: TemperatureKind::Clip,
        temperature_init: (-scale).exp(),
        logit_bias: None,
    })
}

fn vit_to_hf(v: &VitConfig) -> Value {
    json!({
        "model_type": "vit", "image_size": v.image_size, "patch_size": v.patch_size, "num_channels": 3,
        "hidden_size": v.width, "num_hidden_layers": v.depth, "num_attention_heads": v.heads,
        "intermediate_size": v.mlp_dim, "layer_norm_eps": v.layer_norm_eps, "hidden_act": "gelu", "qkv_bias": true,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "pooler_act": "tanh", "pooler_output_size": v.width,
    })
}

/// The `VisionTextDualEncoderConfig` JSON of a model built as that model is.
pub fn vtde_spec_to_hf(spec: &ModelSpec) -> Result<Value, String> {
    let (ImageSpec::Vit(v), TextSpec::Bert(t)) = (&spec.image, &spec.text) else {
        return Err("VisionTextDualEncoderModel is written for ViT + BERT models".into());
    };
    if v.pool != ImagePooling::Pooler
        || spec.text_pooling != TextPooling::Pooler
        || !spec.image_projection
        || spec.text_projection_bias
        || spec.temperature != TemperatureKind::Clip
        || spec.logit_bias.is_some()
    {
        return Err("VisionTextDualEncoderModel embeds each side by its pooler and projects without a bias: train with model.vit.pool = \"pooler\", model.text_pooling = \"pooler\", model.text_projection_bias = false, model.image_projection = true and model.temperature = \"clip\" to export as one".into());
    }
    let mut text = bert_to_hf(t);
    text["model_type"] = "bert".into();
    Ok(json!({
        "architectures": ["VisionTextDualEncoderModel"],
        "model_type": "vision-text-dual-encoder",
        "projection_dim": spec.embed_dim,
        "logit_scale_init_value": (1.0 / spec.temperature_init).ln(),
        "vision_config": vit_to_hf(v),
        "text_config": text,
    }))
}

/// Loads a `VisionTextDualEncoderModel` directory (ViT + BERT) as an align model.
pub fn load_hf_vtde(dir: &Path, device: &Device) -> Result<LoadedModel> {
    let config_path = dir.join("config.json");
    let spec = vtde_spec_from_hf(&read_json(&config_path)?).map_err(|e| anyhow!("{}: {e}", config_path.display()))?;
    let TextSpec::Bert(bert) = &spec.text else { unreachable!("a VisionTextDualEncoder spec has a BERT text tower") };
    let max_len = read_json(&dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|c| c.get("model_max_length").and_then(Value::as_u64))
        .map_or(bert.max_position, |m| (m as usize).min(bert.max_position));
    let tokenizer = read_tokenizer(dir, max_len)?;
    let processor = dir.join("preprocessor_config.json");
    if !processor.is_file() {
        bail!("{} has no preprocessor_config.json: align takes a checkpoint's image preprocessing from it", dir.display());
    }
    let mut config = Config::default();
    config.data.image = super::preprocess::read_image_config(&processor)?;
    config.text.max_len = max_len;
    config.model.embed_dim = spec.embed_dim;
    let varmap = VarMap::new();
    let model = DualEncoder::new(&spec, SeededVars::builder(&varmap, 0, device))?;
    load_prefixed(&varmap, &read_weights(dir, device)?, "", "", &dir.display().to_string())?;
    Ok(LoadedModel { model, varmap, tokenizer, config, dir: dir.to_path_buf() })
}

/// Writes a ViT + BERT model built as `VisionTextDualEncoderModel` is as one, with its tokenizer
/// files and `preprocessor_config.json`.
pub fn export_hf_vtde(spec: &ModelSpec, vm: &VarMap, tokenizer: &TextTokenizer, image: &ImageConfig, out: &Path) -> Result<()> {
    let config = vtde_spec_to_hf(spec).map_err(anyhow::Error::msg)?;
    HfDir {
        config,
        tensors: f32_tensors(vm)?,
        tokenizer_class: "BertTokenizer",
        specials: &BERT_SPECIALS,
        tokenizer_extra: Value::Null,
        image_processor: "ViTImageProcessor",
        processor: "VisionTextDualEncoderProcessor",
    }
    .write(tokenizer, image, out)
}
