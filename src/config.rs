//! The experiment config: one TOML file read top to bottom, every field documented here with its
//! default. `--set section.key=value` overrides a field; unknown keys and impossible values are
//! errors that name the field.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::data::transform::ImageConfig;
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};
use crate::model::efficientnet::EfficientNetConfig;
use crate::model::presets::{
    BertConfig, BertOverrides, EfficientNetOverrides, TemperatureKind, TextPooling, VitConfig, VitOverrides, BERT_PRESETS,
    EFFICIENTNET_PRESETS, VIT_PRESETS,
};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The run's name, output directory and seed.
    pub run: RunConfig,
    /// Training shards and how they are read, decoded and augmented.
    pub data: DataConfig,
    /// Tokenizer and caption length.
    pub text: TextConfig,
    /// The two towers, the shared embedding and the start.
    pub model: ModelConfig,
    /// The contrastive loss.
    pub loss: LossConfig,
    /// ALIGN §5: LAMB with weight decay ratio 1e-5 (the defaults of [`OptimizerConfig`]).
    pub optimizer: OptimizerConfig,
    /// Batch, length, schedule, checkpoints, precision and the moving average.
    pub train: TrainConfig,
    /// The evaluations run during and after training.
    pub eval: EvalConfig,
    /// Distillation from a teacher, online or from its stored embeddings.
    pub distill: DistillConfig,
    /// Which fields the file and the `--set` overrides named (not part of the config itself).
    #[serde(skip)]
    pub explicit: Explicit,
}

/// The fields a config's file and overrides set, as dotted paths (`data.image.image_size`); for a
/// config built in code, `None`: a field then counts as set when it differs from its default.
/// Where a field's value came from does not make two configs differ.
#[derive(Debug, Clone, Default)]
pub struct Explicit(pub Option<std::collections::BTreeSet<String>>);

