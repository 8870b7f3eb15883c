//! Hugging Face `CLIPModel` and `SiglipModel` directories: their configs as align's model sizes,
//! and loading one (weights, tokenizer, image preprocessing) as an align model.
//!
//! transformers writes only the values that differ from a config class's defaults into older
//! `config.json` files, so every key missing here takes the default of transformers' class.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use candle_core::Device;
use candle_nn::VarMap;
use serde_json::Value;

use super::files::{f32_tensors, load_prefixed, read_json, read_weights, HfDir};
use crate::config::Config;
use crate::data::tokenizer::TextTokenizer;
use crate::io::load::LoadedModel;
use crate::model::clip::{ClipTextConfig, ClipVisionConfig};
use crate::model::dual_encoder::{DualEncoder, ImageSpec, ModelSpec, TextSpec};
use crate::model::init::SeededVars;
use crate::model::prenorm::{Act, EncoderConfig};
use crate::model::presets::{TemperatureKind, TextPooling};
use crate::model::siglip::{SiglipTextConfig, SiglipVisionConfig};

fn usize_or(c: &Value, key: &str, default: usize, ctx: &str) -> Result<usize, String> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| format!("{ctx}.{key} is not an integer")),
    }
}

fn f64_or(c: &Value, key: &str, default: f64, ctx: &str) -> Result<f64, String> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().ok_or_else(|| format!("{ctx}.{key} is not a number")),
    }
}

/// A transformers class's encoder defaults.
struct EncoderDefaults {
    width: usize,
    layers: usize,
    heads: usize,
    mlp_dim: usize,
    eps: f64,
    act: &'static str,
}

fn encoder(c: &Value, d: EncoderDefaults, ctx: &str) -> Result<EncoderConfig, String> {
    if c.get("num_channels").and_then(Value::as_u64).is_some_and(|n| n != 3) {
        return Err(format!("{ctx}.num_channels must be 3"));
    }
    let act = c.get("hidden_act").and_then(Value::as_str).unwrap_or(d.act);
    let e = EncoderConfig {
        width: usize_or(c, "hidden_size", d.width, ctx)?,
        layers: usize_or(c, "num_hidden_layers", d.layers, ctx)?,
        heads: usize_or(c, "num_attention_heads", d.heads, ctx)?,
        mlp_dim: usize_or(c, "intermediate_size", d.mlp_dim, ctx)?,
        layer_norm_eps: f64_or(c, "layer_norm_eps", d.eps, ctx)?,
        act: Act::from_hf(act).map_err(|e| format!("{ctx}: {e}"))?,
    };
    if e.heads == 0 || !e.width.is_multiple_of(e.heads) {
        return Err(format!("{ctx}: hidden_size {} is not divisible by num_attention_heads {}", e.width, e.heads));
    }
    Ok(e)
}

fn sub<'a>(c: &'a Value, key: &str) -> &'a Value {
    static EMPTY: Value = Value::Null;
    c.get(key).unwrap_or(&EMPTY)
}

/// A `CLIPConfig` JSON as align's model sizes.
pub fn clip_spec_from_hf(c: &Value) -> Result<ModelSpec, String> {
    let (t, v) = (sub(c, "text_config"), sub(c, "vision_config"));
    let text = ClipTextConfig {
        vocab_size: usize_or(t, "vocab_size", 49408, "text_config")?,
        max_position: usize_or(t, "max_position_embeddings", 77, "text_config")?,
        encoder: encoder(
            t,
            EncoderDefaults { width: 512, layers: 12, heads: 8, mlp_dim: 2048, eps: 1e-5, act: "quick_gelu" },
            "text_config",
        )?,
        eos_token_id: usize_or(t, "eos_token_id", 49407, "text_config")? as u32,
    };
    let vision = ClipVisionConfig {
        image_size: usize_or(v, "image_size", 224, "vision_config")?,
        patch_size: usize_or(v, "patch_size", 32, "vision_config")?,
        encoder: encoder(
            v,
            EncoderDefaults { width: 768, layers: 12, heads: 12, mlp_dim: 3072, eps: 1e-5, act: "quick_gelu" },
            "vision_config",
        )?,
    };
    if vision.patch_size == 0 || !vision.image_size.is_multiple_of(vision.patch_size) {
        return Err(format!("vision_config: image_size {} is not a multiple of patch_size {}", vision.image_size, vision.patch_size));
    }
    Ok(ModelSpec {
        image: ImageSpec::Clip(vision),
        text: TextSpec::Clip(text),
        embed_dim: usize_or(c, "projection_dim", 512, "config")?,
        image_projection: true,
        text_projection_bias: false,
        text_pooling: TextPooling::Cls,
        temperature: TemperatureKind::Clip,
        temperature_init: 1.0 / f64_or(c, "logit_scale_init_value", 2.6592, "config")?.exp(),
        logit_bias: None,
    })
}

