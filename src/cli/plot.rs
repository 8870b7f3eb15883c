use std::path::PathBuf;

use align::plot::{figure, runs};
use anyhow::{Context, Result};
use clap::Args;

#[derive(Args)]
pub struct PlotArgs {
    /// Run directories (`checkpoints/RUN`, or one of their `step-N` checkpoints); several runs
    /// share the figure, one colour each.
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// The PNG to write (default: plot.png in the first run's directory).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Figure width in pixels; the height follows from the number of panels.
    #[arg(long, default_value_t = 1500)]
    width: u32,
    /// Smooth the training curves as TensorBoard's slider does (0: none; 0.6-0.9 for noisy
    /// runs); the raw curves stay, faint.
    #[arg(long, default_value_t = 0.0)]
    smooth: f64,
    /// Print what was plotted as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(a: &PlotArgs) -> Result<()> {
    let loaded = a.runs.iter().map(|p| runs::load(p)).collect::<Result<Vec<_>>>()?;
    anyhow::ensure!((0.0..1.0).contains(&a.smooth), "--smooth must be in [0, 1), got {}", a.smooth);
    let img = figure::render_with(&loaded, &figure::Options { width: a.width.clamp(600, 6000), smooth: a.smooth })?;
    let out = match &a.out {
        Some(p) => p.clone(),
        None => runs::run_dir(&a.runs[0])?.join("plot.png"),
    };
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    img.save(&out).with_context(|| format!("writing {}", out.display()))?;
    if a.json {
        let described: Vec<_> = loaded
            .iter()
            .map(|r| {
                let last = r.curves.values().filter_map(|c| c.last().map(|p| p.0)).fold(0.0, f64::max);
                serde_json::json!({"run": r.name, "last_step": last, "curves": r.curves.keys().collect::<Vec<_>>()})
            })
            .collect();
        super::print_json(&serde_json::json!({"out": out, "width": img.width(), "height": img.height(), "runs": described}))
    } else {
        println!("wrote {} ({}×{})", out.display(), img.width(), img.height());
        Ok(())
    }
}