impl PartialEq for Explicit {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Every leaf of a TOML table as a dotted path.
fn leaf_paths(table: &toml::Table, prefix: &str, out: &mut std::collections::BTreeSet<String>) {
    for (k, v) in table {
        let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            toml::Value::Table(t) => leaf_paths(t, &path, out),
            _ => {
                out.insert(path);
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Checkpoints go to `out_dir/name/`.
    pub name: String,
    /// The directory that holds runs (each in `out_dir/name/`).
    pub out_dir: PathBuf,
    /// Seeds weight init, shard order, shuffling and augmentation.
    pub seed: u64,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig { name: "run".into(), out_dir: "checkpoints".into(), seed: 0 }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
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
    /// With `resampled`: one weight per source that `::` joins in `train` (open_clip's
    /// `--train-data-upsampling-factors`): every shard of a source is drawn with its source's
    /// factor, so `[1.0, 2.0]` reads the second source's samples twice as often as the first's.
    /// Empty: uniform over shards.
    pub upsampling_factors: Vec<f64>,
    /// Ready batches each worker may hold.
    pub prefetch: usize,
    /// How much the loader threads lower their scheduling priority (Linux nice, 0-19): they
    /// then use the cycles compute leaves idle without delaying a step.
    pub worker_nice: i32,
    /// Seconds a `pipe:` shard may send nothing before it is abandoned (a warning names it, and it
    /// counts as a skipped shard).
    pub stall_timeout_s: f64,
    /// NaFlex token-budget batches (timm's `--naflex-train-seq-lens`): for a SigLIP 2 NaFlex
    /// tower, each batch draws one of these sequence lengths (patches per image, uniformly),
    /// resizes its images to at most that many patches, and holds
    /// `micro · max(naflex_seq_lens) / length` images rounded down to `naflex_batch_divisor`, so
    /// that every batch carries about the same patches (micro: this rank's share of
    /// `train.batch_size`, the batch at the longest length). Empty: every batch is
    /// `train.batch_size` images at `data.image.naflex.max_num_patches`.
    pub naflex_seq_lens: Vec<usize>,
    /// Token-budget batch sizes above the longest length's are rounded down to a multiple of
    /// this (timm's `batch_divisor`).
    pub naflex_batch_divisor: usize,
    /// Decoding and augmentation. The defaults (`data::transform::ImageConfig`) are ALIGN §5's:
    /// a square resize, a random crop with horizontal flip for training, the central crop for
    /// evaluation, at the same size for every EfficientNet variant.
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
            upsampling_factors: Vec::new(),
            prefetch: 2,
            worker_nice: 10,
            stall_timeout_s: 300.0,
            naflex_seq_lens: Vec::new(),
            naflex_batch_divisor: 8,
            image: ImageConfig::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TextConfig {
    /// A `tokenizer.json`; when empty or missing, a WordPiece vocabulary is trained on the
    /// training captions (ALIGN §4.1 builds its own from its training data) and saved with the run.
    pub tokenizer: PathBuf,
    /// Tokens per caption including [CLS] and [SEP]. ALIGN §5: 64 wordpieces, its alt-texts
    /// having at most 20 unigrams.
    pub max_len: usize,
    /// Lowercase captions before tokenizing (for a vocabulary trained here; a loaded
    /// `tokenizer.json` keeps its own normaliser).
    pub lowercase: bool,
    /// Size of a vocabulary trained from the captions. ALIGN §4.1: 100k wordpieces.
    pub vocab_size: usize,
    /// Captions read to train the vocabulary (0 = all).
    pub vocab_samples: usize,
}

impl Default for TextConfig {
    fn default() -> Self {
        TextConfig { tokenizer: PathBuf::new(), max_len: 64, lowercase: true, vocab_size: 100_000, vocab_samples: 1_000_000 }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// `efficientnet-b0` … `efficientnet-b7`, `efficientnet-l2`, or `vit-ti16`, `vit-s16`,
    /// `vit-b32`, `vit-b16`, `vit-l14`, or `vit` with sizes in `[model.vit]`. ALIGN §4.1: an
    /// EfficientNet with global pooling; `efficientnet-b7` is ALIGN's 640-d model (§6.1, Table 9;
    /// Hugging Face's `kakaobrain/align-base`). The results of §5 use `efficientnet-l2`
    /// (`configs/align-l2-bert-large.toml`).
    pub image_tower: String,
    /// `bert-tiny` … `bert-large`, or `bert` with sizes in `[model.bert]`. ALIGN §4.1 and §6.2:
    /// `bert-base`, trained from scratch.
    pub text_tower: String,
    /// Size of the shared embedding space. ALIGN §6.1: 640, the width of EfficientNet-B7's pooled
    /// feature, to which the ablations project the other towers (Table 8's baseline included);
    /// it grows with the image tower, 1376 for L2.
    pub embed_dim: usize,
    /// A linear layer from the image tower's feature to `embed_dim`. ALIGN §4.1: none, the
    /// EfficientNet's globally pooled feature is the image embedding; §6.1's ablations add one to
    /// towers narrower or wider than B7. Off requires the tower's width to equal `embed_dim`.
    pub image_projection: bool,
    /// ALIGN §4.1: BERT's [CLS] state, then a linear layer to `embed_dim` (always present).
    /// `pooler` applies BERT's pooler first, as `VisionTextDualEncoderModel` does.
    pub text_pooling: TextPooling,
    /// The text projection's bias. ALIGN's has one; CLIP's and `VisionTextDualEncoderModel`'s
    /// do not.
    pub text_projection_bias: bool,
    /// ALIGN §4.1: logits are cosine similarities divided by a learned σ, one σ for both
    /// directions.
    pub temperature: TemperatureKind,
    /// σ at initialisation. ALIGN §5: 1.0 (CLIP: 0.07).
    pub temperature_init: f64,
    /// Sizes replacing those of the `vit-*` preset (or all of them, for `image_tower = "vit"`).
    pub vit: VitOverrides,
    /// Scalings and regularisers replacing those of the `efficientnet-*` preset.
    pub efficientnet: EfficientNetOverrides,
    /// Sizes replacing those of the `bert-*` preset (or all of them, for `text_tower = "bert"`).
    pub bert: BertOverrides,
    /// A whole architecture by open_clip's name, trained from scratch: `ViT-B-32`, `ViT-B-16`,
    /// `ViT-L-14` (and their `-quickgelu` forms, `ViT-B-32-256`), `ViT-B-16-SigLIP`,
    /// `ViT-B-16-SigLIP2`, and transformers' `siglip2-base-patch16-naflex` (SigLIP 2's NaFlex
    /// B/16). Its towers, image size, preprocessing, text length, loss family and
    /// the family's optimizer recipe become the run's defaults (settings given explicitly win);
    /// CLIP's BPE tokenizes unless `text.tokenizer` names another. Instead of `image_tower` and
    /// `text_tower`.
    pub architecture: String,
    /// Start from these weights: an align checkpoint or run; a Hugging Face `AlignModel`,
    /// `CLIPModel`, `SiglipModel` or `VisionTextDualEncoderModel` folder; an open_clip folder
    /// (`open_clip_config.json`); or `hf:ID[@REV]` (e.g. `hf:openai/clip-vit-base-patch32`). The
    /// architecture, preprocessing, text length, tokenizer and loss family then come from that
    /// checkpoint (settings given explicitly win). Empty: random initialisation.
    pub init: String,
    /// Text tower from a `BertModel` checkpoint (directory or `hf:bert-base-uncased`).
    pub init_text: String,
    /// Image tower from a `ViTModel` checkpoint (directory or `hf:ID`).
    pub init_image: String,
    /// LiT (Zhai et al. 2022): freeze the image tower and its projection, all but its last
    /// `lock_image_unlocked_groups` groups (embeddings, each layer or block, the projection).
    /// open_clip's `--lock-image`.
    pub lock_image: bool,
    /// Groups of a locked image tower left trainable, counted from its last (the projection);
    /// 0 locks the whole tower. open_clip's `--lock-image-unlocked-groups`.
    pub lock_image_unlocked_groups: usize,
    /// A locked EfficientNet normalises with its running statistics and never updates them.
    pub lock_image_freeze_bn_stats: bool,
    /// Freeze the text tower and its projection, all but its last `lock_text_unlocked_layers`
    /// groups. open_clip's `--lock-text`.
    pub lock_text: bool,
    /// Groups of a locked text tower left trainable, counted from its last; 0 locks the whole
    /// tower. open_clip's `--lock-text-unlocked-layers`.
    pub lock_text_unlocked_layers: usize,
    /// Also freeze the LayerNorms of the text groups left trainable.
    pub lock_text_freeze_layer_norm: bool,
}

impl ModelConfig {
    /// The locking settings.
    pub fn lock(&self) -> crate::model::lock::LockConfig {
        crate::model::lock::LockConfig {
            lock_image: self.lock_image,
            lock_image_unlocked_groups: self.lock_image_unlocked_groups,
            lock_image_freeze_bn_stats: self.lock_image_freeze_bn_stats,
            lock_text: self.lock_text,
            lock_text_unlocked_layers: self.lock_text_unlocked_layers,
            lock_text_freeze_layer_norm: self.lock_text_freeze_layer_norm,
        }
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            image_tower: "efficientnet-b7".into(),
            text_tower: "bert-base".into(),
            embed_dim: 640,
            image_projection: false,
            text_pooling: TextPooling::Cls,
            text_projection_bias: true,
            temperature: TemperatureKind::Align,
            temperature_init: 1.0,
            vit: VitOverrides::default(),
            efficientnet: EfficientNetOverrides::default(),
            bert: BertOverrides::default(),
            architecture: String::new(),
            init: String::new(),
            init_text: String::new(),
            init_image: String::new(),
            lock_image: false,
            lock_image_unlocked_groups: 0,
            lock_image_freeze_bn_stats: false,
            lock_text: false,
            lock_text_unlocked_layers: 0,
            lock_text_freeze_layer_norm: false,
        }
    }
}

/// Which contrastive loss trains the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// ALIGN's (and CLIP's) normalised softmax over the batch, both directions.
    #[default]
    Softmax,
    /// SigLIP's pairwise sigmoid loss with a learned logit bias.
    Sigmoid,
}

/// How the sigmoid loss brings other ranks' texts to a rank's images (`train::sigmoid_loss`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Exchange {
    /// Around the ring, one block at a time: logits memory `n × n` per rank.
    #[default]
    Shift,
    /// All texts gathered on every rank: logits memory `n × N`.
    Gather,
}

/// The distillation loss's form (`train::distill_loss`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DistillLoss {
    /// The cross-entropy between the teacher's and the student's distributions (open_clip's
    /// `DistillClipLoss`).
    #[default]
    CrossEntropy,
    /// The Kullback-Leibler divergence from the teacher's (MobileCLIP): the same gradient, 0 when
    /// the student matches the teacher.
    Kl,
}

/// A teacher the student learns from (`train::distill_loss`), as open_clip's `--distill-model`
/// and MobileCLIP's reinforced datasets use one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DistillConfig {
    /// The teacher: any checkpoint align reads (a run, a Hugging Face or open_clip folder),
    /// run forward-only and frozen beside the student. It sees each sample through its own
    /// evaluation preprocessing and tokenizer (a separate, deterministic view: the one `align data
    /// score` embeds). Empty: no online teacher.
    pub teacher: PathBuf,
    /// Stored teacher embeddings instead: the folder `align data score --embeddings` wrote
    /// (DataCompDR-style), one file per shard, matched to each sample by key and caption.
    pub embeddings: PathBuf,
    /// Weight of the distillation loss beside the contrastive one.
    pub weight: f64,
    /// Keep the contrastive loss (false: the student learns from the teacher alone).
    pub contrastive: bool,
    /// `cross_entropy` (open_clip's `DistillClipLoss`) or `kl` (MobileCLIP).
    pub loss: DistillLoss,
    /// The online teacher's matrix products: `f32`, or `bf16` (bfloat16 operands, f32 sums, as
    /// `--precision bf16` runs the forward-only commands; CPUs with AVX-512 BF16).
    pub precision: Precision,
}

