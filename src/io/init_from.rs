//! Starting a run from pretrained weights instead of random ones: a whole dual encoder
//! (`model.init`: anything [`crate::io::format::locate`] resolves, in any format align reads), and/or
//! single towers (`model.init_text`: a `BertModel` such as `hf:bert-base-uncased`;
//! `model.init_image`: a `ViTModel` such as `hf:google/vit-base-patch16-224-in21k`), with new
//! projections.
//!
//! With `model.init` the architecture comes from that checkpoint, and so do the run's defaults
//! for preprocessing, text length and loss ([`adopt`]); the run's own settings that apply to a
//! pretrained model (image size, patch dropout, BatchNorm freezing, stochastic depth) are applied
//! to its sizes in one place, [`apply_run_settings`]. A different image size resamples the
//! position embeddings (bicubic, as open_clip's `resize_pos_embed`). With a tower init, that
//! tower's sizes come from its `config.json`. The tokenizer comes from the checkpoint unless
//! `text.tokenizer` names one.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;

use super::format::{locate, locate_tower, Located};
use super::hf::files::{load_prefixed, read_json, read_tokenizer, read_weights};
use super::hf::layout::{bert_from_hf, vit_from_hf};
use crate::config::Config;
use crate::data::tokenizer::TextTokenizer;
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};

fn located(loc: &str) -> Result<Option<Located>> {
    if loc.is_empty() {
        return Ok(None);
    }
    locate(loc).map(Some)
}

/// A single tower's checkpoint directory (`model.init_text`, `model.init_image`).
fn tower_dir(loc: &str) -> Result<Option<std::path::PathBuf>> {
    if loc.is_empty() {
        return Ok(None);
    }
    locate_tower(loc).map(Some)
}

/// The starting checkpoint of `model.init`, with its own sizes.
pub struct Start {
    pub located: Located,
    pub spec: ModelSpec,
}

/// The checkpoint `model.init` names, if any.
pub fn start(cfg: &Config) -> Result<Option<Start>> {
    let Some(located) = located(&cfg.model.init).with_context(|| format!("model.init {}", cfg.model.init))? else { return Ok(None) };
    let spec = located.format.spec(&located.dir).with_context(|| format!("model.init {}", cfg.model.init))?;
    Ok(Some(Start { located, spec }))
}

pub use super::adopt::adopt;

/// The tokenizer an init checkpoint brings, when `text.tokenizer` is not set.
pub fn tokenizer(cfg: &Config) -> Result<Option<TextTokenizer>> {
    if !cfg.text.tokenizer.as_os_str().is_empty() {
        return Ok(None);
    }
    let max_len = cfg.text.max_len;
    if let Some(s) = start(cfg)? {
        let t = s.located.format.tokenizer(&s.located.dir, &s.spec, Some(max_len))?;
        return Ok(Some(t));
    }
    if let Some(dir) = tower_dir(&cfg.model.init_text)? {
        return read_tokenizer(&dir, max_len).map(Some);
    }
    Ok(None)
}

/// The model's sizes: the init checkpoint's where there is one, else the config's (with tower
/// inits), with the run's settings applied.
pub fn spec(cfg: &Config, vocab: usize) -> Result<ModelSpec> {
    let mut spec = towers(cfg, vocab)?;
    apply_run_settings(&mut spec, cfg)?;
    Ok(spec)
}

