//! What a run starts from, resolved once per run into a [`Start`]: random weights of the
//! config's towers, a whole pretrained dual encoder (`model.init`: anything
//! [`crate::io::registry::locate`] resolves, in any format align reads), single pretrained towers
//! (`model.init_text`: a `BertModel` such as `hf:bert-base-uncased`; `model.init_image`: a
//! `ViTModel` such as `hf:google/vit-base-patch16-224-in21k`) with new projections, or, on
//! resume, the run's own checkpoint.
//!
//! Everything the trainer needs of the start comes from that one value: the settings it brings as
//! the run's defaults ([`Start::adopt`], in `adopt`), the tokenizer, the model's sizes and the
//! weights. A resumed run reads its sizes, tokenizer and weights from its own checkpoint and its
//! start's settings from its own `config.toml`, so the start it began from need not exist any
//! more. The run's settings that apply to any model (image size, patch dropout, stochastic depth,
//! BatchNorm freezing) are applied to its sizes in one place, [`run_settings`], for a new model
//! and a pretrained one alike.

mod adopt;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;

pub use adopt::{tower_names, train_image, Adopted};

use crate::config::{Config, LossKind};
use crate::data::clip_bpe::Clean;
use crate::data::tokenizer::TextTokenizer;
use crate::io::format::align_run::AlignRun;
use crate::io::format::hf::files::{load_prefixed, read_json, read_tokenizer, read_weights};
use crate::io::format::hf::layout::{bert_from_hf, vit_from_hf};
use crate::io::format::open_clip::presets::Family;
use crate::io::format::{Format, Usage};
use crate::io::registry::{locate, locate_tower, Located};
use crate::io::run_dir::{CONFIG_FILE, TOKENIZER_FILE};
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};

/// A pretrained dual encoder located once, with its sizes and the way it is used.
pub struct Pretrained {
    pub located: Located,
    pub spec: ModelSpec,
    pub usage: Usage,
}

/// What a run starts from.
pub enum Start {
    /// Random weights of the towers the config names.
    Scratch,
    /// A whole pretrained dual encoder (`model.init`).
    Model(Pretrained),
    /// Pretrained single towers (`model.init_text`, `model.init_image`; either or both), the
    /// rest random.
    Towers { text: Option<PathBuf>, image: Option<PathBuf> },
    /// A named architecture (`model.architecture`), its weights random.
    Architecture(Box<crate::io::format::open_clip::presets::Architecture>),
    /// The run's own checkpoint (`--resume`): its sizes, and the config it was trained with.
    Resume { checkpoint: PathBuf, spec: ModelSpec, saved: Box<Config> },
}

impl Start {
    /// The start of a run of `cfg`, resuming from `checkpoint` when there is one. The only place
    /// a start's location is resolved; a resume resolves none.
    pub fn resolve(cfg: &Config, checkpoint: Option<&Path>) -> Result<Start> {
        if let Some(dir) = checkpoint {
            let spec = AlignRun.spec(dir)?;
            let saved = Config::load(&dir.join(CONFIG_FILE), &[])?;
            return Ok(Start::Resume { checkpoint: dir.to_path_buf(), spec, saved: Box::new(saved) });
        }
        let m = &cfg.model;
        if !m.architecture.is_empty() {
            if !(m.init.is_empty() && m.init_text.is_empty() && m.init_image.is_empty()) {
                bail!("model.architecture {:?} is trained from scratch; model.init, model.init_text and model.init_image start from weights instead: set one or the other", m.architecture);
            }
            return Ok(Start::Architecture(Box::new(crate::io::format::open_clip::presets::architecture(&m.architecture)?)));
        }
        if !m.init.is_empty() {
            let what = || format!("model.init {}", m.init);
            let located = locate(&m.init).with_context(what)?;
            let spec = located.format.spec(&located.dir).with_context(what)?;
            let usage = located.format.usage(&located.dir, &spec).with_context(what)?;
            return Ok(Start::Model(Pretrained { located, spec, usage }));
        }
        let tower = |loc: &str, field: &str| -> Result<Option<PathBuf>> {
            if loc.is_empty() {
                return Ok(None);
            }
            locate_tower(loc).map(Some).with_context(|| format!("{field} {loc}"))
        };
        let (text, image) = (tower(&m.init_text, "model.init_text")?, tower(&m.init_image, "model.init_image")?);
        if text.is_none() && image.is_none() {
            return Ok(Start::Scratch);
        }
        Ok(Start::Towers { text, image })
    }