impl Default for DistillConfig {
    fn default() -> Self {
        DistillConfig {
            teacher: PathBuf::new(),
            embeddings: PathBuf::new(),
            weight: 1.0,
            contrastive: true,
            loss: DistillLoss::CrossEntropy,
            precision: Precision::F32,
        }
    }
}

impl DistillConfig {
    /// Whether the run distils from a teacher.
    pub fn active(&self) -> bool {
        !self.teacher.as_os_str().is_empty() || !self.embeddings.as_os_str().is_empty()
    }
}

/// How the softmax loss's two directions make one loss (`loss.directions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Directions {
    /// Image→text plus text→image (ALIGN §4.1).
    #[default]
    Sum,
    /// Their average (CLIP's pseudocode, open_clip's `ClipLoss`, transformers' `clip_loss`): the
    /// loss a CLIP start logs compares with theirs.
    Mean,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LossConfig {
    /// `softmax` (ALIGN §4.1, the default) or `sigmoid` (SigLIP, Zhai et al. 2023). The sigmoid
    /// loss learns t = exp(s) as `logit_scale` (the model's `temperature` settings do not apply)
    /// and a bias b as `logit_bias`.
    pub kind: LossKind,
    /// Label smoothing of both softmax losses. ALIGN §5: 0.1; CLIP and open_clip: 0.
    pub label_smoothing: f64,
    /// Softmax loss: `sum` of the two directions (ALIGN) or their `mean` (CLIP, open_clip).
    pub directions: Directions,
    /// Sigmoid loss: how texts reach other ranks (open_clip's `dist_impl`): `shift` passes them
    /// around the ring (logits n × n per rank), `gather` gathers them all (n × N).
    pub dist_impl: Exchange,
    /// Sigmoid loss: s at initialisation, t = exp(s). SigLIP: ln 10.
    pub init_logit_scale: f64,
    /// Sigmoid loss: b at initialisation. SigLIP: −10.
    pub init_logit_bias: f64,
}

impl Default for LossConfig {
    fn default() -> Self {
        LossConfig {
            kind: LossKind::Softmax,
            label_smoothing: 0.1,
            directions: Directions::Sum,
            dist_impl: Default::default(),
            init_logit_scale: 10f64.ln(),
            init_logit_bias: -10.0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Pairs per optimiser step over all ranks; each pair's negatives are all other pairs of the
    /// batch. ALIGN §5: 16384 (16 pairs on each of 1024 TPU cores). Each micro-batch is
    /// `batch_size / (world_size · accum_steps)`.
    pub batch_size: usize,
    /// Micro-batches per step; their embeddings are cached so that negatives still come from the
    /// whole batch (GradCache).
    pub accum_steps: usize,
    /// Optimiser steps in the run. ALIGN §5: 1.2M (about 12 epochs); §6.1's ablations: 1M.
    /// Or give `epochs` or `samples` instead (one of the three).
    pub steps: u64,
    /// The run's length in passes over `samples_per_epoch` pairs (open_clip's `--epochs`);
    /// 0: use `steps`. The implied steps, ceil(epochs · samples_per_epoch / batch_size), are
    /// printed at the start and written as `steps` in the run's config.
    pub epochs: f64,
    /// Pairs per epoch (open_clip's `--train-num-samples`); 0: counted from `data.train`'s
    /// shards at the start.
    pub samples_per_epoch: u64,
    /// The run's length in pairs seen over all ranks; 0: use `steps` or `epochs`.
    pub samples: u64,
    /// Peak learning rate. ALIGN §5: 1e-3.
    pub lr: f64,
    /// Steps of linear warm-up from zero. ALIGN §5: 10k.
    pub warmup_steps: u64,
    /// Decay after the warm-up. ALIGN §5: linear, to zero at `steps`.
    pub schedule: ScheduleKind,
    /// Write a record to `metrics.jsonl` and TensorBoard (and a log line in a batch job) every
    /// N steps.
    pub log_every: u64,
    /// Save every N steps (and always at the end); 0 = only at the end.
    pub checkpoint_every: u64,
    /// Step checkpoints kept (older ones are deleted).
    pub keep_last: usize,
    /// Evaluate every N steps when eval data is configured; 0 = only at the end.
    pub eval_every: u64,
    /// Also evaluate the starting model before the first step (logged at step 0): the baseline a
    /// fine-tuning run from `model.init` improves on.
    pub eval_at_start: bool,
    /// All-gather embeddings with gradient (exact global-batch gradients); open_clip's
    /// `--gather-with-grad`.
    pub gather_with_grad: bool,
    /// Each rank computes the loss of its own rows against the global batch (logits memory linear
    /// in the global batch); open_clip's `--local-loss`.
    pub local_loss: bool,
    /// Seconds a rank waits in a collective (or rendezvous) before giving up.
    pub collective_timeout_s: f64,
    /// `f32`, or `bf16`: mixed precision from f32 master weights (optimizer state, logits and
    /// loss stay f32). On the CPU, the kernels' large matrix products of the forward and backward
    /// passes take bf16 operands into f32 sums (AVX-512 BF16; refused without it) and all else
    /// stays f32; on a GPU, the towers compute in bfloat16.
    pub precision: Precision,
    /// Activation checkpointing: keep only each transformer / MBConv block's input in the
    /// forward pass and recompute the block in the backward pass. Same gradients, activation
    /// memory of about one block instead of all of them, about one more forward pass of compute.
    pub grad_checkpointing: bool,
    /// Compute threads (rayon's pool, which candle's CPU kernels share); 0 = one per core. Lower
    /// it to give the loader whole cores of its own.
    pub compute_threads: usize,
    /// What data-parallel ranks split between them instead of each keeping a whole copy (ZeRO's
    /// stages; ignored on one rank). Each tensor's optimizer moments live on one rank only.
    pub shard: ShardMode,
    /// The last N steps train without patch dropout (FLIP's unmasked tuning); 0 = none.
    pub unmasked_tuning_steps: u64,
    /// Decay of an exponential moving average of the weights, kept in f32 beside them and saved
    /// with each checkpoint (`ema.safetensors`); 0 = none. timm's `--model-ema-decay`.
    pub ema_decay: f64,
    /// Ramp the decay up from 0 as timm's `ModelEmaV3` does: `1 − (1 + n/γ)^−p` after n updates,
    /// capped at `ema_decay`, so early weights do not linger.
    pub ema_warmup: bool,
    /// γ of the warm-up.
    pub ema_warmup_gamma: f64,
    /// p of the warm-up (2/3 for runs of a million steps or more, 3/4 for shorter ones).
    pub ema_warmup_power: f64,
    /// The periodic evaluation also evaluates the average (logged as `ema`).
    pub ema_eval: bool,
}

/// `train.shard`: ZeRO's stages 0, 1 and 2 over whole tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ShardMode {
    /// Every rank keeps the whole optimizer state and all-reduces whole gradients (plain data
    /// parallelism).
    #[default]
    None,
    /// Each rank keeps the moments of the tensors it owns (about 1/N of them, balanced by size),
    /// receives only their summed gradients (reduce-scatter once a step, after accumulating its
    /// micro-batches whole), updates them and all-gathers the new weights (ZeRO stage 1; the
    /// paper's version all-reduces the gradients, but a rank uses only its own tensors' sums,
    /// and a reduce-scatter sends half as much).
    Optimizer,
    /// As `optimizer`, and each micro-batch's gradients are reduce-scattered as soon as they are
    /// computed, so that accumulating (`train.accum_steps` > 1) keeps only this rank's part
    /// (ZeRO stage 2); one exchange per micro-batch instead of one per step.
    Gradients,
}

impl ShardMode {
    /// The name the config and the checkpoint's manifest use.
    pub fn name(self) -> &'static str {
        match self {
            ShardMode::None => "none",
            ShardMode::Optimizer => "optimizer",
            ShardMode::Gradients => "gradients",
        }
    }
}

