//! Checkpoints: `RUN/step-N/` directories written atomically, a `latest` pointer, keep-last-K.
//!
//! A checkpoint directory holds
//! - `model.safetensors`: weights under Hugging Face names,
//! - `optimizer.safetensors`: AdamW/LAMB moments (`exp_avg.NAME`, `exp_avg_sq.NAME`), or, when
//!   ranks shard them (`train.shard`), one file a rank and `optimizer.manifest.json`
//!   (`state_shards`),
//! - `ema.safetensors`: the weights' moving average under the weights' names, when the run keeps
//!   one (`train.ema_decay`),
//! - `config.toml`: the full experiment config, `align.json`: the resolved model sizes,
//! - `tokenizer.json`: the vocabulary the run trains with,
//! - `state.json`: step, samples seen, the loader position and the run's clock.
//!
//! ## The protocol and its invariants
//! A save of step N writes everything into `step-N.partial/` (`state.json` last; the ranks of a
//! sharded optimizer each write their file there first, and rank 0 the manifest once all are
//! written), syncs it, and
//! moves it into place: a rename to `step-N/`, or, when `step-N/` already exists (Ctrl-C on a
//! checkpoint step, or a run resumed from an earlier step passing N again), an atomic exchange of
//! the two directories (`renameat2(RENAME_EXCHANGE)`) after which the old one is deleted. Then
//! `latest` is rewritten (`latest.tmp`, synced, renamed) and old checkpoints are pruned, each
//! first renamed to `step-K.deleting/` and then deleted. So, whenever the process dies:
//! 1. every `step-N/` directory is a complete checkpoint: directories only get that name once
//!    their files are synced, and lose it before anything in them is deleted;
//! 2. `latest` names a complete checkpoint, the new one or the one before it; on a filesystem
//!    without the exchange a re-save of the latest step falls back to rename-away-then-rename,
//!    and if it dies between the two renames, reading `latest` falls back (point 4);
//! 3. the debris an interrupted save or prune leaves (`*.partial`, `*.old`, `*.deleting`,
//!    `latest.tmp`, and `step-N/` directories without `state.json` from older versions) never
//!    changes which checkpoint is latest, and [`clean`] removes it at the start of every run
//!    (under the run's lock) and after every prune;
//! 4. a `latest` that names nothing usable (or a missing `latest` beside complete checkpoints)
//!    falls back to the newest complete checkpoint, with a warning.
//!
//! The tests stop a save at each of its steps (as a kill would) and check these points.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::state_shards::{self, Manifest};
use super::tensors::{read_tensors_where, save_tensors, sync_dir, write_synced};
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
    /// The distillation teacher the run learns from (its identity), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher: Option<String>,
}

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const EMA_FILE: &str = "ema.safetensors";
pub const STATE_FILE: &str = "state.json";
pub const SPEC_FILE: &str = "align.json";
pub const CONFIG_FILE: &str = "config.toml";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const LATEST: &str = "latest";

/// The optimizer's moments: whole, or already written by each rank into the partial directory
/// (`begin_partial`, `state_shards::write_shard`) and described by a manifest.
pub enum OptimizerState {
    Whole(HashMap<String, Tensor>),
    Sharded(Manifest),
}

/// Everything a checkpoint stores, as bytes or tensors ready to write.
pub struct CheckpointContents<'a> {
    pub weights: HashMap<String, Tensor>,
    pub optimizer: OptimizerState,
    /// The weights' moving average, when the run keeps one.
    pub ema: Option<HashMap<String, Tensor>>,
    pub config_toml: String,
    pub spec_json: String,
    pub tokenizer: &'a crate::data::tokenizer::TextTokenizer,
    pub state: &'a TrainState,
}

/// Writes `run_dir/step-N/` atomically, points `latest` at it and prunes to `keep_last`.
pub fn save(run_dir: &Path, c: &CheckpointContents, keep_last: usize) -> Result<PathBuf> {
    save_with(run_dir, c, keep_last, &mut |_| Ok(()))
}

