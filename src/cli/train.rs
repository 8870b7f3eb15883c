use std::path::PathBuf;

use align::config::Config;
use align::io::metrics_log;
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
    if let Some(by) = &s.stopped_by {
        t.row("stopped", format!("by {by} (resume with --resume)"));
    }
    for b in &s.best_eval {
        // Recalls and accuracies are fractions, shown in percent; losses are shown as they are.
        let value = if metrics_log::lower_is_better(&b.metric) { format!("{:.4}", b.value) } else { format!("{:.1}%", 100.0 * b.value) };
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

/// Where `--resume` continues from: `auto` / `latest` (the run's latest checkpoint, or the start
/// when there is none: what a requeued job wants), or a checkpoint (`RUN/step-N`) or run
/// directory, as open_clip's `--resume latest` / `--resume PATH`.
fn resume_from(value: &str) -> Option<PathBuf> {
    (!matches!(value, "auto" | "latest")).then(|| PathBuf::from(value))
}

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Experiment config (TOML).
    #[arg(long)]
    config: PathBuf,
    /// Override a config field: `--set train.lr=1e-4` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    overrides: Vec<String>,
    /// Continue exactly where a checkpoint stopped: `--resume` (or `auto`, `latest`) from the
    /// run's latest checkpoint, starting from scratch when there is none yet; `--resume PATH`
    /// from that checkpoint (`RUN/step-N`) or run directory: an earlier step of this run, or
    /// another run's checkpoint continued into this run's directory.
    #[arg(long, num_args = 0..=1, default_missing_value = "auto", value_name = "auto|latest|PATH")]
    resume: Option<String>,
    /// With --resume: let the run change this field of its checkpoint's config (`run.seed`,
    /// `train.batch_size`, `train.steps`, `data.train`, `model`), which breaks exact continuation,
    /// or restart a missing weight average (`train.ema_decay`) (repeatable).
    #[arg(long, value_name = "FIELD")]
    allow_change: Vec<String>,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// No progress bars.
    #[arg(long)]
    quiet: bool,
    /// Stop after this many steps (the schedule still follows train.steps).
    #[arg(long)]
    stop_after: Option<u64>,
    /// Data-parallel ranks as threads of this process (CPU); the global batch is split over them
    /// and negatives are gathered from all. Ranks as processes (GPUs), as torchrun's
    /// `--nproc-per-node`: `align launch --nproc-per-node N -- train ...`.
    #[arg(long, default_value_t = 1)]
    nproc: usize,
    /// Print time per phase and per op kind at the end (also `ALIGN_PROFILE=1`).
    #[arg(long)]
    profile: bool,
}

pub fn run(a: &TrainArgs) -> Result<()> {
    if a.profile {
        align::util::profile::enable(true);
    }
    let cfg = Config::load(&a.config, &a.overrides)?;
    align::util::interrupt::install();
    let opts = TrainOptions {
        resume: a.resume.is_some(),
        resume_from: a.resume.as_deref().and_then(resume_from),
        quiet: a.quiet,
        device: super::default_device(),
        stop_after: a.stop_after,
        nproc: a.nproc,
        allow_change: a.allow_change.clone(),
    };
    let summary = train(&cfg, &opts)?;
    if a.json {
        super::print_json(&summary)?;
    } else {
        summary_table(&summary, true).print();
    }
    if align::util::profile::enabled() {
        let totals = align::util::profile::take();
        let steps = totals.get("optimizer").map_or(1, |x| x.1 as usize);
        eprintln!("\nprofile (rank threads summed):\n{}", align::util::profile::report(&totals, steps));
    }
    if let Some(status) = summary.exit_status {
        align::util::interrupt::run_before_exit();
        // 128 + the signal, as a shell reports a process the signal ended: scripts see that the
        // run did not finish (and requeue it with --resume).
        std::process::exit(status);
    }
    Ok(())
}