/// The towers' compute precision (`train.precision`; the forward-only commands' `--precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, schemars::JsonSchema, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in 32-bit floats.
    #[default]
    F32,
    /// The towers in bfloat16: in training from f32 master weights; in the forward-only
    /// commands, their matrix products' operands (summed in f32).
    Bf16,
    /// The forward-only commands only: linear layers' products on 8-bit integers (per-channel
    /// weights, per-token inputs, 32-bit sums), the other large products as in `bf16` where the
    /// CPU has it. Never for training.
    Int8,
}

impl Precision {
    /// The name results record (`f32`, `bf16`, `int8`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::Int8 => "int8",
        }
    }

    pub fn compute_dtype(self) -> candle_core::DType {
        match self {
            Precision::F32 => candle_core::DType::F32,
            Precision::Bf16 => candle_core::DType::BF16,
            Precision::Int8 => candle_core::DType::F32,
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            batch_size: 16384,
            accum_steps: 1,
            steps: 1_200_000,
            epochs: 0.0,
            samples_per_epoch: 0,
            samples: 0,
            lr: 1e-3,
            warmup_steps: 10_000,
            schedule: ScheduleKind::Linear,
            log_every: 10,
            checkpoint_every: 5000,
            keep_last: 3,
            eval_every: 0,
            eval_at_start: false,
            gather_with_grad: true,
            local_loss: true,
            collective_timeout_s: 1800.0,
            precision: Precision::F32,
            grad_checkpointing: false,
            compute_threads: 0,
            shard: ShardMode::None,
            unmasked_tuning_steps: 0,
            ema_decay: 0.0,
            ema_warmup: true,
            ema_warmup_gamma: 1.0,
            ema_warmup_power: 2.0 / 3.0,
            ema_eval: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
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
    /// Images or captions embedded per forward pass.
    pub batch_size: usize,
    /// Held-out shards whose training loss is logged at each evaluation (open_clip's
    /// `--val-data`); empty disables.
    pub validation: String,
    /// Pairs per batch of the validation loss (each pair's negatives are its batch's other
    /// pairs, so the loss depends on it).
    pub validation_batch: usize,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            retrieval: String::new(),
            zeroshot: String::new(),
            classes: PathBuf::new(),
            templates: PathBuf::new(),
            batch_size: 256,
            validation: String::new(),
            validation_batch: 256,
        }
    }
}

/// The update rule (`optimizer.kind`): AdamW or LAMB (`train::optim`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// Adam with decoupled weight decay (Loshchilov & Hutter), CLIP's and open_clip's.
    Adamw,
    /// LAMB (You et al. 2020): Adam's update scaled per tensor by its trust ratio, ALIGN's.
    Lamb,
}

/// The optimiser (`[optimizer]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    /// `lamb` (ALIGN §5) or `adamw` (CLIP, open_clip).
    pub kind: OptimizerKind,
    /// Decay of the moving average of gradients.
    pub beta1: f64,
    /// Decay of the moving average of squared gradients (CLIP: 0.98 for ViTs).
    pub beta2: f64,
    /// Added to the denominator's square root.
    pub eps: f64,
    /// Decoupled weight decay, per step, times the learning rate; gains, biases and
    /// normalisation parameters are not decayed. ALIGN §5: 1e-5.
    pub weight_decay: f64,
    /// Clip gradients to this global L2 norm (0 disables).
    pub grad_clip: f64,
    /// Layer-wise learning-rate decay of the image tower (BEiT, timm's `--layer-decay`): a group
    /// k groups before the tower's last (its projection) trains at lr·decayᵏ; 1 = none.
    pub layer_decay_image: f64,
    /// The same for the text tower.
    pub layer_decay_text: f64,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::Lamb,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 1e-5,
            grad_clip: 0.0,
            layer_decay_image: 1.0,
            layer_decay_text: 1.0,
        }
    }
}

