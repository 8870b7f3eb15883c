//! The JSONL metrics log (`RUN/metrics.jsonl`): one record per logged step or evaluation. It is
//! the source of truth for curves; on resume, records past the resumed step are dropped so the
//! log reads as one uninterrupted run.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

pub struct MetricsLog {
    file: File,
    path: PathBuf,
}

impl MetricsLog {
    /// Opens for appending, keeping only records with `step <= keep_through` (all when None).
    pub fn open(path: &Path, keep_through: Option<u64>) -> Result<Self> {
        if let Some(limit) = keep_through {
            if path.exists() {
                let kept: Vec<String> = BufReader::new(File::open(path).with_context(|| format!("reading {}", path.display()))?)
                    .lines()
                    .map_while(|l| l.ok())
                    .filter(|l| {
                        serde_json::from_str::<Value>(l)
                            .ok()
                            .and_then(|v| v.get("step").and_then(Value::as_u64))
                            .is_some_and(|s| s <= limit)
                    })
                    .collect();
                // Written beside and renamed over it: a full disk leaves the old log whole and
                // names the file it could not write.
                crate::util::files::write_atomic(path, kept.iter().map(|l| format!("{l}\n")).collect::<String>().as_bytes())
                    .context("keeping the metrics log's records up to the resumed step")?;
            }
        } else if path.exists() {
            std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
        }
        let file = OpenOptions::new().create(true).append(true).open(path).with_context(|| format!("opening {}", path.display()))?;
        Ok(MetricsLog { file, path: path.to_path_buf() })
    }

    pub fn write(&mut self, record: &Value) -> Result<()> {
        writeln!(self.file, "{record}").with_context(|| format!("writing {}", self.path.display()))?;
        self.file.flush()?;
        Ok(())
    }
}

/// Reads every record of a metrics log.
pub fn read(path: &Path) -> Result<Vec<Value>> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    Ok(BufReader::new(f).lines().map_while(|l| l.ok()).filter_map(|l| serde_json::from_str(&l).ok()).collect())
}

/// Fields of an evaluation report that count things rather than measure them.
const EVAL_COUNTS: [&str; 5] = ["images", "texts", "classes", "pairs", "batch"];

/// The curves of one record as (tag, value): what the TensorBoard files and `align plot` draw,
/// so both are derived from the log and never disagree with it. A training record gives
/// `train/FIELD` for each number but the step; an evaluation record gives `eval/PATH` for each
/// measured number of its report (`eval/zeroshot/acc1`, `eval/retrieval/text_retrieval_recall@1`,
/// `eval/validation/loss`, ...), and one of the weights' moving average `eval_ema/PATH`. Logs
/// written before the metrics took CLIP_benchmark's names read as if written today.
pub fn scalars(record: &Value) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    if let Some(eval) = record.get("eval") {
        flatten("eval", eval, &mut out);
    } else if let Some(eval) = record.get("eval_ema") {
        flatten("eval_ema", eval, &mut out);
    } else if let Some(fields) = record.as_object() {
        for (k, v) in fields {
            if let (false, Some(x)) = (k == "step", v.as_f64()) {
                out.push((format!("train/{k}"), x));
            }
        }
    }
    out
}

fn flatten(prefix: &str, v: &Value, out: &mut Vec<(String, f64)>) {
    match v {
        Value::Object(fields) => {
            for (k, v) in fields {
                if !EVAL_COUNTS.contains(&k.as_str()) {
                    flatten(&format!("{prefix}/{k}"), v, out);
                }
            }
        }
        _ => {
            if let Some(x) = v.as_f64() {
                out.push(current_name(prefix, x));
            }
        }
    }
}

