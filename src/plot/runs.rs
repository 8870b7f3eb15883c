//! A run's curves, read from its metrics log (or, for a run that has only TensorBoard files,
//! from those), as tag → (step, value) points.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use crate::io::{metrics_log, tensorboard};

pub type Curves = BTreeMap<String, Vec<(f64, f64)>>;

pub struct Run {
    pub name: String,
    pub curves: Curves,
}

/// The run directory for a path given on the command line: the run itself, or one of its
/// `step-N` checkpoints.
pub fn run_dir(path: &Path) -> Result<PathBuf> {
    for dir in [Some(path), path.parent()].into_iter().flatten() {
        if dir.join("metrics.jsonl").is_file() || dir.join("tb").is_dir() {
            return Ok(dir.to_path_buf());
        }
    }
    bail!("{} is not a run directory: it has neither metrics.jsonl nor tb/", path.display())
}

pub fn load(path: &Path) -> Result<Run> {
    let dir = run_dir(path)?;
    let mut curves = Curves::new();
    let log = dir.join("metrics.jsonl");
    if log.is_file() {
        for r in metrics_log::read(&log)? {
            let Some(step) = r.get("step").and_then(serde_json::Value::as_f64) else { continue };
            for (tag, v) in metrics_log::scalars(&r) {
                curves.entry(tag).or_default().push((step, v));
            }
        }
    } else {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("tb"))?.filter_map(|e| e.ok().map(|e| e.path())).collect();
        files.sort();
        for f in files {
            for s in tensorboard::read_scalars(&f)? {
                let (tag, value) = metrics_log::current_name(&s.tag, s.value as f64);
                curves.entry(tag).or_default().push((s.step as f64, value));
            }
        }
        // A resumed run's later file supersedes the earlier one from the resumed step on.
        for points in curves.values_mut() {
            let mut by_step = BTreeMap::new();
            for (s, v) in points.drain(..) {
                by_step.insert(s as i64, v);
            }
            points.extend(by_step.into_iter().map(|(s, v)| (s as f64, v)));
        }
    }
    if curves.is_empty() {
        bail!("{} has no logged steps yet", dir.display());
    }
    let name = path.to_string_lossy().trim_end_matches('/').to_string();
    Ok(Run { name, curves })
}