impl OptimizerConfig {
    pub fn validate(&self) -> std::result::Result<(), String> {
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            return Err(format!("betas ({}, {}) must be in [0, 1)", self.beta1, self.beta2));
        }
        if self.eps <= 0.0 || self.weight_decay < 0.0 || self.grad_clip < 0.0 {
            return Err("eps must be positive; weight_decay and grad_clip non-negative".into());
        }
        for (name, d) in [("layer_decay_image", self.layer_decay_image), ("layer_decay_text", self.layer_decay_text)] {
            if !(d > 0.0 && d <= 1.0) {
                return Err(format!("{name} {d} must be in (0, 1] (1 = no decay)"));
            }
        }
        Ok(())
    }
}

/// The learning-rate schedule after the warm-up (`train.schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// Linear warmup from zero, then linear decay to zero at the last step (ALIGN §5).
    Linear,
    /// Linear warmup, then half-cosine decay to zero (CLIP, open_clip).
    Cosine,
    /// Linear warmup, then constant.
    Constant,
}

/// The fields that state a run's length; a recipe sets one of them.
const LENGTH_FIELDS: [&str; 3] = ["steps", "epochs", "samples"];

/// A length given with `--set` wins over the file's for this run: the file's other length
/// fields are dropped, each with a line saying what replaced it (`--set train.epochs=10` on a
/// recipe that states `train.steps`).
fn replace_length(table: &mut toml::Table, origin: &str, overrides: &[String]) {
    let set: Vec<&str> = overrides
        .iter()
        .filter_map(|o| o.split_once('=').map(|(k, _)| k.trim()))
        .filter_map(|k| k.strip_prefix("train."))
        .filter(|k| LENGTH_FIELDS.contains(k))
        .collect();
    let Some(&given) = set.last() else { return };
    let Some(train) = table.get_mut("train").and_then(toml::Value::as_table_mut) else { return };
    for field in LENGTH_FIELDS.iter().filter(|f| **f != given) {
        if let Some(old) = train.remove(*field) {
            crate::util::log::info(format!("--set train.{given} replaces train.{field} = {old} of {origin} for this run"));
        }
    }
}

impl Config {
    pub fn from_toml(text: &str, origin: &str) -> Result<Self> {
        let cfg: Config = toml::from_str(text).with_context(|| format!("config {origin}"))?;
        Ok(cfg)
    }