/// An evaluation tag of an older log (`zeroshot/top1`, `retrieval/i2t/r1`, `retrieval/rsum` in
/// percent) under its current name and unit; current tags pass through.
pub fn current_name(tag: &str, x: f64) -> (String, f64) {
    let Some((head, leaf)) = tag.rsplit_once('/') else { return (tag.to_string(), x) };
    let renamed = |name: String| (format!("{head}/{name}"), x);
    if head.ends_with("/zeroshot") {
        match leaf {
            "top1" => return renamed("acc1".into()),
            "top5" => return renamed("acc5".into()),
            _ => {}
        }
    }
    if head.ends_with("/retrieval") && leaf == "rsum" {
        return (format!("{head}/mean_recall"), x / 600.0);
    }
    if let (Some(k), Some((retrieval, direction))) = (leaf.strip_prefix('r'), head.rsplit_once('/')) {
        let name = match direction {
            "i2t" => "text_retrieval_recall",
            "t2i" => "image_retrieval_recall",
            _ => return (tag.to_string(), x),
        };
        if retrieval.ends_with("/retrieval") && k.parse::<u32>().is_ok() {
            return (format!("{retrieval}/{name}@{k}"), x);
        }
    }
    (tag.to_string(), x)
}

/// Whether a smaller value of an evaluation tag is the better one: the validation losses; every
/// accuracy and recall is higher-is-better.
pub fn lower_is_better(tag: &str) -> bool {
    tag.contains("/validation/")
}

