//! The evaluation suite (`align eval suite --config evals.toml`): several datasets for one or
//! several checkpoints, in one command. Each checkpoint is loaded once and each dataset embedded once per checkpoint; the
//! results print as one table and are written as one CLIP_benchmark JSON per (checkpoint,
//! dataset), named as CLIP_benchmark names its own, so its `build` aggregates both together.
//!
//! ```toml
//! checkpoints = ["runs/demo", "hf:kakaobrain/align-base"]
//! output_dir = "eval-results"       # default: no files, the table (or --json) only
//! batch = 64                       # default: the model's own (64, or 32 for a large EfficientNet)
//! recall_k = [1, 5, 10]
//!
//! [[dataset]]
//! name = "imagenet1k"
//! task = "zeroshot_classification"
//! imagenet = "/data/imagenet/val"   # or: data = "shards-{000..009}.tar" with classes = "classes.txt"
//!
//! [[dataset]]
//! name = "flickr30k"
//! task = "zeroshot_retrieval"
//! karpathy = "dataset_flickr30k.json"
//! images = "flickr30k-images"       # or: data = "test-{000..004}.tar"
//!
//! [[dataset]]
//! name = "cifar10"
//! task = "linear_probe"
//! train = "cifar10-train-{0..9}.tar"
//! test = "cifar10-test-{0..1}.tar"
//! ```
//!
//! Relative paths are taken from the directory `align` runs in, as in training configs.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use serde::Deserialize;

use super::embed::auto_batch;
use super::linear_probe::ProbeConfig;
use super::record::{result_file_name, EvalRecord};
use super::tasks::{self, ZeroShotData};
use crate::data::folders::Variant;
use crate::io::load::{load_model, LoadedModel};
use crate::util::progress::Progress;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Suite {
    /// Checkpoints, run directories, Hugging Face directories or `hf:ID`s.
    pub checkpoints: Vec<PathBuf>,
    #[serde(default)]
    pub output_dir: Option<PathBuf>,
    /// Images (and texts) per forward pass; absent: each model's own (64, or 32 for a large
    /// EfficientNet).
    #[serde(default)]
    pub batch: Option<usize>,
    #[serde(default = "default_ks")]
    pub recall_k: Vec<usize>,
    #[serde(default)]
    pub strict: bool,
    #[serde(rename = "dataset")]
    pub datasets: Vec<Dataset>,
}

fn default_ks() -> Vec<usize> {
    vec![1, 5, 10]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    ZeroshotClassification,
    ZeroshotRetrieval,
    LinearProbe,
}

/// One dataset and the task run on it; the fields a task does not read are refused.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dataset {
    /// The name results carry (CLIP_benchmark's `dataset`), e.g. `imagenet1k`, `flickr30k`.
    pub name: String,
    pub task: Task,
    /// Shards (zero-shot with `classes`, or retrieval).
    pub data: Option<String>,
    /// Zero-shot: an ImageNet-style folder, its `variant`, optional `classes`, `wnids`.
    pub imagenet: Option<PathBuf>,
    pub variant: Option<Variant>,
    pub classes: Option<PathBuf>,
    pub wnids: Option<PathBuf>,
    /// Zero-shot: prompt templates (default CLIP's 80).
    pub templates: Option<PathBuf>,
    /// Retrieval: a Karpathy split file, its image folder and split (default `test`).
    pub karpathy: Option<PathBuf>,
    pub images: Option<PathBuf>,
    pub split: Option<String>,
    /// Linear probe: labelled shards (or ImageNet-style folders) to train and to test on.
    pub train: Option<String>,
    pub test: Option<String>,
    pub train_imagenet: Option<PathBuf>,
    pub test_imagenet: Option<PathBuf>,
    /// Linear probe: CLIP_benchmark's settings, defaults as there.
    pub epochs: Option<usize>,
    pub lr: Option<f64>,
    pub val_proportion: Option<f64>,
    pub seed: Option<u64>,
}

impl Suite {
    pub fn read(path: &Path) -> Result<Suite> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let suite: Suite = toml::from_str(&text).with_context(|| format!("{} is not a valid suite", path.display()))?;
        suite.check().with_context(|| format!("{}", path.display()))?;
        Ok(suite)
    }

    /// Every mistake a suite can hold is found before the first checkpoint is loaded.
    fn check(&self) -> Result<()> {
        if self.checkpoints.is_empty() {
            bail!("`checkpoints` is empty");
        }
        if self.datasets.is_empty() {
            bail!("no [[dataset]]");
        }
        if self.batch == Some(0) || self.recall_k.is_empty() || self.recall_k.contains(&0) {
            bail!("`batch` and every `recall_k` must be positive, and `recall_k` not empty");
        }
        let mut names = std::collections::HashSet::new();
        for d in &self.datasets {
            if !names.insert(&d.name) {
                bail!("two datasets are named {:?}", d.name);
            }
            d.check().with_context(|| format!("dataset {:?}", d.name))?;
        }
        Ok(())
    }
}

