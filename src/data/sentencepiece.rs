//! SentencePiece unigram models (`spiece.model`, what SigLIP and T5 checkpoints ship instead of
//! a `tokenizer.json`) as a `tokenizers` pipeline, the conversion transformers' `SpmConverter`
//! makes: the model's pieces and scores as a Unigram model, its precompiled normalisation map,
//! `▁` for spaces with one prepended, and `</s>` appended.
//!
//! The file is a protobuf `ModelProto`; `prost` decodes the few fields used, declared below by
//! their numbers in sentencepiece's `sentencepiece_model.proto`. The SentencePiece library itself
//! (C++, through bindings) would add a CMake build for what is a table lookup here, and its
//! tokenisation is what the `tokenizers` Unigram model reproduces.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use prost::Message;
use tokenizers::models::unigram::Unigram;
use tokenizers::normalizers::{Lowercase, Precompiled, Replace, Sequence, Strip};
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{NormalizerWrapper, Tokenizer};

#[derive(Clone, PartialEq, Message)]
struct ModelProto {
    #[prost(message, repeated, tag = "1")]
    pieces: Vec<Piece>,
    #[prost(message, optional, tag = "2")]
    trainer_spec: Option<TrainerSpec>,
    #[prost(message, optional, tag = "3")]
    normalizer_spec: Option<NormalizerSpec>,
}

#[derive(Clone, PartialEq, Message)]
struct Piece {
    #[prost(string, optional, tag = "1")]
    piece: Option<String>,
    #[prost(float, optional, tag = "2")]
    score: Option<f32>,
    /// 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    #[prost(int32, optional, tag = "3")]
    kind: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
struct TrainerSpec {
    /// 1 unigram, 2 BPE, 3 word, 4 char.
    #[prost(int32, optional, tag = "3")]
    model_type: Option<i32>,
    #[prost(bool, optional, tag = "35")]
    byte_fallback: Option<bool>,
}

#[derive(Clone, PartialEq, Message)]
struct NormalizerSpec {
    #[prost(bytes = "vec", optional, tag = "2")]
    precompiled_charsmap: Option<Vec<u8>>,
    #[prost(bool, optional, tag = "3")]
    add_dummy_prefix: Option<bool>,
    #[prost(bool, optional, tag = "4")]
    remove_extra_whitespaces: Option<bool>,
}

const UNKNOWN: i32 = 2;

/// What a checkpoint's tokenizer does to a text before SentencePiece sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Canonical {
    pub lowercase: bool,
    /// SigLIP's `canonicalize_text`: ASCII punctuation deleted, runs of whitespace made one
    /// space, the ends stripped.
    pub strip_punctuation: bool,
}

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("{e}")
}

/// A `tokenizers` pipeline equal to the SentencePiece unigram model at `path`, after `canonical`,
/// with `end` (SigLIP's and T5's `</s>`) appended to every text.
pub fn read_unigram(path: &Path, canonical: Canonical, end: &str) -> Result<Tokenizer> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let model = ModelProto::decode(bytes.as_slice()).map_err(|e| anyhow!("{} is not a SentencePiece model: {e}", path.display()))?;
    let kind = model.trainer_spec.as_ref().and_then(|t| t.model_type).unwrap_or(1);
    if kind != 1 {
        bail!("{}: a SentencePiece model of type {kind}; align reads unigram models (type 1) only", path.display());
    }
    if model.pieces.is_empty() {
        bail!("{} has no pieces", path.display());
    }
    let vocab: Vec<(String, f64)> =
        model.pieces.iter().map(|p| (p.piece.clone().unwrap_or_default(), p.score.unwrap_or(0.0) as f64)).collect();
    let unk = model.pieces.iter().position(|p| p.kind == Some(UNKNOWN));
    let byte_fallback = model.trainer_spec.as_ref().and_then(|t| t.byte_fallback).unwrap_or(false);
    let unigram = Unigram::from(vocab, unk, byte_fallback).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let mut tok = Tokenizer::new(unigram);

    let mut steps: Vec<NormalizerWrapper> = Vec::new();
    if canonical.lowercase {
        steps.push(Lowercase.into());
    }
    if canonical.strip_punctuation {
        // Python's string.punctuation: the four ASCII runs of printable non-alphanumerics.
        steps.push(
            Replace::new(tokenizers::normalizers::replace::ReplacePattern::Regex(r"[!-/:-@\[-`{-~]".into()), "").map_err(err)?.into(),
        );
        steps.push(Replace::new(tokenizers::normalizers::replace::ReplacePattern::Regex(r"\s+".into()), " ").map_err(err)?.into());
        steps.push(Strip::new(true, true).into());
    }
    let spec = model.normalizer_spec.unwrap_or_default();
    if let Some(map) = spec.precompiled_charsmap.filter(|m| !m.is_empty()) {
        steps.push(Precompiled::from(&map).map_err(|e| anyhow!("{}: its normalisation map: {e}", path.display()))?.into());
    }
    if spec.remove_extra_whitespaces.unwrap_or(true) {
        steps.push(Replace::new(tokenizers::normalizers::replace::ReplacePattern::Regex(" {2,}".into()), " ").map_err(err)?.into());
    }
    tok.with_normalizer(Some(Sequence::new(steps))).map_err(err)?;
    let prepend = if spec.add_dummy_prefix.unwrap_or(true) { PrependScheme::Always } else { PrependScheme::Never };
    tok.with_pre_tokenizer(Some(Metaspace::new('▁', prepend, true)));
    tok.with_decoder(Some(Metaspace::new('▁', prepend, true)));
    let end_id = tok.token_to_id(end).ok_or_else(|| anyhow!("{} has no {end} piece", path.display()))?;
    let template = TemplateProcessing::builder()
        .try_single(format!("$A:0 {end}:0"))
        .map_err(err)?
        .try_pair(format!("$A:0 {end}:0 $B:1 {end}:1"))
        .map_err(err)?
        .special_tokens(vec![(end, end_id)])
        .build()
        .map_err(err)?;
    tok.with_post_processor(Some(template));
    Ok(tok)
}
