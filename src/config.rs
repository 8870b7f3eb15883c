//! The experiment config: one TOML file read top to bottom, every field documented here with its
//! default. `--set section.key=value` overrides a field; unknown keys and impossible values are
//! errors that name the field.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::data::transform::ImageConfig;
use crate::model::config::{
    BertConfig, BertOverrides, EfficientNetOverrides, TemperatureKind, TextPooling, VitConfig, VitOverrides, BERT_PRESETS,
    EFFICIENTNET_PRESETS, VIT_PRESETS,
};
use crate::model::dual_encoder::{ImageSpec, ModelSpec};
use crate::model::efficientnet::EfficientNetConfig;
use crate::train::optim::OptimizerConfig;
use crate::train::schedule::ScheduleKind;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub run: RunConfig,
    pub data: DataConfig,
    pub text: TextConfig,
    pub model: ModelConfig,
    pub loss: LossConfig,
    pub optimizer: OptimizerConfig,
    pub train: TrainConfig,
    pub eval: EvalConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Checkpoints go to `out_dir/name/`.
    pub name: String,
    pub out_dir: PathBuf,
    /// Seeds weight init, shard order, shuffling and augmentation.
    pub seed: u64,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig { name: "run".into(), out_dir: "checkpoints".into(), seed: 0 }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Training shard spec (see `data::spec`).
    pub train: String,
    /// Loader worker threads per rank (each decodes and augments whole batches).
    pub workers: usize,
    /// Samples held in each worker's shuffle buffer.
    pub shuffle_buffer: usize,
    /// Permute the shard list every epoch.
    pub shuffle_shards: bool,
    /// Draw shards with replacement forever instead of epochs.
    pub resampled: bool,
    /// Ready batches each worker may hold.
    pub prefetch: usize,
    /// How much the loader threads lower their scheduling priority (Linux nice, 0-19): they
    /// then use the cycles compute leaves idle without delaying a step.
    pub worker_nice: i32,
    pub image: ImageConfig,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            train: String::new(),
            workers: 4,
            shuffle_buffer: 2000,
            shuffle_shards: true,
            resampled: false,
            prefetch: 2,
            worker_nice: 10,
            image: ImageConfig::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TextConfig {
    /// A `tokenizer.json`; when empty or missing, a WordPiece vocabulary is trained on the
    /// training captions (ALIGN §4) and saved with the run.
    pub tokenizer: PathBuf,
    /// Tokens per caption including [CLS] and [SEP] (ALIGN: 64).
    pub max_len: usize,
    pub lowercase: bool,
    /// Size of a vocabulary trained from the captions (ALIGN: 100k).
    pub vocab_size: usize,
    /// Captions read to train the vocabulary (0 = all).
    pub vocab_samples: usize,
}

