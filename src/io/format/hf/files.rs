//! The files of a Hugging Face model directory: weights (single or sharded), `config.json`, the
//! tokenizer, and tensors set into a model's variables under a prefix.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use serde_json::Value;

use super::hub::{shard_files, WEIGHTS, WEIGHTS_INDEX};
use crate::data::tokenizer::TextTokenizer;
use crate::data::transform::ImageConfig;
use crate::io::tensors::{is_unused_tensor, read_tensors};
use crate::util::log;

/// Every tensor of a directory's `model.safetensors`, or of the shards its index lists, with
/// SigLIP's `[1]`-shaped `logit_scale` and `logit_bias` as the scalars align keeps.
pub fn read_weights(dir: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let mut w = read_stored_weights(dir, device)?;
    for name in ["logit_scale", "logit_bias"] {
        if let Some(t) = w.get(name).filter(|t| t.dims() == [1]) {
            let scalar = t.squeeze(0)?;
            w.insert(name.to_string(), scalar);
        }
    }
    Ok(w)
}

fn read_stored_weights(dir: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let single = dir.join(WEIGHTS);
    if single.is_file() {
        return read_tensors(&single, device);
    }
    let index = dir.join(WEIGHTS_INDEX);
    if !index.is_file() {
        bail!("{} has neither {WEIGHTS} nor {WEIGHTS_INDEX}", dir.display());
    }
    let mut out = HashMap::new();
    for shard in shard_files(&index)? {
        out.extend(read_tensors(&dir.join(&shard), device)?);
    }
    Ok(out)
}

pub fn read_json(path: &Path) -> Result<Value> {
    serde_json::from_str(&std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?)
        .with_context(|| format!("parsing {}", path.display()))
}

/// Whether a directory holds a Hugging Face model of the given `model_type` (and is not an align
/// checkpoint, which has a `config.toml` instead).
pub fn is_hf_model(dir: &Path, model_type: &str) -> bool {
    !dir.join(crate::io::run_dir::SPEC_FILE).is_file()
        && read_json(&dir.join("config.json")).is_ok_and(|c| c.get("model_type").and_then(Value::as_str) == Some(model_type))
}

/// Whether a directory holds Hugging Face weights: `model.safetensors`, or an index and its shards.
pub fn has_hf_weights(dir: &Path) -> bool {
    dir.join(WEIGHTS).is_file() || dir.join(WEIGHTS_INDEX).is_file()
}

/// The tokenizer and processor files a Hugging Face model directory may have.
pub const HF_SIDE_FILES: [&str; 9] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "preprocessor_config.json",
    "processor_config.json",
];

/// Fetches a Hugging Face model's weights (single or sharded) and its tokenizer and processor
/// files from the hub.
pub fn fetch_hf_model(fetch: &mut crate::io::format::HubFetch) -> Result<()> {
    if fetch(WEIGHTS)?.is_none() {
        if let Some(index) = fetch(WEIGHTS_INDEX)? {
            for shard in shard_files(&index)? {
                if fetch(&shard)?.is_none() {
                    bail!("{} lists {shard}, which the repository does not have", index.display());
                }
            }
        }
    }
    for file in HF_SIDE_FILES {
        fetch(file)?;
    }
    Ok(())
}

/// The shapes of every tensor of a directory's Hugging Face weights, read from the safetensors
/// headers alone (nothing else of the files is read).
pub fn weight_shapes(dir: &Path) -> Result<HashMap<String, Vec<usize>>> {
    let single = dir.join(WEIGHTS);
    let files =
        if single.is_file() { vec![single] } else { shard_files(&dir.join(WEIGHTS_INDEX))?.into_iter().map(|f| dir.join(f)).collect() };
    let mut out = HashMap::new();
    for f in files {
        out.extend(crate::io::tensors::header_shapes(&f)?);
    }
    for name in ["logit_scale", "logit_bias"] {
        if let Some(s) = out.get_mut(name).filter(|s| s.as_slice() == [1]) {
            s.clear();
        }
    }
    Ok(out)
}

/// The text length a checkpoint's tokenizer config sets (`model_max_length`), at most the text
/// tower's positions; `default` (also capped) when it sets none.
pub fn model_max_length(dir: &Path, spec: &crate::model::dual_encoder::ModelSpec, default: usize) -> usize {
    let positions = spec.text.max_position();
    read_json(&dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|c| c.get("model_max_length").and_then(Value::as_u64))
        .map_or(default, |m| m as usize)
        .min(positions)
}

/// The tokenizer shipped with a checkpoint: `tokenizer.json`, else a BERT `vocab.txt`.
pub fn read_tokenizer(dir: &Path, max_len: usize) -> Result<TextTokenizer> {
    let json = dir.join("tokenizer.json");
    if json.is_file() {
        return TextTokenizer::from_file(&json, max_len);
    }
    let vocab = dir.join("vocab.txt");
    if vocab.is_file() {
        let lower = read_json(&dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|c| c.get("do_lower_case").and_then(Value::as_bool))
            .unwrap_or(true);
        return TextTokenizer::from_bert_vocab(&vocab, lower, max_len);
    }
    bail!("{} has no tokenizer.json or vocab.txt", dir.display())
}