/// The points of a save where the tests stop it, in order.
#[cfg_attr(not(test), allow(dead_code))]
const CRASH_POINTS: [&str; 6] = ["written", "moved", "old-removed", "latest-written", "pruning", "pruned"];

/// [`save`], calling `at` at each point of [`CRASH_POINTS`]: an error there stops the save as a
/// kill would.
fn save_with(run_dir: &Path, c: &CheckpointContents, keep_last: usize, at: &mut dyn FnMut(&str) -> Result<()>) -> Result<PathBuf> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let name = format!("step-{}", c.state.step);
    let partial = partial_dir(run_dir, c.state.step);
    let final_dir = run_dir.join(&name);
    write_partial(&partial, c)?;
    at("written")?;
    if final_dir.exists() {
        replace(run_dir, &partial, &final_dir, at)?;
    } else {
        rename(&partial, &final_dir)?;
        at("moved")?;
        at("old-removed")?;
    }
    sync_dir(run_dir);
    let tmp = run_dir.join(format!("{LATEST}.tmp"));
    write_synced(&tmp, format!("{name}\n").as_bytes())?;
    rename(&tmp, &run_dir.join(LATEST))?;
    sync_dir(run_dir);
    at("latest-written")?;
    prune(run_dir, keep_last, &name, at)?;
    at("pruned")?;
    Ok(final_dir)
}

/// Where step `step`'s checkpoint is written before it is moved into place.
pub fn partial_dir(run_dir: &Path, step: u64) -> PathBuf {
    run_dir.join(format!("step-{step}.partial"))
}

/// An empty partial directory for step `step`, for the ranks of a sharded optimizer to write
/// their files into before rank 0 saves the rest.
pub fn begin_partial(run_dir: &Path, step: u64) -> Result<PathBuf> {
    let partial = partial_dir(run_dir, step);
    if partial.exists() {
        std::fs::remove_dir_all(&partial).with_context(|| format!("removing {}", partial.display()))?;
    }
    std::fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
    Ok(partial)
}

/// Every file of a checkpoint into `partial` (emptied first, unless the ranks' optimizer files are
/// in it already), `state.json` last, all synced.
fn write_partial(partial: &Path, c: &CheckpointContents) -> Result<()> {
    match &c.optimizer {
        OptimizerState::Whole(_) => {
            if partial.exists() {
                std::fs::remove_dir_all(partial).with_context(|| format!("removing {}", partial.display()))?;
            }
            std::fs::create_dir_all(partial).with_context(|| format!("creating {}", partial.display()))?;
        }
        OptimizerState::Sharded(_) if !partial.is_dir() => bail!("{} vanished while the ranks wrote into it", partial.display()),
        OptimizerState::Sharded(_) => {}
    }
    save_tensors(&c.weights, &partial.join(MODEL_FILE))?;
    match &c.optimizer {
        OptimizerState::Whole(t) => save_tensors(t, &partial.join(OPTIMIZER_FILE))?,
        OptimizerState::Sharded(m) => state_shards::write_manifest(partial, m)?,
    }
    if let Some(ema) = &c.ema {
        save_tensors(ema, &partial.join(EMA_FILE))?;
    }
    write_synced(&partial.join(CONFIG_FILE), c.config_toml.as_bytes())?;
    write_synced(&partial.join(SPEC_FILE), c.spec_json.as_bytes())?;
    let tokenizer = partial.join(TOKENIZER_FILE);
    c.tokenizer.save(&tokenizer)?;
    File::open(&tokenizer).and_then(|f| f.sync_all()).with_context(|| format!("syncing {}", tokenizer.display()))?;
    write_synced(&partial.join(STATE_FILE), serde_json::to_string_pretty(c.state)?.as_bytes())?;
    sync_dir(partial);
    Ok(())
}

