//! Hugging Face `VisionTextDualEncoderModel` directories with a `ViTModel` and a `BertModel`:
//! loading one, and writing align's ViT + BERT models as one. That model embeds each side by its
//! pooler (`tanh(dense([CLS]))`) and projects without a bias, so align's model must have been
//! built the same way (`model.vit.pool = "pooler"`, `model.text_pooling = "pooler"`,
//! `model.text_projection_bias = false`, `model.temperature = "clip"`) to be written as one.

use std::path::Path;

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::files::{model_max_length, read_tokenizer, HfDir, BERT_SPECIALS};
use super::layout::{bert_from_hf, bert_to_hf, vit_from_hf};
use super::model_dir::HfLayout;
use super::preprocess::read_dir_image_config;
use super::tower_config::{read, JointFields};
use crate::config::LossKind;
use crate::data::tokenizer::TextTokenizer;
use crate::io::format::{ModelFiles, Usage};
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};
use crate::model::presets::{ImagePooling, TemperatureKind, TextPooling, VitConfig};

/// The Hugging Face `VisionTextDualEncoderModel` format (ViT + BERT).
pub struct HfVtde;

impl HfLayout for HfVtde {
    const CLASS: &'static str = "VisionTextDualEncoderModel";
    const DESCRIBE: &'static str = "Hugging Face VisionTextDualEncoderModel: ViT + BERT";
    const MODEL_TYPE: &'static str = "vision-text-dual-encoder";

    fn spec_from(&self, config: &Value) -> std::result::Result<ModelSpec, String> {
        vtde_spec_from_hf(config)
    }

    fn config_of(&self, spec: &ModelSpec) -> std::result::Result<Value, String> {
        vtde_spec_to_hf(spec)
    }

    fn tokenizer(&self, dir: &Path, spec: &ModelSpec, max_len: Option<usize>) -> Result<TextTokenizer> {
        read_tokenizer(dir, max_len.unwrap_or_else(|| model_max_length(dir, spec, usize::MAX)))
    }

    fn usage(&self, dir: &Path, spec: &ModelSpec) -> Result<Usage> {
        let Some(image) = read_dir_image_config(dir, Some("vit"))? else {
            bail!("{} has no preprocessor_config.json: align takes a checkpoint's image preprocessing from it", dir.display());
        };
        if image.image_size != spec.image.image_size() {
            bail!(
                "{}: the image processor gives {} px images but the ViT takes {} px",
                dir.display(),
                image.image_size,
                spec.image.image_size()
            );
        }
        Ok(Usage { image, text_len: model_max_length(dir, spec, usize::MAX), loss: LossKind::Softmax })
    }

    fn write(&self, m: &ModelFiles, out: &Path) -> Result<()> {
        let config = vtde_spec_to_hf(m.spec).map_err(anyhow::Error::msg)?;
        HfDir {
            config,
            tensors: m.tensors.clone(),
            tokenizer_class: "BertTokenizer",
            specials: &BERT_SPECIALS,
            tokenizer_extra: Value::Null,
            image_processor: "ViTImageProcessor",
            processor: "VisionTextDualEncoderProcessor",
        }
        .write(m.tokenizer, &m.usage.image, out)
    }
}

/// A `VisionTextDualEncoderConfig` JSON with ViT and BERT towers as align's model sizes.
pub fn vtde_spec_from_hf(c: &Value) -> Result<ModelSpec, String> {
    let sub = |key: &str| super::tower_config::sub(c, key).map_err(|e| e.to_string());
    let (v, t) = (sub("vision_config")?, sub("text_config")?);
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
    let (embed_dim, temperature_init) = read::<JointFields>(c, "config").and_then(|j| j.sizes()).map_err(|e| e.to_string())?;
    Ok(ModelSpec {
        image: ImageSpec::Vit(vision),
        text: TextSpec::Bert(bert_from_hf(t)?),
        embed_dim,
        image_projection: true,
        text_projection_bias: false,
        text_projection_hidden: None,
        text_pooling: TextPooling::Pooler,
        temperature: TemperatureKind::Clip,
        temperature_init,
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
    super::layout::plain_bert_text(spec, "VisionTextDualEncoderModel")?;
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
