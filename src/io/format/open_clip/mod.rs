//! open_clip's own checkpoint format, as `create_model("local-dir:DIR")` and `hf-hub:` read it
//! (open_clip 3.x): `open_clip_config.json` (`model_cfg`, `preprocess_cfg`) with the weights in
//! `open_clip_model.safetensors` or the PyTorch pickle `open_clip_pytorch_model.bin`. LAION,
//! DataComp, DFN and MetaCLIP publish their weights this way, some only this way.
//!
//! Read: native `CLIP` models (a vision transformer with a class token, CLIP's causal text
//! transformer) with the native towers' options (CLIPA's `no_ln_pre`, `pool_type` `avg` and
//! `final_ln_after_pool`; text `pool_type` `argmax`/`eos`/`first`/`last`, `no_causal_mask`,
//! `proj_bias`), and `CustomTextCLIP` ones with native towers and SigLIP-style text (`text.*`, no
//! causal mask, last-token pooling, a projection with a bias, a logit bias). The tokenizer is
//! open_clip's `SimpleTokenizer` (CLIP's BPE with its text cleaning, padded with 0 to
//! `context_length`), or the Hugging Face tokenizer the config names, from the folder, with
//! open_clip's cleaning and `strip_sep_token`.
//! Written: native `CLIP` models, which open_clip and CLIP_benchmark then load from the folder.
//!
//! OpenAI's, DFN's and MetaCLIP's weights were trained with quick-GELU, which open_clip sets from
//! the model name (`ViT-B-32-quickgelu`) rather than from their folders' configs; a folder
//! whose config lacks `"quick_gelu": true` is read with plain GELU, as open_clip reads it, unless
//! `ALIGN_OPEN_CLIP_QUICK_GELU=1` forces it (as `create_model(..., force_quick_gelu=True)`).

pub mod config;
pub mod convert;
pub mod hf_text;
pub mod keys;
pub mod presets;
pub mod timm;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use self::convert::{model_in, model_to, preprocess_from, preprocess_to, OpenClipModel};
use super::hf::files::read_json;
use super::{loss_of, Format, HubFetch, ModelFiles, Usage};
use crate::data::clip_bpe::{self, Clean};
use crate::data::tokenizer::TextTokenizer;
use crate::model::dual_encoder::ModelSpec;

pub const CONFIG: &str = "open_clip_config.json";
/// The weights files open_clip looks for, in its order of preference.
const WEIGHTS: [&str; 4] =
    ["open_clip_model.safetensors", "open_clip_pytorch_model.safetensors", "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth"];

/// The open_clip format.
pub struct OpenClip;

/// Extensions of a training checkpoint named directly (`epoch_3.pt`, `epoch_latest.pt`).
const CHECKPOINT_FILES: [&str; 4] = ["pt", "pth", "bin", "safetensors"];

/// The folder a location's files are in: the directory itself, or the folder of a training
/// checkpoint named as a file (open_clip's `epoch_N.pt`, read beside its `open_clip_config.json`).
fn folder(dir: &Path) -> &Path {
    if dir.is_file() {
        dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
    } else {
        dir
    }
}

fn config(dir: &Path) -> Result<Value> {
    read_json(&folder(dir).join(CONFIG))
}

fn model(dir: &Path) -> Result<OpenClipModel> {
    let path = folder(dir).join(CONFIG);
    let c = config(dir)?;
    let mut cfg = c.get("model_cfg").cloned().unwrap_or(Value::Null);
    if std::env::var("ALIGN_OPEN_CLIP_QUICK_GELU").is_ok_and(|v| v == "1") && cfg.is_object() {
        cfg["quick_gelu"] = Value::Bool(true);
    }
    let shapes = if convert::needs_shapes(&cfg) { Some(raw_shapes(dir)?) } else { None };
    // A Hugging Face text tower's config.json, when the folder holds it.
    let hf_text_config =
        cfg.pointer("/text_cfg/hf_model_name").and_then(Value::as_str).and_then(|_| read_json(&folder(dir).join("config.json")).ok());
    let found = convert::Folder { shapes: shapes.as_ref(), hf_text_config: hf_text_config.as_ref() };
    let m = model_in(&cfg, &found).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    crate::io::limits::check_spec(&m.spec).with_context(|| path.display().to_string())?;
    Ok(m)
}

/// The weights file's tensor shapes under open_clip's own names.
fn raw_shapes(dir: &Path) -> Result<timm::Shapes> {
    let path = weights_file(dir).with_context(|| format!("{} has no open_clip weights file", dir.display()))?;
    if path.extension().is_some_and(|e| e == "safetensors") {
        let header = crate::io::tensors::header_shapes(&path)?;
        return Ok(header.into_iter().map(|(k, s)| (without_ddp(k), s)).collect());
    }
    Ok(state_dict(&path, &Device::Cpu)?.into_iter().map(|(k, t)| (k, t.dims().to_vec())).collect())
}

