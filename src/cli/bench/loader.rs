//! `align bench loader`: images per second from shards through the training loader (decode,
//! augment, tokenise, batch), per core; `scripts/bench_loader_python.py` is the webdataset + PIL
//! side.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use align::config::Config;
use align::data::distribute::{Placement, ShardPlan};
use align::data::loader::{LoaderSettings, TrainLoader};
use align::data::spec;
use align::data::tokenizer::{captions_from_shards, train_wordpiece, TextTokenizer};
use align::util::progress::Progress;
use anyhow::Result;
use clap::Args;
use serde::Serialize;

use crate::cli::table::Table;

#[derive(Args)]
pub struct LoaderArgs {
    /// Shards to read (a shard spec).
    #[arg(long)]
    pub data: String,
    /// Loader workers (`data.workers`).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Batches to time (after one warm-up batch per worker).
    #[arg(long, default_value_t = 50)]
    pub batches: usize,
    /// Take the image transform and text settings from this config (default: ALIGN's 346 → 289).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Further config overrides (`--set data.image.image_size=224`).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct LoaderBench {
    images_per_second: f64,
    batches: usize,
    batch_size: usize,
    workers: usize,
    image_size: usize,
    seconds: f64,
    skipped: u64,
}

pub fn loader(a: &LoaderArgs) -> Result<()> {
    let cfg = match &a.config {
        Some(p) => Config::load(p, &a.overrides)?,
        None => Config::from_str_with_overrides("", "defaults", &a.overrides)?,
    };
    let shards = spec::expand(&a.data)?;
    let captions = captions_from_shards(&shards, 5000);
    let tok = Arc::new(TextTokenizer::new(train_wordpiece(captions.iter(), 2000, true, 1)?, cfg.text.max_len)?);
    let plan = ShardPlan { shards, seed: 0, shuffle: true, resampled: true, weights: Vec::new(), sources: Vec::new() };
    let settings = LoaderSettings {
        image: cfg.data.image.clone(),
        batch_size: a.batch,
        shuffle_buffer: cfg.data.shuffle_buffer,
        seed: 0,
        prefetch: cfg.data.prefetch,
        // Nothing competes with the loader here: its raw throughput is what is measured.
        nice: 0,
        token_budget: align::data::token_budget::TokenBudget::of(&cfg.data.naflex_seq_lens, cfg.data.naflex_batch_divisor, a.batch),
        teacher: None,
    };
    let mut loader = TrainLoader::start(plan, Placement::single(a.workers), settings, tok, None)?;
    for _ in 0..a.workers {
        loader.next_batch()?;
    }
    let bar = Progress::bar(a.batches as u64, "batches", a.json);
    let t0 = Instant::now();
    for _ in 0..a.batches {
        loader.next_batch()?;
        bar.inc(1);
    }
    let seconds = t0.elapsed().as_secs_f64();
    bar.finish();
    let r = LoaderBench {
        images_per_second: (a.batches * a.batch) as f64 / seconds,
        batches: a.batches,
        batch_size: a.batch,
        workers: a.workers,
        image_size: cfg.data.image.image_size,
        seconds,
        skipped: loader.skips().total(),
    };
    if a.json {
        return crate::cli::print_json(&r);
    }
    let mut t = Table::new(&format!("Loader: {}", a.data));
    t.row("images/s", format!("{:.1}", r.images_per_second)).row("workers", r.workers.to_string()).row("batch", r.batch_size.to_string());
    t.row("image size", r.image_size.to_string()).row("seconds", format!("{:.2}", r.seconds)).row("skipped", r.skipped.to_string());
    t.print();
    Ok(())
}