    /// The config file at `path` (with the file it extends, if any) and then `overrides`.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        Self::from_table_with_overrides(read_file(path)?, &path.display().to_string(), overrides)
    }

    pub fn from_str_with_overrides(text: &str, origin: &str, overrides: &[String]) -> Result<Self> {
        let table: toml::Table = toml::from_str(text).with_context(|| format!("config {origin}"))?;
        if table.contains_key(EXTENDS) {
            bail!("config {origin}: `{EXTENDS}` names a file relative to the config's own, so the config must be read from a file");
        }
        Self::from_table_with_overrides(table, origin, overrides)
    }

    fn from_table_with_overrides(mut table: toml::Table, origin: &str, overrides: &[String]) -> Result<Self> {
        replace_length(&mut table, origin, overrides);
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        let mut explicit = std::collections::BTreeSet::new();
        leaf_paths(&table, "", &mut explicit);
        let mut cfg: Config = toml::Table::try_into(table).with_context(|| format!("config {origin}"))?;
        cfg.explicit = Explicit(Some(explicit));
        cfg.validate().with_context(|| format!("config {origin}"))?;
        Ok(cfg)
    }

    /// Whether the user set the field at `path` (`data.image.mean`): named in the file or an
    /// override, or, for a config built in code, different from the default.
    pub fn is_explicit(&self, path: &str) -> bool {
        match &self.explicit.0 {
            Some(set) => set.iter().any(|p| p == path || p.starts_with(&format!("{path}."))),
            None => {
                let field = |c: &Config| toml::Value::try_from(c).ok().and_then(|v| path.split('.').try_fold(v, |v, k| v.get(k).cloned()));
                field(self) != field(&Config::default())
            }
        }
    }

    pub fn validate(&self) -> Result<()> {
        self.check_length_and_batches()?;
        self.check_data_and_objective()?;
        self.check_average_and_locks()
    }

    /// The batch, the run's length and rate, and the validation batch.
    fn check_length_and_batches(&self) -> Result<()> {
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
        if t.precision == Precision::Int8 {
            bail!("train.precision = \"int8\" is the forward-only commands' precision (--precision int8 of embed, eval and data score): train in \"f32\" or \"bf16\"");
        }
        if self.distill.precision == Precision::Int8 {
            // The int8 switch is process-wide: it would reach the student's products too.
            bail!("distill.precision = \"int8\" is not supported (int8 products would reach the student too): use \"f32\" or \"bf16\"");
        }
        if !(t.epochs >= 0.0 && t.epochs.is_finite()) {
            bail!("train.epochs must be a non-negative number (0: use train.steps), got {}", t.epochs);
        }
        if t.epochs > 0.0 && t.samples > 0 {
            bail!("set one of train.steps, train.epochs and train.samples: both train.epochs and train.samples are set");
        }
        if (t.epochs > 0.0 || t.samples > 0) && self.is_explicit("train.steps") {
            bail!("set one of train.steps, train.epochs and train.samples: train.steps is set beside train.epochs / train.samples");
        }
        if !(t.lr > 0.0 && t.lr.is_finite()) {
            bail!("train.lr must be a positive number, got {}", t.lr);
        }
        if self.eval.validation_batch < 2 {
            bail!(
                "eval.validation_batch is {}: the validation loss needs at least 2 pairs a batch (each pair's negatives are the others)",
                self.eval.validation_batch
            );
        }
        Ok(())
    }

    /// The data's sources and loaders, the objective and the embedding, the text length and the
    /// evaluation batch.
    fn check_data_and_objective(&self) -> Result<()> {
        let d = &self.distill;
        if !d.teacher.as_os_str().is_empty() && !d.embeddings.as_os_str().is_empty() {
            bail!("set one of distill.teacher (a teacher run beside the student) and distill.embeddings (its stored embeddings), not both");
        }
        if !(d.weight >= 0.0 && d.weight.is_finite()) {
            bail!("distill.weight must be a non-negative number, got {}", d.weight);
        }
        if !d.contrastive && !d.active() {
            bail!("distill.contrastive = false leaves no loss: it needs distill.teacher or distill.embeddings");
        }
        if self.data.naflex_seq_lens.contains(&0) || self.data.naflex_batch_divisor == 0 {
            bail!(
                "data.naflex_seq_lens {:?} and data.naflex_batch_divisor {} must be positive",
                self.data.naflex_seq_lens,
                self.data.naflex_batch_divisor
            );
        }
        let factors = &self.data.upsampling_factors;
        if !factors.is_empty() {
            if !self.data.resampled {
                bail!("data.upsampling_factors weights sources drawn with replacement: set data.resampled = true (as open_clip needs --dataset-resampled)");
            }
            let sources = crate::data::spec::source_count(&self.data.train);
            if factors.len() != sources {
                bail!("data.upsampling_factors has {} factors for the {sources} sources `::` joins in data.train", factors.len());
            }
            if factors.iter().any(|f| !(f.is_finite() && *f >= 0.0)) || factors.iter().all(|f| *f == 0.0) {
                bail!("data.upsampling_factors must be non-negative numbers, not all zero: {factors:?}");
            }
        }
        if !(0.0..1.0).contains(&self.loss.label_smoothing) {
            bail!("loss.label_smoothing must be in [0, 1), got {}", self.loss.label_smoothing);
        }
        if self.model.embed_dim == 0 {
            bail!("model.embed_dim must be positive");
        }
        if self.loss.kind == LossKind::Sigmoid {
            let d = ModelConfig::default();
            if (self.model.temperature, self.model.temperature_init) != (d.temperature, d.temperature_init) {
                bail!("with loss.kind = \"sigmoid\" the scale is loss.init_logit_scale: model.temperature and model.temperature_init do not apply");
            }
            if !self.loss.init_logit_scale.is_finite() || !self.loss.init_logit_bias.is_finite() {
                bail!("loss.init_logit_scale and loss.init_logit_bias must be finite numbers");
            }
        }
        if self.model.temperature_init <= 0.0 || self.model.temperature_init.is_nan() {
            bail!("model.temperature_init must be positive, got {}", self.model.temperature_init);
        }
        if self.data.workers == 0 {
            bail!("data.workers must be at least 1");
        }
        if !(self.data.stall_timeout_s > 0.0 && self.data.stall_timeout_s.is_finite()) {
            bail!("data.stall_timeout_s must be a positive number of seconds, got {}", self.data.stall_timeout_s);
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
        Ok(())
    }

    /// The weights' moving average, LiT's locking, FLIP's unmasked tuning, and the image and
    /// optimizer sections' own checks.
    fn check_average_and_locks(&self) -> Result<()> {
        let t = &self.train;
        if !(0.0..1.0).contains(&t.ema_decay) {
            bail!("train.ema_decay must be in [0, 1) (0 = no average), got {}", t.ema_decay);
        }
        if t.ema_warmup
            && (t.ema_warmup_gamma <= 0.0 || t.ema_warmup_power <= 0.0 || t.ema_warmup_gamma.is_nan() || t.ema_warmup_power.is_nan())
        {
            bail!("train.ema_warmup_gamma and train.ema_warmup_power must be positive");
        }
        if t.ema_eval && t.ema_decay == 0.0 {
            bail!("train.ema_eval evaluates the weight average, but train.ema_decay is 0 (no average)");
        }
        let m = &self.model;
        if (m.lock_image_unlocked_groups > 0 || m.lock_image_freeze_bn_stats) && !m.lock_image {
            bail!("model.lock_image_unlocked_groups and model.lock_image_freeze_bn_stats apply to a locked image tower: set model.lock_image = true");
        }
        if (m.lock_text_unlocked_layers > 0 || m.lock_text_freeze_layer_norm) && !m.lock_text {
            bail!("model.lock_text_unlocked_layers and model.lock_text_freeze_layer_norm apply to a locked text tower: set model.lock_text = true");
        }
        if t.unmasked_tuning_steps > t.steps {
            bail!("train.unmasked_tuning_steps {} exceeds train.steps {}", t.unmasked_tuning_steps, t.steps);
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
        // The sigmoid loss's t = exp(s) is CLIP's log-parameterised scale (clamped at 100, as
        // open_clip's training clamps it for SigLIP too) plus a bias.
        let sigmoid = self.loss.kind == LossKind::Sigmoid;
        Ok(ModelSpec {
            image,
            text: TextSpec::Bert(bert),
            text_projection_bias: m.text_projection_bias,
            text_projection_hidden: None,
            embed_dim: m.embed_dim,
            image_projection: m.image_projection,
            text_pooling: m.text_pooling,
            temperature: if sigmoid { TemperatureKind::Clip } else { m.temperature },
            temperature_init: if sigmoid { (-self.loss.init_logit_scale).exp() } else { m.temperature_init },
            logit_bias: sigmoid.then_some(self.loss.init_logit_bias),
        })
    }

    pub fn run_dir(&self) -> PathBuf {
        self.run.out_dir.join(&self.run.name)
    }

    pub fn to_toml(&self) -> Result<String> {
        Ok(toml::to_string_pretty(self)?)
    }
}

/// The value at the dotted `path` (`data.image.mean`) of a config's table, if it is there.
pub fn value_at<'a>(table: &'a toml::Table, path: &str) -> Option<&'a toml::Value> {
    let mut parts = path.split('.');
    let first = table.get(parts.next()?)?;
    parts.try_fold(first, |v, k| v.get(k))
}

/// The section of a config's table that holds the field at the dotted `path`, and the field's
/// own key (`data.image.mean` → the `[data.image]` table and `mean`).
pub fn section_of<'a, 'p>(table: &'a mut toml::Table, path: &'p str) -> Option<(&'a mut toml::Table, &'p str)> {
    let (keys, leaf) = path.rsplit_once('.')?;
    let section = keys.split('.').try_fold(table, |t, k| t.get_mut(k)?.as_table_mut())?;
    Some((section, leaf))
}

