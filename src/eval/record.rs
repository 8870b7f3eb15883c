//! What an evaluation reports besides its numbers, so that a result names what it measured: the
//! checkpoint and its step, the data, how many images and texts were evaluated, what was skipped
//! and whether that leaves the set partial; the metrics as fractions under CLIP_benchmark's names.
//! `--output FILE` writes the layout CLIP_benchmark's `eval` writes (dataset, model, pretrained,
//! task, metrics, language), which its `build` aggregates with its own results.

use std::path::Path;

use crate::config::Precision;
use crate::data::skips::SkipCounts;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::{Map, Value};

#[derive(Serialize)]
pub struct EvalRecord {
    pub checkpoint: String,
    /// The training step of an align checkpoint (none for a Hugging Face model).
    pub step: Option<u64>,
    pub data: String,
    /// The dataset's name in a suite (`imagenet1k`, `flickr30k`); CLIP_benchmark's `dataset`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataset: Option<String>,
    /// CLIP_benchmark's task name: `zeroshot_retrieval`, `zeroshot_classification` or
    /// `linear_probe`; `knn` for ALIGN's nearest-neighbour classification, which CLIP_benchmark
    /// does not have.
    pub task: &'static str,
    pub images: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub texts: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub classes: Option<usize>,
    /// The neighbours that vote (KNN).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub neighbours: Option<usize>,
    pub skipped: SkipCounts,
    pub skipped_total: u64,
    /// False when samples were skipped: the numbers are over part of the set.
    pub complete: bool,
    /// Every metric is a fraction in [0, 1].
    pub unit: &'static str,
    /// The towers' matrix products: `f32`, or `bf16` (`--precision bf16`).
    pub precision: &'static str,
    pub metrics: Map<String, Value>,
}

impl EvalRecord {
    /// The record of `task` on `data` by the checkpoint's model with its products in
    /// `precision`, over `images` images.
    pub fn new(checkpoint: &Path, precision: Precision, data: &str, task: &'static str, images: usize, skipped: &SkipCounts) -> EvalRecord {
        let step = crate::io::run_dir::read_state(checkpoint).ok().map(|s| s.step);
        EvalRecord {
            checkpoint: checkpoint.display().to_string(),
            step,
            data: data.to_string(),
            dataset: None,
            task,
            images,
            texts: None,
            classes: None,
            neighbours: None,
            skipped: skipped.clone(),
            skipped_total: skipped.total(),
            complete: skipped.is_empty(),
            unit: "fraction",
            precision: precision.name(),
            metrics: Map::new(),
        }
    }

    pub fn metric(&mut self, name: impl Into<String>, value: f64) {
        self.metrics.insert(name.into(), Value::from(value));
    }

    /// `--strict`: a skipped sample is an error, not a partial result.
    pub fn check_strict(&self, strict: bool) -> Result<()> {
        if strict && !self.complete {
            bail!(
                "{} of the evaluation data's samples were skipped ({}): --strict allows none",
                self.skipped_total,
                self.skipped.summary()
            );
        }
        Ok(())
    }

    /// The warning a table shows under a partial result.
    pub fn partial_note(&self) -> Option<String> {
        (!self.complete)
            .then(|| format!("PARTIAL: {} samples skipped ({}); the numbers cover the rest", self.skipped_total, self.skipped.summary()))
    }

    /// Writes CLIP_benchmark's result layout to `path`.
    pub fn write_clip_benchmark(&self, path: &Path) -> Result<()> {
        let v = serde_json::json!({
            "dataset": self.dataset.as_ref().unwrap_or(&self.data),
            "model": self.checkpoint,
            "pretrained": self.step.map_or_else(String::new, |s| format!("step-{s}")),
            "task": self.task,
            "metrics": self.metrics,
            "language": "en",
        });
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        crate::io::tensors::write_atomic(path, serde_json::to_string_pretty(&v)?.as_bytes())
    }
}

/// CLIP_benchmark's file name for a result: `{dataset}_{pretrained}_{model}_{language}_{task}.json`,
/// with the characters a file name cannot hold replaced.
pub fn result_file_name(r: &EvalRecord) -> String {
    let clean = |s: &str| -> String {
        let s: String = s.chars().map(|c| if c.is_ascii_alphanumeric() || "-.".contains(c) { c } else { '-' }).collect();
        s.trim_matches('-').to_string()
    };
    let dataset = r.dataset.as_deref().unwrap_or(&r.data);
    let pretrained = r.step.map_or_else(|| "pretrained".to_string(), |s| format!("step-{s}"));
    format!("{}_{}_{}_en_{}.json", clean(dataset), pretrained, clean(&r.checkpoint), r.task)
}

/// `--recall-k 1,5,10`.
pub fn parse_ks(s: &str) -> Result<Vec<usize>> {
    let ks: Vec<usize> = s
        .split(',')
        .map(|k| k.trim().parse::<usize>().with_context(|| format!("--recall-k {s:?}: {k:?} is not a number")))
        .collect::<Result<_>>()?;
    if ks.is_empty() || ks.contains(&0) {
        bail!("--recall-k {s:?}: give positive numbers, e.g. 1,5,10");
    }
    Ok(ks)
}
