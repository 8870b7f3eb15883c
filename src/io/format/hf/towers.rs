//! What CLIP's and SigLIP's Hugging Face directories share: the encoder fields of their tower
//! configs (with transformers' class defaults for missing keys, and bounds on every size), and
//! their tokenizers.
//!
//! transformers writes only the values that differ from a config class's defaults into older
//! `config.json` files, so every key missing here takes the default of transformers' class.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde_json::Value;

use super::files::read_json;
use crate::data::tokenizer::TextTokenizer;
use crate::io::limits::{check_size, kind_of_key};
use crate::model::dual_encoder::TextSpec;
use crate::model::prenorm::{Act, EncoderConfig};

/// A size field: the class default when absent, an error when it is not a whole number or out of
/// bounds.
pub(crate) fn usize_or(c: &Value, key: &str, default: usize, ctx: &str) -> Result<usize, String> {
    let v = match c.get(key) {
        None | Some(Value::Null) => default,
        Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| format!("{ctx}.{key} is {v}, not a whole number"))?,
    };
    check_size(v, kind_of_key(key), &format!("{ctx}.{key}"))
}

pub(crate) fn f64_or(c: &Value, key: &str, default: f64, ctx: &str) -> Result<f64, String> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| format!("{ctx}.{key} is {v}, not a number")),
    }
}

/// A transformers class's encoder defaults.
pub(crate) struct EncoderDefaults {
    pub width: usize,
    pub layers: usize,
    pub heads: usize,
    pub mlp_dim: usize,
    pub eps: f64,
    pub act: &'static str,
}

pub(crate) fn encoder(c: &Value, d: EncoderDefaults, ctx: &str) -> Result<EncoderConfig, String> {
    if !c.is_object() {
        return Err(format!("{ctx} is missing (or not an object)"));
    }
    if c.get("num_channels").is_some_and(|n| n.as_u64() != Some(3)) {
        return Err(format!("{ctx}.num_channels must be 3"));
    }
    let act = match c.get("hidden_act") {
        None | Some(Value::Null) => d.act,
        Some(v) => v.as_str().ok_or_else(|| format!("{ctx}.hidden_act is {v}, not a name"))?,
    };
    let e = EncoderConfig {
        width: usize_or(c, "hidden_size", d.width, ctx)?,
        layers: usize_or(c, "num_hidden_layers", d.layers, ctx)?,
        heads: usize_or(c, "num_attention_heads", d.heads, ctx)?,
        mlp_dim: usize_or(c, "intermediate_size", d.mlp_dim, ctx)?,
        layer_norm_eps: f64_or(c, "layer_norm_eps", d.eps, ctx)?,
        act: Act::from_hf(act).map_err(|e| format!("{ctx}: {e}"))?,
    };
    if !e.width.is_multiple_of(e.heads) {
        return Err(format!("{ctx}: hidden_size {} is not divisible by num_attention_heads {}", e.width, e.heads));
    }
    if !(e.layer_norm_eps > 0.0 && e.layer_norm_eps < 1.0) {
        return Err(format!("{ctx}.layer_norm_eps is {}; it must be a small positive number", e.layer_norm_eps));
    }
    Ok(e)
}

/// A tower's sub-config, which must be there: transformers would silently build its default
/// tower, whose weights then do not fit.
pub(crate) fn sub<'a>(c: &'a Value, key: &str) -> Result<&'a Value, String> {
    c.get(key).filter(|v| v.is_object()).ok_or_else(|| format!("config.json has no {key} (the tower's sizes)"))
}

/// A tower's sub-config: the encoder's sizes and activation, with the tower's own `fields`.
pub(crate) fn tower_to_hf(e: &EncoderConfig, fields: Value) -> Value {
    let mut j = serde_json::json!({"hidden_size": e.width, "num_hidden_layers": e.layers, "num_attention_heads": e.heads,
        "intermediate_size": e.mlp_dim, "layer_norm_eps": e.layer_norm_eps, "hidden_act": e.act.hf_name()});
    if let (Some(j), Value::Object(fields)) = (j.as_object_mut(), fields) {
        j.extend(fields);
    }
    j
}

/// The padding token a tokenizer config names (a string, or an object with `content`).
fn pad_token(dir: &Path) -> Option<String> {
    ["tokenizer_config.json", "special_tokens_map.json"].iter().find_map(|f| {
        let c = read_json(&dir.join(f)).ok()?;
        match c.get("pad_token")? {
            Value::String(s) => Some(s.clone()),
            v => v.get("content")?.as_str().map(str::to_string),
        }
    })
}

/// The checkpoint's tokenizer, padded as its tokenizer config says to `model_max_length`: CLIP's
/// `tokenizer.json`, or SigLIP's SentencePiece `spiece.model` with SigLIP's text canonicalisation
/// (lowercase, ASCII punctuation deleted) and `</s>` appended.
pub(crate) fn tokenizer(dir: &Path, text: &TextSpec, max_len: Option<usize>) -> Result<TextTokenizer> {
    let tokenizer_config = read_json(&dir.join("tokenizer_config.json")).ok();
    let (positions, default_pad) = match text {
        TextSpec::Clip(t) => (t.max_position, crate::data::tokenizer::CLIP_END),
        TextSpec::Siglip(t) => (t.max_position, crate::data::tokenizer::SENTENCE_END),
        TextSpec::Bert(_) => bail!("{}: a BERT text tower in a CLIP or SigLIP directory", dir.display()),
    };
    let max_len = max_len.unwrap_or_else(|| {
        tokenizer_config
            .as_ref()
            .and_then(|c| c.get("model_max_length").and_then(Value::as_u64))
            .map_or(positions, |m| (m as usize).min(positions))
    });
    let pad = pad_token(dir).unwrap_or_else(|| default_pad.to_string());
    let (inner, from) = match text {
        // SigLIP's own tokenizer is its SentencePiece model; a tokenizer.json alone (as align
        // exports SigLIP) carries the whole pipeline, canonicalisation included.
        TextSpec::Siglip(_) if dir.join("spiece.model").is_file() || !dir.join("tokenizer.json").is_file() => {
            let path = dir.join("spiece.model");
            if !path.is_file() {
                bail!("{} has neither spiece.model nor tokenizer.json: SigLIP checkpoints ship their SentencePiece model", dir.display());
            }
            let lowercase = tokenizer_config.as_ref().and_then(|c| c.get("do_lower_case").and_then(Value::as_bool)).unwrap_or(true);
            let canonical = crate::data::sentencepiece::Canonical { lowercase, strip_punctuation: true };
            (crate::data::sentencepiece::read_unigram(&path, canonical, crate::data::tokenizer::SENTENCE_END)?, path)
        }
        _ if dir.join("tokenizer.json").is_file() => {
            let path = dir.join("tokenizer.json");
            (crate::data::tokenizer::read_tokenizer_json(&path)?, path)
        }
        TextSpec::Clip(_) if dir.join("vocab.json").is_file() && dir.join("merges.txt").is_file() => {
            let (vocab, merges) = (dir.join("vocab.json"), dir.join("merges.txt"));
            (crate::data::clip_bpe::from_files(&vocab, &merges)?, merges)
        }
        _ => bail!("{} has no tokenizer.json (nor CLIP's vocab.json and merges.txt)", dir.display()),
    };
    TextTokenizer::with_pad_token(inner, max_len, &pad).map_err(|e| anyhow!("{}: {e}", from.display()))
}