impl Dataset {
    fn check(&self) -> Result<()> {
        let set = |present: bool, field: &str| present.then(|| field.to_string());
        let zeroshot = [
            set(self.imagenet.is_some(), "imagenet"),
            set(self.variant.is_some(), "variant"),
            set(self.classes.is_some(), "classes"),
            set(self.wnids.is_some(), "wnids"),
            set(self.templates.is_some(), "templates"),
        ];
        let retrieval =
            [set(self.karpathy.is_some(), "karpathy"), set(self.images.is_some(), "images"), set(self.split.is_some(), "split")];
        let probe = [
            set(self.train.is_some(), "train"),
            set(self.test.is_some(), "test"),
            set(self.train_imagenet.is_some(), "train_imagenet"),
            set(self.test_imagenet.is_some(), "test_imagenet"),
            set(self.epochs.is_some(), "epochs"),
            set(self.lr.is_some(), "lr"),
            set(self.val_proportion.is_some(), "val_proportion"),
            set(self.seed.is_some(), "seed"),
        ];
        let (foreign, data_ok): (Vec<&Option<String>>, bool) = match self.task {
            Task::ZeroshotClassification => (retrieval.iter().chain(&probe).collect(), true),
            Task::ZeroshotRetrieval => (zeroshot.iter().chain(&probe).collect(), true),
            Task::LinearProbe => (zeroshot.iter().chain(&retrieval).collect(), self.data.is_none()),
        };
        if let Some(f) = foreign.into_iter().flatten().next() {
            bail!("`{f}` does not apply to task {:?}", self.task);
        }
        if !data_ok {
            bail!("a linear probe reads `train` and `test`, not `data`");
        }
        Ok(())
    }

    /// The probe's settings: CLIP_benchmark's defaults (its batch of 64 included, as
    /// `align eval linear-probe` has them) where the dataset sets none.
    fn probe_config(&self) -> ProbeConfig {
        let d = ProbeConfig::default();
        ProbeConfig {
            epochs: self.epochs.unwrap_or(d.epochs),
            lr: self.lr.unwrap_or(d.lr),
            batch: d.batch,
            val_proportion: self.val_proportion.unwrap_or(d.val_proportion),
            seed: self.seed.unwrap_or(d.seed),
        }
    }

    /// Evaluates `m` on this dataset. The data's sources are opened here, per checkpoint: a
    /// source is a reader over files, used up by one pass.
    fn evaluate(&self, m: &LoadedModel, suite: &Suite, device: &Device) -> Result<EvalRecord> {
        let mut record = match self.task {
            Task::ZeroshotClassification => {
                let variant = self.variant.unwrap_or(Variant::Val);
                let data = ZeroShotData::new(&self.data, &self.imagenet, variant, &self.classes, &self.wnids, &self.templates)?;
                tasks::evaluate_zeroshot(m, data, suite.batch.unwrap_or(auto_batch(m.spec())), device, true)?.record
            }
            Task::ZeroshotRetrieval => {
                let split = self.split.clone().unwrap_or_else(|| "test".into());
                let (source, what) = tasks::retrieval_source(&self.data, &self.karpathy, &self.images, &split)?;
                tasks::evaluate_retrieval(m, source, &what, &suite.recall_k, suite.batch.unwrap_or(auto_batch(m.spec())), device, true)?
                    .record
            }
            Task::LinearProbe => {
                let sources = (
                    tasks::labelled_source(&self.train, &self.train_imagenet, "train")?,
                    tasks::labelled_source(&self.test, &self.test_imagenet, "test")?,
                );
                let what = format!("{} → {}", self.train.clone().unwrap_or_default(), self.test.clone().unwrap_or_default());
                tasks::evaluate_linear_probe(m, sources, &what, &self.probe_config(), device, true)?.record
            }
        };
        record.dataset = Some(self.name.clone());
        Ok(record)
    }
}

