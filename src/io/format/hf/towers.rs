//! What CLIP's and SigLIP's Hugging Face directories share besides their configs (in
//! `tower_config`): a tower's sub-config as written, and their tokenizers.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde_json::Value;

use super::files::read_json;
use crate::data::tokenizer::TextTokenizer;
use crate::model::dual_encoder::TextSpec;
use crate::model::prenorm::EncoderConfig;

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
    let tokenizer = TextTokenizer::with_pad_token(inner, max_len, &pad).map_err(|e| anyhow!("{}: {e}", from.display()))?;
    Ok(tokenizer.padding_left(pads_left(tokenizer_config.as_ref())))
}

/// transformers' `padding_side`: the tokenizer config's, else its class's (Gemma's and SigLIP 2's
/// tokenizers pad on the left, the rest on the right).
fn pads_left(tokenizer_config: Option<&Value>) -> bool {
    let Some(c) = tokenizer_config else { return false };
    match c.get("padding_side").and_then(Value::as_str) {
        Some(side) => side == "left",
        None => {
            matches!(c.get("tokenizer_class").and_then(Value::as_str), Some("GemmaTokenizer" | "GemmaTokenizerFast" | "Siglip2Tokenizer"))
        }
    }
}
