//! `align eval suite --config evals.toml`: arguments and the results' table; the suite itself
//! (its file, the evaluations, CLIP_benchmark's result files) is `align::eval::suite`.

use std::path::PathBuf;

use align::eval::record::EvalRecord;
use align::eval::suite::{self, Suite};
use anyhow::Result;
use clap::Args;

#[derive(Args)]
pub struct SuiteArgs {
    #[command(flatten)]
    pub precision: super::precision::PrecisionArg,
    #[command(flatten)]
    pub stall: super::stall::StallArg,
    /// The suite (TOML): `checkpoints`, optional `output_dir`, `batch`, `recall_k`, `strict`, and
    /// one `[[dataset]]` each with its `name`, `task` (zeroshot_classification,
    /// zeroshot_retrieval, linear_probe) and data; `configs/evals/` has examples.
    #[arg(long)]
    pub config: PathBuf,
    /// Print every result as one JSON array instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Any skipped sample is an error instead of a partial result.
    #[arg(long)]
    pub strict: bool,
    /// Write the CLIP_benchmark JSON files here (overrides the config's `output_dir`).
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
}

/// The headline numbers of a result for the suite's table.
fn headline(r: &EvalRecord) -> String {
    let get = |k: &str| r.metrics.get(k).and_then(serde_json::Value::as_f64);
    let pct = |k: &str| get(k).map_or("-".to_string(), super::table::pct);
    match r.task {
        "zeroshot_classification" => {
            format!("acc@1 {}  acc@5 {}  mean-class recall {}", pct("acc1"), pct("acc5"), pct("mean_per_class_recall"))
        }
        "zeroshot_retrieval" => format!(
            "image→text R@1 {}  text→image R@1 {}  (R@5 {} / {})",
            pct("text_retrieval_recall@1"),
            pct("image_retrieval_recall@1"),
            pct("text_retrieval_recall@5"),
            pct("image_retrieval_recall@5")
        ),
        _ => format!("acc@1 {}  acc@5 {}", pct("lp_acc1"), pct("lp_acc5")),
    }
}

pub fn suite(a: &SuiteArgs) -> Result<()> {
    let precision = a.precision.apply()?;
    a.stall.apply()?;
    let s = Suite::read(&a.config)?;
    let output_dir = a.output_dir.clone().or_else(|| s.output_dir.clone());
    let device = super::default_device();
    let run =
        suite::SuiteRun { strict: a.strict || s.strict, output_dir: output_dir.as_deref(), precision, device: &device, quiet: a.json };
    let records = suite::run(&s, &run)?;
    if a.json {
        return super::print_json(&records);
    }
    print_table(&records);
    Ok(())
}

fn print_table(records: &[EvalRecord]) {
    let rows: Vec<[String; 5]> = records
        .iter()
        .map(|r| {
            let note = if r.complete { String::new() } else { format!("PARTIAL: {} skipped", r.skipped_total) };
            [r.checkpoint.clone(), r.dataset.clone().unwrap_or_default(), r.images.to_string(), headline(r), note]
        })
        .collect();
    let head = ["checkpoint", "dataset", "images", "result", ""];
    let widths: Vec<usize> = (0..5).map(|i| rows.iter().map(|r| r[i].chars().count()).chain([head[i].len()]).max().unwrap_or(0)).collect();
    let line = |cells: [&str; 5]| {
        let s: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        println!("{}", s.join("   ").trim_end());
    };
    line(head);
    println!("{}", "-".repeat(widths.iter().sum::<usize>() + 12));
    for r in &rows {
        line([&r[0], &r[1], &r[2], &r[3], &r[4]]);
    }
}