/// Evaluates every checkpoint on every dataset, each checkpoint loaded once; with `strict`, a
/// skipped sample is an error; with `output_dir`, each result is written there as CLIP_benchmark
/// writes its own.
/// How a suite runs: whether a skipped sample fails it, where CLIP_benchmark's files go, the
/// precision the products run in (already set for the process), the device, and whether to show
/// progress.
pub struct SuiteRun<'a> {
    pub strict: bool,
    pub output_dir: Option<&'a Path>,
    pub precision: crate::config::Precision,
    pub device: &'a Device,
    pub quiet: bool,
}

pub fn run(suite: &Suite, o: &SuiteRun) -> Result<Vec<EvalRecord>> {
    let SuiteRun { strict, output_dir, precision, device, quiet } = *o;
    if let Some(dir) = output_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let jobs = (suite.checkpoints.len() * suite.datasets.len()) as u64;
    let bar = Progress::bar(jobs, "evaluations", quiet);
    let mut records = Vec::new();
    for checkpoint in &suite.checkpoints {
        let mut m = load_model(checkpoint, device)?;
        m.set_precision(precision);
        for d in &suite.datasets {
            bar.set_message(format!("{} on {}", d.name, checkpoint.display()));
            let record = d.evaluate(&m, suite, device).with_context(|| format!("dataset {:?}", d.name))?;
            record.check_strict(strict).with_context(|| format!("dataset {:?} with {}", d.name, checkpoint.display()))?;
            if let Some(dir) = output_dir {
                record.write_clip_benchmark(&dir.join(result_file_name(&record)))?;
            }
            records.push(record);
            bar.inc(1);
        }
    }
    bar.finish();
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Suite> {
        let s: Suite = toml::from_str(text)?;
        s.check()?;
        Ok(s)
    }

    #[test]
    fn a_suite_reads_its_datasets_with_defaults() {
        let s = parse(
            r#"checkpoints = ["runs/a"]
            [[dataset]]
            name = "imagenet1k"
            task = "zeroshot_classification"
            imagenet = "val"
            variant = "v2"
            [[dataset]]
            name = "flickr30k"
            task = "zeroshot_retrieval"
            karpathy = "dataset_flickr30k.json"
            images = "flickr30k-images"
            "#,
        )
        .unwrap();
        assert_eq!((s.batch, s.recall_k.clone()), (None, vec![1, 5, 10]));
        assert_eq!(s.datasets[0].variant, Some(Variant::V2));
        assert_eq!(s.datasets[1].task, Task::ZeroshotRetrieval);
    }

    #[test]
    fn mistakes_are_found_before_anything_runs() {
        let cases = [
            ("checkpoints = []\n[[dataset]]\nname = \"a\"\ntask = \"linear_probe\"", "`checkpoints` is empty"),
            ("checkpoints = [\"x\"]", "dataset"),
            (
                "checkpoints = [\"x\"]\n[[dataset]]\nname = \"a\"\ntask = \"zeroshot_retrieval\"\n[[dataset]]\nname = \"a\"\ntask = \"zeroshot_retrieval\"",
                "two datasets",
            ),
            ("checkpoints = [\"x\"]\n[[dataset]]\nname = \"a\"\ntask = \"zeroshot_retrieval\"\nclasses = \"c.txt\"", "`classes` does not apply"),
            ("checkpoints = [\"x\"]\n[[dataset]]\nname = \"a\"\ntask = \"linear_probe\"\ndata = \"s.tar\"", "not `data`"),
            ("checkpoints = [\"x\"]\n[[dataset]]\nname = \"a\"\ntask = \"zeroshot_retrieval\"\nkarpathi = \"k\"", "unknown field"),
            ("checkpoints = [\"x\"]\n[[dataset]]\nname = \"a\"\ntask = \"knn\"", "unknown variant"),
        ];
        for (text, why) in cases {
            let e = format!("{:#}", parse(text).unwrap_err());
            assert!(e.contains(why), "{text}\n→ {e}");
        }
    }

    #[test]
    fn result_files_are_named_as_clip_benchmark_names_them() {
        let mut r = EvalRecord::new(
            Path::new("runs/demo/checkpoints/step-120"),
            crate::config::Precision::F32,
            "x.tar",
            "zeroshot_retrieval",
            3,
            &Default::default(),
        );
        r.dataset = Some("flickr30k".into());
        r.step = Some(120);
        assert_eq!(result_file_name(&r), "flickr30k_step-120_runs-demo-checkpoints-step-120_en_zeroshot_retrieval.json");
    }

    #[test]
    fn the_shipped_suites_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/evals");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            Suite::read(&path).unwrap_or_else(|e| panic!("{e:#}"));
            n += 1;
        }
        assert!(n >= 2, "{}", dir.display());
    }
}