impl Default for TextConfig {
    fn default() -> Self {
        TextConfig { tokenizer: PathBuf::new(), max_len: 64, lowercase: true, vocab_size: 100_000, vocab_samples: 1_000_000 }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// `efficientnet-b0` … `efficientnet-b7`, `efficientnet-l2` (ALIGN), or `vit-ti16`, `vit-s16`,
    /// `vit-b32`, `vit-b16`, `vit-l14`, or `vit` with sizes in `[model.vit]`.
    pub image_tower: String,
    /// `bert-tiny` … `bert-large`, or `bert` with sizes in `[model.bert]`.
    pub text_tower: String,
    /// Shared embedding size (ALIGN: 640).
    pub embed_dim: usize,
    /// Project image features to `embed_dim` (off requires tower width == embed_dim).
    pub image_projection: bool,
    pub text_pooling: TextPooling,
    pub temperature: TemperatureKind,
    /// σ at initialisation: ALIGN 1.0; CLIP 0.07.
    pub temperature_init: f64,
    pub vit: VitOverrides,
    pub efficientnet: EfficientNetOverrides,
    pub bert: BertOverrides,
    /// Start from these weights: an align checkpoint or run, a Hugging Face `AlignModel`
    /// directory, or `hf:ID[@REV]` (e.g. `hf:kakaobrain/align-base`). The architecture then comes
    /// from that checkpoint. Empty: random initialisation.
    pub init: String,
    /// Text tower from a `BertModel` checkpoint (directory or `hf:bert-base-uncased`).
    pub init_text: String,
    /// Image tower from a `ViTModel` checkpoint (directory or `hf:ID`).
    pub init_image: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            image_tower: "vit-b16".into(),
            text_tower: "bert-base".into(),
            embed_dim: 640,
            image_projection: true,
            text_pooling: TextPooling::Cls,
            temperature: TemperatureKind::Align,
            temperature_init: 1.0,
            vit: VitOverrides::default(),
            efficientnet: EfficientNetOverrides::default(),
            bert: BertOverrides::default(),
            init: String::new(),
            init_text: String::new(),
            init_image: String::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossConfig {
    /// ALIGN: 0.1.
    pub label_smoothing: f64,
}

impl Default for LossConfig {
    fn default() -> Self {
        LossConfig { label_smoothing: 0.1 }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Pairs per optimiser step over all ranks (ALIGN: 16384). Each micro-batch is
    /// `batch_size / (world_size · accum_steps)`; negatives come from one micro-batch.
    pub batch_size: usize,
    pub accum_steps: usize,
    /// Optimiser steps in the run (ALIGN: 1.2M).
    pub steps: u64,
    /// Peak learning rate (ALIGN: 1e-3).
    pub lr: f64,
    /// ALIGN: 10k.
    pub warmup_steps: u64,
    pub schedule: ScheduleKind,
    pub log_every: u64,
    /// Save every N steps (and always at the end); 0 = only at the end.
    pub checkpoint_every: u64,
    /// Step checkpoints kept (older ones are deleted).
    pub keep_last: usize,
    /// Evaluate every N steps when eval data is configured; 0 = only at the end.
    pub eval_every: u64,
    /// All-gather embeddings with gradient (exact global-batch gradients); open_clip's
    /// `--gather-with-grad`.
    pub gather_with_grad: bool,
    /// Each rank computes the loss of its own rows against the global batch (logits memory linear
    /// in the global batch); open_clip's `--local-loss`.
    pub local_loss: bool,
    /// Seconds a rank waits in a collective (or rendezvous) before giving up.
    pub collective_timeout_s: f64,
    /// `f32`, or `bf16`: towers computed in bfloat16 from f32 master weights (optimizer state,
    /// logits and loss stay f32).
    pub precision: Precision,
    /// Activation checkpointing: keep only each transformer / MBConv block's input in the
    /// forward pass and recompute the block in the backward pass. Same gradients, activation
    /// memory of about one block instead of all of them, about one more forward pass of compute.
    pub grad_checkpointing: bool,
    /// Compute threads (rayon's pool, which candle's CPU kernels share); 0 = one per core. Lower
    /// it to give the loader whole cores of its own.
    pub compute_threads: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    Bf16,
}

impl Precision {
    pub fn compute_dtype(self) -> candle_core::DType {
        match self {
            Precision::F32 => candle_core::DType::F32,
            Precision::Bf16 => candle_core::DType::BF16,
        }
    }
}

impl TrainConfig {
    pub fn gather_options(&self) -> crate::train::gather::GatherOptions {
        crate::train::gather::GatherOptions { gather_with_grad: self.gather_with_grad, local_loss: self.local_loss }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            batch_size: 16384,
            accum_steps: 1,
            steps: 1_200_000,
            lr: 1e-3,
            warmup_steps: 10_000,
            schedule: ScheduleKind::Linear,
            log_every: 10,
            checkpoint_every: 5000,
            keep_last: 3,
            eval_every: 0,
            gather_with_grad: true,
            local_loss: true,
            collective_timeout_s: 1800.0,
            precision: Precision::F32,
            grad_checkpointing: false,
            compute_threads: 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Shards for retrieval (captions one per line in `txt`); empty disables.
    pub retrieval: String,
    /// Shards with `cls` labels for zero-shot classification; empty disables.
    pub zeroshot: String,
    /// Class names, one per line, in label order.
    pub classes: PathBuf,
    /// Prompt templates with `{}` for the class name, one per line.
    pub templates: PathBuf,
    pub batch_size: usize,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            retrieval: String::new(),
            zeroshot: String::new(),
            classes: PathBuf::new(),
            templates: PathBuf::new(),
            batch_size: 256,
        }
    }
}

impl Config {
    pub fn from_toml(text: &str, origin: &str) -> Result<Self> {
        let cfg: Config = toml::from_str(text).with_context(|| format!("config {origin}"))?;
        Ok(cfg)
    }

    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
        Self::from_str_with_overrides(&text, &path.display().to_string(), overrides)
    }

    pub fn from_str_with_overrides(text: &str, origin: &str, overrides: &[String]) -> Result<Self> {
        let mut table: toml::Table = toml::from_str(text).with_context(|| format!("config {origin}"))?;
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        let cfg: Config = toml::Table::try_into(table).with_context(|| format!("config {origin}"))?;
        cfg.validate().with_context(|| format!("config {origin}"))?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        let t = &self.train;
        if t.batch_size == 0 || t.accum_steps == 0 {
            bail!("train.batch_size and train.accum_steps must be positive");
        }
        if !t.batch_size.is_multiple_of(t.accum_steps) {
            bail!("train.batch_size {} is not divisible by train.accum_steps {}", t.batch_size, t.accum_steps);
        }
        if t.steps == 0 {
            bail!("train.steps must be positive");
        }
        if !(t.lr > 0.0 && t.lr.is_finite()) {
            bail!("train.lr must be a positive number, got {}", t.lr);
        }
        if !(0.0..1.0).contains(&self.loss.label_smoothing) {
            bail!("loss.label_smoothing must be in [0, 1), got {}", self.loss.label_smoothing);
        }
        if self.model.embed_dim == 0 {
            bail!("model.embed_dim must be positive");
        }
        if self.model.temperature_init <= 0.0 || self.model.temperature_init.is_nan() {
            bail!("model.temperature_init must be positive, got {}", self.model.temperature_init);
        }
        if self.data.workers == 0 {
            bail!("data.workers must be at least 1");
        }
        if !(0..=19).contains(&self.data.worker_nice) {
            bail!("data.worker_nice must be between 0 and 19, got {}", self.data.worker_nice);
        }
        if self.text.max_len < 2 {
            bail!("text.max_len must leave room for [CLS] and [SEP]");
        }
        if self.train.collective_timeout_s <= 0.0 || self.train.collective_timeout_s.is_nan() {
            bail!("train.collective_timeout_s must be positive");
        }
        if self.eval.batch_size == 0 {
            bail!("eval.batch_size must be positive");
        }
        self.data.image.validate().map_err(|e| anyhow::anyhow!("data.image: {e}"))?;
        self.optimizer.validate().map_err(|e| anyhow::anyhow!("optimizer: {e}"))?;
        Ok(())
    }

    /// Concrete model sizes for a vocabulary of `vocab_size` tokens.
    pub fn model_spec(&self, vocab_size: usize) -> Result<ModelSpec> {
        let m = &self.model;
        let image_size = self.data.image.image_size;
        let image = if let Some(e) = EfficientNetConfig::preset(&m.image_tower, image_size) {
            let e = e.with(&m.efficientnet);
            e.validate().map_err(|err| anyhow::anyhow!("model.efficientnet: {err}"))?;
            ImageSpec::EfficientNet(e)
        } else {
            let vit = VitConfig::preset(&m.image_tower, image_size)
                .with_context(|| {
                    format!("model.image_tower {:?} is not one of {:?}, {:?} or \"vit\"", m.image_tower, VIT_PRESETS, EFFICIENTNET_PRESETS)
                })?
                .with(&m.vit);
            vit.validate().map_err(|e| anyhow::anyhow!("model.vit: {e}"))?;
            ImageSpec::Vit(vit)
        };
        if !m.image_projection && image.width() != m.embed_dim {
            bail!(
                "model.image_projection is off, so model.embed_dim ({}) must equal the image tower's width ({})",
                m.embed_dim,
                image.width()
            );
        }
        let bert = BertConfig::preset(&m.text_tower, vocab_size)
            .with_context(|| format!("model.text_tower {:?} is not one of {:?} or \"bert\"", m.text_tower, BERT_PRESETS))?
            .with(&m.bert);
        bert.validate(self.text.max_len).map_err(|e| anyhow::anyhow!("model.bert: {e}"))?;
        Ok(ModelSpec {
            image,
            text: bert,
            embed_dim: m.embed_dim,
            image_projection: m.image_projection,
            text_pooling: m.text_pooling,
            temperature: m.temperature,
            temperature_init: m.temperature_init,
        })
    }

    pub fn run_dir(&self) -> PathBuf {
        self.run.out_dir.join(&self.run.name)
    }

    pub fn to_toml(&self) -> Result<String> {
        Ok(toml::to_string_pretty(self)?)
    }
}

/// `section.key=value`: the value is read as TOML (`1e-4`, `true`, `[1, 2]`, `"x"`), or as a bare
/// string when it is not valid TOML (`data.train=shards/{0..9}.tar`).
pub fn apply_override(table: &mut toml::Table, spec: &str) -> Result<()> {
    let (path, raw) = spec.split_once('=').with_context(|| format!("override {spec:?} is not KEY=VALUE"))?;
    let value: toml::Value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").expect("parsed key"),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let keys: Vec<&str> = path.trim().split('.').collect();
    let mut cur = table;
    for k in &keys[..keys.len() - 1] {
        let entry = cur.entry(k.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry.as_table_mut().with_context(|| format!("override {path}: {k} is not a section"))?;
    }
    cur.insert(keys[keys.len() - 1].to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_alignss_recipe() {
        let c = Config::default();
        assert_eq!(c.model.embed_dim, 640);
        assert_eq!(c.model.temperature_init, 1.0);
        assert_eq!(c.loss.label_smoothing, 0.1);
        assert_eq!(c.train.batch_size, 16384);
        assert_eq!(c.optimizer.weight_decay, 1e-5);
        assert_eq!((c.data.image.resize, c.data.image.image_size), (346, 289));
        assert_eq!(c.text.max_len, 64);
    }

    #[test]
    fn overrides_parse_as_toml_or_strings() {
        let c = Config::from_str_with_overrides(
            "[train]\nlr = 0.1\n",
            "test",
            &["train.lr=1e-4".into(), "data.train=s/{0..9}.tar".into(), "data.image.hflip=false".into()],
        )
        .unwrap();
        assert_eq!(c.train.lr, 1e-4);
        assert_eq!(c.data.train, "s/{0..9}.tar");
        assert!(!c.data.image.hflip);
    }

    #[test]
    fn unknown_keys_and_impossible_values_name_the_field() {
        let err = format!("{:#}", Config::from_str_with_overrides("[train]\nlearning_rate = 0.1\n", "x.toml", &[]).unwrap_err());
        assert!(err.contains("learning_rate") && err.contains("x.toml"), "{err}");
        let err = format!("{:#}", Config::from_str_with_overrides("", "x.toml", &["loss.label_smoothing=1.5".into()]).unwrap_err());
        assert!(err.contains("label_smoothing"), "{err}");
        let err = format!(
            "{:#}",
            Config::from_str_with_overrides("", "x.toml", &["train.batch_size=10".into(), "train.accum_steps=3".into()]).unwrap_err()
        );
        assert!(err.contains("accum_steps"), "{err}");
    }

    #[test]
    fn the_shipped_configs_parse() {
        for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/configs")).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                Config::load(&path, &[]).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            }
        }
    }
}