/// Puts the complete `partial` in the place of the existing checkpoint `final_dir`.
fn replace(run_dir: &Path, partial: &Path, final_dir: &Path, at: &mut dyn FnMut(&str) -> Result<()>) -> Result<()> {
    if exchange(partial, final_dir).with_context(|| format!("exchanging {} and {}", partial.display(), final_dir.display()))? {
        at("moved")?;
        std::fs::remove_dir_all(partial).with_context(|| format!("removing the replaced {}", partial.display()))?;
        return at("old-removed");
    }
    let old = run_dir.join(format!("{}.old", final_dir.file_name().and_then(|n| n.to_str()).unwrap_or("step")));
    if old.exists() {
        std::fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
    }
    rename(final_dir, &old)?;
    rename(partial, final_dir)?;
    at("moved")?;
    std::fs::remove_dir_all(&old).with_context(|| format!("removing the replaced {}", old.display()))?;
    at("old-removed")
}

/// Swaps two directories in one step (Linux `renameat2(RENAME_EXCHANGE)`); false where the
/// system or filesystem cannot.
fn exchange(a: &Path, b: &Path) -> std::io::Result<bool> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
        let (ca, cb) = (c(a)?, c(b)?);
        // SAFETY: two valid NUL-terminated paths relative to the working directory.
        let r =
            unsafe { libc::syscall(libc::SYS_renameat2, libc::AT_FDCWD, ca.as_ptr(), libc::AT_FDCWD, cb.as_ptr(), libc::RENAME_EXCHANGE) };
        if r == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) => Ok(false),
            _ => Err(e),
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (a, b);
        Ok(false)
    }
}

fn rename(from: &Path, to: &Path) -> Result<()> {
    std::fs::rename(from, to).with_context(|| format!("renaming {} to {}", from.display(), to.display()))
}

