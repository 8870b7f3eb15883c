//! Hugging Face `Siglip2Model` directories (SigLIP 2's NaFlex checkpoints,
//! `google/siglip2-*-naflex`): the config as align's model sizes and back, the processor's patch
//! budget (`Siglip2ImageProcessor`'s `patch_size` and `max_num_patches`), and the Gemma
//! tokenizer as `Siglip2Processor` runs it (lower-cased first).

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use serde_json::{json, Value};

use super::files::{model_max_length, read_json, HfDir};
use super::model_dir::HfLayout;
use super::siglip::{joint_spec, tokenizer_returns_mask, with_vector_scales};
use super::tower_config::siglip2_towers;
use super::towers::{tokenizer, tower_to_hf};
use crate::config::LossKind;
use crate::data::tokenizer::TextTokenizer;
use crate::data::transform::{ImageConfig, Interpolation, Naflex};
use crate::io::format::{ModelFiles, Usage};
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};
use crate::model::presets::TemperatureKind;

/// The Hugging Face `Siglip2Model` format.
pub struct HfSiglip2;

const PROCESSOR: &str = "preprocessor_config.json";

/// `Siglip2ImageProcessor`'s settings: transformers' class defaults where a key is absent.
fn processor(dir: &Path) -> Result<(Naflex, ImageConfig)> {
    let path = dir.join(PROCESSOR);
    let p = if path.is_file() { read_json(&path)? } else { json!({}) };
    let what = || path.display().to_string();
    let kind = p.get("image_processor_type").and_then(Value::as_str).unwrap_or("Siglip2ImageProcessor");
    if kind.trim_end_matches("Fast") != "Siglip2ImageProcessor" {
        anyhow::bail!("{}: a Siglip2Model's images go through Siglip2ImageProcessor, not {kind}", what());
    }
    let number = |key: &str, default: u64| -> Result<usize> {
        match p.get(key) {
            None | Some(Value::Null) => Ok(default as usize),
            Some(v) => v.as_u64().map(|n| n as usize).with_context(|| format!("{}: {key} is {v}, not a whole number", what())),
        }
    };
    let naflex = Naflex { patch_size: number("patch_size", 16)?, max_num_patches: number("max_num_patches", 256)? };
    let three = |key: &str| -> Result<[f32; 3]> {
        match p.get(key) {
            None | Some(Value::Null) => Ok([0.5; 3]),
            Some(v) => {
                let xs: Vec<f32> = serde_json::from_value(v.clone()).with_context(|| format!("{}: {key} is {v}", what()))?;
                xs.try_into().map_err(|_| anyhow!("{}: {key} is not three numbers", what()))
            }
        }
    };
    let interpolation = match number("resample", 2)? {
        2 => Interpolation::Bilinear,
        3 => Interpolation::Bicubic,
        r => anyhow::bail!("{}: resample {r}: align resizes NaFlex images bilinear (2) or bicubic (3)", what()),
    };
    if p.get("do_resize") == Some(&Value::Bool(false)) || p.get("do_normalize") == Some(&Value::Bool(false)) {
        anyhow::bail!("{}: do_resize and do_normalize must stay on for NaFlex patches", what());
    }
    let image = ImageConfig {
        image_size: naflex.patch_size,
        resize: naflex.patch_size,
        mean: three("image_mean")?,
        std: three("image_std")?,
        interpolation,
        // Siglip2ImageProcessor refuses images that are not RGB; transformers' load_image, the
        // usual way to one, converts with PIL, which drops the alpha channel.
        naflex: Some(naflex),
        ..ImageConfig::default()
    };
    image.validate().map_err(|e| anyhow!("{}: {e}", what()))?;
    Ok((naflex, image))
}

impl HfLayout for HfSiglip2 {
    const CLASS: &'static str = "Siglip2Model";
    const DESCRIBE: &'static str = "Hugging Face Siglip2Model (NaFlex)";
    const MODEL_TYPE: &'static str = "siglip2";

    fn spec_from(&self, config: &Value) -> std::result::Result<ModelSpec, String> {
        spec(config, 256, false)
    }

    fn spec_in(&self, dir: &Path, config: &Value) -> std::result::Result<ModelSpec, String> {
        let (naflex, _) = processor(dir).map_err(|e| format!("{e:#}"))?;
        spec(config, naflex.max_num_patches, tokenizer_returns_mask(dir))
    }

    fn config_of(&self, spec: &ModelSpec) -> std::result::Result<Value, String> {
        config_of(spec)
    }

    fn tokenizer(&self, dir: &Path, spec: &ModelSpec, max_len: Option<usize>) -> Result<TextTokenizer> {
        // Siglip2Processor's tokenizer lower-cases before Gemma's normaliser, as SigLIP 2 was
        // trained.
        tokenizer(dir, &spec.text, max_len)?.lowercased()
    }

    fn usage(&self, dir: &Path, spec: &ModelSpec) -> Result<Usage> {
        let (naflex, image) = processor(dir)?;
        if let ImageSpec::Naflex(v) = &spec.image {
            if v.patch_size != naflex.patch_size {
                anyhow::bail!(
                    "{}: patch_size {} but the vision tower's patches are {} px",
                    dir.join(PROCESSOR).display(),
                    naflex.patch_size,
                    v.patch_size
                );
            }
        }
        Ok(Usage { image, text_len: model_max_length(dir, spec, usize::MAX), loss: LossKind::Sigmoid })
    }

    fn write(&self, m: &ModelFiles, out: &Path) -> Result<()> {
        export(m, out)
    }
}

