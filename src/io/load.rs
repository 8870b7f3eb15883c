//! Loading a model to use it (evaluate, embed, search, score, export) from any location
//! [`crate::io::registry::locate`] resolves, in any format align reads.

use crate::config::Precision;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use super::format::{Format, ModelFiles, Usage};
use super::registry::locate;
use crate::data::tokenizer::TextTokenizer;
use crate::model::dual_encoder::{DualEncoder, ModelSpec};
use crate::model::init::FixedVars;

/// A model restored from a checkpoint, with what is needed to use it. Its weights are plain
/// tensors, not variables: a forward pass records no graph.
pub struct LoadedModel {
    pub model: DualEncoder,
    /// The weights under align's names, as read (f32).
    pub weights: HashMap<String, Tensor>,
    pub tokenizer: TextTokenizer,
    /// The checkpoint's own preprocessing, text length and loss family.
    pub usage: Usage,
    pub dir: PathBuf,
    pub format: &'static dyn Format,
    /// The training step, for checkpoints that record one.
    pub step: Option<u64>,
    /// The precision its matrix products run in (`--precision`, which the command that loaded
    /// it sets with [`LoadedModel::set_precision`]), as results record it.
    pub precision: Precision,
    /// Under int8 and bf16, its weights frozen: each packed once, on its first product.
    frozen: Option<crate::model::FrozenWeights>,
}

impl LoadedModel {
    /// Records the precision its products run in (the process's switch, which the command sets
    /// before loading). Under int8 and bf16 its weights, which nothing writes, are frozen for as
    /// long as it lives, so that each is quantized or packed once rather than at every product.
    /// The bf16 panels hold half the weights' size again (about 290 MiB for CLIP ViT-B/32, whose
    /// peak stays below PyTorch's under autocast); packing at every product had been 4% of its
    /// bf16 embedding, more for a text tower that runs a batch as several length groups.
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
        let packs = matches!(precision, Precision::Int8 | Precision::Bf16);
        self.frozen = packs.then(|| crate::model::freeze_weights(self.weights.values()));
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.model.spec
    }

    /// The model as a format writes it: f32 weights on the CPU.
    pub fn files(&self) -> Result<ModelFiles<'_>> {
        let tensors = self
            .weights
            .iter()
            .map(|(k, t)| Ok((k.clone(), t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        Ok(ModelFiles { spec: &self.model.spec, tensors, tokenizer: &self.tokenizer, usage: &self.usage })
    }
}

/// Loads a model onto `device` from a checkpoint, a run directory (its latest checkpoint), a
/// Hugging Face or open_clip directory, or `hf:ID[@REVISION]`.
pub fn load_model(path: &Path, device: &Device) -> Result<LoadedModel> {
    load_model_with(path, device, false)
}

/// [`load_model`], with the weights' moving average in place of the weights when `ema` is set
/// (`--ema`; an align checkpoint of a run with `train.ema_decay`).
pub fn load_model_with(path: &Path, device: &Device, ema: bool) -> Result<LoadedModel> {
    let located = locate(&path.to_string_lossy())?;
    let (dir, format) = (located.dir.clone(), located.format);
    let spec = format.spec(&dir)?;
    let origin = dir.join(format.config_file()).display().to_string();
    super::limits::check_against_weights(&spec, &format.weight_shapes(&dir)?, &origin)?;
    let weights = if ema {
        match format.ema_weights(&dir, device)? {
            Some(w) => w,
            None if format.name() == "align" => {
                bail!(
                    "--ema: {} has no ema.safetensors: its run kept no moving average of the weights (train.ema_decay = 0)",
                    dir.display()
                )
            }
            None => {
                bail!("--ema: {} is a {} checkpoint, which holds one set of weights and no moving average", path.display(), format.name())
            }
        }
    } else {
        format.weights(&dir, &spec, device)?
    };
    let weights = used_weights(&spec, weights, &origin)?;
    let model = DualEncoder::new(&spec, FixedVars::builder(weights.clone(), DType::F32, device))
        .with_context(|| format!("building the model of {origin}"))?;
    let tokenizer = format.tokenizer(&dir, &spec, None)?;
    check_vocabulary(&tokenizer, &spec, &origin)?;
    let usage = format.usage(&dir, &spec)?;
    Ok(LoadedModel { model, weights, tokenizer, usage, step: format.step(&dir), dir, format, precision: Precision::F32, frozen: None })
}

/// The weights the model uses, with those it has no use for reported once: every planned
/// parameter must be there at its shape (missing and mis-shaped ones are listed together).
fn used_weights(spec: &ModelSpec, mut weights: HashMap<String, Tensor>, origin: &str) -> Result<HashMap<String, Tensor>> {
    let planned = super::limits::planned_parameters(spec)?;
    let shapes: HashMap<String, Vec<usize>> = weights.iter().map(|(k, t)| (k.clone(), t.dims().to_vec())).collect();
    super::limits::check_against_weights(spec, &shapes, origin)?;
    let mut unused: Vec<String> =
        weights.keys().filter(|k| !planned.contains_key(*k) && !super::tensors::is_unused_tensor(k)).cloned().collect();
    if !unused.is_empty() {
        unused.sort();
        crate::util::log::warn(format!("{origin}: {} tensors not used: {unused:?}", unused.len()));
    }
    weights.retain(|k, _| planned.contains_key(k));
    for (name, t) in &weights {
        super::tensors::check_weight(name, t, origin)?;
    }
    Ok(weights)
}

/// A tokenizer whose ids run past the text tower's embedding table fails at load, not inside the
/// first batch that meets such an id.
pub fn check_vocabulary(tokenizer: &TextTokenizer, spec: &ModelSpec, origin: &str) -> Result<()> {
    let (ids, table) = (tokenizer.vocab_size(), spec.text.vocab_size());
    if ids > table {
        bail!("{origin}: the tokenizer has {ids} tokens but the text tower's embedding table only {table}");
    }
    Ok(())
}