/// Complete step checkpoints in a run directory, sorted by step.
pub fn list_steps(run_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    if !run_dir.is_dir() {
        return Ok(out);
    }
    for entry in std::fs::read_dir(run_dir).with_context(|| format!("listing {}", run_dir.display()))? {
        let entry = entry.with_context(|| format!("listing {}", run_dir.display()))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if let Some(n) = step_of(&name) {
            if entry.path().join(STATE_FILE).is_file() {
                out.push((n, entry.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// N of a checkpoint directory's name `step-N`.
fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("step-").and_then(|s| s.parse::<u64>().ok())
}

/// Deletes the checkpoints beyond the newest `keep_last` (never `current` or what `latest` names).
fn prune(run_dir: &Path, keep_last: usize, current: &str, at: &mut dyn FnMut(&str) -> Result<()>) -> Result<()> {
    let steps = list_steps(run_dir)?;
    let excess = steps.len().saturating_sub(keep_last.max(1));
    let latest = pointer(run_dir);
    for (_, path) in steps.into_iter().take(excess) {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        if name != current && latest.as_deref() != Some(name.as_str()) {
            let doomed = run_dir.join(format!("{name}.deleting"));
            rename(&path, &doomed)?;
            at("pruning")?;
            std::fs::remove_dir_all(&doomed).with_context(|| format!("removing old checkpoint {}", doomed.display()))?;
        }
    }
    clean(run_dir)
}

/// What `latest` says, if it says a checkpoint's name.
fn pointer(run_dir: &Path) -> Option<String> {
    let name = std::fs::read_to_string(run_dir.join(LATEST)).ok()?.trim().to_string();
    step_of(&name).map(|_| name)
}

/// Removes what an interrupted save or prune left behind (see the module doc); never a complete
/// checkpoint, never what `latest` names.
pub fn clean(run_dir: &Path) -> Result<()> {
    if !run_dir.is_dir() {
        return Ok(());
    }
    let latest = pointer(run_dir);
    for entry in std::fs::read_dir(run_dir).with_context(|| format!("listing {}", run_dir.display()))? {
        let path = entry.with_context(|| format!("listing {}", run_dir.display()))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        let debris = [".partial", ".old", ".deleting"].iter().any(|s| name.ends_with(s) && name.starts_with("step-"))
            || (step_of(&name).is_some() && !path.join(STATE_FILE).is_file() && latest.as_deref() != Some(name.as_str()));
        if debris && path.is_dir() {
            std::fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))?;
        } else if name == format!("{LATEST}.tmp") {
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

/// The checkpoint to resume from: what `latest` names, or (when it names nothing complete, or is
/// missing beside complete checkpoints) the newest complete checkpoint, with a warning.
pub fn latest(run_dir: &Path) -> Result<Option<PathBuf>> {
    let pointer_path = run_dir.join(LATEST);
    if let Some(name) = pointer(run_dir) {
        let dir = run_dir.join(&name);
        if dir.join(STATE_FILE).is_file() {
            return Ok(Some(dir));
        }
    }
    let newest = list_steps(run_dir)?.pop().map(|(_, dir)| dir);
    if let Some(dir) = &newest {
        let said = std::fs::read_to_string(&pointer_path).map_or_else(|_| "is missing".to_string(), |s| format!("names {:?}", s.trim()));
        crate::util::log::warn(format!(
            "{} {said}, which is not a complete checkpoint: resuming from the newest complete one, {}",
            pointer_path.display(),
            dir.display()
        ));
    }
    Ok(newest)
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

/// The optimizer state tensors named in `wanted` (a rank's own, or all) from the checkpoint at
/// `dir`, whether one file holds them or a sharded run wrote one a rank.
pub fn read_optimizer(dir: &Path, device: &candle_core::Device, wanted: &[String]) -> Result<HashMap<String, Tensor>> {
    if dir.join(state_shards::MANIFEST_FILE).is_file() {
        return state_shards::read(dir, device, wanted);
    }
    let set: std::collections::HashSet<&str> = wanted.iter().map(String::as_str).collect();
    read_tensors_where(&dir.join(OPTIMIZER_FILE), device, &|name| set.contains(name))
}

pub fn read_state(dir: &Path) -> Result<TrainState> {
    let p = dir.join(STATE_FILE);
    serde_json::from_str(&std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?)
        .with_context(|| format!("parsing {}", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::tokenizer::{train_wordpiece, TextTokenizer};
    use candle_core::Device;

    fn tokenizer() -> TextTokenizer {
        let caps = ["a dog", "a cat", "two dogs"];
        TextTokenizer::new(train_wordpiece(caps.iter(), 50, true, 1).unwrap(), 8).unwrap()
    }

    /// Saves step `step` (the weights and the optimizer state hold the step, so a checkpoint
    /// tells which save wrote it), stopped at `crash` if given; `sharded`, the optimizer state as
    /// two ranks write it, the kill point `shard` falling between the ranks' files.
    fn save_step(run: &Path, step: u64, version: f32, crash: Option<&str>, sharded: bool) -> Result<PathBuf> {
        let tok = tokenizer();
        let state = TrainState { step, samples_seen: step * 4, loaders: Vec::new(), seconds: 0.0, last_loss: None, teacher: None };
        let tensor = |v: f32| Tensor::new(&[step as f32, v], &Device::Cpu).unwrap();
        let mut weights = HashMap::new();
        weights.insert("w".to_string(), tensor(version));
        let moments: HashMap<String, Tensor> =
            [("exp_avg.w".to_string(), tensor(version)), ("exp_avg_sq.w".to_string(), tensor(-version))].into();
        let optimizer = if sharded {
            let partial = begin_partial(run, step)?;
            let (first, second): (HashMap<_, _>, HashMap<_, _>) = moments.into_iter().partition(|(k, _)| k.starts_with("exp_avg."));
            let a = state_shards::write_shard(&partial, 0, 2, &first)?;
            if crash == Some("shard") {
                bail!("killed between the ranks' files");
            }
            let b = state_shards::write_shard(&partial, 1, 2, &second)?;
            OptimizerState::Sharded(Manifest::new("optimizer", vec![a, b]))
        } else {
            OptimizerState::Whole(moments)
        };
        let c = CheckpointContents {
            weights,
            optimizer,
            ema: None,
            config_toml: String::new(),
            spec_json: "{}".into(),
            tokenizer: &tok,
            state: &state,
        };
        save_with(run, &c, 2, &mut |point| match crash {
            Some(p) if p == point => bail!("killed at {point}"),
            _ => Ok(()),
        })
    }

    /// `[step, version]` of the checkpoint `latest` resolves to, its weights and optimizer state
    /// from the same save.
    fn latest_contents(run: &Path) -> [f32; 2] {
        let dir = latest(run).unwrap().expect("a checkpoint to resume from");
        assert!(dir.join(STATE_FILE).is_file(), "{} is incomplete", dir.display());
        let w = super::super::tensors::read_tensors(&dir.join(MODEL_FILE), &Device::Cpu).unwrap()["w"].to_vec1::<f32>().unwrap();
        let state = read_state(&dir).unwrap();
        assert_eq!(state.step as f32, w[0], "state and weights from different saves");
        let names = vec!["exp_avg.w".to_string(), "exp_avg_sq.w".to_string()];
        let opt = read_optimizer(&dir, &Device::Cpu, &names).unwrap();
        assert_eq!(opt["exp_avg.w"].to_vec1::<f32>().unwrap(), w, "optimizer state and weights from different saves");
        assert_eq!(opt["exp_avg_sq.w"].to_vec1::<f32>().unwrap(), [w[0], -w[1]]);
        [w[0], w[1]]
    }

    fn names(run: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(run).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn a_save_killed_at_any_point_leaves_latest_on_a_complete_checkpoint() {
        let points = CRASH_POINTS.iter().map(|p| (*p, false)).chain(std::iter::once("shard").chain(CRASH_POINTS).map(|p| (p, true)));
        for (point, sharded) in points {
            for resave in [false, true] {
                let dir = tempfile::tempdir().unwrap();
                let run = dir.path();
                // The earlier checkpoints in the other form: a run may change `train.shard`.
                save_step(run, 2, 0.0, None, !sharded).unwrap();
                save_step(run, 4, 0.0, None, !sharded).unwrap();
                // A new step (6, pruning step 2) or the latest step again (4, a new version).
                let step = if resave { 4 } else { 6 };
                let killed = save_step(run, step, 1.0, Some(point), sharded);
                let what = format!(
                    "killed at {point}, {}{}",
                    if resave { "re-saving step 4" } else { "saving step 6" },
                    if sharded { ", sharded" } else { "" }
                );
                assert!(killed.is_err() || point == "pruning", "{what}: the save did not stop");
                let [got, version] = latest_contents(run);
                assert!(got == 4.0 || (got == step as f32 && version == 1.0), "{what}: latest is step {got} version {version}");
                clean(run).unwrap();
                let left = names(run);
                assert!(left.iter().all(|n| !n.contains('.') && (n == LATEST || n == ".lock" || step_of(n).is_some())), "{what}: {left:?}");
                assert_eq!(latest_contents(run), [got, version], "{what}: cleaning changed latest");
                save_step(run, 8, 2.0, None, sharded).unwrap();
                assert_eq!(latest_contents(run), [8.0, 2.0], "{what}: the next save");
                assert_eq!(list_steps(run).unwrap().len(), 2, "{what}: kept {:?}", names(run));
            }
        }
    }

    #[test]
    fn a_broken_or_missing_latest_falls_back_to_the_newest_complete_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        save_step(run, 2, 0.0, None, false).unwrap();
        save_step(run, 4, 0.0, None, false).unwrap();
        std::fs::write(run.join(LATEST), "step-9\n").unwrap();
        assert_eq!(latest_contents(run), [4.0, 0.0]);
        std::fs::remove_file(run.join(LATEST)).unwrap();
        assert_eq!(latest_contents(run), [4.0, 0.0]);
        // A half-deleted checkpoint of an older version (no state.json) is debris.
        std::fs::create_dir(run.join("step-6")).unwrap();
        std::fs::write(run.join("step-6").join(MODEL_FILE), b"partial").unwrap();
        assert_eq!(latest_contents(run), [4.0, 0.0]);
        clean(run).unwrap();
        assert!(!run.join("step-6").exists());
        assert!(latest(&run.join("nothing-here")).unwrap().is_none());
    }
}
