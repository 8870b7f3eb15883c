//! Saving a rank's run: every rank contributes its loader position (and, with a sharded
//! optimizer, writes its own moments into the checkpoint being formed) and rank 0 writes the rest
//! of the checkpoint (`io::run_dir`). Every rank gets the same path back, so all of them agree on
//! whether a final save is still due.

use std::path::PathBuf;

use anyhow::Result;

use super::setup::Run;
use crate::config::Config;
use crate::data::loader::LoaderPosition;
use crate::io::run_dir::{self, CheckpointContents, OptimizerState, TrainState};
use crate::io::state_shards::{self, Manifest, ShardFile};
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

/// What one rank hands rank 0 for a checkpoint.
#[derive(serde::Serialize, serde::Deserialize)]
struct RankPart {
    loader: LoaderPosition,
    /// Its optimizer file, already in the partial checkpoint, when the state is sharded.
    shard: Option<ShardFile>,
}

pub(super) fn save(cfg: &Config, group: &dyn Collective, run: &Run, at: &Position) -> Result<PathBuf> {
    let shard = match run.opt.sharding() {
        Some((_, rank, world)) => {
            if group.rank() == 0 {
                run_dir::begin_partial(&run.run_dir, at.step)?;
            }
            group.barrier()?;
            let partial = run_dir::partial_dir(&run.run_dir, at.step);
            Some(state_shards::write_shard(&partial, rank, world, &run.opt.state_tensors())?)
        }
        None => None,
    };
    let mine = serde_json::to_vec(&RankPart { loader: run.loader.position().clone(), shard })?;
    let all = group.all_gather_bytes(&mine)?;
    if group.rank() != 0 {
        return Ok(run.run_dir.join(format!("step-{}", at.step)));
    }
    let parts = all.iter().map(|b| serde_json::from_slice(b)).collect::<std::result::Result<Vec<RankPart>, _>>()?;
    let optimizer = match run.opt.sharding() {
        Some((mode, _, _)) => OptimizerState::Sharded(Manifest::new(mode.name(), parts.iter().filter_map(|p| p.shard.clone()).collect())),
        None => OptimizerState::Whole(run.opt.state_tensors()),
    };
    let loaders = parts.into_iter().map(|p| p.loader).collect();
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
        optimizer,
        ema: run.ema.as_ref().map(|e| e.tensors()),
        config_toml: cfg.to_toml()?,
        spec_json: serde_json::to_string_pretty(&run.spec)?,
        tokenizer: &run.tokenizer,
        state: &state,
    };
    run_dir::save(&run.run_dir, &contents, cfg.train.keep_last)
}