    /// Applies the start's settings to `cfg` as its defaults; an explicit setting wins, with a
    /// warning, except where it would change the start's architecture (an error naming it).
    pub fn adopt(&self, cfg: &mut Config) -> Result<Adopted> {
        match self {
            Start::Model(p) => {
                let format = p.located.format.name();
                let done = adopt::from_start(cfg, &p.spec, &p.usage, format, &format!("model.init ({format})"));
                if !done.conflicts.is_empty() {
                    bail!(
                        "model.init {} brings its own architecture, which these settings would change: {}; remove them, or train from scratch without model.init",
                        cfg.model.init,
                        done.conflicts.join("; ")
                    );
                }
                Ok(done)
            }
            Start::Architecture(a) => {
                let format = match a.family {
                    Family::Clip => "open_clip",
                    Family::Siglip => "SiglipModel",
                };
                let done = adopt::from_start(cfg, &a.spec, &a.usage, format, &format!("model.architecture {}", a.name));
                if !done.conflicts.is_empty() {
                    bail!(
                        "model.architecture {} names its towers, which these settings would change: {}; remove them, or name the towers without model.architecture",
                        a.name,
                        done.conflicts.join("; ")
                    );
                }
                Ok(done)
            }
            Start::Resume { saved, .. } if !saved.model.init.is_empty() || !saved.model.architecture.is_empty() => {
                adopt::from_saved(cfg, saved)
            }
            _ => Ok(Adopted::default()),
        }
    }

    /// The checkpoint a resumed run continues from.
    pub fn resumed_from(&self) -> Option<&Path> {
        match self {
            Start::Resume { checkpoint, .. } => Some(checkpoint),
            _ => None,
        }
    }

    /// The config the resumed checkpoint was trained with.
    pub fn saved_config(&self) -> Option<&Config> {
        match self {
            Start::Resume { saved, .. } => Some(saved),
            _ => None,
        }
    }

    /// The tokenizer the start brings: a resumed run's own; a pretrained model's or text tower's
    /// unless `text.tokenizer` names one; none from scratch.
    pub fn tokenizer(&self, cfg: &Config) -> Result<Option<TextTokenizer>> {
        let max_len = cfg.text.max_len;
        if let Start::Resume { checkpoint, .. } = self {
            return TextTokenizer::from_file(&checkpoint.join(TOKENIZER_FILE), max_len).map(Some);
        }
        if !cfg.text.tokenizer.as_os_str().is_empty() {
            return Ok(None);
        }
        match self {
            Start::Model(p) => p.located.format.tokenizer(&p.located.dir, &p.spec, Some(max_len)).map(Some),
            Start::Architecture(a) => {
                let clean = match a.family {
                    Family::Clip => Clean::Lower,
                    Family::Siglip => Clean::Canonicalize,
                };
                // open_clip's SimpleTokenizer pads with id 0.
                let inner = crate::data::clip_bpe::open_clip_simple(clean)?;
                let pad = inner.id_to_token(0).ok_or_else(|| anyhow!("CLIP's vocabulary has no id 0"))?;
                TextTokenizer::with_pad_token(inner, max_len, &pad).map(Some)
            }
            Start::Towers { text: Some(dir), .. } => read_tokenizer(dir, max_len).map(Some),
            _ => Ok(None),
        }
    }

