//! Starting a run from pretrained weights instead of random ones: a whole dual encoder
//! (`model.init`: an align checkpoint, a Hugging Face `AlignModel` directory, or `hf:ID` such as
//! `hf:kakaobrain/align-base`), and/or single towers (`model.init_text`: a `BertModel` such as
//! `hf:bert-base-uncased`; `model.init_image`: a `ViTModel` such as
//! `hf:google/vit-base-patch16-224-in21k`), with new projections.
//!
//! With `model.init` the architecture comes from that checkpoint (the `[model]` sizes are not
//! used; `[model.efficientnet]` still sets BatchNorm freezing and stochastic depth). With a tower
//! init, that tower's sizes come from its `config.json`. The tokenizer comes from the checkpoint
//! unless `text.tokenizer` names one.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::Device;
use candle_nn::VarMap;

use super::hf::clip::{hf_spec, read_hf_tokenizer};
use super::hf::files::{is_hf_model, load_prefixed, read_json, read_tokenizer, read_weights};
use super::hf::hub::resolve_location;
use super::hf::layout::{align_spec_from_hf, bert_from_hf, vit_from_hf};
use super::run_dir::{self, MODEL_FILE, SPEC_FILE, TOKENIZER_FILE};
use super::tensors::read_tensors;
use crate::config::Config;
use crate::data::tokenizer::TextTokenizer;
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};

fn located(loc: &str) -> Result<Option<PathBuf>> {
    if loc.is_empty() {
        return Ok(None);
    }
    let p = resolve_location(loc)?;
    // A run directory means its latest checkpoint.
    if p.join("latest").is_file() {
        return run_dir::resolve(&p).map(Some);
    }
    Ok(Some(p))
}

/// The tokenizer an init checkpoint brings, when `text.tokenizer` is not set.
pub fn tokenizer(cfg: &Config) -> Result<Option<TextTokenizer>> {
    if !cfg.text.tokenizer.as_os_str().is_empty() {
        return Ok(None);
    }
    let max_len = cfg.text.max_len;
    if let Some(dir) = located(&cfg.model.init)? {
        // Before any tokenizer.json: SigLIP's own is its SentencePiece model.
        if is_hf_model(&dir, "clip") || is_hf_model(&dir, "siglip") {
            return read_hf_tokenizer(&dir, max_len).map(Some);
        }
        if dir.join(TOKENIZER_FILE).is_file() {
            return TextTokenizer::from_file(&dir.join(TOKENIZER_FILE), max_len).map(Some);
        }
        return read_tokenizer(&dir, max_len).map(Some);
    }
    if let Some(dir) = located(&cfg.model.init_text)? {
        return read_tokenizer(&dir, max_len).map(Some);
    }
    Ok(None)
}

/// The model's sizes, from the init checkpoints where there are any, with the run's patch
/// dropout on a ViT image tower (a training setting, so it applies to a pretrained tower too).
pub fn spec(cfg: &Config, vocab: usize) -> Result<ModelSpec> {
    let mut spec = towers(cfg, vocab)?;
    if cfg.model.lock_image && cfg.model.lock_image_freeze_bn_stats {
        match &mut spec.image {
            ImageSpec::EfficientNet(e) => e.bn_frozen = true,
            _ => bail!("model.lock_image_freeze_bn_stats freezes BatchNorm statistics, which only an EfficientNet image tower has"),
        }
    }
    if let Some(rate) = cfg.model.vit.patch_dropout {
        match &mut spec.image {
            ImageSpec::Vit(v) => v.patch_dropout = rate,
            _ if rate == 0.0 => {}
            _ => bail!("model.vit.patch_dropout drops the patch tokens of align's ViT tower, which this model's image tower is not"),
        }
        if let ImageSpec::Vit(v) = &spec.image {
            v.validate().map_err(|e| anyhow!("model.vit: {e}"))?;
        }
    }
    Ok(spec)
}

