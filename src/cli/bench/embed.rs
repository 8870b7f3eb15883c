//! `align bench embed`: forward-only throughput and peak memory of embedding a data set's images
//! and captions with a checkpoint, through the same path `align embed`, `align eval`, scoring and
//! training's evaluation take. `scripts/bench_embed.py` measures the same work in PyTorch
//! (transformers or open_clip) for a side-by-side figure.

use std::path::PathBuf;
use std::time::Instant;

use align::config::Precision;
use align::data::eval_reader::{EvalSource, Needs};
use align::eval::embed::Embedder;
use align::io::load::load_model;
use align::ops::kernels::bf16_gemm;
use anyhow::Result;
use clap::Args;
use serde::Serialize;

use crate::cli::table::Table;

#[derive(Args)]
pub struct EmbedArgs {
    #[command(flatten)]
    pub precision: crate::cli::precision::PrecisionArg,
    /// The model: any checkpoint `--checkpoint` reads.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Shards whose images and captions are embedded.
    #[arg(long)]
    pub data: String,
    /// Images (and texts) per forward pass (default: the model's, as `align embed` chooses).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Untimed batches first (the data's first ones, images and captions), then every batch
    /// timed: throughput once the weights are packed and a batch's memory exists, as in a long
    /// run. `scripts/bench_embed.py --warmup` does the same in PyTorch.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct EmbedBench {
    checkpoint: String,
    /// The towers' products: `f32`, `bf16` or `int8`.
    precision: &'static str,
    /// Where bf16 products run (under `bf16`, and `int8`'s other products): the instruction
    /// their multiply-adds take.
    #[serde(skip_serializing_if = "Option::is_none")]
    bf16_instruction: Option<&'static str>,
    batch: usize,
    /// Untimed batches before the timed pass over the whole data.
    warmup: usize,
    images: usize,
    texts: usize,
    /// From the first read to the last embedding (the model's loading and the warm-up batches
    /// excluded).
    seconds: f64,
    images_per_s: f64,
    peak_rss_mib: Option<f64>,
}

pub fn embed(a: &EmbedArgs) -> Result<()> {
    let precision = a.precision.apply()?;
    let device = crate::cli::default_device();
    let mut m = load_model(&a.checkpoint, &device)?;
    m.set_precision(precision);
    let batch = a.batch.unwrap_or(align::eval::embed::auto_batch(m.spec()));
    let needs = Needs { image: true, captions: true, label: false };
    let shards = align::data::spec::expand(&a.data)?;
    let embedder = Embedder::of(&m, batch, &device, a.json);
    embedder.warm_up(EvalSource::Shards(shards.clone()), needs, a.warmup)?;
    if align::util::profile::enabled() {
        // The report is of the timed batches alone.
        align::util::profile::take();
    }
    let start = Instant::now();
    let e = embedder.pairs(EvalSource::Shards(shards), needs)?;
    let seconds = start.elapsed().as_secs_f64();
    let images = e.keys.len();
    let r = EmbedBench {
        checkpoint: a.checkpoint.display().to_string(),
        precision: precision.name(),
        bf16_instruction: (precision != Precision::F32 && bf16_gemm::available()).then(super::products::bf16_products_instruction),
        batch,
        warmup: a.warmup,
        images,
        texts: e.captions.iter().map(Vec::len).sum(),
        seconds,
        images_per_s: images as f64 / seconds,
        peak_rss_mib: super::model::rss_mib("VmHWM:"),
    };
    if align::util::profile::enabled() {
        let batches = images.div_ceil(batch.max(1));
        eprintln!("profile (per batch):\n{}", align::util::profile::report(&align::util::profile::take(), batches));
    }
    if a.json {
        return crate::cli::print_json(&r);
    }
    let mut t = Table::new(&format!("embedding with {} (batch {})", r.checkpoint, r.batch));
    t.row("images / texts", format!("{} / {}", r.images, r.texts));
    if r.warmup > 0 {
        t.row("untimed warm-up", format!("{} batch{}", r.warmup, if r.warmup == 1 { "" } else { "es" }));
    }
    t.row("wall time", format!("{:.2} s", r.seconds));
    if let Some(i) = r.bf16_instruction {
        t.row("bf16 products on", i);
    }
    t.row("images/s", format!("{:.1}", r.images_per_s));
    t.row("peak memory", r.peak_rss_mib.map_or("-".into(), |m| format!("{m:.0} MiB")));
    t.print();
    Ok(())
}
