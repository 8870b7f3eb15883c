//! Image-text retrieval on data whose samples carry one image and one or more captions.

use anyhow::Result;

use super::embed::Embedder;
use super::metrics::{retrieval_ranks, Ranks, RetrievalReport};
use crate::data::eval_reader::{EvalSource, Needs};
use crate::data::skips::SkipCounts;

pub struct RetrievalRun {
    pub report: RetrievalReport,
    /// Every query's rank, for recall at any k.
    pub ranks: Ranks,
    pub skipped: SkipCounts,
}

pub fn run(e: &Embedder, source: EvalSource) -> Result<RetrievalRun> {
    let mut images = e.pairs(source, Needs { image: true, captions: true, label: false })?;
    let links: Vec<usize> = images.captions.iter().enumerate().flat_map(|(i, caps)| caps.iter().map(move |_| i)).collect();
    let text_emb = images.caption_embeddings.take().expect("pairs embeds the captions");
    let ranks = retrieval_ranks(&images.embeddings, &text_emb, &links, 1024)?;
    Ok(RetrievalRun { report: RetrievalReport::from_ranks(&ranks), ranks, skipped: images.skipped })
}
