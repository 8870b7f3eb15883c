//! What a finished (or interrupted) run reports: steps, samples, time and throughput, the final
//! loss, temperature and learning rate, the evaluations (the last and the best of each metric
//! over the whole run) and the samples skipped on every rank.

use std::path::PathBuf;

use anyhow::Result;
use serde::Serialize;

use super::checkpointing;
use super::coll;
use super::logging::RunLog;
use super::setup::Run;
use super::step_loop::LoopEnd;
use crate::config::Config;
use crate::data::skips::SkipCounts;
use crate::eval::periodic::EvalResults;
use crate::io::metrics_log;
use crate::train::collective::Collective;

#[derive(Debug, Clone, Serialize)]
pub struct TrainSummary {
    pub steps: u64,
    pub samples_seen: u64,
    pub seconds: f64,
    pub samples_per_second: f64,
    /// Fraction of this invocation's wall time spent waiting for batches.
    pub data_wait_share: f64,
    pub final_loss: Option<f64>,
    pub temperature: f64,
    pub final_lr: f64,
    pub skipped: SkipCounts,
    pub checkpoint: PathBuf,
    /// Stopped early by a signal (after saving `checkpoint`).
    pub interrupted: bool,
    /// That signal's name (`SIGTERM`, ...) and the process's exit status for it (128 + number).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_by: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_status: Option<i32>,
    #[serde(skip_serializing_if = "EvalResults::is_empty")]
    pub eval: EvalResults,
    /// The best value of each evaluation metric over the whole run, from its metrics log.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub best_eval: Vec<BestMetric>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BestMetric {
    pub metric: String,
    pub value: f64,
    pub step: u64,
}

/// Closes the logs, saves the run if this invocation has no checkpoint yet, and sums up.
pub(super) fn finish(cfg: &Config, group: &dyn Collective, run: &Run, log: RunLog, end: LoopEnd) -> Result<TrainSummary> {
    log.close()?;
    let best_eval = if group.rank() == 0 { best_metrics(run)? } else { Vec::new() };
    let at = end.position;
    let checkpoint = match end.last_checkpoint {
        Some(p) => p,
        None => checkpointing::save(cfg, group, run, &at)?,
    };
    let seconds = at.seconds.max(1e-9);
    Ok(TrainSummary {
        steps: at.step,
        samples_seen: at.samples_seen,
        seconds: run.start.seconds + at.seconds,
        samples_per_second: (at.samples_seen - run.start.samples_seen) as f64 / seconds,
        data_wait_share: end.data_wait / seconds,
        final_loss: at.last_loss,
        temperature: run.model.temperature_value()?,
        final_lr: end.lr,
        skipped: skips_of_every_rank(group, run)?,
        checkpoint,
        interrupted: end.stopped_by.is_some(),
        stopped_by: end.stopped_by.map(|s| crate::util::interrupt::name(s).to_string()),
        exit_status: end.stopped_by.map(crate::util::interrupt::exit_status),
        eval: end.eval,
        best_eval,
    })
}

fn best_metrics(run: &Run) -> Result<Vec<BestMetric>> {
    let records = metrics_log::read(&run.run_dir.join("metrics.jsonl"))?;
    Ok(metrics_log::best_eval(&records).into_iter().map(|(metric, value, step)| BestMetric { metric, value, step }).collect())
}

/// The loader's skipped samples, summed over ranks.
fn skips_of_every_rank(group: &dyn Collective, run: &Run) -> Result<SkipCounts> {
    let all = group.all_gather_bytes(&serde_json::to_vec(&run.loader.skips())?).map_err(coll)?;
    let mut total = SkipCounts::default();
    for b in all {
        total.merge(&serde_json::from_slice(&b)?);
    }
    Ok(total)
}
