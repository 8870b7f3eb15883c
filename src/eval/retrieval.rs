//! Image-text retrieval on data whose samples carry one image and one or more captions.

use anyhow::Result;
use candle_core::Device;

use super::embed::embed_pairs;
use super::metrics::{retrieval_ranks, Ranks, RetrievalReport};
use crate::data::eval_reader::{EvalSource, Needs};
use crate::data::skips::SkipCounts;
use crate::data::tokenizer::TextTokenizer;
use crate::data::transform::ImageConfig;
use crate::model::dual_encoder::DualEncoder;

pub struct RetrievalRun {
    pub report: RetrievalReport,
    /// Every query's rank, for recall at any k.
    pub ranks: Ranks,
    pub skipped: SkipCounts,
}

pub fn run(
    model: &DualEncoder,
    tokenizer: &TextTokenizer,
    source: EvalSource,
    image_cfg: &ImageConfig,
    batch: usize,
    device: &Device,
    quiet: bool,
) -> Result<RetrievalRun> {
    let mut images =
        embed_pairs(model, tokenizer, source, image_cfg, Needs { image: true, captions: true, label: false }, batch, device, quiet)?;
    let links: Vec<usize> = images.captions.iter().enumerate().flat_map(|(i, caps)| caps.iter().map(move |_| i)).collect();
    let text_emb = images.caption_embeddings.take().expect("embed_pairs embeds the captions");
    let ranks = retrieval_ranks(&images.embeddings, &text_emb, &links, 1024)?;
    Ok(RetrievalRun { report: RetrievalReport::from_ranks(&ranks), ranks, skipped: images.skipped })
}