/// The key a config file names its base with: `extends = "demo.toml"` (relative to the file)
/// takes every value of the base, and the file's own values replace the base's one by one.
pub const EXTENDS: &str = "extends";

/// The table of the config file at `path`, over the file it extends (and that file's base, ...).
pub fn read_file(path: &Path) -> Result<toml::Table> {
    read_extending(path, &mut Vec::new())
}

fn read_extending(path: &Path, chain: &mut Vec<PathBuf>) -> Result<toml::Table> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
    let mut table: toml::Table = toml::from_str(&text).with_context(|| format!("config {}", path.display()))?;
    let Some(base) = table.remove(EXTENDS) else { return Ok(table) };
    let base = base.as_str().with_context(|| format!("config {}: {EXTENDS} must be a file name, not {base}", path.display()))?;
    let base = path.parent().unwrap_or(Path::new("")).join(base);
    let canonical = base.canonicalize().with_context(|| format!("config {}: {EXTENDS} {}", path.display(), base.display()))?;
    if chain.contains(&canonical) {
        bail!("config {}: {EXTENDS} {} leads back to a file it came from", path.display(), base.display());
    }
    chain.push(canonical);
    let mut merged = read_extending(&base, chain)?;
    overlay(&mut merged, table);
    Ok(merged)
}

