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
                let kept: Vec<String> = BufReader::new(File::open(path)?)
                    .lines()
                    .map_while(|l| l.ok())
                    .filter(|l| {
                        serde_json::from_str::<Value>(l)
                            .ok()
                            .and_then(|v| v.get("step").and_then(Value::as_u64))
                            .is_some_and(|s| s <= limit)
                    })
                    .collect();
                let tmp = path.with_extension("jsonl.tmp");
                std::fs::write(&tmp, kept.iter().map(|l| format!("{l}\n")).collect::<String>())?;
                std::fs::rename(&tmp, path)?;
            }
        } else if path.exists() {
            std::fs::remove_file(path)?;
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
/// measured number of its report (`eval/zeroshot/top1`, `eval/retrieval/i2t/r1`, ...), and one
/// of the weights' moving average `eval_ema/PATH`.
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
                out.push((prefix.to_string(), x));
            }
        }
    }
}

/// The best value of each evaluation metric over a log (all of them are higher-is-better) and
/// the step it came at, in tag order.
pub fn best_eval(records: &[Value]) -> Vec<(String, f64, u64)> {
    let mut best: std::collections::BTreeMap<String, (f64, u64)> = Default::default();
    for r in records.iter().filter(|r| r.get("eval").is_some() || r.get("eval_ema").is_some()) {
        let step = r.get("step").and_then(Value::as_u64).unwrap_or(0);
        for (tag, x) in scalars(r) {
            let e = best.entry(tag).or_insert((x, step));
            if x > e.0 {
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
        let eval = serde_json::json!({"step": 7, "eval": {"zeroshot": {"top1": 0.5, "top5": 0.9, "images": 10, "classes": 3},
            "retrieval": {"i2t": {"r1": 0.25, "r5": 0.5, "r10": 0.75}, "rsum": 3.0, "texts": 20}}});
        let tags: Vec<String> = scalars(&eval).into_iter().map(|(t, _)| t).collect();
        for want in ["eval/zeroshot/top1", "eval/zeroshot/top5", "eval/retrieval/i2t/r1", "eval/retrieval/i2t/r10", "eval/retrieval/rsum"] {
            assert!(tags.contains(&want.to_string()), "{want} missing from {tags:?}");
        }
        assert!(!tags.iter().any(|t| t.ends_with("images") || t.ends_with("texts") || t.ends_with("classes")));
        let ema = serde_json::json!({"step": 7, "eval_ema": {"zeroshot": {"top1": 0.75}}});
        assert_eq!(scalars(&ema), vec![("eval_ema/zeroshot/top1".to_string(), 0.75)]);
    }

    #[test]
    fn best_eval_keeps_the_highest_value_and_its_step() {
        let recs = vec![
            serde_json::json!({"step": 10, "loss": 1.0}),
            serde_json::json!({"step": 10, "eval": {"zeroshot": {"top1": 0.4}}}),
            serde_json::json!({"step": 20, "eval": {"zeroshot": {"top1": 0.6}}}),
            serde_json::json!({"step": 30, "eval": {"zeroshot": {"top1": 0.5}}}),
        ];
        assert_eq!(best_eval(&recs), vec![("eval/zeroshot/top1".to_string(), 0.6, 20)]);
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