/// A `SiglipConfig` JSON as align's model sizes.
pub fn siglip_spec_from_hf(c: &Value) -> Result<ModelSpec, String> {
    let (t, v) = (sub(c, "text_config"), sub(c, "vision_config"));
    let text_encoder = encoder(
        t,
        EncoderDefaults { width: 768, layers: 12, heads: 12, mlp_dim: 3072, eps: 1e-6, act: "gelu_pytorch_tanh" },
        "text_config",
    )?;
    let text = SiglipTextConfig {
        vocab_size: usize_or(t, "vocab_size", 32000, "text_config")?,
        max_position: usize_or(t, "max_position_embeddings", 64, "text_config")?,
        projection: usize_or(t, "projection_size", text_encoder.width, "text_config")?,
        encoder: text_encoder,
    };
    if v.get("vision_use_head").and_then(Value::as_bool) == Some(false) {
        return Err("vision_config.vision_use_head is false: SigLIP's image embedding is its pooling head's output".into());
    }
    let vision = SiglipVisionConfig {
        image_size: usize_or(v, "image_size", 224, "vision_config")?,
        patch_size: usize_or(v, "patch_size", 16, "vision_config")?,
        encoder: encoder(
            v,
            EncoderDefaults { width: 768, layers: 12, heads: 12, mlp_dim: 3072, eps: 1e-6, act: "gelu_pytorch_tanh" },
            "vision_config",
        )?,
    };
    if vision.patch_size == 0 || !vision.image_size.is_multiple_of(vision.patch_size) {
        return Err(format!("vision_config: image_size {} is not a multiple of patch_size {}", vision.image_size, vision.patch_size));
    }
    if vision.encoder.width != text.projection {
        return Err(format!(
            "the image embedding is {} wide and the text embedding {}: they must match",
            vision.encoder.width, text.projection
        ));
    }
    Ok(ModelSpec {
        embed_dim: text.projection,
        image: ImageSpec::Siglip(vision),
        text: TextSpec::Siglip(text),
        image_projection: false,
        text_projection_bias: false,
        text_pooling: TextPooling::Cls,
        temperature: TemperatureKind::Clip,
        // SigLIP's initial scale and bias; the checkpoint's values replace them.
        temperature_init: 0.1,
        logit_bias: Some(-10.0),
    })
}

/// The padding token a tokenizer config names (a string, or an object with `content`).
fn pad_token(dir: &Path) -> Option<String> {
    ["tokenizer_config.json", "special_tokens_map.json"].iter().find_map(|f| {
        let c = read_json(&dir.join(f)).ok()?;
        match c.get("pad_token")? {
            Value::String(s) => Some(s.clone()),
            v => v.get("content")?.as_str().map(str::to_string),
        }
    })
}

/// The tokenizer of a `CLIPModel` or `SiglipModel` directory, cutting texts at `max_len` tokens.
pub fn read_hf_tokenizer(dir: &Path, max_len: usize) -> Result<TextTokenizer> {
    tokenizer(dir, &hf_spec(dir)?.text, Some(max_len))
}

/// The sizes of a `CLIPModel` or `SiglipModel` directory.
pub fn hf_spec(dir: &Path) -> Result<ModelSpec> {
    let config_path = dir.join("config.json");
    let config = read_json(&config_path)?;
    match config.get("model_type").and_then(Value::as_str) {
        Some("clip") => clip_spec_from_hf(&config),
        Some("siglip") => siglip_spec_from_hf(&config),
        other => Err(format!("model_type {other:?} is neither \"clip\" nor \"siglip\"")),
    }
    .map_err(|e| anyhow!("{}: {e}", config_path.display()))
}

/// The model of a `CLIPModel` or `SiglipModel` directory with its weights, without its
/// tokenizer and preprocessing.
pub fn hf_model(dir: &Path, device: &Device) -> Result<(DualEncoder, VarMap)> {
    let spec = hf_spec(dir)?;
    let varmap = VarMap::new();
    let model = DualEncoder::new(&spec, SeededVars::builder(&varmap, 0, device))?;
    load_prefixed(&varmap, &read_weights(dir, device)?, "", "", &dir.display().to_string())?;
    Ok((model, varmap))
}

