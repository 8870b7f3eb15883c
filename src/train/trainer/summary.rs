//! What a finished (or interrupted) run reports: steps, samples, time and throughput, the final
//! loss, temperature and learning rate, the evaluations (the last and the best of each metric
//! over the whole run) and the samples skipped on every rank.

use std::path::PathBuf;

use anyhow::Result;
use serde::Serialize;

use super::checkpointing;
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
    /// Samples trained on from each `::` source of `data.train`, over every rank and
    /// resumption (a mix's ratio, to check against `data.upsampling_factors`); empty for one
    /// source.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub samples_per_source: Vec<u64>,
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
        samples_per_source: per_source(cfg, group, run)?,
    })
}

/// Every rank's samples by source, summed, with a line for the log when the run mixes sources.
fn per_source(cfg: &Config, group: &dyn Collective, run: &Run) -> Result<Vec<u64>> {
    let all = group.all_gather_bytes(&serde_json::to_vec(&run.loader.position().source_samples())?)?;
    let mut total: Vec<u64> = Vec::new();
    for b in all {
        let counts: Vec<u64> = serde_json::from_slice(&b)?;
        if total.len() < counts.len() {
            total.resize(counts.len(), 0);
        }
        for (t, n) in total.iter_mut().zip(counts) {
            *t += n;
        }
    }
    let names: Vec<&str> = cfg.data.train.split("::").map(str::trim).filter(|p| !p.is_empty()).collect();
    if names.len() < 2 {
        return Ok(Vec::new());
    }
    total.resize(names.len(), 0);
    if group.rank() == 0 {
        let all: u64 = total.iter().sum::<u64>().max(1);
        let parts: Vec<String> =
            names.iter().zip(&total).map(|(name, &n)| format!("{name}: {n} ({:.1}%)", 100.0 * n as f64 / all as f64)).collect();
        crate::util::log::info(format!("samples per source: {}", parts.join(", ")));
    }
    Ok(total)
}

fn best_metrics(run: &Run) -> Result<Vec<BestMetric>> {
    let records = metrics_log::read(&run.run_dir.join("metrics.jsonl"))?;
    Ok(metrics_log::best_eval(&records).into_iter().map(|(metric, value, step)| BestMetric { metric, value, step }).collect())
}

/// The loader's skipped samples, summed over ranks.
fn skips_of_every_rank(group: &dyn Collective, run: &Run) -> Result<SkipCounts> {
    let all = group.all_gather_bytes(&serde_json::to_vec(&run.loader.skips())?)?;
    let mut total = SkipCounts::default();
    for b in all {
        total.merge(&serde_json::from_slice(&b)?);
    }
    Ok(total)
}
