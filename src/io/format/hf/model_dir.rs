//! What the Hugging Face formats share: a `config.json` whose `model_type` names the model, the
//! weights in `model.safetensors` (or an index and its shards) under names align's towers also
//! use, and the tokenizer and processor files beside them. Each model class says only what
//! differs ([`HfLayout`]); [`Hf`] makes it a checkpoint format.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, Result};
use candle_core::{Device, Tensor};
use serde_json::Value;

use super::files::{fetch_hf_model, has_hf_weights, is_hf_model, read_json, read_weights, weight_shapes};
use crate::data::tokenizer::TextTokenizer;
use crate::io::format::{Format, HubFetch, ModelFiles, Usage};
use crate::model::dual_encoder::ModelSpec;

/// One Hugging Face model class as align reads and writes it.
pub trait HfLayout: Sync {
    /// The class (`CLIPModel`), the format's name.
    const CLASS: &'static str;
    /// What it is, in a few words.
    const DESCRIBE: &'static str;
    /// The `model_type` of its `config.json`.
    const MODEL_TYPE: &'static str;

    /// The model's sizes from its `config.json`.
    fn spec_from(&self, config: &Value) -> Result<ModelSpec, String>;

    /// The model's sizes from its `config.json` and, where they change how it runs, the other
    /// files of its directory.
    fn spec_in(&self, _dir: &Path, config: &Value) -> Result<ModelSpec, String> {
        self.spec_from(config)
    }

    /// The `config.json` of a model of these sizes, or why the class cannot hold it.
    fn config_of(&self, spec: &ModelSpec) -> Result<Value, String>;

    fn tokenizer(&self, dir: &Path, spec: &ModelSpec, max_len: Option<usize>) -> Result<TextTokenizer>;

    fn usage(&self, dir: &Path, spec: &ModelSpec) -> Result<Usage>;

    /// Writes the model's directory (config, weights, tokenizer and processor files).
    fn write(&self, m: &ModelFiles, out: &Path) -> Result<()>;
}

/// A Hugging Face model class as a checkpoint format.
pub struct Hf<L>(pub L);

impl<L: HfLayout> Format for Hf<L> {
    fn name(&self) -> &'static str {
        L::CLASS
    }

    fn describe(&self) -> &'static str {
        L::DESCRIBE
    }

    fn claims(&self, dir: &Path) -> bool {
        is_hf_model(dir, L::MODEL_TYPE)
    }

    fn has_weights(&self, dir: &Path) -> bool {
        has_hf_weights(dir)
    }

    fn fetch_from_hub(&self, fetch: &mut HubFetch) -> Result<()> {
        fetch_hf_model(fetch)
    }

    fn spec(&self, dir: &Path) -> Result<ModelSpec> {
        let path = dir.join("config.json");
        self.0.spec_in(dir, &read_json(&path)?).map_err(|e| anyhow!("{}: {e}", path.display()))
    }

    fn weights(&self, dir: &Path, _spec: &ModelSpec, device: &Device) -> Result<HashMap<String, Tensor>> {
        read_weights(dir, device)
    }

    fn weight_shapes(&self, dir: &Path) -> Result<HashMap<String, Vec<usize>>> {
        weight_shapes(dir)
    }

    fn tokenizer(&self, dir: &Path, spec: &ModelSpec, max_len: Option<usize>) -> Result<TextTokenizer> {
        self.0.tokenizer(dir, spec, max_len)
    }

    fn usage(&self, dir: &Path, spec: &ModelSpec) -> Result<Usage> {
        self.0.usage(dir, spec)
    }

    fn writes(&self) -> bool {
        true
    }

    fn hugging_face(&self) -> bool {
        true
    }

    fn can_write(&self, spec: &ModelSpec) -> std::result::Result<(), String> {
        self.0.config_of(spec).map(|_| ())
    }

    fn write(&self, m: &ModelFiles, out: &Path) -> Result<()> {
        self.0.write(m, out)
    }
}
