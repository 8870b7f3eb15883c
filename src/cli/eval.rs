//! `align eval retrieval | zeroshot | knn | linear-probe`: arguments and tables; the evaluations
//! and their records are `align::eval::tasks` and `align::eval::record`.

use std::path::PathBuf;

use align::data::folders::Variant;
use align::eval::embed::auto_batch;
use align::eval::metrics::recall_at;
use align::eval::record::{parse_ks, EvalRecord};
use align::eval::tasks::{self, labelled_source, retrieval_source, ZeroShotData};
use anyhow::Result;
use clap::Args;

use super::table::{add_retrieval, add_zeroshot, pct, Table};

#[derive(Args)]
pub struct RetrievalArgs {
    #[command(flatten)]
    pub model: super::precision::ModelArgs,
    #[command(flatten)]
    pub stall: super::stall::StallArg,
    /// Shards with one image and its captions (lines of `txt`, or `captions` in `json`).
    #[arg(long, conflicts_with = "karpathy")]
    pub data: Option<String>,
    /// A Karpathy split file (`dataset_flickr30k.json`, `dataset_coco.json`).
    #[arg(long, requires = "images")]
    pub karpathy: Option<PathBuf>,
    /// The image folder the Karpathy file refers to.
    #[arg(long)]
    pub images: Option<PathBuf>,
    /// Split of the Karpathy file (Flickr30K 1K test and MSCOCO 5K test are `test`).
    #[arg(long, default_value = "test")]
    pub split: String,
    /// Images (and texts) per forward pass (default: the model's, 64 or 32).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Recall at these k (CLIP_benchmark's `--recall_k`).
    #[arg(long, default_value = "1,5,10")]
    pub recall_k: String,
    /// Any skipped sample is an error instead of a partial result.
    #[arg(long)]
    pub strict: bool,
    /// Also write the result in CLIP_benchmark's layout to this JSON file.
    #[arg(long)]
    pub output: Option<PathBuf>,
}

pub fn retrieval(a: &RetrievalArgs) -> Result<()> {
    a.stall.apply()?;
    let (source, what) = retrieval_source(&a.data, &a.karpathy, &a.images, &a.split)?;
    let device = super::default_device();
    let m = a.model.load(&device)?;
    let ks = parse_ks(&a.recall_k)?;
    let e = tasks::evaluate_retrieval(&m, source, &what, &ks, a.batch.unwrap_or(auto_batch(m.spec())), &device, a.json)?;
    let mut t = Table::new(&format!("Retrieval: {what}"));
    add_retrieval(&mut t, &e.run.report);
    for &k in ks.iter().filter(|k| ![1, 5, 10].contains(*k)) {
        t.row(
            format!("R@{k} image→text / text→image"),
            format!("{} / {}", pct(recall_at(&e.run.ranks.i2t, k)), pct(recall_at(&e.run.ranks.t2i, k))),
        );
    }
    t.row("skipped", e.run.skipped.summary());
    Outcome { record: e.record, table: t }.finish(a.strict, a.output.as_deref(), a.json)
}

/// A finished evaluation: the record for `--json` / `--output` and the table for people.
pub struct Outcome {
    pub record: EvalRecord,
    pub table: Table,
}

impl Outcome {
    /// `--strict`, `--output FILE`, then the JSON or the table on standard output.
    fn finish(mut self, strict: bool, output: Option<&std::path::Path>, json: bool) -> Result<()> {
        self.record.check_strict(strict)?;
        if let Some(path) = output {
            self.record.write_clip_benchmark(path)?;
        }
        if json {
            return super::print_json(&self.record);
        }
        if let Some(note) = self.record.partial_note() {
            self.table.row("warning", note);
        }
        self.table.print();
        Ok(())
    }
}

