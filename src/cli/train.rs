use std::path::Path;

use align::config::Config;
use align::train::trainer::{train, TrainOptions, TrainSummary};
use anyhow::Result;

use super::table::{add_retrieval, add_zeroshot, Table};

pub fn summary_table(s: &TrainSummary, with_eval: bool) -> Table {
    let mut t = Table::new("Training");
    t.row("steps", s.steps.to_string());
    t.row("samples seen", s.samples_seen.to_string());
    t.row("wall time", format!("{:.1} s", s.seconds));
    t.row("samples/s (this run)", format!("{:.1}", s.samples_per_second));
    t.row("data wait", format!("{:.1}%", 100.0 * s.data_wait_share));
    t.row("final loss", s.final_loss.map_or("-".into(), |l| format!("{l:.4}")));
    t.row("temperature σ", format!("{:.4}", s.temperature));
    t.row("final learning rate", format!("{:.3e}", s.final_lr));
    t.row("skipped samples", s.skipped.summary());
    t.row("checkpoint", s.checkpoint.display().to_string());
    if s.interrupted {
        t.row("stopped", "by Ctrl-C (resume with --resume)".to_string());
    }
    for b in &s.best_eval {
        // Recalls and accuracies are fractions; rsum is already a sum of percentages.
        let value = if b.metric.ends_with("rsum") { format!("{:.1}", b.value) } else { format!("{:.1}%", 100.0 * b.value) };
        t.row(format!("best {}", b.metric.trim_start_matches("eval/")), format!("{value} (step {})", b.step));
    }
    if with_eval {
        if let Some(z) = &s.eval.zeroshot {
            add_zeroshot(&mut t, z);
        }
        if let Some(r) = &s.eval.retrieval {
            add_retrieval(&mut t, r);
        }
    }
    t
}

pub fn run(
    config: &Path,
    overrides: &[String],
    resume: bool,
    json: bool,
    quiet: bool,
    stop_after: Option<u64>,
    nproc: usize,
) -> Result<()> {
    let cfg = Config::load(config, overrides)?;
    align::util::interrupt::install();
    let summary = train(&cfg, &TrainOptions { resume, quiet, device: super::default_device(), stop_after, nproc })?;
    if json {
        super::print_json(&summary)?;
    } else {
        summary_table(&summary, true).print();
    }
    if align::util::profile::enabled() {
        let totals = align::util::profile::take();
        let steps = totals.get("optimizer").map_or(1, |x| x.1 as usize);
        eprintln!("\nprofile (rank threads summed):\n{}", align::util::profile::report(&totals, steps));
    }
    if summary.interrupted {
        // The conventional status of a run ended by SIGINT, so scripts see it did not finish.
        std::process::exit(130);
    }
    Ok(())
}
