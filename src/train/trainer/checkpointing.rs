//! Saving a rank's run: every rank contributes its loader position and rank 0 writes the
//! checkpoint (`io::run_dir`). Every rank gets the same path back, so all of them agree on
//! whether a final save is still due.

use std::path::PathBuf;

use anyhow::Result;

use super::setup::Run;
use crate::config::Config;
use crate::io::run_dir::{self, CheckpointContents, TrainState};
use crate::io::tensors::var_tensors;
use crate::train::collective::Collective;

/// Where the run stands: what a checkpoint records besides the weights.
#[derive(Clone, Copy, Debug)]
pub(super) struct Position {
    pub step: u64,
    pub samples_seen: u64,
    pub last_loss: Option<f64>,
    /// Seconds this invocation has trained.
    pub seconds: f64,
}

pub(super) fn save(cfg: &Config, group: &dyn Collective, run: &Run, at: &Position) -> Result<PathBuf> {
    let mine = serde_json::to_vec(run.loader.position())?;
    let all = group.all_gather_bytes(&mine)?;
    if group.rank() != 0 {
        return Ok(run.run_dir.join(format!("step-{}", at.step)));
    }
    let loaders = all.iter().map(|b| serde_json::from_slice(b)).collect::<std::result::Result<Vec<_>, _>>()?;
    let state = TrainState {
        step: at.step,
        samples_seen: at.samples_seen,
        loaders,
        seconds: run.start.seconds + at.seconds,
        last_loss: at.last_loss,
        teacher: run.teacher.as_ref().map(|t| t.identity.clone()),
    };
    let contents = CheckpointContents {
        weights: var_tensors(&run.varmap),
        optimizer: run.opt.state_tensors(),
        ema: run.ema.as_ref().map(|e| e.tensors()),
        config_toml: cfg.to_toml()?,
        spec_json: serde_json::to_string_pretty(&run.spec)?,
        tokenizer: &run.tokenizer,
        state: &state,
    };
    run_dir::save(&run.run_dir, &contents, cfg.train.keep_last)
}