    /// The model's sizes for a vocabulary of `vocab` tokens, with the run's settings applied.
    pub fn spec(&self, cfg: &Config, vocab: usize) -> Result<ModelSpec> {
        let mut spec = match self {
            Start::Scratch => cfg.model_spec(vocab)?,
            Start::Resume { spec, .. } => spec.clone(),
            Start::Model(p) => pretrained_spec(cfg, &p.spec, vocab)?,
            Start::Architecture(a) => architecture_spec(cfg, &a.spec, vocab)?,
            Start::Towers { text, image } => towers_spec(cfg, text.as_deref(), image.as_deref(), vocab)?,
        };
        run_settings(&mut spec, cfg)?;
        Ok(spec)
    }

    /// Sets the start's pretrained weights into the run's model of sizes `run_spec` (nothing for a
    /// new model, or a resumed one, whose weights the checkpoint restores). Returns a description
    /// for the log.
    pub fn load_weights(&self, cfg: &Config, run_spec: &ModelSpec, vm: &VarMap, device: &Device) -> Result<Vec<String>> {
        let mut done = Vec::new();
        match self {
            Start::Scratch | Start::Architecture(_) | Start::Resume { .. } => {}
            Start::Model(p) => {
                let (dir, format) = (&p.located.dir, p.located.format);
                let sizes = dir.join(format.config_file()).display().to_string();
                crate::io::limits::check_against_weights(&p.spec, &format.weight_shapes(dir)?, &sizes)?;
                let mut weights = format.weights(dir, &p.spec, device)?;
                if let Some(line) = crate::model::pos_embed::resample_for(&p.spec, run_spec, &mut weights)? {
                    done.push(line);
                }
                if let (None, Some(bias)) = (p.spec.logit_bias, run_spec.logit_bias) {
                    weights.insert("logit_bias".into(), Tensor::new(bias as f32, device)?);
                    done.push(format!("logit_bias = {bias} (loss.init_logit_bias: the start was trained without one)"));
                }
                let n = load_prefixed(vm, &weights, "", "", &format!("model.init {}", cfg.model.init))?;
                done.push(format!("{n} tensors from {} ({} format)", cfg.model.init, format.name()));
            }
            Start::Towers { text, image } => {
                if let Some(dir) = text {
                    let weights = read_weights(dir, device)?;
                    let from = prefix_of(&weights, &["", "bert."]);
                    let n = load_prefixed(vm, &weights, &from, "text_model.", &cfg.model.init_text)?;
                    done.push(format!("text tower: {n} tensors from {}", cfg.model.init_text));
                }
                if let Some(dir) = image {
                    let weights = read_weights(dir, device)?;
                    let from = prefix_of(&weights, &["", "vit."]);
                    let n = load_prefixed(vm, &weights, &from, "vision_model.", &cfg.model.init_image)?;
                    done.push(format!("image tower: {n} tensors from {}", cfg.model.init_image));
                }
            }
        }
        Ok(done)
    }
}

/// The sizes of a new model of the config's towers, with the run's settings: what a run from
/// scratch trains (and what `align bench` measures).
pub fn scratch_spec(cfg: &Config, vocab: usize) -> Result<ModelSpec> {
    Start::Scratch.spec(cfg, vocab)
}