fn weights_file(dir: &Path) -> Option<PathBuf> {
    if dir.is_file() {
        return Some(dir.to_path_buf());
    }
    WEIGHTS.iter().map(|f| dir.join(f)).find(|p| p.is_file())
}

/// A state dict from a safetensors file or a PyTorch pickle, unwrapped from a training
/// checkpoint's `state_dict` and a DistributedDataParallel `module.` prefix.
fn state_dict(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let raw: Vec<(String, Tensor)> = if path.extension().is_some_and(|e| e == "safetensors") {
        crate::io::tensors::read_tensors(path, device)?.into_iter().collect()
    } else {
        let all = candle_core::pickle::read_all_with_key(path, None);
        let all = match all {
            Ok(v) if !v.is_empty() => v,
            _ => candle_core::pickle::read_all_with_key(path, Some("state_dict")).with_context(|| format!("reading {}", path.display()))?,
        };
        all.into_iter().map(|(k, t)| Ok((k, t.to_device(device)?))).collect::<Result<_>>()?
    };
    Ok(raw.into_iter().map(|(k, t)| (without_ddp(k), t)).collect())
}

/// A state-dict key without the `module.` that DistributedDataParallel puts before every name
/// (open_clip strips it when it loads a checkpoint saved from DDP).
fn without_ddp(key: String) -> String {
    key.strip_prefix("module.").map(str::to_string).unwrap_or(key)
}

fn text_prefix(m: &OpenClipModel, names: impl Fn(&str) -> bool) -> &'static str {
    // An old flat text dict in a CustomTextCLIP folder is read as open_clip reads it.
    if m.custom_text && names("text.token_embedding.weight") {
        "text."
    } else {
        ""
    }
}

/// The standard CLIP vocabulary: open_clip's `SimpleTokenizer` reads it without any file.
fn is_clip_vocabulary(t: &TextTokenizer) -> bool {
    let inner = t.inner();
    t.vocab_size() == 49_408 && inner.id_to_token(0).as_deref() == Some("!") && inner.token_to_id("jekyll</w>") == Some(49_405)
}

