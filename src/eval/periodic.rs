//! The evaluations a config asks for (`[eval]`), run on an in-memory model: used during training
//! and by `align eval` / `align demo`.

use super::embed::Embedder;
use anyhow::Result;
use candle_core::Device;
use serde::Serialize;

use super::metrics::{ClassificationReport, RetrievalReport};
use super::{retrieval, zeroshot};
use crate::config::Config;
use crate::data::eval_reader::EvalSource;
use crate::data::spec;
use crate::data::tokenizer::TextTokenizer;
use crate::model::dual_encoder::DualEncoder;

#[derive(Debug, Clone, Serialize, Default)]
pub struct EvalResults {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zeroshot: Option<ClassificationReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retrieval: Option<RetrievalReport>,
    /// The training loss on held-out pairs (computed by `train::validation`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub validation: Option<ValidationLoss>,
}

/// The training loss on held-out pairs, as the training loss is logged (`loss` = `i2t` + `t2i`
/// for the softmax loss; the sigmoid loss has no directions, and splits it as training does).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ValidationLoss {
    pub loss: f64,
    pub i2t: f64,
    pub t2i: f64,
    pub pairs: usize,
    /// Pairs per batch: the loss depends on it.
    pub batch: usize,
}

impl EvalResults {
    pub fn is_empty(&self) -> bool {
        self.zeroshot.is_none() && self.retrieval.is_none() && self.validation.is_none()
    }

    /// A short one-line summary for logs.
    pub fn line(&self) -> String {
        let mut parts = Vec::new();
        if let Some(z) = &self.zeroshot {
            parts.push(format!("zero-shot acc1 {:.3} acc5 {:.3}", z.top1, z.top5));
        }
        if let Some(r) = &self.retrieval {
            parts.push(format!(
                "text_retrieval_recall@1 {:.3} image_retrieval_recall@1 {:.3} mean_recall {:.3}",
                r.i2t.r1,
                r.t2i.r1,
                r.mean_recall()
            ));
        }
        if let Some(v) = &self.validation {
            parts.push(format!("validation loss {:.4} ({} pairs)", v.loss, v.pairs));
        }
        parts.join("; ")
    }
}

pub fn configured(cfg: &Config) -> bool {
    !cfg.eval.zeroshot.is_empty() || !cfg.eval.retrieval.is_empty() || !cfg.eval.validation.is_empty()
}

pub fn run(model: &DualEncoder, tokenizer: &TextTokenizer, cfg: &Config, device: &Device, quiet: bool) -> Result<EvalResults> {
    let mut out = EvalResults::default();
    let e = &cfg.eval;
    let embedder = Embedder { model, tokenizer, image: &cfg.data.image, batch: e.batch_size, device, quiet };
    if !e.zeroshot.is_empty() {
        let classes = zeroshot::read_lines(&e.classes)?;
        let templates = zeroshot::read_lines(&e.templates)?;
        let source = EvalSource::Shards(spec::expand(&e.zeroshot)?);
        out.zeroshot = Some(zeroshot::run(&embedder, source, &classes, &templates)?.report);
    }
    if !e.retrieval.is_empty() {
        let source = EvalSource::Shards(spec::expand(&e.retrieval)?);
        out.retrieval = Some(retrieval::run(&embedder, source)?.report);
    }
    Ok(out)
}
