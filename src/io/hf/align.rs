//! Hugging Face `AlignModel` directories: loading one as an align model, and writing align's
//! EfficientNet + BERT models as one that `transformers.AlignModel.from_pretrained` loads.

use std::path::Path;

use anyhow::{anyhow, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;

use serde_json::Value;

use super::files::{f32_tensors, load_prefixed, read_json, read_tokenizer, read_weights, HfDir, BERT_SPECIALS};
use super::layout::{align_spec_from_hf, align_spec_to_hf};
use crate::config::Config;
use crate::data::tokenizer::TextTokenizer;
use crate::data::transform::ImageConfig;
use crate::io::load::LoadedModel;
use crate::model::dual_encoder::{DualEncoder, ModelSpec};
use crate::model::init::SeededVars;

/// The image settings of a Hugging Face checkpoint: its `preprocessor_config.json` when present,
/// else ALIGN's (resize to 346/289 of the input size, center crop, x/127.5 − 1).
fn image_config(dir: &Path, image_size: usize) -> Result<crate::data::transform::ImageConfig> {
    let processor = dir.join("preprocessor_config.json");
    if processor.exists() {
        return super::preprocess::read_image_config(&processor);
    }
    Ok(crate::data::transform::ImageConfig { image_size, resize: (image_size * 346).div_ceil(289), ..Default::default() })
}

/// Loads a Hugging Face `AlignModel` directory as an align model.
pub fn load_hf_align(dir: &Path, device: &Device) -> Result<LoadedModel> {
    let hf = read_json(&dir.join("config.json"))?;
    let spec = align_spec_from_hf(&hf).map_err(|e| anyhow!("{}: {e}", dir.join("config.json").display()))?;
    let mut config = Config::default();
    config.data.image = image_config(dir, spec.image.image_size())?;
    config.model.embed_dim = spec.embed_dim;
    config.model.image_projection = false;
    let tokenizer = read_tokenizer(dir, config.text.max_len)?;
    let varmap = VarMap::new();
    let model = DualEncoder::new(&spec, SeededVars::builder(&varmap, 0, device))?;
    let weights = read_weights(dir, device)?;
    let origin = dir.display().to_string();
    let loaded = load_prefixed(&varmap, &weights, "", "", &origin)?;
    debug_assert_eq!(loaded, varmap.all_vars().len());
    Ok(LoadedModel { model, varmap, tokenizer, config, dir: dir.to_path_buf() })
}

/// Writes an ALIGN-architecture model as a Hugging Face `AlignModel` directory: `config.json`,
/// `model.safetensors` (with zero BatchNorm batch counters and an unused zero BERT pooler, which
/// transformers expects), the tokenizer files and the `preprocessor_config.json` of `image`, so
/// that `AlignProcessor` and the zero-shot pipeline load it.
pub fn export_hf_align(spec: &ModelSpec, vm: &VarMap, tokenizer: &TextTokenizer, image: &ImageConfig, out: &Path) -> Result<()> {
    let config = align_spec_to_hf(spec).map_err(anyhow::Error::msg)?;
    let mut tensors = f32_tensors(vm)?;
    let counters: Vec<String> =
        tensors.keys().filter_map(|n| n.strip_suffix("running_mean")).map(|p| format!("{p}num_batches_tracked")).collect();
    for name in counters {
        tensors.insert(name, Tensor::zeros((), DType::I64, &Device::Cpu)?);
    }
    // AlignTextModel carries BERT's pooler, which ALIGN never uses; zeros keep transformers from
    // reporting it as missing.
    let h = spec.text.width();
    tensors.insert("text_model.pooler.dense.weight".into(), Tensor::zeros((h, h), DType::F32, &Device::Cpu)?);
    tensors.insert("text_model.pooler.dense.bias".into(), Tensor::zeros(h, DType::F32, &Device::Cpu)?);
    HfDir {
        config,
        tensors,
        tokenizer_class: "BertTokenizer",
        specials: &BERT_SPECIALS,
        tokenizer_extra: Value::Null,
        image_processor: "EfficientNetImageProcessor",
        processor: "AlignProcessor",
    }
    .write(tokenizer, image, out)
}