impl Format for OpenClip {
    fn name(&self) -> &'static str {
        "open_clip"
    }

    fn describe(&self) -> &'static str {
        "open_clip's open_clip_config.json with open_clip_model.safetensors or open_clip_pytorch_model.bin"
    }

    fn claims(&self, dir: &Path) -> bool {
        let checkpoint_file = dir.extension().is_some_and(|e| CHECKPOINT_FILES.iter().any(|x| e == *x));
        (dir.is_dir() || (dir.is_file() && checkpoint_file))
            && folder(dir).join(CONFIG).is_file()
            && !folder(dir).join(crate::io::run_dir::SPEC_FILE).is_file()
    }

    fn config_file(&self) -> &'static str {
        CONFIG
    }

    fn has_weights(&self, dir: &Path) -> bool {
        weights_file(dir).is_some()
    }

    fn fetch_from_hub(&self, fetch: &mut HubFetch) -> Result<()> {
        // Safetensors first, as open_clip's own hub loader prefers it.
        if fetch(WEIGHTS[0])?.is_none() {
            fetch(WEIGHTS[2])?;
        }
        for file in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"] {
            fetch(file)?;
        }
        Ok(())
    }

    fn spec(&self, dir: &Path) -> Result<ModelSpec> {
        Ok(model(dir)?.spec)
    }

    fn weights(&self, dir: &Path, _spec: &ModelSpec, device: &Device) -> Result<HashMap<String, Tensor>> {
        let m = model(dir)?;
        let path = weights_file(dir).with_context(|| format!("{} has no open_clip weights file", dir.display()))?;
        let sd = state_dict(&path, device)?;
        let prefix = text_prefix(&m, |k| sd.contains_key(k));
        keys::to_align(sd, prefix, m.text_kind, m.timm_trunk).with_context(|| path.display().to_string())
    }

    fn weight_shapes(&self, dir: &Path) -> Result<HashMap<String, Vec<usize>>> {
        let path = weights_file(dir).with_context(|| format!("{} has no open_clip weights file", dir.display()))?;
        if path.extension().is_none_or(|e| e != "safetensors") {
            let w = self.weights(dir, &self.spec(dir)?, &Device::Cpu)?;
            return Ok(w.into_iter().map(|(k, t)| (k, t.dims().to_vec())).collect());
        }
        // The header's shapes through the same renaming, on zero-strided stand-ins: nothing of the
        // file's size is allocated before the shapes are known to fit.
        let m = model(dir)?;
        let header = crate::io::tensors::header_shapes(&path)?;
        let zero = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        let fake: HashMap<String, Tensor> =
            header.into_iter().map(|(k, s)| Ok((without_ddp(k), zero.broadcast_as(s)?))).collect::<Result<_>>()?;
        let prefix = text_prefix(&m, |k| fake.contains_key(k));
        let mapped = keys::to_align(fake, prefix, m.text_kind, m.timm_trunk).with_context(|| path.display().to_string())?;
        Ok(mapped.into_iter().map(|(k, t)| (k, t.dims().to_vec())).collect())
    }

    fn tokenizer(&self, dir: &Path, spec: &ModelSpec, max_len: Option<usize>) -> Result<TextTokenizer> {
        let dir = folder(dir);
        let path = dir.join(CONFIG);
        let text_cfg = config(dir)?.pointer("/model_cfg/text_cfg").cloned().unwrap_or(json!({}));
        let max_len = max_len.unwrap_or_else(|| context_length(&text_cfg, spec));
        let kwargs = text_cfg.get("tokenizer_kwargs").cloned().unwrap_or(json!({}));
        let hf = text_cfg.get("hf_tokenizer_name").and_then(Value::as_str).filter(|s| !s.is_empty());
        // open_clip's own tokenizer cleans as "lower" by default, a Hugging Face one as "whitespace".
        let default_clean = if hf.is_some() { "whitespace" } else { "lower" };
        let clean = match kwargs.get("clean") {
            None | Some(Value::Null) => default_clean,
            Some(Value::String(s)) => s.as_str(),
            Some(v) => bail!("{}: text_cfg.tokenizer_kwargs.clean is {v}, not a name", path.display()),
        };
        let clean = Clean::parse(clean).with_context(|| path.display().to_string())?;
        let Some(name) = hf else {
            let inner = clip_bpe::open_clip_simple(clean)?;
            // SimpleTokenizer pads with id 0.
            let pad = inner.id_to_token(0).expect("CLIP's vocabulary has id 0");
            return TextTokenizer::with_pad_token(inner, max_len, &pad);
        };
        // open_clip reads a local folder's own tokenizer files whatever the name says; from the
        // hub, the named repository's.
        let file = dir.join("tokenizer.json");
        let file = if file.is_file() {
            file
        } else {
            let mut repo = crate::io::format::hf::hub::HubRepo::new(name, None);
            repo.fetch("tokenizer_config.json")?;
            repo.fetch("tokenizer.json")?.with_context(|| {
                format!("{}: text_cfg.hf_tokenizer_name {name:?} has no tokenizer.json, in the folder or on the hub", path.display())
            })?
        };
        let mut inner = crate::data::tokenizer::read_tokenizer_json(&file)?;
        clip_bpe::put_cleaning(&mut inner, clean)?;
        let tokenizer_config = read_json(&file.with_file_name("tokenizer_config.json")).ok();
        match kwargs.get("strip_sep_token") {
            None | Some(Value::Null | Value::Bool(false)) => {}
            Some(Value::Bool(true)) => {
                let sep = tokenizer_config.as_ref().and_then(|c| token_of(c.get("sep_token")?)).unwrap_or_else(|| "[SEP]".into());
                strip_sep(&mut inner, &sep).with_context(|| format!("{}: text_cfg.tokenizer_kwargs.strip_sep_token", path.display()))?;
            }
            Some(v) => bail!("{}: text_cfg.tokenizer_kwargs.strip_sep_token is {v}, not true or false", path.display()),
        }
        let pad = tokenizer_config
            .as_ref()
            .and_then(|c| token_of(c.get("pad_token")?))
            .or_else(|| inner.get_padding().map(|p| p.pad_token.clone()))
            .unwrap_or_else(|| clip_bpe::END.to_string());
        TextTokenizer::with_pad_token(inner, max_len, &pad).map_err(|e| anyhow!("{}: {e}", file.display()))
    }

    fn usage(&self, dir: &Path, spec: &ModelSpec) -> Result<Usage> {
        let c = config(dir)?;
        let text_cfg = c.pointer("/model_cfg/text_cfg").cloned().unwrap_or(json!({}));
        let image = preprocess_from(c.get("preprocess_cfg"), spec.image.image_size())
            .map_err(|e| anyhow!("{}: {e}", folder(dir).join(CONFIG).display()))?;
        Ok(Usage { image, text_len: context_length(&text_cfg, spec), loss: loss_of(spec) })
    }

    fn writes(&self) -> bool {
        true
    }

    fn can_write(&self, spec: &ModelSpec) -> std::result::Result<(), String> {
        model_to(spec).map(|_| ()).map_err(|e| e.to_string())
    }

    fn write(&self, m: &ModelFiles, out: &Path) -> Result<()> {
        let mut model_cfg = model_to(m.spec).map_err(anyhow::Error::msg)?;
        let preprocess = preprocess_to(&m.usage.image, m.spec.image.image_size()).map_err(anyhow::Error::msg)?;
        if m.tokenizer.max_len() != m.spec.text.max_position() {
            // open_clip always pads to the context length, which is the positions' count.
            model_cfg["text_cfg"]["context_length"] = m.tokenizer.max_len().into();
            if m.tokenizer.max_len() > m.spec.text.max_position() {
                bail!("the tokenizer's length {} exceeds the text tower's {} positions", m.tokenizer.max_len(), m.spec.text.max_position());
            }
        }
        let mut tensors = keys::from_align(&m.tensors)?;
        if m.tokenizer.max_len() < m.spec.text.max_position() {
            let name = "positional_embedding";
            let cut = tensors[name].narrow(0, 0, m.tokenizer.max_len())?.contiguous()?;
            tensors.insert(name.into(), cut);
        }
        if !is_clip_vocabulary(m.tokenizer) {
            // Not CLIP's own vocabulary: open_clip reads the folder's Hugging Face tokenizer.
            model_cfg["text_cfg"]["hf_tokenizer_name"] =
                out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default().into();
            let clean = m.tokenizer.clean().unwrap_or(Clean::Whitespace);
            model_cfg["text_cfg"]["tokenizer_kwargs"] = json!({"clean": clean.name()});
            let mut inner = m.tokenizer.inner().clone();
            inner.with_truncation(None).map_err(|e| anyhow!("{e}"))?;
            inner.with_padding(None);
            inner.save(out.join("tokenizer.json"), true).map_err(|e| anyhow!("writing the tokenizer: {e}"))?;
            let pad = inner.id_to_token(m.tokenizer.pad_id()).unwrap_or_default();
            let tc = json!({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": m.tokenizer.max_len(), "pad_token": pad,
                "bos_token": clip_bpe::START, "eos_token": clip_bpe::END});
            std::fs::write(out.join("tokenizer_config.json"), serde_json::to_string_pretty(&tc)?)?;
        }
        crate::io::tensors::write_tensors(&tensors, &out.join(WEIGHTS[0]))?;
        let cfg = json!({"model_cfg": model_cfg, "preprocess_cfg": preprocess});
        std::fs::write(out.join(CONFIG), serde_json::to_string_pretty(&cfg)?)
            .with_context(|| format!("writing {}", out.join(CONFIG).display()))?;
        Ok(())
    }
}

