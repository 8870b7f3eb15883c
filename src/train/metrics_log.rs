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

#[cfg(test)]
mod tests {
    use super::*;

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