#[derive(Args)]
pub struct ZeroShotArgs {
    #[command(flatten)]
    pub model: super::precision::ModelArgs,
    #[command(flatten)]
    pub stall: super::stall::StallArg,
    /// Shards with a `cls` label per sample (needs --classes).
    #[arg(long, conflicts_with = "imagenet")]
    pub data: Option<String>,
    /// An ImageNet-style image folder (see --variant).
    #[arg(long)]
    pub imagenet: Option<PathBuf>,
    /// Folder layout for --imagenet.
    #[arg(long, value_enum, default_value = "val")]
    pub variant: Variant,
    /// Class names, one per line, in label order (default with --imagenet: the 1000 shipped ones).
    #[arg(long)]
    pub classes: Option<PathBuf>,
    /// WordNet ids in label order (default: the shipped ImageNet-1k order).
    #[arg(long)]
    pub wnids: Option<PathBuf>,
    /// Prompt templates with `{}`, one per line (default: CLIP's 80). One template gives the
    /// number without ensembling.
    #[arg(long)]
    pub templates: Option<PathBuf>,
    /// Images (and texts) per forward pass (default: the model's, 64 or 32).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Any skipped sample is an error instead of a partial result.
    #[arg(long)]
    pub strict: bool,
    /// Also write the result in CLIP_benchmark's layout to this JSON file.
    #[arg(long)]
    pub output: Option<PathBuf>,
}

pub fn zeroshot(a: &ZeroShotArgs) -> Result<()> {
    a.stall.apply()?;
    let task = ZeroShotData::new(&a.data, &a.imagenet, a.variant, &a.classes, &a.wnids, &a.templates)?;
    let device = super::default_device();
    let m = a.model.load(&device)?;
    let title = format!("Zero-shot: {}, {} templates", task.what, task.templates.len());
    let e = tasks::evaluate_zeroshot(&m, task, a.batch.unwrap_or(auto_batch(m.spec())), &device, a.json)?;
    let mut t = Table::new(&title);
    add_zeroshot(&mut t, &e.run.report);
    t.row("mean per-class recall", pct(e.run.report.mean_per_class_recall));
    t.row("skipped", e.run.skipped.summary());
    Outcome { record: e.record, table: t }.finish(a.strict, a.output.as_deref(), a.json)
}

#[derive(Args)]
pub struct KnnArgs {
    #[command(flatten)]
    pub model: super::precision::ModelArgs,
    #[command(flatten)]
    pub stall: super::stall::StallArg,
    /// Labelled shards for the index (`cls` per sample).
    #[arg(long, conflicts_with = "train_imagenet")]
    pub train: Option<String>,
    /// An ImageNet-style train folder (`<wnid>/*.JPEG`) for the index.
    #[arg(long)]
    pub train_imagenet: Option<PathBuf>,
    /// Labelled shards for the queries.
    #[arg(long, conflicts_with = "val_imagenet")]
    pub val: Option<String>,
    /// An ImageNet-style validation folder for the queries.
    #[arg(long)]
    pub val_imagenet: Option<PathBuf>,
    /// Neighbours that vote for the top-1 label.
    #[arg(long, default_value_t = 20)]
    pub k: usize,
    /// Images per forward pass (default: the model's, 64 or 32).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Print the result as JSON (the record every evaluation prints) instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Any skipped sample is an error instead of a partial result.
    #[arg(long)]
    pub strict: bool,
    /// Also write the result in CLIP_benchmark's layout to this JSON file.
    #[arg(long)]
    pub output: Option<PathBuf>,
}

pub fn knn(a: &KnnArgs) -> Result<()> {
    a.stall.apply()?;
    let device = super::default_device();
    let m = a.model.load(&device)?;
    let sources = (labelled_source(&a.train, &a.train_imagenet, "train")?, labelled_source(&a.val, &a.val_imagenet, "val")?);
    let what = split_names(&a.train, &a.train_imagenet, &a.val, &a.val_imagenet);
    let e = tasks::evaluate_knn(&m, sources, &what, a.k, a.batch.unwrap_or(auto_batch(m.spec())), &device, a.json)?;
    let rep = &e.run.report;
    let mut t = Table::new(&format!("KNN classification: {what}"));
    t.row(format!("top-1 ({}-NN vote)", rep.k), pct(rep.top1));
    t.row("Recall@1 / @5 / @10", format!("{} / {} / {}", pct(rep.r1), pct(rep.r5), pct(rep.r10)));
    t.row("index / queries", format!("{} / {}", rep.index, rep.queries));
    t.row("skipped", e.run.skipped.summary());
    Outcome { record: e.record, table: t }.finish(a.strict, a.output.as_deref(), a.json)
}