fn towers(cfg: &Config, vocab: usize) -> Result<ModelSpec> {
    if let Some(dir) = located(&cfg.model.init)? {
        let mut spec = if dir.join(SPEC_FILE).is_file() {
            serde_json::from_str::<ModelSpec>(&std::fs::read_to_string(dir.join(SPEC_FILE))?)
                .with_context(|| format!("parsing {}", dir.join(SPEC_FILE).display()))?
        } else if is_hf_model(&dir, "align") {
            align_spec_from_hf(&read_json(&dir.join("config.json"))?).map_err(|e| anyhow!("{}: {e}", dir.display()))?
        } else if is_hf_model(&dir, "clip") || is_hf_model(&dir, "siglip") {
            hf_spec(&dir)?
        } else {
            bail!("model.init {}: neither an align checkpoint nor a Hugging Face AlignModel, CLIPModel or SiglipModel", cfg.model.init);
        };
        if let ImageSpec::EfficientNet(e) = &mut spec.image {
            let o = &cfg.model.efficientnet;
            e.bn_frozen = o.bn_frozen.unwrap_or(e.bn_frozen);
            e.drop_path = o.drop_path.unwrap_or(e.drop_path);
            e.image_size = cfg.data.image.image_size;
        }
        if spec.text.vocab_size() != vocab {
            bail!("model.init {} has a {}-token vocabulary but the tokenizer has {vocab}", cfg.model.init, spec.text.vocab_size());
        }
        let positions = match &spec.text {
            TextSpec::Bert(t) => t.max_position,
            TextSpec::Clip(t) => t.max_position,
            TextSpec::Siglip(t) => t.max_position,
        };
        if cfg.text.max_len > positions {
            bail!(
                "text.max_len {} exceeds the {positions} positions of model.init {}'s text tower; set text.max_len to at most {positions}",
                cfg.text.max_len,
                cfg.model.init
            );
        }
        return Ok(spec);
    }
    let mut spec = cfg.model_spec(vocab)?;
    if let Some(dir) = located(&cfg.model.init_text)? {
        spec.text = TextSpec::Bert(
            bert_from_hf(&read_json(&dir.join("config.json"))?).map_err(|e| anyhow!("model.init_text {}: {e}", cfg.model.init_text))?,
        );
        if spec.text.vocab_size() != vocab {
            bail!(
                "model.init_text {} has a {}-token vocabulary but the tokenizer has {vocab}",
                cfg.model.init_text,
                spec.text.vocab_size()
            );
        }
    }
    if let Some(dir) = located(&cfg.model.init_image)? {
        let vit =
            vit_from_hf(&read_json(&dir.join("config.json"))?).map_err(|e| anyhow!("model.init_image {}: {e}", cfg.model.init_image))?;
        if vit.image_size != cfg.data.image.image_size {
            bail!(
                "model.init_image {} was trained at {} px; set data.image.image_size to it (now {})",
                cfg.model.init_image,
                vit.image_size,
                cfg.data.image.image_size
            );
        }
        spec.image = ImageSpec::Vit(vit);
    }
    Ok(spec)
}

/// The prefix a checkpoint puts before a tower's names (`bert.` in `BertForPreTraining`, `vit.`
/// in `ViTForImageClassification`, none in the bare models).
fn prefix_of(weights: &std::collections::HashMap<String, candle_core::Tensor>, candidates: &[&str]) -> String {
    candidates.iter().find(|p| weights.keys().any(|k| k.starts_with(&format!("{p}embeddings.")))).map(|p| p.to_string()).unwrap_or_default()
}

/// Sets the weights the init checkpoints hold. Returns a description for the log.
pub fn load_weights(cfg: &Config, vm: &VarMap, device: &Device) -> Result<Vec<String>> {
    let mut done = Vec::new();
    if let Some(dir) = located(&cfg.model.init)? {
        let weights =
            if dir.join(SPEC_FILE).is_file() { read_tensors(&dir.join(MODEL_FILE), device)? } else { read_weights(&dir, device)? };
        let n = load_prefixed(vm, &weights, "", "", &cfg.model.init)?;
        done.push(format!("{n} tensors from {}", cfg.model.init));
        return Ok(done);
    }
    if let Some(dir) = located(&cfg.model.init_text)? {
        let weights = read_weights(&dir, device)?;
        let from = prefix_of(&weights, &["", "bert."]);
        let n = load_prefixed(vm, &weights, &from, "text_model.", &cfg.model.init_text)?;
        done.push(format!("text tower: {n} tensors from {}", cfg.model.init_text));
    }
    if let Some(dir) = located(&cfg.model.init_image)? {
        let weights = read_weights(&dir, device)?;
        let from = prefix_of(&weights, &["", "vit."]);
        let n = load_prefixed(vm, &weights, &from, "vision_model.", &cfg.model.init_image)?;
        done.push(format!("image tower: {n} tensors from {}", cfg.model.init_image));
    }
    Ok(done)
}