/// A special token as `tokenizer_config.json` gives it: a string, or an object with `content`.
fn token_of(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        v => v.get("content")?.as_str().map(str::to_string),
    }
}

/// open_clip's `strip_sep_token`: the separator its Hugging Face tokenizer appends becomes id 0
/// (CLIPA's text tower was trained on BERT ids without `[SEP]`). Done in the post-processor, so
/// the separator's place is still reserved when a text is truncated, as open_clip reserves it.
fn strip_sep(inner: &mut tokenizers::Tokenizer, sep: &str) -> Result<()> {
    let zero = inner.id_to_token(0).ok_or_else(|| anyhow!("the vocabulary has no id 0"))?;
    let post = inner.get_post_processor().ok_or_else(|| anyhow!("the tokenizer adds no separator to strip"))?;
    let mut p = serde_json::to_value(post)?;
    let kind = p.get("type").and_then(Value::as_str).unwrap_or_default().to_string();
    match kind.as_str() {
        "BertProcessing" | "RobertaProcessing" if p["sep"][0] == sep => p["sep"] = json!([zero, 0]),
        "TemplateProcessing" => {
            let mut found = false;
            for part in ["single", "pair"] {
                for item in p[part].as_array_mut().into_iter().flatten() {
                    if item.pointer("/SpecialToken/id").and_then(Value::as_str) == Some(sep) {
                        item["SpecialToken"]["id"] = zero.clone().into();
                        found = true;
                    }
                }
            }
            if !found {
                bail!("its template has no {sep}");
            }
            p["special_tokens"][&zero] = json!({"id": zero, "ids": [0], "tokens": [zero]});
        }
        other => bail!("its post-processor ({other}) has no {sep} to strip"),
    }
    let post: tokenizers::PostProcessorWrapper = serde_json::from_value(p)?;
    inner.with_post_processor(Some(post));
    Ok(())
}

/// The length open_clip tokenizes to: `text_cfg.context_length` (77 unless set), at most the
/// text tower's positions (a Hugging Face tower has more than it is given).
fn context_length(text_cfg: &Value, spec: &ModelSpec) -> usize {
    let positions = spec.text.max_position();
    match spec.text {
        crate::model::dual_encoder::TextSpec::Bert(_) => {
            text_cfg.get("context_length").and_then(Value::as_u64).map_or(77, |n| n as usize).min(positions)
        }
        _ => positions,
    }
}