/// "TRAIN → TEST" as the user named the two splits.
fn split_names(a: &Option<String>, a_dir: &Option<PathBuf>, b: &Option<String>, b_dir: &Option<PathBuf>) -> String {
    let name =
        |s: &Option<String>, d: &Option<PathBuf>| s.clone().or_else(|| d.as_ref().map(|d| d.display().to_string())).unwrap_or_default();
    format!("{} → {}", name(a, a_dir), name(b, b_dir))
}

#[derive(Args)]
pub struct LinearProbeArgs {
    #[command(flatten)]
    pub model: super::precision::ModelArgs,
    #[command(flatten)]
    pub stall: super::stall::StallArg,
    /// Labelled shards to train the classifier on (`cls` per sample).
    #[arg(long, conflicts_with = "train_imagenet")]
    pub train: Option<String>,
    /// An ImageNet-style train folder.
    #[arg(long)]
    pub train_imagenet: Option<PathBuf>,
    /// Labelled shards to score it on.
    #[arg(long, conflicts_with = "test_imagenet")]
    pub test: Option<String>,
    /// An ImageNet-style validation folder to score it on.
    #[arg(long)]
    pub test_imagenet: Option<PathBuf>,
    /// Share of the training split held out to choose the weight decay (0: none, no decay).
    #[arg(long, default_value_t = 0.2)]
    pub val_proportion: f64,
    /// Epochs of the classifier's training (CLIP_benchmark: 10).
    #[arg(long, default_value_t = 10)]
    pub epochs: usize,
    /// Learning rate of the classifier (CLIP_benchmark: 0.1).
    #[arg(long, default_value_t = 0.1)]
    pub lr: f64,
    /// Batch of the classifier's training (and of the embedding).
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Seed of the held-out split and the classifier's initialisation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Any skipped sample is an error instead of a partial result.
    #[arg(long)]
    pub strict: bool,
    /// Also write the result in CLIP_benchmark's layout to this JSON file.
    #[arg(long)]
    pub output: Option<PathBuf>,
}

pub fn linear_probe(a: &LinearProbeArgs) -> Result<()> {
    a.stall.apply()?;
    let device = super::default_device();
    let m = a.model.load(&device)?;
    let sources = (labelled_source(&a.train, &a.train_imagenet, "train")?, labelled_source(&a.test, &a.test_imagenet, "test")?);
    let what = split_names(&a.train, &a.train_imagenet, &a.test, &a.test_imagenet);
    let pc = align::eval::linear_probe::ProbeConfig {
        epochs: a.epochs,
        lr: a.lr,
        batch: a.batch,
        val_proportion: a.val_proportion,
        seed: a.seed,
    };
    let e = tasks::evaluate_linear_probe(&m, sources, &what, &pc, &device, a.json)?;
    let rep = &e.run.report;
    let mut t = Table::new(&format!("Linear probe: {what}"));
    t.row("top-1", pct(rep.acc1));
    t.row("top-5", rep.acc5.map_or("-".into(), pct));
    t.row("mean per-class recall", pct(rep.mean_per_class_recall));
    t.row("weight decay (chosen)", format!("{:.3e}", rep.weight_decay));
    t.row("train / test images", format!("{} / {}", rep.train, rep.test));
    t.row("skipped", e.run.skipped.summary());
    Outcome { record: e.record, table: t }.finish(a.strict, a.output.as_deref(), a.json)
}