/// Tensors of `checkpoint` under `from` (e.g. `""` for a `BertModel`, `"bert."` for a
/// `BertForPreTraining`) set into the variables of `vm` under `into` (e.g. `"text_model."`), with
/// names and shapes checked. Missing or mis-shaped tensors are errors listing them; tensors the
/// model has no use for are listed in a warning.
pub fn load_prefixed(vm: &VarMap, checkpoint: &HashMap<String, Tensor>, from: &str, into: &str, origin: &str) -> Result<usize> {
    let data = vm.data().lock().unwrap();
    let mut missing = Vec::new();
    let mut wrong = Vec::new();
    let mut loaded = 0;
    let mut targets: Vec<(&String, &candle_core::Var)> = data.iter().filter(|(k, _)| k.starts_with(into)).collect();
    targets.sort_by(|a, b| a.0.cmp(b.0));
    for (name, var) in &targets {
        let source = format!("{from}{}", &name[into.len()..]);
        match checkpoint.get(&source) {
            None => missing.push(source),
            Some(t) if t.dims() != var.dims() => wrong.push(format!("{source}: checkpoint {:?}, model {:?}", t.dims(), var.dims())),
            Some(t) => {
                crate::io::tensors::check_weight(&source, t, origin)?;
                var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
                loaded += 1;
            }
        }
    }
    let mut unused: Vec<&String> = checkpoint
        .keys()
        .filter(|k| k.starts_with(from) && !is_unused_tensor(k) && !data.contains_key(&format!("{into}{}", &k[from.len()..])))
        .collect();
    unused.sort();
    if !missing.is_empty() || !wrong.is_empty() {
        bail!("{origin} does not fit the model: missing {missing:?}; wrong shape {wrong:?}; unexpected {unused:?}");
    }
    if !unused.is_empty() {
        log::warn(format!("{origin}: {} tensors not used: {:?}", unused.len(), unused));
    }
    Ok(loaded)
}

/// An exported model directory: what `AutoModel`, `AutoTokenizer` and `AutoProcessor` read.
pub struct HfDir<'a> {
    pub config: Value,
    /// Weights under their Hugging Face names.
    pub tensors: HashMap<String, Tensor>,
    /// `tokenizer_class`, the special tokens as (role, token) pairs such as
    /// `("pad_token", "[PAD]")`, and any further `tokenizer_config.json` entries.
    pub tokenizer_class: &'a str,
    pub specials: &'a [(&'a str, &'a str)],
    pub tokenizer_extra: Value,
    /// The image processor's class and the processor's, which pairs it with the tokenizer.
    pub image_processor: &'a str,
    pub processor: &'a str,
}

impl HfDir<'_> {
    /// Writes `config.json`, `model.safetensors`, `tokenizer.json` (without align's truncation,
    /// which transformers sets from `model_max_length`), `tokenizer_config.json`,
    /// `special_tokens_map.json` and `preprocessor_config.json` (preprocessing as `image`).
    pub fn write(self, tokenizer: &TextTokenizer, image: &ImageConfig, out: &Path) -> Result<()> {
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
        crate::io::tensors::write_tensors(&self.tensors, &out.join(WEIGHTS))?;
        std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&self.config)?)?;
        let mut inner = tokenizer.portable()?;
        inner.with_truncation(None).map_err(|e| anyhow::anyhow!("{e}"))?;
        inner.with_padding(None);
        inner
            .save(out.join("tokenizer.json"), true)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", out.join("tokenizer.json").display()))?;
        let mut config = serde_json::json!({"tokenizer_class": self.tokenizer_class, "model_max_length": tokenizer.max_len()});
        let mut map = serde_json::Map::new();
        for (role, token) in self.specials {
            config[*role] = Value::String(token.to_string());
            map.insert(role.to_string(), Value::String(token.to_string()));
        }
        if let (Some(c), Value::Object(extra)) = (config.as_object_mut(), self.tokenizer_extra) {
            c.extend(extra);
        }
        std::fs::write(out.join("tokenizer_config.json"), serde_json::to_string_pretty(&config)?)?;
        std::fs::write(out.join("special_tokens_map.json"), serde_json::to_string_pretty(&Value::Object(map))?)?;
        let mut processor = super::preprocess::processor_json(image, self.image_processor)?;
        processor["processor_class"] = Value::String(self.processor.into());
        std::fs::write(out.join("preprocessor_config.json"), serde_json::to_string_pretty(&processor)?)?;
        Ok(())
    }
}

/// Every variable as an f32 CPU tensor, for an exported `model.safetensors`.
pub fn f32_tensors(vm: &VarMap) -> Result<HashMap<String, Tensor>> {
    vm.data()
        .lock()
        .unwrap()
        .iter()
        .map(|(name, var)| Ok((name.clone(), var.as_tensor().to_dtype(DType::F32)?.to_device(&Device::Cpu)?)))
        .collect()
}

/// BERT's special tokens as its tokenizer config names them.
pub const BERT_SPECIALS: [(&str, &str); 5] =
    [("cls_token", "[CLS]"), ("sep_token", "[SEP]"), ("pad_token", "[PAD]"), ("unk_token", "[UNK]"), ("mask_token", "[MASK]")];