/// `over`'s values in place of `base`'s, section by section.
fn overlay(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => overlay(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// A value as a config file writes it (`"shorter"`, `[0.5, 0.5, 0.5]`), so that a line can be
/// copied into `--set` as it is.
pub fn as_written<T: serde::Serialize>(v: &T) -> String {
    match toml::Value::try_from(v) {
        Ok(t) => render(&t),
        // What TOML cannot hold (an unset option) reads as JSON's null.
        Err(_) => serde_json::to_string(v).unwrap_or_default(),
    }
}

/// A TOML value with its floats as short as they round-trip: an f32 field's 0.48 is written
/// 0.48, not the 0.47999998927116394 its widening to f64 gives.
fn render(v: &toml::Value) -> String {
    match v {
        toml::Value::Float(x) if (*x as f32) as f64 == *x => {
            let short = format!("{}", *x as f32);
            if short.contains(['.', 'e', 'n', 'i']) {
                short
            } else {
                format!("{short}.0")
            }
        }
        toml::Value::Array(items) => format!("[{}]", items.iter().map(render).collect::<Vec<_>>().join(", ")),
        other => other.to_string(),
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

    /// ALIGN §4.1 and §5, number by number.
    #[test]
    fn defaults_are_aligns_recipe() {
        let c = Config::default();
        assert_eq!((c.model.image_tower.as_str(), c.model.text_tower.as_str()), ("efficientnet-b7", "bert-base"));
        assert!(!c.model.image_projection, "ALIGN embeds the EfficientNet's pooled feature unprojected");
        assert_eq!(c.model.embed_dim, 640);
        assert_eq!((c.model.text_pooling, c.model.temperature), (TextPooling::Cls, TemperatureKind::Align));
        assert_eq!(c.model.temperature_init, 1.0);
        assert_eq!(c.loss.label_smoothing, 0.1);
        assert_eq!(toml::Value::try_from(c.optimizer.kind).unwrap().as_str(), Some("lamb"));
        assert_eq!(c.optimizer.weight_decay, 1e-5);
        assert_eq!((c.train.lr, c.train.warmup_steps, c.train.schedule), (1e-3, 10_000, ScheduleKind::Linear));
        assert_eq!((c.train.batch_size, c.train.steps), (16384, 1_200_000));
        assert_eq!((c.data.image.resize, c.data.image.image_size), (346, 289));
        assert_eq!((c.text.max_len, c.text.vocab_size), (64, 100_000));
    }

    #[test]
    fn the_defaults_are_a_runnable_experiment() {
        let c = Config::default();
        c.validate().unwrap();
        let spec = c.model_spec(100_000).unwrap();
        assert!(matches!(spec.image, ImageSpec::EfficientNet(_)));
        assert_eq!((spec.image.image_size(), spec.image.width(), spec.embed_dim), (289, 640, 640));
        let text = spec.text.bert().unwrap();
        assert_eq!((text.layers, text.hidden, text.vocab_size), (12, 768, 100_000));
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
        for key in ["train.precision", "distill.precision"] {
            let err = format!("{:#}", Config::from_str_with_overrides("", "x.toml", &[format!("{key}=\"int8\"")]).unwrap_err());
            assert!(err.contains(key) && err.contains("int8"), "{err}");
        }
    }

    #[test]
    fn upsampling_factors_need_resampling_and_one_factor_per_source() {
        let with = |extra: &[&str]| {
            let mut o: Vec<String> = vec!["data.train=a/{0..3}.tar::b/{0..9}.tar".into()];
            o.extend(extra.iter().map(|s| s.to_string()));
            Config::from_str_with_overrides("", "x.toml", &o).map_err(|e| format!("{e:#}"))
        };
        let e = with(&["data.upsampling_factors=[1.0, 2.0]"]).unwrap_err();
        assert!(e.contains("data.resampled"), "{e}");
        let e = with(&["data.resampled=true", "data.upsampling_factors=[1.0]"]).unwrap_err();
        assert!(e.contains("1 factors for the 2 sources"), "{e}");
        let e = with(&["data.resampled=true", "data.upsampling_factors=[1.0, -2.0]"]).unwrap_err();
        assert!(e.contains("non-negative"), "{e}");
        assert_eq!(with(&["data.resampled=true", "data.upsampling_factors=[1.0, 0.5]"]).unwrap().data.upsampling_factors, [1.0, 0.5]);
    }

    fn shipped_configs() -> Vec<PathBuf> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/configs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .collect();
        paths.sort();
        paths
    }

    fn shipped(name: &str, overrides: &[String]) -> Config {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs").join(name);
        Config::load(&path, overrides).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()))
    }

    /// Every experiment file describes a model that can be built: a config with `model.init` takes
    /// its sizes from the checkpoint, but its `[model]` section must still be consistent.
    #[test]
    fn the_shipped_configs_parse_and_build_a_model() {
        let paths = shipped_configs();
        assert!(paths.iter().any(|p| p.ends_with("align-b7-bert-base.toml")), "{paths:?}");
        for path in paths {
            let cfg = Config::load(&path, &[]).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            cfg.model_spec(1000).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
        }
    }

    /// The paper's recipe file only names the run and its data: every number of the recipe is the
    /// default's.
    #[test]
    fn the_paper_recipe_file_is_the_defaults() {
        let (c, d) = (shipped("align-b7-bert-base.toml", &[]), Config::default());
        assert_eq!((&c.model, &c.loss, &c.optimizer, &c.text, &c.data.image), (&d.model, &d.loss, &d.optimizer, &d.text, &d.data.image));
        let recipe = |t: &TrainConfig| (t.batch_size, t.accum_steps, t.steps, t.lr, t.warmup_steps, t.schedule, t.precision);
        assert_eq!(recipe(&c.train), recipe(&d.train));
    }

    /// The towers and embedding sizes that the ablation files tell the user to set (ALIGN §6.1,
    /// Figure 3 and Table 8) all build.
    #[test]
    fn the_ablation_overrides_build() {
        let images = ["efficientnet-b1", "efficientnet-b3", "efficientnet-b5", "efficientnet-b7", "efficientnet-l2"];
        let texts = ["bert-mini", "bert-medium", "bert-base", "bert-large"];
        for image in images {
            for text in texts {
                // B7's feature is 640 wide already: §6.1 projects only the other towers.
                let projection = image != "efficientnet-b7";
                let set = [
                    format!("model.image_tower={image:?}"),
                    format!("model.text_tower={text:?}"),
                    format!("model.image_projection={projection}"),
                ];
                let spec = shipped("ablation-b5-bert-base.toml", &set).model_spec(1000).unwrap();
                assert_eq!((spec.embed_dim, spec.image_projection), (640, projection), "{image} + {text}");
            }
        }
        for dim in [320, 160, 80] {
            let c = shipped("ablation-b5-bert-base.toml", &[format!("model.embed_dim={dim}")]);
            assert_eq!(c.model_spec(1000).unwrap().embed_dim, dim);
        }
        for name in ["ablation-b3-bert-mini.toml", "ablation-b7-bert-base.toml"] {
            let c = shipped(name, &["train.steps=100000".into()]);
            assert_eq!(c.train.steps, 100_000);
            c.model_spec(1000).unwrap();
        }
    }

    /// `--set` on the command line states the run's length over the file's, in any of its
    /// three forms; two lengths in the file itself are still an error.
    #[test]
    fn a_length_set_on_the_command_line_replaces_the_files() {
        let file = "[train]\nsteps = 5000\n";
        let c = Config::from_str_with_overrides(file, "f.toml", &["train.epochs=10".into()]).unwrap();
        assert_eq!((c.train.epochs, c.train.steps), (10.0, Config::default().train.steps));
        let c = Config::from_str_with_overrides("[train]\nepochs = 3.0\n", "f.toml", &["train.steps=7".into()]).unwrap();
        assert_eq!((c.train.epochs, c.train.steps), (0.0, 7));
        let c = Config::from_str_with_overrides(file, "f.toml", &["train.samples=100".into()]).unwrap();
        assert_eq!(c.train.samples, 100);
        let e = Config::from_str_with_overrides("[train]\nsteps = 5\nepochs = 2.0\n", "f.toml", &[]).unwrap_err();
        assert!(format!("{e:#}").contains("set one of"), "{e:#}");
    }

    /// A file that extends another takes its values, replaces them section by section, counts
    /// the base's values as set in a file, and refuses a cycle by name.
    #[test]
    fn a_config_extends_its_base_value_by_value() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        write("base.toml", "[train]\nsteps = 50\nlr = 0.5\n[model.vit]\nwidth = 64\ndepth = 2\n");
        write("mid.toml", "extends = \"base.toml\"\n[train]\nlr = 0.25\n");
        write("top.toml", "extends = \"mid.toml\"\n[model.vit]\ndepth = 3\n");
        let c = Config::load(&dir.path().join("top.toml"), &["train.steps=60".into()]).unwrap();
        assert_eq!((c.train.steps, c.train.lr, c.model.vit.width, c.model.vit.depth), (60, 0.25, Some(64), Some(3)));
        assert!(c.is_explicit("model.vit.width") && !c.is_explicit("train.batch_size"));
        write("loop.toml", "extends = \"top2.toml\"\n");
        write("top2.toml", "extends = \"loop.toml\"\n");
        let e = format!("{:#}", Config::load(&dir.path().join("loop.toml"), &[]).unwrap_err());
        assert!(e.contains("leads back"), "{e}");
        let e = format!("{:#}", Config::from_str_with_overrides("extends = \"base.toml\"\n", "inline", &[]).unwrap_err());
        assert!(e.contains("read from a file"), "{e}");
    }

    /// The demo's variants are the demo with their own few lines.
    #[test]
    fn the_demo_variants_are_the_demo_and_their_changes() {
        let paths = [
            "data.train=\"runs/demo/data/train-{00000..00007}.tar\"".to_string(),
            "text.tokenizer=\"runs/demo/data/tokenizer.json\"".into(),
            "eval.zeroshot=\"runs/demo/data/test-00000.tar\"".into(),
            "eval.retrieval=\"runs/demo/data/test-00000.tar\"".into(),
            "eval.classes=\"runs/demo/data/classes.txt\"".into(),
            "eval.templates=\"runs/demo/data/templates.txt\"".into(),
        ];
        let with = |more: &[&str]| paths.iter().cloned().chain(more.iter().map(|s| s.to_string())).collect::<Vec<_>>();
        let cases: [(&str, Vec<String>); 3] = [
            (
                "demo-ema.toml",
                with(&["run.name=\"demo-ema\"", "train.ema_decay=0.995", "train.ema_warmup_power=0.75", "train.ema_eval=true"]),
            ),
            ("demo-flip.toml", with(&["run.name=\"demo-flip\"", "model.vit.patch_dropout=0.5", "train.unmasked_tuning_steps=50"])),
            (
                "demo-sigmoid.toml",
                with(&[
                    "run.name=\"demo-sigmoid\"",
                    "model.temperature=\"align\"",
                    "model.temperature_init=1.0",
                    "loss.kind=\"sigmoid\"",
                    "loss.dist_impl=\"shift\"",
                ]),
            ),
        ];
        for (variant, overrides) in cases {
            assert_eq!(shipped(variant, &[]), shipped("demo.toml", &overrides), "{variant}");
        }
    }
}
