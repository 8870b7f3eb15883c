//! The checkpoint formats align reads and writes: the [`Format`] trait and the types it speaks
//! in (a model's [`Usage`], the [`ModelFiles`] a writer takes), and below it one module per
//! format: align's own run checkpoints (`align_run`), Hugging Face's model folders (`hf/`: one
//! format for `AlignModel`, `CLIPModel`, `SiglipModel` and `VisionTextDualEncoderModel`, with
//! their configs, processors and `hf:` hub locations) and open_clip's (`open_clip/`).
//!
//! A format knows how to recognise its files, and how to read the model's sizes, its weights
//! under align's parameter names, its tokenizer and the preprocessing it was published with; the
//! formats align can also write know how to write them. Which formats exist, and which one a
//! location holds, is the registry's business (`io::registry`), above this module: no format
//! knows the others.

pub mod align_run;
pub mod config_error;
pub mod hf;
pub mod open_clip;

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::{Device, Tensor};
use serde::Serialize;

use crate::config::LossKind;
use crate::data::tokenizer::TextTokenizer;
use crate::data::transform::ImageConfig;
use crate::model::dual_encoder::ModelSpec;

/// How a checkpoint's model is meant to be used, as the checkpoint itself says: the image
/// preprocessing it was published with, the text length its tokenizer pads and cuts to, and the
/// loss family it was trained with. Evaluation uses it as it is; a run starting from the
/// checkpoint takes it as its defaults.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Usage {
    pub image: ImageConfig,
    pub text_len: usize,
    pub loss: LossKind,
}

/// A model ready to be written in some format: its sizes, its weights (f32, on the CPU, under
/// align's names), its tokenizer and how it is used.
pub struct ModelFiles<'a> {
    pub spec: &'a ModelSpec,
    pub tensors: HashMap<String, Tensor>,
    pub tokenizer: &'a TextTokenizer,
    pub usage: &'a Usage,
}

/// Fetches a file of a hub repository into the local snapshot: `Ok(Some(path))` when the
/// repository has it, `Ok(None)` when it has not (or, offline, the cache has not).
pub type HubFetch<'a> = dyn FnMut(&str) -> Result<Option<std::path::PathBuf>> + 'a;

/// One checkpoint format.
pub trait Format: Sync {
    /// The name users see and pass to `export --format` (`align`, `AlignModel`, `open_clip`, ...).
    fn name(&self) -> &'static str;

    /// What the format is, in a few words, for listings and errors.
    fn describe(&self) -> &'static str;

    /// Whether the config files in `dir` say it holds this format (its weights may be absent).
    fn claims(&self, dir: &Path) -> bool;

    /// The file that states the model's sizes (named when they disagree with the weights).
    fn config_file(&self) -> &'static str {
        "config.json"
    }

    /// Whether the weights this format reads are in `dir`.
    fn has_weights(&self, dir: &Path) -> bool;

    /// Whether `dir` holds a complete checkpoint of this format: its config and its weights.
    fn detect(&self, dir: &Path) -> bool {
        self.claims(dir) && self.has_weights(dir)
    }

    /// Brings the files this format reads from a hub repository whose config files
    /// (`config.json`, `open_clip_config.json`) are already in the snapshot. Missing optional
    /// files are not errors here; [`Format::detect`] decides afterwards.
    fn fetch_from_hub(&self, fetch: &mut HubFetch) -> Result<()>;

    /// The model's sizes.
    fn spec(&self, dir: &Path) -> Result<ModelSpec>;

    /// Every weight of the model under align's parameter names, on `device`.
    fn weights(&self, dir: &Path, spec: &ModelSpec, device: &Device) -> Result<HashMap<String, Tensor>>;

    /// The name and shape of every weight under align's names, read without loading the weights
    /// where the format allows (a safetensors header holds every shape).
    fn weight_shapes(&self, dir: &Path) -> Result<HashMap<String, Vec<usize>>> {
        let weights = self.weights(dir, &self.spec(dir)?, &Device::Cpu)?;
        Ok(weights.into_iter().map(|(k, t)| (k, t.dims().to_vec())).collect())
    }

    /// A file of the weights' moving average under the same names, if the format keeps one.
    fn ema_weights(&self, _dir: &Path, _device: &Device) -> Result<Option<HashMap<String, Tensor>>> {
        Ok(None)
    }

    /// The checkpoint's tokenizer, cutting and padding to `max_len` tokens (its own length when
    /// `None`).
    fn tokenizer(&self, dir: &Path, spec: &ModelSpec, max_len: Option<usize>) -> Result<TextTokenizer>;

    /// How the checkpoint is used: its preprocessing, text length and loss family.
    fn usage(&self, dir: &Path, spec: &ModelSpec) -> Result<Usage>;

    /// The training step of the checkpoint, where the format records one.
    fn step(&self, _dir: &Path) -> Option<u64> {
        None
    }

    /// Whether align writes this format at all (for some model sizes).
    fn writes(&self) -> bool {
        false
    }

    /// Whether this is one of Hugging Face transformers' model classes (what `export --format hf`
    /// chooses among).
    fn hugging_face(&self) -> bool {
        false
    }

    /// Whether a model of these sizes can be written in this format, and if not, why.
    fn can_write(&self, _spec: &ModelSpec) -> std::result::Result<(), String> {
        Err(format!("align does not write {} checkpoints", self.name()))
    }

    /// Writes the model into `out`, an empty directory that exists.
    fn write(&self, _model: &ModelFiles, _out: &Path) -> Result<()> {
        anyhow::bail!("align does not write {} checkpoints", self.name())
    }
}

/// The loss family of a model of these sizes: sigmoid where it carries a logit bias (SigLIP),
/// else softmax.
pub fn loss_of(spec: &ModelSpec) -> LossKind {
    if spec.logit_bias.is_some() {
        LossKind::Sigmoid
    } else {
        LossKind::Softmax
    }
}
