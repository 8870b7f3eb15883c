use std::path::PathBuf;

use align::data::eval_reader::EvalSource;
use align::data::folders::{self, imagenet, Variant};
use align::data::spec;
use align::eval::embed::auto_batch;
use align::eval::{retrieval as ret, zeroshot as zs};
use align::io::load::{load_model_with, LoadedModel};
use anyhow::{bail, Context, Result};
use clap::Args;

use super::eval_record::{parse_ks, EvalRecord};
use super::table::{add_retrieval, add_zeroshot, Table};
use align::eval::metrics::recall_at;

#[derive(Args)]
pub struct RetrievalArgs {
    /// Checkpoint directory, or a run directory (its latest checkpoint).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Use the weights' moving average the checkpoint holds (`train.ema_decay`).
    #[arg(long)]
    pub ema: bool,
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
    let (source, what) = retrieval_source(&a.data, &a.karpathy, &a.images, &a.split)?;
    let device = super::default_device();
    let m = load_model_with(&a.checkpoint, &device, a.ema)?;
    let ks = parse_ks(&a.recall_k)?;
    let done = evaluate_retrieval(&m, source, &what, &ks, a.batch.unwrap_or(auto_batch(m.spec())), &device, a.json)?;
    done.finish(a.strict, a.output.as_deref(), a.json)
}

/// A finished evaluation: the record for `--json` / `--output` and the table for people.
pub struct Evaluated {
    pub record: EvalRecord,
    pub table: Table,
}