fn spec(config: &Value, max_patches: usize, masked: bool) -> std::result::Result<ModelSpec, String> {
    let (mut text, vision) = siglip2_towers(config, max_patches).map_err(|e| e.to_string())?;
    text.masked = masked;
    let width = vision.encoder.width;
    joint_spec(ImageSpec::Naflex(vision), width, text)
}

fn config_of(spec: &ModelSpec) -> std::result::Result<Value, String> {
    let (ImageSpec::Naflex(v), TextSpec::Siglip(t)) = (&spec.image, &spec.text) else {
        return Err("Siglip2Model has SigLIP 2's NaFlex vision tower and SigLIP's text tower; this model does not".into());
    };
    if spec.image_projection || spec.temperature != TemperatureKind::Clip || spec.logit_bias.is_none() {
        return Err("Siglip2Model has no image projection and scales by exp(logit_scale) plus a bias: this model differs".into());
    }
    let text = tower_to_hf(
        &t.encoder,
        json!({"model_type": "siglip2_text_model", "vocab_size": t.vocab_size, "max_position_embeddings": t.max_position,
            "projection_size": t.projection}),
    );
    let vision = tower_to_hf(
        &v.encoder,
        json!({"model_type": "siglip2_vision_model", "num_patches": v.position_grid * v.position_grid, "patch_size": v.patch_size,
            "num_channels": 3, "vision_use_head": true}),
    );
    Ok(json!({"architectures": ["Siglip2Model"], "model_type": "siglip2", "text_config": text, "vision_config": vision}))
}

/// Writes a NaFlex model as a `Siglip2Model` directory that transformers' `AutoModel` and
/// `AutoProcessor` load with align's embeddings.
fn export(m: &ModelFiles, out: &Path) -> Result<()> {
    let mut config = config_of(m.spec).map_err(anyhow::Error::msg)?;
    let ImageSpec::Naflex(v) = &m.spec.image else { unreachable!("config_of checked the tower") };
    let pad = m.tokenizer.inner().id_to_token(m.tokenizer.pad_id()).unwrap_or_default();
    config["text_config"]["pad_token_id"] = m.tokenizer.pad_id().into();
    let tensors = with_vector_scales(&m.tensors)?;
    let masked = matches!(&m.spec.text, TextSpec::Siglip(t) if t.masked);
    let names = if masked { json!(["input_ids", "attention_mask"]) } else { json!(["input_ids"]) };
    let side = if m.tokenizer.pads_left() { "left" } else { "right" };
    // Siglip2Processor's tokenizer class defaults to Gemma's special tokens, which another
    // vocabulary (CLIP's BPE of a model trained here) lacks: name the vocabulary's own.
    let inner = m.tokenizer.inner();
    let first = |names: &[&str]| names.iter().find(|t| inner.token_to_id(t).is_some()).map(|t| t.to_string());
    let unk = serde_json::to_value(inner.get_model())
        .ok()
        .and_then(|v| v.get("unk_token").and_then(Value::as_str).map(str::to_string))
        .or_else(|| first(&["<unk>"]))
        .unwrap_or_else(|| pad.clone());
    let eos = first(&["<eos>", "</s>", crate::data::clip_bpe::END]).unwrap_or_else(|| pad.clone());
    let bos = first(&["<bos>", "<s>", crate::data::clip_bpe::START]);
    let mut extra = json!({"model_input_names": names, "padding_side": side, "mask_token": first(&["<mask>"])});
    extra["bos_token"] = bos.map_or(Value::Null, Value::from);
    let specials = [("pad_token", pad.as_str()), ("unk_token", unk.as_str()), ("eos_token", eos.as_str())];
    if inner.token_to_id("▁").is_none() && inner.token_to_id("<eos>").is_none() {
        crate::util::log::warn(
            "transformers' Siglip2Processor rebuilds every tokenizer as Gemma's (SentencePiece-style BPE), so this vocabulary's texts tokenize differently there; load the exported tokenizer.json with PreTrainedTokenizerFast for align's ids",
        );
    }
    HfDir {
        config,
        tensors,
        tokenizer_class: "GemmaTokenizer",
        specials: &specials,
        tokenizer_extra: extra,
        image_processor: "SiglipImageProcessor",
        processor: "Siglip2Processor",
    }
    .write(m.tokenizer, &square_stand_in(&m.usage.image, v.patch_size), out)?;
    let image = &m.usage.image;
    let naflex = image.naflex.unwrap_or(Naflex { patch_size: v.patch_size, max_num_patches: v.max_patches });
    let resample = match image.interpolation {
        Interpolation::Bicubic => 3,
        _ => 2,
    };
    let p = json!({"image_processor_type": "Siglip2ImageProcessor", "processor_class": "Siglip2Processor", "do_resize": true,
        "do_rescale": true, "rescale_factor": 1.0 / 255.0, "do_normalize": true, "image_mean": image.mean, "image_std": image.std,
        "resample": resample, "patch_size": naflex.patch_size, "max_num_patches": naflex.max_num_patches, "do_convert_rgb": true});
    std::fs::write(out.join(PROCESSOR), serde_json::to_string_pretty(&p)?)
        .with_context(|| format!("writing {}", out.join(PROCESSOR).display()))?;
    Ok(())
}

/// A square preprocessing for the shared writer, whose processor file is then replaced.
fn square_stand_in(image: &ImageConfig, patch: usize) -> ImageConfig {
    ImageConfig { image_size: patch, resize: patch, naflex: None, ..image.clone() }
}