/// The checkpoint's tokenizer, padded as its tokenizer config says to `model_max_length`: CLIP's
/// `tokenizer.json`, or SigLIP's SentencePiece `spiece.model` with SigLIP's text canonicalisation
/// (lowercase, ASCII punctuation deleted) and `</s>` appended.
fn tokenizer(dir: &Path, text: &TextSpec, max_len: Option<usize>) -> Result<TextTokenizer> {
    let tokenizer_config = read_json(&dir.join("tokenizer_config.json")).ok();
    let (positions, default_pad) = match text {
        TextSpec::Clip(t) => (t.max_position, crate::data::tokenizer::CLIP_END),
        TextSpec::Siglip(t) => (t.max_position, crate::data::tokenizer::SENTENCE_END),
        TextSpec::Bert(_) => bail!("{}: a BERT text tower in a CLIP or SigLIP directory", dir.display()),
    };
    let max_len = max_len.unwrap_or_else(|| {
        tokenizer_config
            .as_ref()
            .and_then(|c| c.get("model_max_length").and_then(Value::as_u64))
            .map_or(positions, |m| (m as usize).min(positions))
    });
    let pad = pad_token(dir).unwrap_or_else(|| default_pad.to_string());
    let (inner, from) = match text {
        // SigLIP's own tokenizer is its SentencePiece model; a tokenizer.json alone (as align
        // exports SigLIP) carries the whole pipeline, canonicalisation included.
        TextSpec::Siglip(_) if dir.join("spiece.model").is_file() || !dir.join("tokenizer.json").is_file() => {
            let path = dir.join("spiece.model");
            if !path.is_file() {
                bail!("{} has neither spiece.model nor tokenizer.json: SigLIP checkpoints ship their SentencePiece model", dir.display());
            }
            let lowercase = tokenizer_config.as_ref().and_then(|c| c.get("do_lower_case").and_then(Value::as_bool)).unwrap_or(true);
            let canonical = crate::data::sentencepiece::Canonical { lowercase, strip_punctuation: true };
            (crate::data::sentencepiece::read_unigram(&path, canonical, crate::data::tokenizer::SENTENCE_END)?, path)
        }
        _ => {
            let path = dir.join("tokenizer.json");
            if !path.is_file() {
                bail!("{} has no tokenizer.json (CLIP checkpoints ship one; align reads the fast tokenizer's file)", dir.display());
            }
            (tokenizers::Tokenizer::from_file(&path).map_err(|e| anyhow!("loading {}: {e}", path.display()))?, path)
        }
    };
    TextTokenizer::with_pad_token(inner, max_len, &pad).map_err(|e| anyhow!("{}: {e}", from.display()))
}

/// Loads a Hugging Face `CLIPModel` or `SiglipModel` directory as an align model: its weights,
/// its tokenizer and its `preprocessor_config.json`.
pub fn load_hf_clip(dir: &Path, device: &Device) -> Result<LoadedModel> {
    let (model, varmap) = hf_model(dir, device)?;
    let spec = &model.spec;
    let tokenizer = tokenizer(dir, &spec.text, None)?;
    let max_len = tokenizer.max_len();
    let processor = dir.join("preprocessor_config.json");
    if !processor.is_file() {
        bail!("{} has no preprocessor_config.json: align takes a checkpoint's image preprocessing from it", dir.display());
    }
    let mut config = Config::default();
    config.data.image = super::preprocess::read_image_config(&processor)?;
    if config.data.image.image_size != spec.image.image_size() {
        bail!(
            "{} crops to {} px but the vision tower takes {} px",
            processor.display(),
            config.data.image.image_size,
            spec.image.image_size()
        );
    }
    config.text.max_len = max_len;
    config.model.embed_dim = spec.embed_dim;
    Ok(LoadedModel { model, varmap, tokenizer, config, dir: dir.to_path_buf() })
}

/// A tower's sub-config: the encoder's sizes and activation, with the tower's own `fields`.
fn tower_to_hf(e: &EncoderConfig, fields: Value) -> Value {
    let mut j = serde_json::json!({"hidden_size": e.width, "num_hidden_layers": e.layers, "num_attention_heads": e.heads,
        "intermediate_size": e.mlp_dim, "layer_norm_eps": e.layer_norm_eps, "hidden_act": e.act.hf_name()});
    if let (Some(j), Value::Object(fields)) = (j.as_object_mut(), fields) {
        j.extend(fields);
    }
    j
}

