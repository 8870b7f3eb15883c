//! The training run, from a config to a summary, as named pieces in the order a rank meets them:
//! - `setup`: the run directory, what a resumed run restores, the vocabulary, the model and its
//!   optimizer (initialised, restored, broadcast), the loader;
//! - `step_loop`: batches in, optimiser steps out, until the schedule's end, `--stop-after` or
//!   Ctrl-C;
//! - `logging`: the metrics log, TensorBoard and the progress bar;
//! - `checkpointing`: every rank's loader position into rank 0's checkpoint;
//! - `evaluation`: the periodic zero-shot / retrieval evaluation;
//! - `summary`: what the run did, for the table and `--json`.
//!
//! This file starts the ranks: one, several as threads of this process (`--nproc`), or one of a
//! multi-process job (torchrun / SLURM variables, over NCCL).

mod checkpointing;
mod evaluation;
mod logging;
mod setup;
mod step_loop;
mod summary;
mod teacher;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::Device;

pub use summary::{BestMetric, TrainSummary};

use super::collective::{Collective, DistEnv, SingleProcess, ThreadGroup};
use super::start::Start;
use crate::config::Config;
use crate::util::log;

pub struct TrainOptions {
    pub resume: bool,
    /// `--resume PATH`: this checkpoint (or this run directory's latest) instead of the run's
    /// own latest.
    pub resume_from: Option<PathBuf>,
    pub quiet: bool,
    pub device: Device,
    /// Stop after this many steps of this invocation (tests, benchmarks); the schedule still
    /// follows `train.steps`.
    pub stop_after: Option<u64>,
    /// Data-parallel ranks as threads of this process (`--nproc`); 1 = a single rank.
    pub nproc: usize,
    /// Fields a resumed run may change from its checkpoint's config (`--allow-change`).
    pub allow_change: Vec<String>,
}

impl TrainOptions {
    /// The options of rank `rank`: only rank 0 speaks.
    fn for_rank(&self, rank: usize, device: Device, nproc: usize) -> TrainOptions {
        TrainOptions {
            resume: self.resume,
            resume_from: self.resume_from.clone(),
            quiet: self.quiet || rank > 0,
            device,
            stop_after: self.stop_after,
            nproc,
            allow_change: self.allow_change.clone(),
        }
    }
}

/// Trains per `cfg`: one rank, `opts.nproc` ranks on threads, or (from torchrun / SLURM variables)
/// one rank of a multi-process job. Returns rank 0's summary.
pub fn train(cfg: &Config, opts: &TrainOptions) -> Result<TrainSummary> {
    // A start's preprocessing, text length and loss become this run's defaults.
    let mut cfg = cfg.clone();
    let resume = setup::resume_checkpoint(opts, &cfg.run_dir())?;
    let start = Start::resolve(&cfg, resume.as_deref())?;
    let adopted = start.adopt(&mut cfg)?;
    if !opts.quiet {
        for line in &adopted.taken {
            log::info(format!("adopted {line}"));
        }
    }
    for line in &adopted.kept {
        log::warn(format!("keeping {line}"));
    }
    let env = DistEnv::from_env(|k| std::env::var(k).ok()).map_err(anyhow::Error::msg)?;
    let world = if env.world_size > 1 { env.world_size } else { opts.nproc.max(1) };
    super::length::resolve(&mut cfg, world, opts.quiet)?;
    cfg.validate()?;
    crate::data::pipe_source::set_stall_timeout(std::time::Duration::from_secs_f64(cfg.data.stall_timeout_s));
    let cfg = &cfg;
    let threads = crate::util::threads::set_compute_threads(cfg.train.compute_threads);
    if !opts.quiet {
        log::info(format!("{threads} compute threads; {} loader workers at nice +{}", cfg.data.workers, cfg.data.worker_nice));
    }
    let start = &start;
    if env.world_size > 1 {
        return train_process_rank(cfg, start, opts, &env);
    }
    if opts.nproc <= 1 {
        return train_rank(cfg, start, opts, Arc::new(SingleProcess));
    }
    train_thread_ranks(cfg, start, opts)
}

#[cfg(feature = "nccl")]
fn train_process_rank(cfg: &Config, start: &Start, opts: &TrainOptions, env: &DistEnv) -> Result<TrainSummary> {
    use anyhow::Context;
    let timeout = std::time::Duration::from_secs_f64(cfg.train.collective_timeout_s);
    let group = super::nccl::NcclGroup::join(env, timeout).with_context(|| format!("rank {} of {}", env.rank, env.world_size))?;
    let opts = opts.for_rank(env.rank, group.device().clone(), 1);
    train_rank(cfg, start, &opts, Arc::new(group))
}

#[cfg(not(feature = "nccl"))]
fn train_process_rank(_cfg: &Config, _start: &Start, _opts: &TrainOptions, env: &DistEnv) -> Result<TrainSummary> {
    bail!(
        "this process is rank {} of {} (from RANK/WORLD_SIZE or SLURM): multi-process training runs over NCCL, which this build does not include (build with --features nccl)",
        env.rank,
        env.world_size
    )
}

/// `opts.nproc` ranks as threads of this process; a failing rank aborts the others.
fn train_thread_ranks(cfg: &Config, start: &Start, opts: &TrainOptions) -> Result<TrainSummary> {
    let timeout = std::time::Duration::from_secs_f64(cfg.train.collective_timeout_s);
    let groups = ThreadGroup::new(opts.nproc, timeout);
    let results: Vec<Result<TrainSummary>> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let opts = opts.for_rank(g.rank(), opts.device.clone(), opts.nproc);
                scope.spawn(move || {
                    let group: Arc<dyn Collective> = Arc::new(g);
                    let out = train_rank(cfg, start, &opts, group.clone());
                    if let Err(e) = &out {
                        group.abort(&format!("{e:#}"));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a training rank panicked")))).collect()
    });
    rank_zero_or_first_failure(results)
}

/// Rank 0's summary, or the failing rank's own error rather than the others' "rank N failed"
/// echoes.
fn rank_zero_or_first_failure(results: Vec<Result<TrainSummary>>) -> Result<TrainSummary> {
    let mut first_err = None;
    let mut summary = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(s) if rank == 0 => summary = Some(s),
            Ok(_) => {}
            Err(e) => {
                let echo = e.to_string().contains("failed:") && e.to_string().starts_with("rank ");
                if first_err.is_none() || !echo {
                    first_err = Some(e.context(format!("rank {rank}")));
                }
            }
        }
    }
    match (first_err, summary) {
        (Some(e), _) => Err(e),
        (None, Some(s)) => Ok(s),
        (None, None) => bail!("rank 0 produced no summary"),
    }
}

/// One rank's run.
fn train_rank(cfg: &Config, start: &Start, opts: &TrainOptions, group: Arc<dyn Collective>) -> Result<TrainSummary> {
    let run_dir = cfg.run_dir();
    let new_dir = group.rank() == 0 && !run_dir.exists();
    let result = (|| {
        let mut run = setup::prepare(cfg, start, opts, &group)?;
        let mut log = logging::RunLog::open(cfg, &run, opts.quiet, group.rank() == 0)?;
        let end = step_loop::run(cfg, opts, &group, &mut run, &mut log)?;
        summary::finish(cfg, &*group, &run, log, end)
    })();
    // A run that failed before its first checkpoint leaves nothing behind: its directory held
    // only what this start wrote (the lock, the vocabulary, the first log lines).
    if result.is_err() && new_dir && crate::io::run_dir::list_steps(&run_dir).is_ok_and(|s| s.is_empty()) {
        let _ = std::fs::remove_dir_all(&run_dir);
    }
    result
}
