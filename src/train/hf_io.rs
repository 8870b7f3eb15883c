//! Hugging Face checkpoints on disk: reading `AlignModel`, `BertModel` and `ViTModel` directories
//! (or `hf:ID[@REVISION]` through the hub cache), and writing align models as `AlignModel`
//! directories that `transformers.AlignModel.from_pretrained` loads.
//!
//! Offline use: with `HF_HUB_OFFLINE=1` (or no network) an `hf:` id resolves from the cache under
//! `HF_HOME` (default `~/.cache/huggingface`) and a missing file is an error naming it and where
//! it was looked for.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use serde_json::Value;

use super::checkpoint::LoadedModel;
use crate::config::Config;
use crate::data::tokenizer::TextTokenizer;
use crate::model::dual_encoder::{DualEncoder, ModelSpec};
use crate::model::hf::{align_spec_from_hf, align_spec_to_hf, is_unused_hf_tensor};
use crate::model::init::SeededVars;
use crate::util::log;

const WEIGHTS: &str = "model.safetensors";
const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// `hf:ORG/NAME` or `hf:ORG/NAME@REVISION`.
pub fn parse_hub_id(loc: &str) -> Option<(String, Option<String>)> {
    let id = loc.strip_prefix("hf:")?;
    Some(match id.split_once('@') {
        Some((i, r)) => (i.to_string(), Some(r.to_string())),
        None => (id.to_string(), None),
    })
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0" && v.to_lowercase() != "false")
}

/// A local directory for `loc`: the path itself, or the hub snapshot holding an `hf:` id's
/// config, weights (single or sharded) and tokenizer files, fetched into the cache unless offline.
pub fn resolve_location(loc: &str) -> Result<PathBuf> {
    let Some((id, revision)) = parse_hub_id(loc) else { return Ok(PathBuf::from(loc)) };
    let repo = match &revision {
        Some(r) => hf_hub::Repo::with_revision(id.clone(), hf_hub::RepoType::Model, r.clone()),
        None => hf_hub::Repo::model(id.clone()),
    };
    let cache = hf_hub::Cache::from_env();
    let cached = cache.repo(repo.clone());
    let fetch = |file: &str, required: bool| -> Result<Option<PathBuf>> {
        if let Some(p) = cached.get(file) {
            return Ok(Some(p));
        }
        if offline() {
            if required {
                bail!("{loc}: {file} is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE is set; download it where there is network (e.g. `huggingface-cli download {id}`) and copy the cache", cache.path().display());
            }
            return Ok(None);
        }
        let api = hf_hub::api::sync::ApiBuilder::from_env().with_progress(false).build().context("starting the Hugging Face hub client")?;
        match api.repo(repo.clone()).get(file) {
            Ok(p) => Ok(Some(p)),
            Err(e) if required => Err(anyhow!("{loc}: cannot fetch {file}: {e} (no network? set HF_HUB_OFFLINE=1 to use the cache only)")),
            Err(_) => Ok(None),
        }
    };
    let config = fetch("config.json", true)?.expect("required");
    match fetch(WEIGHTS, false)? {
        Some(_) => {}
        None => {
            let index =
                fetch(WEIGHTS_INDEX, true).with_context(|| format!("{loc}: neither {WEIGHTS} nor {WEIGHTS_INDEX}"))?.expect("required");
            for shard in shard_files(&index)? {
                fetch(&shard, true)?;
            }
        }
    }
    for optional in ["tokenizer.json", "vocab.txt", "tokenizer_config.json", "preprocessor_config.json"] {
        fetch(optional, false)?;
    }
    Ok(config.parent().expect("a file in a snapshot").to_path_buf())
}

fn shard_files(index: &Path) -> Result<Vec<String>> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(index).with_context(|| format!("reading {}", index.display()))?)?;
    let map = v.get("weight_map").and_then(Value::as_object).ok_or_else(|| anyhow!("{} has no weight_map", index.display()))?;
    let mut files: Vec<String> = map.values().filter_map(Value::as_str).map(String::from).collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// Every tensor of a directory's `model.safetensors`, or of the shards its index lists.
pub fn read_weights(dir: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let single = dir.join(WEIGHTS);
    if single.is_file() {
        return super::checkpoint::read_tensors(&single, device);
    }
    let index = dir.join(WEIGHTS_INDEX);
    if !index.is_file() {
        bail!("{} has neither {WEIGHTS} nor {WEIGHTS_INDEX}", dir.display());
    }
    let mut out = HashMap::new();
    for shard in shard_files(&index)? {
        out.extend(super::checkpoint::read_tensors(&dir.join(&shard), device)?);
    }
    Ok(out)
}

