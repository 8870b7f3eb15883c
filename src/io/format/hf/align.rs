//! Hugging Face `AlignModel` directories: loading one as an align model, and writing align's
//! EfficientNet + BERT models as one that `transformers.AlignModel.from_pretrained` loads.

use std::path::Path;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use super::files::{model_max_length, read_tokenizer, HfDir, BERT_SPECIALS};
use super::layout::{align_spec_from_hf, align_spec_to_hf};
use super::model_dir::HfLayout;
use super::preprocess::read_dir_image_config;
use crate::config::LossKind;
use crate::data::tokenizer::TextTokenizer;
use crate::data::transform::ImageConfig;
use crate::io::format::{ModelFiles, Usage};
use crate::model::dual_encoder::ModelSpec;

/// The Hugging Face `AlignModel` format.
pub struct HfAlign;

/// ALIGN's text length (the processor's `model_max_length` in `kakaobrain/align-base`).
const ALIGN_TEXT_LEN: usize = 64;

impl HfLayout for HfAlign {
    const CLASS: &'static str = "AlignModel";
    const DESCRIBE: &'static str = "Hugging Face AlignModel: EfficientNet + BERT";
    const MODEL_TYPE: &'static str = "align";

    fn spec_from(&self, config: &Value) -> std::result::Result<ModelSpec, String> {
        align_spec_from_hf(config)
    }

    fn config_of(&self, spec: &ModelSpec) -> std::result::Result<Value, String> {
        align_spec_to_hf(spec)
    }

    fn tokenizer(&self, dir: &Path, spec: &ModelSpec, max_len: Option<usize>) -> Result<TextTokenizer> {
        let max_len = max_len.unwrap_or_else(|| model_max_length(dir, spec, ALIGN_TEXT_LEN));
        read_tokenizer(dir, max_len)
    }

    /// The `preprocessor_config.json` when there is one, else ALIGN's: a square resize to 346/289
    /// of the tower's input, a centre crop, x/127.5 − 1.
    fn usage(&self, dir: &Path, spec: &ModelSpec) -> Result<Usage> {
        let size = spec.image.image_size();
        let image = match read_dir_image_config(dir, Some("align"))? {
            Some(image) => image,
            None => ImageConfig { image_size: size, resize: (size * 346).div_ceil(289), ..Default::default() },
        };
        Ok(Usage { image, text_len: model_max_length(dir, spec, ALIGN_TEXT_LEN), loss: LossKind::Softmax })
    }

    fn write(&self, m: &ModelFiles, out: &Path) -> Result<()> {
        export_hf_align(m, out)
    }
}

/// Writes an ALIGN-architecture model as a Hugging Face `AlignModel` directory: `config.json`,
/// `model.safetensors` (with zero BatchNorm batch counters and an unused zero BERT pooler, which
/// transformers expects), the tokenizer files and the `preprocessor_config.json` of `image`, so
/// that `AlignProcessor` and the zero-shot pipeline load it.
fn export_hf_align(m: &ModelFiles, out: &Path) -> Result<()> {
    let spec = m.spec;
    let config = align_spec_to_hf(spec).map_err(anyhow::Error::msg)?;
    let mut tensors = m.tensors.clone();
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
    .write(m.tokenizer, &m.usage.image, out)
}