/// A `CLIPConfig` JSON for a model with CLIP's towers, projections and temperature.
pub fn clip_spec_to_hf(spec: &ModelSpec) -> Result<Value, String> {
    let (ImageSpec::Clip(v), TextSpec::Clip(t)) = (&spec.image, &spec.text) else {
        return Err("CLIPModel has CLIP's vision and text towers; this model does not".into());
    };
    if !spec.image_projection || spec.text_projection_bias || spec.temperature != TemperatureKind::Clip || spec.logit_bias.is_some() {
        return Err("CLIPModel projects both towers without a bias and scales by exp(logit_scale): this model differs".into());
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
pub fn export_hf_siglip(
    spec: &ModelSpec,
    vm: &VarMap,
    tokenizer: &TextTokenizer,
    image: &crate::data::transform::ImageConfig,
    out: &Path,
) -> Result<()> {
    let mut config = siglip_spec_to_hf(spec).map_err(anyhow::Error::msg)?;
    if let Some(end) = tokenizer.inner().token_to_id(crate::data::tokenizer::SENTENCE_END) {
        config["text_config"]["eos_token_id"] = end.into();
        config["text_config"]["pad_token_id"] = end.into();
    }
    config["text_config"]["bos_token_id"] = Value::Null;
    let mut tensors = f32_tensors(vm)?;
    // SiglipModel keeps its scale and bias as [1] tensors.
    for name in ["logit_scale", "logit_bias"] {
        if let Some(t) = tensors.get(name) {
            let one = t.reshape(1)?;
            tensors.insert(name.to_string(), one);
        }
    }
    let end = crate::data::tokenizer::SENTENCE_END;
    HfDir {
        config,
        tensors,
        tokenizer_class: "PreTrainedTokenizerFast",
        specials: &[("eos_token", end), ("pad_token", end), ("unk_token", "<unk>")],
        // SigLIP was trained attending to its padding: the tokenizer must return no mask.
        tokenizer_extra: serde_json::json!({"model_input_names": ["input_ids"]}),
        image_processor: "SiglipImageProcessor",
        processor: "SiglipProcessor",
    }
    .write(tokenizer, image, out)
}

/// Writes a model with CLIP's architecture as a Hugging Face `CLIPModel` directory: config,
/// weights, the tokenizer files and the processor config, for `CLIPModel.from_pretrained`,
/// `AutoProcessor` and the zero-shot pipeline.
pub fn export_hf_clip(
    spec: &ModelSpec,
    vm: &VarMap,
    tokenizer: &TextTokenizer,
    image: &crate::data::transform::ImageConfig,
    out: &Path,
) -> Result<()> {
    let mut config = clip_spec_to_hf(spec).map_err(anyhow::Error::msg)?;
    // The special tokens' ids, which transformers checks against the vocabulary.
    let id = |t: &str| tokenizer.inner().token_to_id(t);
    if let (Some(bos), Some(end)) = (id("<|startoftext|>"), id(crate::data::tokenizer::CLIP_END)) {
        config["text_config"]["bos_token_id"] = bos.into();
        config["text_config"]["pad_token_id"] = end.into();
    }
    let end = crate::data::tokenizer::CLIP_END;
    HfDir {
        config,
        tensors: f32_tensors(vm)?,
        tokenizer_class: "CLIPTokenizer",
        specials: &[("bos_token", "<|startoftext|>"), ("eos_token", end), ("pad_token", end), ("unk_token", end)],
        tokenizer_extra: Value::Null,
        image_processor: "CLIPImageProcessor",
        processor: "CLIPProcessor",
    }
    .write(tokenizer, image, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_keys_take_transformers_defaults() {
        let spec = clip_spec_from_hf(&serde_json::json!({"text_config": {}, "vision_config": {"patch_size": 16}})).unwrap();
        let (ImageSpec::Clip(v), TextSpec::Clip(t)) = (&spec.image, &spec.text) else { panic!("{spec:?}") };
        assert_eq!((v.image_size, v.patch_size, v.encoder.width, v.encoder.act), (224, 16, 768, Act::QuickGelu));
        assert_eq!((t.vocab_size, t.max_position, t.encoder.width, t.eos_token_id), (49408, 77, 512, 49407));
        assert_eq!(spec.embed_dim, 512);
        assert!((spec.temperature_init - 0.07).abs() < 1e-4, "{}", spec.temperature_init);
        let s = siglip_spec_from_hf(&serde_json::json!({})).unwrap();
        assert_eq!((s.embed_dim, s.image.image_size(), s.logit_bias), (768, 224, Some(-10.0)));
        let e = clip_spec_from_hf(&serde_json::json!({"text_config": {"hidden_act": "relu"}})).unwrap_err();
        assert!(e.contains("text_config") && e.contains("relu"), "{e}");
    }
}
