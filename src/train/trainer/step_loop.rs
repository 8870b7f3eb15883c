//! The steps: batches in, optimiser steps out, with logging, checkpoints and evaluation on their
//! cadences, until the schedule's end, `--stop-after` or a stop signal (Ctrl-C, SIGTERM, SIGUSR1:
//! all ranks stop at the same step, after saving).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::Tensor;

use super::checkpointing::{self, Position};
use super::logging::{RunLog, StepFigures};
use super::setup::{self, Run};
use super::{evaluation, TrainOptions};
use crate::config::{Config, Precision};
use crate::data::batch::TeacherRows;
use crate::data::loader::Batch;
use crate::eval::periodic::EvalResults;
use crate::train::collective::Collective;
use crate::train::schedule::lr_at;
use crate::train::step::{self, MicroBatch, TeacherMicro};
use crate::util::log;
use crate::util::rng::derive_seed;

/// Where the loop left the run.
pub(super) struct LoopEnd {
    pub position: Position,
    pub lr: f64,
    /// The signal that stopped the run early (after saving), if one did.
    pub stopped_by: Option<i32>,
    /// The newest checkpoint, this invocation's or the one it resumed from.
    pub last_checkpoint: Option<PathBuf>,
    pub eval: EvalResults,
    /// Seconds spent waiting for batches.
    pub data_wait: f64,
}

pub(super) fn run(cfg: &Config, opts: &TrainOptions, group: &Arc<dyn Collective>, run: &mut Run, log: &mut RunLog) -> Result<LoopEnd> {
    let total = cfg.train.steps;
    let end = opts.stop_after.map_or(total, |n| (run.start.step + n).min(total));
    let started = Instant::now();
    let mut at = Position { step: run.start.step, samples_seen: run.start.samples_seen, last_loss: run.start.last_loss, seconds: 0.0 };
    let mut out = LoopEnd {
        lr: lr_at(at.step, cfg.train.lr, cfg.train.warmup_steps, total, cfg.train.schedule),
        position: at,
        stopped_by: None,
        last_checkpoint: run.resumed_from.clone(),
        eval: EvalResults::default(),
        data_wait: 0.0,
    };
    // The starting model's figures, logged at step 0, before it has trained (train.eval_at_start).
    if cfg.train.eval_at_start && at.step == 0 && group.rank() == 0 && crate::eval::periodic::configured(cfg) {
        out.eval = evaluation::evaluate(cfg, run, 0, opts.quiet, log)?;
    }
    while at.step < end {
        out.lr = lr_at(at.step, cfg.train.lr, cfg.train.warmup_steps, total, cfg.train.schedule);
        let samples = match one_step(cfg, group, run, log, &mut at, &mut out) {
            Ok(s) => s,
            // A stop signal while waiting for data: the step cannot finish, and the last
            // checkpoint is where --resume continues (its loader position matches it exactly).
            Err(e) if e.downcast_ref::<crate::data::loader::LoaderStopped>().is_some() => {
                let signal = crate::util::interrupt::received().unwrap_or(libc::SIGTERM);
                let at_checkpoint = out.last_checkpoint.as_ref().map_or("none yet".to_string(), |p| p.display().to_string());
                log::warn(format!(
                    "{} while waiting for data at step {}: stopping without a new checkpoint; --resume continues from {at_checkpoint}",
                    crate::util::interrupt::name(signal),
                    at.step + 1
                ));
                out.stopped_by = Some(signal);
                break;
            }
            Err(e) => return Err(e),
        };
        at.seconds = started.elapsed().as_secs_f64();
        let last = at.step == end;
        if at.step.is_multiple_of(cfg.train.log_every.max(1)) || last {
            log_step(run, log, &at, &samples, out.lr, run.start.seconds + at.seconds)?;
        }
        if (cfg.train.checkpoint_every > 0 && at.step.is_multiple_of(cfg.train.checkpoint_every)) || last {
            out.last_checkpoint = Some(checkpointing::save(cfg, &**group, run, &at)?);
        }
        if group.rank() == 0 && evaluation::due(cfg, at.step) {
            out.eval = evaluation::evaluate(cfg, run, at.step, opts.quiet, log)?;
        }
        if let Some(signal) = if last { None } else { stop_signal(&**group)? } {
            out.stopped_by = Some(signal);
            if !opts.quiet {
                log::info(format!("{} at step {}; saving a checkpoint", crate::util::interrupt::name(signal), at.step));
            }
            out.last_checkpoint = Some(checkpointing::save(cfg, &**group, run, &at)?);
            break;
        }
    }
    at.seconds = started.elapsed().as_secs_f64();
    out.position = at;
    Ok(out)
}

/// What one step leaves for its log line.
struct StepDone {
    out: step::StepOutput,
    grad_norm: f64,
}