/// The best value of each evaluation metric over a log and the step it came at, in tag order.
/// Counts that travel with a metric (the validation set's pairs and batch) are not metrics.
pub fn best_eval(records: &[Value]) -> Vec<(String, f64, u64)> {
    let mut best: std::collections::BTreeMap<String, (f64, u64)> = Default::default();
    for r in records.iter().filter(|r| r.get("eval").is_some() || r.get("eval_ema").is_some()) {
        let step = r.get("step").and_then(Value::as_u64).unwrap_or(0);
        for (tag, x) in scalars(r) {
            let lower = lower_is_better(&tag);
            let e = best.entry(tag).or_insert((x, step));
            if (lower && x < e.0) || (!lower && x > e.0) {
                *e = (x, step);
            }
        }
    }
    best.into_iter().map(|(k, (x, s))| (k, x, s)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_become_tagged_scalars() {
        let train = serde_json::json!({"step": 7, "loss": 2.5, "lr": 1e-3, "note": "x"});
        let mut got = scalars(&train);
        got.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(got, vec![("train/loss".to_string(), 2.5), ("train/lr".to_string(), 1e-3)]);
        let eval = serde_json::json!({"step": 7, "eval": {"zeroshot": {"acc1": 0.5, "acc5": 0.9, "images": 10, "classes": 3},
            "retrieval": {"text_retrieval_recall@1": 0.25, "image_retrieval_recall@10": 0.75, "mean_recall": 0.5, "texts": 20},
            "validation": {"loss": 1.5, "pairs": 64, "batch": 32}}});
        let got = scalars(&eval);
        for (want, x) in [
            ("eval/zeroshot/acc1", 0.5),
            ("eval/zeroshot/acc5", 0.9),
            ("eval/retrieval/text_retrieval_recall@1", 0.25),
            ("eval/retrieval/image_retrieval_recall@10", 0.75),
            ("eval/retrieval/mean_recall", 0.5),
            ("eval/validation/loss", 1.5),
        ] {
            assert!(got.contains(&(want.to_string(), x)), "{want} = {x} missing from {got:?}");
        }
        assert_eq!(got.len(), 6, "counts are not curves: {got:?}");
        let ema = serde_json::json!({"step": 7, "eval_ema": {"zeroshot": {"acc1": 0.75}}});
        assert_eq!(scalars(&ema), vec![("eval_ema/zeroshot/acc1".to_string(), 0.75)]);
    }

    /// A log written before the metrics took CLIP_benchmark's names (top1, i2t/r1, rsum in
    /// percent) gives the curves a current log gives.
    #[test]
    fn older_logs_read_in_the_current_vocabulary() {
        let old = serde_json::json!({"step": 7, "eval": {"zeroshot": {"top1": 0.5, "top5": 0.9, "images": 10, "classes": 3},
            "retrieval": {"i2t": {"r1": 0.25, "r5": 0.5, "r10": 0.75}, "t2i": {"r1": 0.2, "r5": 0.4, "r10": 0.6},
            "rsum": 270.0, "images": 10, "texts": 20}}});
        let mut got = scalars(&old);
        got.sort_by(|a, b| a.0.cmp(&b.0));
        let want: Vec<(String, f64)> = [
            ("eval/retrieval/image_retrieval_recall@1", 0.2),
            ("eval/retrieval/image_retrieval_recall@10", 0.6),
            ("eval/retrieval/image_retrieval_recall@5", 0.4),
            ("eval/retrieval/mean_recall", 0.45),
            ("eval/retrieval/text_retrieval_recall@1", 0.25),
            ("eval/retrieval/text_retrieval_recall@10", 0.75),
            ("eval/retrieval/text_retrieval_recall@5", 0.5),
            ("eval/zeroshot/acc1", 0.5),
            ("eval/zeroshot/acc5", 0.9),
        ]
        .into_iter()
        .map(|(t, x)| (t.to_string(), x))
        .collect();
        assert_eq!(got, want);
        // A name that only looks old is left alone.
        let other = serde_json::json!({"step": 1, "eval": {"validation": {"r1": 0.5}}});
        assert_eq!(scalars(&other), vec![("eval/validation/r1".to_string(), 0.5)]);
    }

    /// The report types write what the log reader expects, so a log written today plots.
    #[test]
    fn reports_serialise_in_the_vocabulary_the_reader_knows() {
        use crate::eval::metrics::{ClassificationReport, Ranks, RetrievalReport};
        let r = RetrievalReport::from_ranks(&Ranks { i2t: vec![0, 3, 7, 20], t2i: vec![0, 0, 6, 12] });
        let z = ClassificationReport { top1: 0.5, top5: 0.75, mean_per_class_recall: 0.4, images: 4, classes: 3 };
        let rec = serde_json::json!({"step": 3, "eval": {"retrieval": r, "zeroshot": z}});
        let got: std::collections::BTreeMap<String, f64> = scalars(&rec).into_iter().collect();
        assert_eq!(got["eval/retrieval/text_retrieval_recall@1"], 0.25);
        assert_eq!(got["eval/retrieval/text_retrieval_recall@5"], 0.5);
        assert_eq!(got["eval/retrieval/image_retrieval_recall@1"], 0.5);
        assert_eq!(got["eval/retrieval/image_retrieval_recall@10"], 0.75);
        // (0.25 + 0.5 + 0.75 + 0.5 + 0.5 + 0.75) / 6
        assert!((got["eval/retrieval/mean_recall"] - 3.25 / 6.0).abs() < 1e-12);
        assert_eq!(got["eval/zeroshot/acc1"], 0.5);
        assert_eq!(got["eval/zeroshot/mean_per_class_recall"], 0.4);
        assert_eq!(got.len(), 10);
    }

    #[test]
    fn best_eval_keeps_the_highest_value_and_its_step() {
        let recs = vec![
            serde_json::json!({"step": 10, "loss": 1.0}),
            serde_json::json!({"step": 10, "eval": {"zeroshot": {"top1": 0.4}}}),
            serde_json::json!({"step": 20, "eval": {"zeroshot": {"top1": 0.6}}}),
            serde_json::json!({"step": 30, "eval": {"zeroshot": {"top1": 0.5}}}),
        ];
        assert_eq!(best_eval(&recs), vec![("eval/zeroshot/acc1".to_string(), 0.6, 20)]);
    }

    #[test]
    fn the_best_validation_loss_is_the_lowest() {
        let recs = vec![
            serde_json::json!({"step": 10, "eval": {"validation": {"loss": 2.0, "pairs": 64}}}),
            serde_json::json!({"step": 20, "eval": {"validation": {"loss": 1.5, "pairs": 64}}}),
            serde_json::json!({"step": 30, "eval": {"validation": {"loss": 1.7, "pairs": 64}}}),
        ];
        assert_eq!(best_eval(&recs), vec![("eval/validation/loss".to_string(), 1.5, 20)]);
    }

    #[test]
    fn resuming_drops_records_past_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.jsonl");
        let mut log = MetricsLog::open(&p, None).unwrap();
        for s in 1..=5 {
            log.write(&serde_json::json!({"step": s, "loss": 1.0})).unwrap();
        }
        drop(log);
        let mut log = MetricsLog::open(&p, Some(3)).unwrap();
        log.write(&serde_json::json!({"step": 4, "loss": 0.5})).unwrap();
        let steps: Vec<u64> = read(&p).unwrap().iter().map(|v| v["step"].as_u64().unwrap()).collect();
        assert_eq!(steps, vec![1, 2, 3, 4]);
    }
}