impl Evaluated {
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

/// Shards, or a Karpathy split file with its image folder.
pub fn retrieval_source(
    data: &Option<String>,
    karpathy: &Option<PathBuf>,
    images: &Option<PathBuf>,
    split: &str,
) -> Result<(EvalSource, String)> {
    Ok(match (data, karpathy, images) {
        (Some(d), _, _) => (EvalSource::Shards(spec::expand(d)?), d.clone()),
        (None, Some(k), Some(images)) => (EvalSource::Files(folders::karpathy(k, images, split)?), format!("{} ({split})", k.display())),
        _ => bail!("give --data SPEC, or --karpathy FILE with --images DIR"),
    })
}

/// Image-text retrieval of `m` on `source`, recall at each of `ks` both ways.
pub fn evaluate_retrieval(
    m: &LoadedModel,
    source: EvalSource,
    what: &str,
    ks: &[usize],
    batch: usize,
    device: &candle_core::Device,
    quiet: bool,
) -> Result<Evaluated> {
    let run = ret::run(&m.model, &m.tokenizer, source, &m.usage.image, batch, device, quiet)
        .with_context(|| format!("evaluating {}", m.dir.display()))?;
    let mut rec = EvalRecord::new(&m.dir, what, "zeroshot_retrieval", run.report.images, &run.skipped);
    rec.texts = Some(run.report.texts);
    for &k in ks {
        // CLIP_benchmark's names: "image retrieval" is a caption finding its image.
        rec.metric(format!("image_retrieval_recall@{k}"), recall_at(&run.ranks.t2i, k));
        rec.metric(format!("text_retrieval_recall@{k}"), recall_at(&run.ranks.i2t, k));
    }
    let mut t = Table::new(&format!("Retrieval: {what}"));
    add_retrieval(&mut t, &run.report);
    for &k in ks.iter().filter(|k| ![1, 5, 10].contains(*k)) {
        t.row(
            format!("R@{k} image→text / text→image"),
            format!("{} / {}", super::table::pct(recall_at(&run.ranks.i2t, k)), super::table::pct(recall_at(&run.ranks.t2i, k))),
        );
    }
    t.row("skipped", run.skipped.summary());
    Ok(Evaluated { record: rec, table: t })
}

#[derive(Args)]
pub struct ZeroShotArgs {
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Use the weights' moving average the checkpoint holds (`train.ema_decay`).
    #[arg(long)]
    pub ema: bool,
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
    let task = ZeroShotData::new(&a.data, &a.imagenet, a.variant, &a.classes, &a.wnids, &a.templates)?;
    let device = super::default_device();
    let m = load_model_with(&a.checkpoint, &device, a.ema)?;
    let done = evaluate_zeroshot(&m, task, a.batch.unwrap_or(auto_batch(m.spec())), &device, a.json)?;
    done.finish(a.strict, a.output.as_deref(), a.json)
}

/// What a zero-shot classification reads: images with labels, class names and prompt templates.
pub struct ZeroShotData {
    pub source: EvalSource,
    pub classes: Vec<String>,
    pub templates: Vec<String>,
    pub what: String,
}

impl ZeroShotData {
    /// Labelled shards with a class file, or an ImageNet-style folder (the shipped ImageNet-1k
    /// classes and WordNet ids unless given); CLIP's 80 templates unless given.
    pub fn new(
        data: &Option<String>,
        imagenet: &Option<PathBuf>,
        variant: Variant,
        classes: &Option<PathBuf>,
        wnids: &Option<PathBuf>,
        templates: &Option<PathBuf>,
    ) -> Result<ZeroShotData> {
        let templates = match templates {
            Some(p) => zs::read_lines(p)?,
            None => imagenet::lines(imagenet::TEMPLATES),
        };
        let (classes, source, what) = match (data, imagenet) {
            (Some(d), _) => {
                let Some(c) = classes else { bail!("--data needs --classes FILE (one class name per line, in label order)") };
                (zs::read_lines(c)?, EvalSource::Shards(spec::expand(d)?), d.clone())
            }
            (None, Some(dir)) => {
                let classes = match classes {
                    Some(c) => zs::read_lines(c)?,
                    None => imagenet::lines(imagenet::CLASSES),
                };
                let wnids = match wnids {
                    Some(w) => zs::read_lines(w)?,
                    None => imagenet::lines(imagenet::WNIDS),
                };
                let (names, files) = folders::imagenet_folder(dir, variant, &classes, &wnids)?;
                (names, EvalSource::Files(files), format!("{} ({variant:?})", dir.display()))
            }
            (None, None) => bail!("give --data SPEC with --classes, or --imagenet DIR"),
        };
        Ok(ZeroShotData { source, classes, templates, what })
    }
}

/// Zero-shot classification of `m` with a prompt ensemble: acc@1, acc@5, mean per-class recall.
pub fn evaluate_zeroshot(m: &LoadedModel, d: ZeroShotData, batch: usize, device: &candle_core::Device, quiet: bool) -> Result<Evaluated> {
    let run = zs::run(&m.model, &m.tokenizer, d.source, &d.classes, &d.templates, &m.usage.image, batch, device, quiet)
        .with_context(|| format!("evaluating {}", m.dir.display()))?;
    let mut rec = EvalRecord::new(&m.dir, &d.what, "zeroshot_classification", run.report.images, &run.skipped);
    rec.classes = Some(run.report.classes);
    rec.metric("acc1", run.report.top1);
    // CLIP_benchmark reports no acc5 below five classes (every image would count).
    rec.metrics.insert("acc5".into(), if run.report.classes >= 5 { run.report.top5.into() } else { serde_json::Value::Null });
    rec.metric("mean_per_class_recall", run.report.mean_per_class_recall);
    let mut t = Table::new(&format!("Zero-shot: {}, {} templates", d.what, d.templates.len()));
    add_zeroshot(&mut t, &run.report);
    t.row("mean per-class recall", super::table::pct(run.report.mean_per_class_recall));
    t.row("skipped", run.skipped.summary());
    Ok(Evaluated { record: rec, table: t })
}

#[derive(Args)]
pub struct KnnArgs {
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Use the weights' moving average the checkpoint holds (`train.ema_decay`).
    #[arg(long)]
    pub ema: bool,
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
    /// Images (and texts) per forward pass (default: the model's, 64 or 32).
    #[arg(long)]
    pub batch: Option<usize>,
    #[arg(long)]
    pub json: bool,
}

pub fn labelled_source(spec_arg: &Option<String>, folder: &Option<PathBuf>, what: &str) -> Result<EvalSource> {
    match (spec_arg, folder) {
        (Some(s), _) => Ok(EvalSource::Shards(spec::expand(s)?)),
        (None, Some(dir)) => {
            let (_, files) =
                folders::imagenet_folder(dir, Variant::Val, &imagenet::lines(imagenet::CLASSES), &imagenet::lines(imagenet::WNIDS))?;
            Ok(EvalSource::Files(files))
        }
        (None, None) => bail!("give --{what} SPEC or --{what}-imagenet DIR"),
    }
}

/// Two labelled splits (a training / index split and a test / query split) embedded with `m`, and
/// their labels checked against the classes both hold.
struct LabelledSplits {
    first: align::eval::embed::EmbeddedImages,
    second: align::eval::embed::EmbeddedImages,
    first_y: Vec<usize>,
    second_y: Vec<usize>,
    classes: usize,
}

fn embed_labelled(
    m: &LoadedModel,
    (first, second): (EvalSource, EvalSource),
    batch: usize,
    device: &candle_core::Device,
    quiet: bool,
) -> Result<LabelledSplits> {
    use align::data::eval_reader::Needs;
    use align::eval::embed::embed_source;
    let needs = Needs { image: true, captions: false, label: true };
    let cfg = &m.usage.image;
    let evaluating = || format!("evaluating {}", m.dir.display());
    let first = embed_source(&m.model, first, cfg, needs, batch, device, quiet).with_context(evaluating)?;
    let second = embed_source(&m.model, second, cfg, needs, batch, device, quiet).with_context(evaluating)?;
    let classes = first.labels.iter().chain(&second.labels).flatten().max().map_or(0, |m| *m as usize + 1);
    let first_y = zs::checked_labels(&first.keys, &first.labels, classes)?;
    let second_y = zs::checked_labels(&second.keys, &second.labels, classes)?;
    Ok(LabelledSplits { first, second, first_y, second_y, classes })
}

pub fn knn(a: &KnnArgs) -> Result<()> {
    let device = super::default_device();
    let m = load_model_with(&a.checkpoint, &device, a.ema)?;
    let sources = (labelled_source(&a.train, &a.train_imagenet, "train")?, labelled_source(&a.val, &a.val_imagenet, "val")?);
    let LabelledSplits { first: index, second: queries, first_y: il, second_y: ql, .. } =
        embed_labelled(&m, sources, a.batch.unwrap_or(auto_batch(m.spec())), &device, a.json)?;
    let rep = align::eval::knn::knn(&index.embeddings, &il, &queries.embeddings, &ql, a.k, 64)?;
    if a.json {
        return super::print_json(&rep);
    }
    let mut t = Table::new("KNN classification");
    t.row(format!("top-1 ({}-NN vote)", rep.k), super::table::pct(rep.top1));
    t.row("Recall@1 / @5 / @10", format!("{} / {} / {}", super::table::pct(rep.r1), super::table::pct(rep.r5), super::table::pct(rep.r10)));
    t.row("index / queries", format!("{} / {}", rep.index, rep.queries));
    t.print();
    Ok(())
}

#[derive(Args)]
pub struct LinearProbeArgs {
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Use the weights' moving average the checkpoint holds (`train.ema_decay`).
    #[arg(long)]
    pub ema: bool,
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
    #[arg(long, default_value_t = 10)]
    pub epochs: usize,
    #[arg(long, default_value_t = 0.1)]
    pub lr: f64,
    /// Batch of the classifier's training (and of the embedding).
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
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
    let device = super::default_device();
    let m = load_model_with(&a.checkpoint, &device, a.ema)?;
    let sources = (labelled_source(&a.train, &a.train_imagenet, "train")?, labelled_source(&a.test, &a.test_imagenet, "test")?);
    let what = format!("{} → {}", a.train.clone().unwrap_or_default(), a.test.clone().unwrap_or_default());
    let pc = align::eval::linear_probe::ProbeConfig {
        epochs: a.epochs,
        lr: a.lr,
        batch: a.batch,
        val_proportion: a.val_proportion,
        seed: a.seed,
    };
    let done = evaluate_linear_probe(&m, sources, &what, &pc, &device, a.json)?;
    done.finish(a.strict, a.output.as_deref(), a.json)
}

/// A logistic-regression probe on `m`'s frozen image features: trained on the first source,
/// scored on the second.
pub fn evaluate_linear_probe(
    m: &LoadedModel,
    sources: (EvalSource, EvalSource),
    what: &str,
    pc: &align::eval::linear_probe::ProbeConfig,
    device: &candle_core::Device,
    quiet: bool,
) -> Result<Evaluated> {
    let LabelledSplits { first: train, second: test, first_y: train_y, second_y: test_y, classes } =
        embed_labelled(m, sources, pc.batch, device, quiet)?;
    let rep = align::eval::linear_probe::probe(&train.embeddings, &train_y, &test.embeddings, &test_y, classes, pc);
    let mut skipped = train.skipped.clone();
    skipped.merge(&test.skipped);
    let mut rec = EvalRecord::new(&m.dir, what, "linear_probe", rep.test, &skipped);
    rec.classes = Some(classes);
    rec.metric("lp_acc1", rep.acc1);
    rec.metrics.insert("lp_acc5".into(), rep.acc5.map_or(serde_json::Value::Null, Into::into));
    rec.metric("lp_mean_per_class_recall", rep.mean_per_class_recall);
    rec.metric("weight_decay", rep.weight_decay);
    let mut t = Table::new("Linear probe");
    t.row("top-1", super::table::pct(rep.acc1));
    t.row("top-5", rep.acc5.map_or("-".into(), super::table::pct));
    t.row("mean per-class recall", super::table::pct(rep.mean_per_class_recall));
    t.row("weight decay (chosen)", format!("{:.3e}", rep.weight_decay));
    t.row("train / test images", format!("{} / {}", rep.train, rep.test));
    t.row("skipped", skipped.summary());
    Ok(Evaluated { record: rec, table: t })
}