/// Loads the step's micro-batches, computes the gradients of the global batch and updates the
/// weights. A non-finite loss or gradient stops the run without saving.
fn one_step(
    cfg: &Config,
    group: &Arc<dyn Collective>,
    run: &mut Run,
    log: &mut RunLog,
    at: &mut Position,
    end: &mut LoopEnd,
) -> Result<StepDone> {
    let mut micro_batches = Vec::with_capacity(cfg.train.accum_steps);
    let mut waited = 0.0;
    for _ in 0..cfg.train.accum_steps {
        let t0 = Instant::now();
        let batch = run.loader.next_batch()?;
        waited += t0.elapsed().as_secs_f64();
        micro_batches.push(batch_tensors(batch, &run.device)?);
    }
    end.data_wait += waited;
    let seed = derive_seed(cfg.run.seed, &[0x5354_4550, at.step]);
    // Mixed precision. On the CPU: the f32 towers with every large matrix product (forward and
    // backward) taking bf16 operands into f32 sums, everything else f32. On a GPU: a bf16 view
    // of the f32 variables, rebuilt after every update.
    let view;
    let bf16_products = cfg.train.precision == Precision::Bf16 && run.device.is_cpu();
    let compute_model = match cfg.train.precision {
        Precision::Bf16 if !bf16_products => {
            view = setup::bf16_view(cfg, run)?;
            &view
        }
        _ => &run.model,
    };
    let masked = at.step < cfg.train.steps - cfg.train.unmasked_tuning_steps;
    let distill = run.teacher.as_ref().map(|t| t.step(cfg));
    let compute = || {
        step::compute_with(compute_model, &run.opt, &micro_batches, group, step::StepLoss::from_config(cfg), seed, masked, distill.as_ref())
    };
    let compute = || if bf16_products { crate::ops::kernels::bf16_gemm::with_bf16_products(compute) } else { compute() };
    // Thread ranks meet at barriers inside the step, and the pool has fewer threads than a run
    // may have ranks: only a lone CPU rank runs its step on the pool.
    let lone_rank = group.world_size() == 1;
    let out = if lone_rank { crate::ops::pool::compute_on(&run.device, compute)? } else { compute()? };
    drop(micro_batches);
    if !out.loss.is_finite() {
        let keep = end.last_checkpoint.as_ref().map_or("none yet".to_string(), |p| p.display().to_string());
        bail!("non-finite loss ({}) at step {}; stopping without saving. Last good checkpoint: {keep}", out.loss, at.step + 1);
    }
    let stats = if lone_rank {
        crate::ops::pool::compute_on(&run.device, || run.opt.step(&out.grads, end.lr))?
    } else {
        run.opt.step(&out.grads, end.lr)?
    };
    if !stats.grad_norm.is_finite() {
        bail!("non-finite gradient norm at step {}; stopping without saving", at.step + 1);
    }
    at.step += 1;
    if let Some(ema) = &mut run.ema {
        ema.update(&run.varmap, at.step)?;
    }
    at.samples_seen += out.pairs;
    at.last_loss = Some(out.loss);
    log.count(out.pairs, waited);
    log.bar.set_position(at.step);
    Ok(StepDone { out, grad_norm: stats.grad_norm })
}

fn log_step(run: &Run, log: &mut RunLog, at: &Position, done: &StepDone, lr: f64, elapsed_s: f64) -> Result<()> {
    let figures = StepFigures {
        step: at.step,
        lr,
        grad_norm: done.grad_norm,
        temperature: run.model.temperature_value()?,
        logit_bias: run.model.logit_bias()?.map(|b| b.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()).transpose()?,
        samples_seen: at.samples_seen,
        skipped: run.loader.skips().total(),
        elapsed_s,
        teacher_scale: run.teacher.as_ref().map(|t| t.logits.scale),
    };
    log.log_step(&done.out, &figures)
}

fn batch_tensors(b: Batch, device: &candle_core::Device) -> Result<MicroBatch> {
    let images = b.image.tensor(b.images, b.size, device)?;
    let ids = Tensor::from_vec(b.ids, (b.size, b.max_len), device)?;
    let mask = Tensor::from_vec(b.mask, (b.size, b.max_len), device)?;
    let teacher = match b.teacher {
        None => None,
        Some(TeacherRows::Inputs { images, image, ids, mask, max_len }) => Some(TeacherMicro::Inputs {
            images: image.tensor(images, b.size, device)?,
            ids: Tensor::from_vec(ids, (b.size, max_len), device)?,
            mask: Tensor::from_vec(mask, (b.size, max_len), device)?,
        }),
        Some(TeacherRows::Embeddings { image, text, dim }) => Some(TeacherMicro::Embeddings {
            image: Tensor::from_vec(image, (b.size, dim), device)?,
            text: Tensor::from_vec(text, (b.size, dim), device)?,
        }),
    };
    Ok(MicroBatch { images, ids, mask, teacher })
}

/// The stop signal, if one arrived. Ranks agree, so every rank leaves the loop at the same step
/// even when the signal reached them between two of their checks (or only some of them).
fn stop_signal(group: &dyn Collective) -> Result<Option<i32>> {
    let mine = crate::util::interrupt::received();
    if group.world_size() == 1 {
        return Ok(mine);
    }
    let all = group.all_gather_bytes(&[mine.unwrap_or(0) as u8])?;
    Ok(all.iter().filter_map(|b| b.first().copied()).filter(|&s| s != 0).max().map(i32::from))
}
