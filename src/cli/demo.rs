//! `align demo`: synthetic data → vocabulary → training → zero-shot and retrieval evaluation.

use std::path::PathBuf;
use std::time::Instant;

use align::config::Config;
use align::data::spec;
use align::data::synth::{write_synth, SynthSpec};
use align::data::tokenizer::{captions_from_shards, train_wordpiece, TextTokenizer};
use align::train::trainer::{train, TrainOptions};
use align::util::log;
use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;

use super::table::{add_retrieval, add_zeroshot, Table};

/// The demo's experiment, compiled in so the demo runs from any directory.
pub const DEMO_CONFIG: &str = include_str!("../../configs/demo.toml");

#[derive(Args)]
pub struct DemoArgs {
    /// Working directory for data and checkpoints (replaced on each run).
    #[arg(long, default_value = "runs/demo")]
    pub out: PathBuf,
    /// Override a config field, e.g. `--set train.steps=100`.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Print the results as JSON on standard output (progress and log lines stay on standard
    /// error, so a minute of training is never silent).
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: &DemoArgs) -> Result<()> {
    // Progress goes to standard error: with --json, standard output still holds only the JSON.
    let quiet = false;
    let data_dir = a.out.join("data");
    let t0 = Instant::now();
    if !quiet {
        log::info(format!("writing synthetic shards to {}", data_dir.display()));
    }
    let synth = write_synth(&data_dir, &SynthSpec::default())?;
    let mut overrides = vec![
        format!("data.train={}", synth.train),
        format!("run.out_dir={}", a.out.join("checkpoints").display()),
        format!("eval.zeroshot={}", synth.test),
        format!("eval.retrieval={}", synth.test),
        format!("eval.classes={}", synth.classes.display()),
        format!("eval.templates={}", synth.templates.display()),
    ];
    let base = Config::from_str_with_overrides(DEMO_CONFIG, "configs/demo.toml", &overrides)?;
    let tok_path = data_dir.join("tokenizer.json");
    let captions = captions_from_shards(&spec::expand(&synth.train)?, 0);
    let tok = TextTokenizer::new(train_wordpiece(captions.iter(), base.text.vocab_size, base.text.lowercase, 2)?, base.text.max_len)?;
    tok.save(&tok_path)?;
    overrides.push(format!("text.tokenizer={}", tok_path.display()));
    overrides.extend(a.overrides.iter().cloned());
    let cfg = Config::from_str_with_overrides(DEMO_CONFIG, "configs/demo.toml", &overrides)?;
    let run_dir = cfg.run_dir();
    if run_dir.exists() {
        std::fs::remove_dir_all(&run_dir).with_context(|| format!("clearing {}", run_dir.display()))?;
    }
    if !quiet {
        log::info(format!(
            "training {} steps of batch {} (ViT {} + BERT {} layers) on the CPU",
            cfg.train.steps,
            cfg.train.batch_size,
            cfg.model.vit.depth.unwrap_or(0),
            cfg.model.bert.layers.unwrap_or(0)
        ));
    }
    let summary = train(
        &cfg,
        &TrainOptions {
            resume: false,
            resume_from: None,
            quiet,
            device: super::default_device(),
            stop_after: None,
            nproc: 1,
            allow_change: Vec::new(),
        },
    )?;
    let plot = run_dir.join("plot.png");
    align::plot::figure::render(&[align::plot::runs::load(&run_dir)?], 1500)?
        .save(&plot)
        .with_context(|| format!("writing {}", plot.display()))?;
    let z = summary.eval.zeroshot.clone().context("the demo evaluates zero-shot classification")?;
    let r = summary.eval.retrieval.clone().context("the demo evaluates retrieval")?;
    if a.json {
        return super::print_json(&json!({
            "zeroshot": z,
            "retrieval": r,
            "train": {"steps": summary.steps, "seconds": summary.seconds, "final_loss": summary.final_loss, "temperature": summary.temperature},
            "total_seconds": t0.elapsed().as_secs_f64(),
            "checkpoint": summary.checkpoint,
            "plot": plot,
        }));
    }
    let mut t = super::train::summary_table(&summary, false);
    t.row("curves", plot.display().to_string());
    t.row("total demo time", format!("{:.1} s", t0.elapsed().as_secs_f64()));
    t.print();
    let mut e = Table::new(&format!("Held-out evaluation ({} images)", z.images));
    add_zeroshot(&mut e, &z);
    add_retrieval(&mut e, &r);
    e.print();
    Ok(())
}