pub fn read_json(path: &Path) -> Result<Value> {
    serde_json::from_str(&std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?)
        .with_context(|| format!("parsing {}", path.display()))
}

/// Whether a directory holds a Hugging Face model of the given `model_type`.
pub fn is_hf_model(dir: &Path, model_type: &str) -> bool {
    read_json(&dir.join("config.json")).is_ok_and(|c| c.get("model_type").and_then(Value::as_str) == Some(model_type))
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
                var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
                loaded += 1;
            }
        }
    }
    let mut unused: Vec<&String> = checkpoint
        .keys()
        .filter(|k| k.starts_with(from) && !is_unused_hf_tensor(k) && !data.contains_key(&format!("{into}{}", &k[from.len()..])))
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

/// The image settings of a Hugging Face checkpoint: its `preprocessor_config.json` when present,
/// else ALIGN's (resize to 346/289 of the input size, center crop, x/127.5 − 1).
fn image_config(dir: &Path, image_size: usize) -> crate::data::transform::ImageConfig {
    let mut c = crate::data::transform::ImageConfig { image_size, resize: (image_size * 346).div_ceil(289), ..Default::default() };
    if let Ok(p) = read_json(&dir.join("preprocessor_config.json")) {
        let side = |v: Option<&Value>| v.and_then(|s| s.get("height").or(Some(s))).and_then(Value::as_u64).map(|x| x as usize);
        if let Some(crop) = side(p.get("crop_size")) {
            c.image_size = crop;
        }
        if let Some(size) = side(p.get("size")) {
            c.resize = size.max(c.image_size);
        }
        if p.get("do_normalize").and_then(Value::as_bool) == Some(true) {
            let three = |k: &str| {
                p.get(k).and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_f64).map(|x| x as f32).collect::<Vec<_>>())
            };
            if let (Some(m), Some(s)) = (three("image_mean"), three("image_std")) {
                if m.len() == 3 && s.len() == 3 {
                    c.mean = [m[0], m[1], m[2]];
                    c.std = [s[0], s[1], s[2]];
                }
            }
        }
    }
    c
}

/// Loads a Hugging Face `AlignModel` directory as an align model.
pub fn load_hf_align(dir: &Path, device: &Device) -> Result<LoadedModel> {
    let hf = read_json(&dir.join("config.json"))?;
    let spec = align_spec_from_hf(&hf).map_err(|e| anyhow!("{}: {e}", dir.join("config.json").display()))?;
    let mut config = Config::default();
    config.data.image = image_config(dir, spec.image.image_size());
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
/// transformers expects) and the tokenizer.
pub fn export_hf_align(spec: &ModelSpec, vm: &VarMap, tokenizer: &TextTokenizer, out: &Path) -> Result<()> {
    let config = align_spec_to_hf(spec).map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (name, var) in vm.data().lock().unwrap().iter() {
        tensors.insert(name.clone(), var.as_tensor().to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
        if let Some(prefix) = name.strip_suffix("running_mean") {
            tensors.insert(format!("{prefix}num_batches_tracked"), Tensor::zeros((), DType::I64, &Device::Cpu)?);
        }
    }
    // AlignTextModel carries BERT's pooler, which ALIGN never uses; zeros keep transformers from
    // reporting it as missing.
    let h = spec.text.hidden;
    tensors.insert("text_model.pooler.dense.weight".into(), Tensor::zeros((h, h), DType::F32, &Device::Cpu)?);
    tensors.insert("text_model.pooler.dense.bias".into(), Tensor::zeros(h, DType::F32, &Device::Cpu)?);
    candle_core::safetensors::save(&tensors, out.join(WEIGHTS)).with_context(|| format!("writing {}", out.join(WEIGHTS).display()))?;
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    tokenizer.save(&out.join("tokenizer.json"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_with_and_without_revision() {
        assert_eq!(parse_hub_id("hf:kakaobrain/align-base"), Some(("kakaobrain/align-base".into(), None)));
        assert_eq!(parse_hub_id("hf:org/m@v1.0"), Some(("org/m".into(), Some("v1.0".into()))));
        assert_eq!(parse_hub_id("checkpoints/run"), None);
    }

    #[test]
    fn offline_misses_name_the_file_and_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY of env mutation in tests: these variables are read only by this resolution.
        std::env::set_var("HF_HOME", dir.path());
        std::env::set_var("HF_HUB_OFFLINE", "1");
        let err = resolve_location("hf:nobody/nothing").unwrap_err().to_string();
        assert!(err.contains("config.json") && err.contains("HF_HUB_OFFLINE") && err.contains(&dir.path().display().to_string()), "{err}");
    }
}
