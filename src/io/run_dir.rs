//! Checkpoints: `RUN/step-N/` directories written atomically, a `latest` pointer, keep-last-K.
//!
//! A checkpoint directory holds
//! - `model.safetensors`: weights under Hugging Face names,
//! - `optimizer.safetensors`: AdamW/LAMB moments (`exp_avg.NAME`, `exp_avg_sq.NAME`),
//! - `config.toml`: the full experiment config, `align.json`: the resolved model sizes,
//! - `tokenizer.json`: the vocabulary the run trains with,
//! - `state.json`: step, samples seen, the loader position and the run's clock.
//!
//! Everything is written into `step-N.partial/`, synced, then renamed to `step-N/`; only then is
//! `latest` replaced (also by rename). A crash at any point leaves the previous checkpoint and
//! pointer intact.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::tensors::{save_tensors, sync_dir, write_synced};
use crate::data::loader::LoaderPosition;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    pub step: u64,
    pub samples_seen: u64,
    /// Each rank's loader position, by rank.
    pub loaders: Vec<LoaderPosition>,
    /// Wall-clock seconds of training so far, over all resumptions.
    pub seconds: f64,
    pub last_loss: Option<f64>,
}

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "state.json";
pub const SPEC_FILE: &str = "align.json";
pub const CONFIG_FILE: &str = "config.toml";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const LATEST: &str = "latest";

/// Everything a checkpoint stores, as bytes or tensors ready to write.
pub struct CheckpointContents<'a> {
    pub weights: HashMap<String, Tensor>,
    pub optimizer: HashMap<String, Tensor>,
    pub config_toml: String,
    pub spec_json: String,
    pub tokenizer: &'a crate::data::tokenizer::TextTokenizer,
    pub state: &'a TrainState,
}

/// Writes `run_dir/step-N/` atomically, points `latest` at it and prunes to `keep_last`.
pub fn save(run_dir: &Path, c: &CheckpointContents, keep_last: usize) -> Result<PathBuf> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let name = format!("step-{}", c.state.step);
    let partial = run_dir.join(format!("{name}.partial"));
    let final_dir = run_dir.join(&name);
    if partial.exists() {
        std::fs::remove_dir_all(&partial)?;
    }
    std::fs::create_dir_all(&partial)?;
    save_tensors(&c.weights, &partial.join(MODEL_FILE))?;
    save_tensors(&c.optimizer, &partial.join(OPTIMIZER_FILE))?;
    write_synced(&partial.join(CONFIG_FILE), c.config_toml.as_bytes())?;
    write_synced(&partial.join(SPEC_FILE), c.spec_json.as_bytes())?;
    write_synced(&partial.join(STATE_FILE), serde_json::to_string_pretty(c.state)?.as_bytes())?;
    c.tokenizer.save(&partial.join(TOKENIZER_FILE))?;
    File::open(partial.join(TOKENIZER_FILE))?.sync_all()?;
    sync_dir(&partial);
    if final_dir.exists() {
        // A re-run over an old step (after resuming from an earlier one) replaces it.
        let old = run_dir.join(format!("{name}.old"));
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(&final_dir, &old)?;
        std::fs::rename(&partial, &final_dir)?;
        std::fs::remove_dir_all(&old)?;
    } else {
        std::fs::rename(&partial, &final_dir)?;
    }
    sync_dir(run_dir);
    let tmp = run_dir.join(format!("{LATEST}.tmp"));
    write_synced(&tmp, format!("{name}\n").as_bytes())?;
    std::fs::rename(&tmp, run_dir.join(LATEST))?;
    sync_dir(run_dir);
    prune(run_dir, keep_last, &name)?;
    Ok(final_dir)
}

/// Step checkpoints in a run directory, sorted by step.
pub fn list_steps(run_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    if !run_dir.is_dir() {
        return Ok(out);
    }
    for entry in std::fs::read_dir(run_dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().to_string();
        if let Some(n) = name.strip_prefix("step-").and_then(|s| s.parse::<u64>().ok()) {
            if entry.path().join(STATE_FILE).is_file() {
                out.push((n, entry.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn prune(run_dir: &Path, keep_last: usize, current: &str) -> Result<()> {
    let steps = list_steps(run_dir)?;
    let excess = steps.len().saturating_sub(keep_last.max(1));
    for (_, path) in steps.into_iter().take(excess) {
        if path.file_name().is_some_and(|n| n != current) {
            std::fs::remove_dir_all(&path).with_context(|| format!("removing old checkpoint {}", path.display()))?;
        }
    }
    Ok(())
}

/// The checkpoint `latest` points at in a run directory, if any.
pub fn latest(run_dir: &Path) -> Result<Option<PathBuf>> {
    let pointer = run_dir.join(LATEST);
    if !pointer.is_file() {
        return Ok(None);
    }
    let name = std::fs::read_to_string(&pointer)?.trim().to_string();
    let dir = run_dir.join(&name);
    if !dir.join(STATE_FILE).is_file() {
        bail!("{} points at {name}, which is not a complete checkpoint", pointer.display());
    }
    Ok(Some(dir))
}

/// Accepts a checkpoint directory or a run directory (then its latest checkpoint).
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join(MODEL_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    match latest(path)? {
        Some(dir) => Ok(dir),
        None => bail!(
            "{} is neither an align checkpoint (no {MODEL_FILE}), a run directory with a `{LATEST}` checkpoint, nor a Hugging Face AlignModel (config.json)",
            path.display()
        ),
    }
}

pub fn read_state(dir: &Path) -> Result<TrainState> {
    let p = dir.join(STATE_FILE);
    serde_json::from_str(&std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?)
        .with_context(|| format!("parsing {}", p.display()))
}