/// A pretrained model's sizes as this run trains them, checked against the run's vocabulary and
/// text length.
fn pretrained_spec(cfg: &Config, start: &ModelSpec, vocab: usize) -> Result<ModelSpec> {
    let mut spec = start.clone();
    // The sigmoid loss on a softmax-trained start: the bias it needs starts at
    // loss.init_logit_bias, as it would in a model built here.
    if cfg.loss.kind == LossKind::Sigmoid && spec.logit_bias.is_none() {
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
    Ok(spec)
}

/// A named architecture with the run's vocabulary, loss and text length.
fn architecture_spec(cfg: &Config, named: &ModelSpec, vocab: usize) -> Result<ModelSpec> {
    let mut spec = named.clone();
    match &mut spec.text {
        TextSpec::Clip(t) => t.vocab_size = vocab,
        TextSpec::Siglip(t) => t.vocab_size = vocab,
        TextSpec::Bert(b) => b.vocab_size = vocab,
    }
    let sigmoid = cfg.loss.kind == LossKind::Sigmoid;
    spec.logit_bias = sigmoid.then_some(cfg.loss.init_logit_bias);
    spec.temperature_init = if sigmoid { (-cfg.loss.init_logit_scale).exp() } else { named.temperature_init };
    let positions = spec.text.max_position();
    if cfg.text.max_len > positions {
        bail!("text.max_len {} exceeds the {positions} positions of model.architecture {}", cfg.text.max_len, cfg.model.architecture);
    }
    Ok(spec)
}

/// The config's towers with the pretrained ones' sizes in their place.
fn towers_spec(cfg: &Config, text: Option<&Path>, image: Option<&Path>, vocab: usize) -> Result<ModelSpec> {
    let mut spec = cfg.model_spec(vocab)?;
    if let Some(dir) = text {
        let bert =
            bert_from_hf(&read_json(&dir.join("config.json"))?).map_err(|e| anyhow!("model.init_text {}: {e}", cfg.model.init_text))?;
        spec.text = TextSpec::Bert(bert);
        if spec.text.vocab_size() != vocab {
            bail!(
                "model.init_text {} has a {}-token vocabulary but the tokenizer has {vocab}",
                cfg.model.init_text,
                spec.text.vocab_size()
            );
        }
    }
    if let Some(dir) = image {
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

/// The run's settings that apply to a pretrained model as much as to a new one, in one place:
/// the image size (a transformer's position embeddings are resampled to it when loaded), BatchNorm
/// freezing and stochastic depth of an EfficientNet, frozen statistics of a locked one, and patch
/// dropout on a ViT.
pub fn run_settings(spec: &mut ModelSpec, cfg: &Config) -> Result<()> {
    let size = cfg.data.image.image_size;
    match &mut spec.image {
        ImageSpec::EfficientNet(e) => {
            let o = &cfg.model.efficientnet;
            e.bn_frozen = o.bn_frozen.unwrap_or(e.bn_frozen);
            e.drop_path = o.drop_path.unwrap_or(e.drop_path);
            e.image_size = size;
            e.validate().map_err(|err| anyhow!("model.efficientnet: {err}"))?;
        }
        ImageSpec::Vit(v) => v.image_size = size,
        ImageSpec::Clip(v) => v.image_size = size,
        ImageSpec::Siglip(v) => v.image_size = size,
        // A NaFlex tower takes any size; its patch budget comes with its preprocessing.
        ImageSpec::Naflex(_) => {}
    }
    let patch = match &spec.image {
        ImageSpec::Vit(v) => Some(v.patch_size),
        ImageSpec::Clip(v) => Some(v.patch_size),
        ImageSpec::Siglip(v) => Some(v.patch_size),
        ImageSpec::Naflex(_) => None,
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
            ImageSpec::Naflex(v) if (0.0..1.0).contains(&rate) => v.patch_dropout = rate,
            ImageSpec::Naflex(_) => bail!("model.vit.patch_dropout {rate} is not in [0, 1): it is the fraction of patches dropped"),
            _ if rate == 0.0 => {}
            _ => bail!(
                "model.vit.patch_dropout drops the patch tokens of align's ViT tower or of a SigLIP 2 NaFlex tower, which this model's image tower is not"
            ),
        }
    }
    if let ImageSpec::Vit(v) = &spec.image {
        v.validate().map_err(|e| anyhow!("model.vit: {e}"))?;
    }
    Ok(())
}

/// The prefix a checkpoint puts before a tower's names (`bert.` in `BertForPreTraining`, `vit.`
/// in `ViTForImageClassification`, none in the bare models).
fn prefix_of(weights: &HashMap<String, Tensor>, candidates: &[&str]) -> String {
    candidates.iter().find(|p| weights.keys().any(|k| k.starts_with(&format!("{p}embeddings.")))).map(|p| p.to_string()).unwrap_or_default()
}
