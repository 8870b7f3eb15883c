//! The evaluations `align eval` runs on a loaded checkpoint, as a library: where each task's data
//! comes from (shards, ImageNet-style folders, Karpathy split files), the task itself, and the
//! record that names what was measured (`record`). The CLI parses arguments and prints; the suite
//! (`suite`) runs these for several checkpoints and datasets; training's periodic evaluation and
//! the scorer share the same embedding path (`retrieval::run`, `zeroshot::run`, `embed`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::Device;

use super::embed::{EmbeddedImages, Embedder};
use super::knn::KnnReport;
use super::linear_probe::{ProbeConfig, ProbeReport};
use super::metrics::recall_at;
use super::record::EvalRecord;
use super::retrieval::{self as ret, RetrievalRun};
use super::zeroshot::{self as zs, ZeroShotRun};
use crate::data::eval_reader::{EvalSource, Needs};
use crate::data::folders::{self, imagenet, Variant};
use crate::data::skips::SkipCounts;
use crate::data::spec;
use crate::io::load::LoadedModel;

/// A finished evaluation: its record (metadata and metrics under CLIP_benchmark's names, as
/// fractions) and the task's own results, for tables.
pub struct Evaluated<R> {
    pub record: EvalRecord,
    pub run: R,
}

/// Shards, or a Karpathy split file with its image folder; returns the source and its name.
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
    device: &Device,
    quiet: bool,
) -> Result<Evaluated<RetrievalRun>> {
    let run = ret::run(&Embedder::of(m, batch, device, quiet), source).with_context(|| format!("evaluating {}", m.dir.display()))?;
    let mut rec = EvalRecord::new(&m.dir, m.precision, what, "zeroshot_retrieval", run.report.images, &run.skipped);
    rec.texts = Some(run.report.texts);
    for &k in ks {
        // CLIP_benchmark's names: "image retrieval" is a caption finding its image.
        rec.metric(format!("image_retrieval_recall@{k}"), recall_at(&run.ranks.t2i, k));
        rec.metric(format!("text_retrieval_recall@{k}"), recall_at(&run.ranks.i2t, k));
    }
    // The mean of the six recalls at 1, 5 and 10, as training's records and the demo give it.
    rec.metric("mean_recall".to_string(), run.report.mean_recall());
    Ok(Evaluated { record: rec, run })
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
pub fn evaluate_zeroshot(m: &LoadedModel, d: ZeroShotData, batch: usize, device: &Device, quiet: bool) -> Result<Evaluated<ZeroShotRun>> {
    let run = zs::run(&Embedder::of(m, batch, device, quiet), d.source, &d.classes, &d.templates)
        .with_context(|| format!("evaluating {}", m.dir.display()))?;
    let mut rec = EvalRecord::new(&m.dir, m.precision, &d.what, "zeroshot_classification", run.report.images, &run.skipped);
    rec.classes = Some(run.report.classes);
    rec.metric("acc1", run.report.top1);
    // CLIP_benchmark reports no acc5 below five classes (every image would count).
    rec.metrics.insert("acc5".into(), if run.report.classes >= 5 { run.report.top5.into() } else { serde_json::Value::Null });
    rec.metric("mean_per_class_recall", run.report.mean_per_class_recall);
    Ok(Evaluated { record: rec, run })
}

/// Labelled shards, or an ImageNet-style folder with the shipped ImageNet-1k order; `what` names
/// the argument (`train`, `val`, `test`) in the error.
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
    first: EmbeddedImages,
    second: EmbeddedImages,
    first_y: Vec<usize>,
    second_y: Vec<usize>,
    classes: usize,
    skipped: SkipCounts,
}

fn embed_labelled(
    m: &LoadedModel,
    (first, second): (EvalSource, EvalSource),
    batch: usize,
    device: &Device,
    quiet: bool,
) -> Result<LabelledSplits> {
    let needs = Needs { image: true, captions: false, label: true };
    let embedder = Embedder::of(m, batch, device, quiet);
    let evaluating = || format!("evaluating {}", m.dir.display());
    let first = embedder.images(first, needs).with_context(evaluating)?;
    let second = embedder.images(second, needs).with_context(evaluating)?;
    let classes = first.labels.iter().chain(&second.labels).flatten().max().map_or(0, |m| *m as usize + 1);
    let first_y = zs::checked_labels(&first.keys, &first.labels, classes)?;
    let second_y = zs::checked_labels(&second.keys, &second.labels, classes)?;
    let mut skipped = first.skipped.clone();
    skipped.merge(&second.skipped);
    Ok(LabelledSplits { first, second, first_y, second_y, classes, skipped })
}

/// A probe's or a KNN classifier's result, with what was skipped from both splits.
pub struct LabelledRun<R> {
    pub report: R,
    pub skipped: SkipCounts,
}

/// A logistic-regression probe on `m`'s frozen image features: trained on the first source,
/// scored on the second.
pub fn evaluate_linear_probe(
    m: &LoadedModel,
    sources: (EvalSource, EvalSource),
    what: &str,
    pc: &ProbeConfig,
    device: &Device,
    quiet: bool,
) -> Result<Evaluated<LabelledRun<ProbeReport>>> {
    let s = embed_labelled(m, sources, pc.batch, device, quiet)?;
    let rep = super::linear_probe::probe(&s.first.embeddings, &s.first_y, &s.second.embeddings, &s.second_y, s.classes, pc);
    let mut rec = EvalRecord::new(&m.dir, m.precision, what, "linear_probe", rep.test, &s.skipped);
    rec.classes = Some(s.classes);
    rec.metric("lp_acc1", rep.acc1);
    rec.metrics.insert("lp_acc5".into(), rep.acc5.map_or(serde_json::Value::Null, Into::into));
    rec.metric("lp_mean_per_class_recall", rep.mean_per_class_recall);
    rec.metric("weight_decay", rep.weight_decay);
    Ok(Evaluated { record: rec, run: LabelledRun { report: rep, skipped: s.skipped } })
}

/// K-nearest-neighbour classification (ALIGN §6): the first source is the index, the second the
/// queries. Its metrics: `knn_acc1` (the k-NN vote) and `knn_recall@1/5/10` (the query's label
/// among its nearest index images' labels).
pub fn evaluate_knn(
    m: &LoadedModel,
    sources: (EvalSource, EvalSource),
    what: &str,
    k: usize,
    batch: usize,
    device: &Device,
    quiet: bool,
) -> Result<Evaluated<LabelledRun<KnnReport>>> {
    let s = embed_labelled(m, sources, batch, device, quiet)?;
    let rep = super::knn::knn(&s.first.embeddings, &s.first_y, &s.second.embeddings, &s.second_y, k, 64)?;
    let mut rec = EvalRecord::new(&m.dir, m.precision, what, "knn", rep.queries, &s.skipped);
    rec.classes = Some(s.classes);
    rec.metric("knn_acc1", rep.top1);
    for (at, v) in [(1, rep.r1), (5, rep.r5), (10, rep.r10)] {
        rec.metric(format!("knn_recall@{at}"), v);
    }
    rec.neighbours = Some(rep.k);
    Ok(Evaluated { record: rec, run: LabelledRun { report: rep, skipped: s.skipped } })
}
