//! Loading a model to use it: an align checkpoint or run directory, a Hugging Face `AlignModel`
//! directory, or `hf:ID[@REVISION]`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::Device;
use candle_nn::VarMap;

use super::run_dir::{resolve, CONFIG_FILE, EMA_FILE, MODEL_FILE, SPEC_FILE, TOKENIZER_FILE};
use super::tensors::{load_strict, read_tensors};

/// The `model_type` of a Hugging Face model directory (one with a `config.json` and no align
/// checkpoint files).
fn hf_model_type(dir: &Path) -> Option<String> {
    if dir.join(SPEC_FILE).is_file() {
        return None;
    }
    let config = super::hf::files::read_json(&dir.join("config.json")).ok()?;
    config.get("model_type")?.as_str().map(str::to_string)
}

/// A model restored from a checkpoint directory, with what is needed to use it.
pub struct LoadedModel {
    pub model: crate::model::dual_encoder::DualEncoder,
    pub varmap: VarMap,
    pub tokenizer: crate::data::tokenizer::TextTokenizer,
    pub config: crate::config::Config,
    pub dir: PathBuf,
}

/// Loads a model onto `device` from an align checkpoint, a run directory (its latest checkpoint),
/// a Hugging Face `AlignModel` directory, or `hf:ID[@REVISION]`.
pub fn load_model(path: &Path, device: &Device) -> Result<LoadedModel> {
    load_model_with(path, device, false)
}

/// [`load_model`], with the weights' moving average in place of the weights when `ema` is set
/// (`--ema`; an align checkpoint of a run with `train.ema_decay`).
pub fn load_model_with(path: &Path, device: &Device, ema: bool) -> Result<LoadedModel> {
    let located = super::hf::hub::resolve_location(&path.to_string_lossy())?;
    if let Some(model_type) = hf_model_type(&located) {
        if ema {
            anyhow::bail!("--ema: {} is a Hugging Face model, which holds one set of weights and no moving average", path.display());
        }
        return match model_type.as_str() {
            "align" => super::hf::align::load_hf_align(&located, device),
            "clip" | "siglip" => super::hf::clip::load_hf_clip(&located, device),
            "vision-text-dual-encoder" => super::hf::vtde::load_hf_vtde(&located, device),
            other => anyhow::bail!(
                "{} is a Hugging Face {other:?} model; align loads its own checkpoints and run directories and Hugging Face \"align\" (AlignModel), \"clip\" (CLIPModel), \"siglip\" (SiglipModel) and \"vision-text-dual-encoder\" (ViT + BERT) directories",
                path.display()
            ),
        };
    }
    let dir = resolve(&located)?;
    let config = crate::config::Config::load(&dir.join(CONFIG_FILE), &[])?;
    let spec_path = dir.join(SPEC_FILE);
    let spec: crate::model::dual_encoder::ModelSpec =
        serde_json::from_str(&std::fs::read_to_string(&spec_path).with_context(|| format!("reading {}", spec_path.display()))?)
            .with_context(|| format!("parsing {}", spec_path.display()))?;
    let tokenizer = crate::data::tokenizer::TextTokenizer::from_file(&dir.join(TOKENIZER_FILE), config.text.max_len)?;
    let varmap = VarMap::new();
    let model = crate::model::dual_encoder::DualEncoder::new(&spec, crate::model::init::SeededVars::builder(&varmap, 0, device))?;
    let file = dir.join(if ema { EMA_FILE } else { MODEL_FILE });
    if ema && !file.is_file() {
        anyhow::bail!("--ema: {} has no {EMA_FILE}: its run kept no moving average of the weights (train.ema_decay = 0)", dir.display());
    }
    load_strict(&varmap, &read_tensors(&file, device)?, &file)?;
    Ok(LoadedModel { model, varmap, tokenizer, config, dir })
}
