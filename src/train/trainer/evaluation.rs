//! The periodic evaluation during training (`train.eval_every`, and at the schedule's end) on the
//! `[eval]` data, run by rank 0 on the model as it stands.

use anyhow::Result;

use super::logging::RunLog;
use super::setup::Run;
use crate::config::Config;
use crate::eval::periodic::{self, EvalResults};
use crate::io::tensors::var_tensors;
use crate::model::dual_encoder::DualEncoder;
use crate::model::init::FixedVars;
use crate::util::log;

/// Whether `step` evaluates: evaluation data is configured, and it is an `eval_every` step or the
/// schedule's last.
pub(super) fn due(cfg: &Config, step: u64) -> bool {
    periodic::configured(cfg) && ((cfg.train.eval_every > 0 && step.is_multiple_of(cfg.train.eval_every)) || step == cfg.train.steps)
}

/// Evaluates and logs the results. An evaluation that fails (non-finite embeddings of a model
/// that diverged, unreadable evaluation data) is logged, as a warning and in the metrics log, and
/// training goes on: the loss decides whether the run is lost.
pub(super) fn evaluate(cfg: &Config, run: &Run, step: u64, quiet: bool, log: &mut RunLog) -> Result<EvalResults> {
    let results = match forward_only(run, var_tensors(&run.varmap)).and_then(|m| run_all(&m, cfg, run)) {
        Ok(r) => r,
        Err(e) => {
            let e = format!("{e:#}");
            crate::util::log::warn(format!("step {step}: evaluation failed: {e}"));
            log.record(serde_json::json!({"step": step, "eval_error": e}))?;
            return Ok(EvalResults::default());
        }
    };
    if !quiet {
        log::info(format!("step {step}: {}", results.line()));
    }
    log.record(serde_json::json!({"step": step, "eval": results}))?;
    if let (true, Some(ema)) = (cfg.train.ema_eval, &run.ema) {
        match forward_only(run, ema.tensors()).and_then(|m| run_all(&m, cfg, run)) {
            Ok(r) => {
                if !quiet {
                    log::info(format!("step {step} (weight average): {}", r.line()));
                }
                log.record(serde_json::json!({"step": step, "eval_ema": r}))?;
            }
            Err(e) => crate::util::log::warn(format!("step {step}: evaluating the weight average failed: {e:#}")),
        }
    }
    Ok(results)
}

/// Zero-shot, retrieval and the validation loss, as configured.
fn run_all(m: &DualEncoder, cfg: &Config, run: &Run) -> Result<EvalResults> {
    let mut r = periodic::run(m, &run.tokenizer, cfg, &run.device, true)?;
    if !cfg.eval.validation.is_empty() {
        r.validation = Some(crate::train::validation::run(m, &run.tokenizer, cfg, &run.device)?);
    }
    Ok(r)
}

/// A forward-only model on `weights` (the run's, detached, or their moving average): the same
/// path `align eval` takes, recording no graph, so an evaluation keeps no activations alive.
fn forward_only(run: &Run, weights: std::collections::HashMap<String, candle_core::Tensor>) -> Result<DualEncoder> {
    let detached = weights.into_iter().map(|(k, t)| (k, t.detach())).collect();
    Ok(DualEncoder::new(&run.spec, FixedVars::builder(detached, candle_core::DType::F32, &run.device))?)
}