/// The run's settings that apply to a pretrained model as much as to a new one, in one place:
/// the image size (a transformer's position embeddings are resampled to it when loaded), BatchNorm
/// freezing and stochastic depth of an EfficientNet, frozen statistics of a locked one, and patch
/// dropout on a ViT.
pub fn apply_run_settings(spec: &mut ModelSpec, cfg: &Config) -> Result<()> {
    let size = cfg.data.image.image_size;
    match &mut spec.image {
        ImageSpec::EfficientNet(e) => {
            let o = &cfg.model.efficientnet;
            e.bn_frozen = o.bn_frozen.unwrap_or(e.bn_frozen);
            e.drop_path = o.drop_path.unwrap_or(e.drop_path);
            e.image_size = size;
        }
        ImageSpec::Vit(v) => v.image_size = size,
        ImageSpec::Clip(v) => v.image_size = size,
        ImageSpec::Siglip(v) => v.image_size = size,
    }
    let patch = match &spec.image {
        ImageSpec::Vit(v) => Some(v.patch_size),
        ImageSpec::Clip(v) => Some(v.patch_size),
        ImageSpec::Siglip(v) => Some(v.patch_size),
        ImageSpec::EfficientNet(_) => None,
    };
    if let Some(p) = patch.filter(|p| !size.is_multiple_of(*p)) {
        bail!("data.image.image_size {size} is not a multiple of the image tower's patch size {p}");
    }
    crate::model::lock::validate(spec, &cfg.model.lock()).map_err(anyhow::Error::msg)?;
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
    Ok(())
}

fn towers(cfg: &Config, vocab: usize) -> Result<ModelSpec> {
    if let Some(s) = start(cfg)? {
        let mut spec = s.spec;
        // The sigmoid loss on a softmax-trained start: the bias it needs starts at
        // loss.init_logit_bias, as it would in a model built here.
        if cfg.loss.kind == crate::config::LossKind::Sigmoid && spec.logit_bias.is_none() {
            spec.logit_bias = Some(cfg.loss.init_logit_bias);
        }
        if spec.text.vocab_size() < vocab {
            bail!("model.init {} has a {}-token vocabulary but the tokenizer has {vocab}", cfg.model.init, spec.text.vocab_size());
        }
        let positions = spec.text.max_position();
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
    if let Some(dir) = tower_dir(&cfg.model.init_text)? {
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
    if let Some(dir) = tower_dir(&cfg.model.init_image)? {
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
fn prefix_of(weights: &HashMap<String, Tensor>, candidates: &[&str]) -> String {
    candidates.iter().find(|p| weights.keys().any(|k| k.starts_with(&format!("{p}embeddings.")))).map(|p| p.to_string()).unwrap_or_default()
}

/// Sets the weights the init checkpoints hold into the run's model of sizes `run_spec`.
/// Returns a description for the log.
pub fn load_weights(cfg: &Config, run_spec: &ModelSpec, vm: &VarMap, device: &Device) -> Result<Vec<String>> {
    let mut done = Vec::new();
    if let Some(s) = start(cfg)? {
        let (dir, format) = (&s.located.dir, s.located.format);
        let origin = format!("model.init {}", cfg.model.init);
        let sizes = dir.join(format.config_file()).display().to_string();
        super::limits::check_against_weights(&s.spec, &format.weight_shapes(dir)?, &sizes)?;
        let mut weights = format.weights(dir, &s.spec, device)?;
        if let Some(line) = crate::model::pos_embed::resample_for(&s.spec, run_spec, &mut weights)? {
            done.push(line);
        }
        if let (None, Some(bias)) = (s.spec.logit_bias, run_spec.logit_bias) {
            weights.insert("logit_bias".into(), Tensor::new(bias as f32, device)?);
            done.push(format!("logit_bias = {bias} (loss.init_logit_bias: the start was trained without one)"));
        }
        let n = load_prefixed(vm, &weights, "", "", &origin)?;
        done.push(format!("{n} tensors from {} ({} format)", cfg.model.init, format.name()));
        return Ok(done);
    }
    if let Some(dir) = tower_dir(&cfg.model.init_text)? {
        let weights = read_weights(&dir, device)?;
        let from = prefix_of(&weights, &["", "bert."]);
        let n = load_prefixed(vm, &weights, &from, "text_model.", &cfg.model.init_text)?;
        done.push(format!("text tower: {n} tensors from {}", cfg.model.init_text));
    }
    if let Some(dir) = tower_dir(&cfg.model.init_image)? {
        let weights = read_weights(&dir, device)?;
        let from = prefix_of(&weights, &["", "vit."]);
        let n = load_prefixed(vm, &weights, &from, "vision_model.", &cfg.model.init_image)?;
        done.push(format!("image tower: {n} tensors from {}", cfg.model.init_image));
    }
    Ok(done)
}
