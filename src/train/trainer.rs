//! The training loop: batches in, optimiser steps out, with logging, checkpoints, evaluation and
//! exact resumption.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use serde::Serialize;

use super::checkpoint::{self, CheckpointContents, TrainState};
use super::loss::contrastive_loss;
use super::metrics_log::MetricsLog;
use super::optim::{Grads, Optimizer};
use super::schedule::lr_at;
use crate::config::Config;
use crate::data::distribute::{Placement, ShardPlan};
use crate::data::loader::{Batch, LoaderSettings, TrainLoader};
use crate::data::skips::SkipCounts;
use crate::data::spec;
use crate::data::tokenizer::{captions_from_shards, train_wordpiece, TextTokenizer};
use crate::eval::suite::{self, EvalResults};
use crate::model::batch_norm::is_running_stat;
use crate::model::dual_encoder::DualEncoder;
use crate::model::init::SeededVars;
use crate::model::Ctx;
use crate::util::log;
use crate::util::progress::Progress;
use crate::util::rng::derive_seed;

pub struct TrainOptions {
    pub resume: bool,
    pub quiet: bool,
    pub device: Device,
    /// Stop after this many steps of this invocation (tests, benchmarks); the schedule still
    /// follows `train.steps`.
    pub stop_after: Option<u64>,
}

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
    pub skipped: SkipCounts,
    pub checkpoint: PathBuf,
    #[serde(skip_serializing_if = "EvalResults::is_empty")]
    pub eval: EvalResults,
}

fn batch_tensors(b: Batch, device: &Device) -> Result<(Tensor, Tensor, Tensor)> {
    let s = b.image_size;
    let images = Tensor::from_vec(b.images, (b.size, 3, s, s), device)?;
    let ids = Tensor::from_vec(b.ids, (b.size, b.max_len), device)?;
    let mask = Tensor::from_vec(b.mask, (b.size, b.max_len), device)?;
    Ok((images, ids, mask))
}

fn resolve_tokenizer(cfg: &Config, resume_dir: Option<&PathBuf>, quiet: bool) -> Result<TextTokenizer> {
    if let Some(dir) = resume_dir {
        return TextTokenizer::from_file(&dir.join(checkpoint::TOKENIZER_FILE), cfg.text.max_len);
    }
    let path = &cfg.text.tokenizer;
    if !path.as_os_str().is_empty() {
        if !path.is_file() {
            bail!("text.tokenizer {} does not exist (leave it empty to train a vocabulary on the training captions)", path.display());
        }
        return TextTokenizer::from_file(path, cfg.text.max_len);
    }
    if !quiet {
        log::info(format!(
            "training a {}-token WordPiece vocabulary on up to {} training captions",
            cfg.text.vocab_size, cfg.text.vocab_samples
        ));
    }
    let shards = spec::expand(&cfg.data.train)?;
    let captions = captions_from_shards(&shards, cfg.text.vocab_samples);
    if captions.is_empty() {
        bail!("no caption found in {} to train a vocabulary on", cfg.data.train);
    }
    let tok = train_wordpiece(captions.iter(), cfg.text.vocab_size, cfg.text.lowercase, 2)?;
    TextTokenizer::new(tok, cfg.text.max_len)
}

pub fn train(cfg: &Config, opts: &TrainOptions) -> Result<TrainSummary> {
    let device = &opts.device;
    let run_dir = cfg.run_dir();
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let resume_dir = if opts.resume { checkpoint::latest(&run_dir)? } else { None };
    if opts.resume && resume_dir.is_none() && !opts.quiet {
        log::info(format!("no checkpoint in {} yet: starting from scratch", run_dir.display()));
    }
    let state = match &resume_dir {
        Some(dir) => checkpoint::read_state(dir)?,
        None => TrainState { step: 0, samples_seen: 0, loader: None, seconds: 0.0, last_loss: None },
    };
    let tokenizer = Arc::new(resolve_tokenizer(cfg, resume_dir.as_ref(), opts.quiet)?);
    let spec = cfg.model_spec(tokenizer.vocab_size())?;
    let varmap = VarMap::new();
    let model = DualEncoder::new(&spec, SeededVars::builder(&varmap, cfg.run.seed, device))?;
    // BatchNorm running statistics are model state, not parameters.
    let vars: Vec<(String, candle_core::Var)> =
        varmap.data().lock().unwrap().iter().filter(|(k, _)| !is_running_stat(k)).map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut opt = Optimizer::new(vars, cfg.optimizer.clone())?;
    if let Some(dir) = &resume_dir {
        checkpoint::load_strict(
            &varmap,
            &checkpoint::read_tensors(&dir.join(checkpoint::MODEL_FILE), device)?,
            &dir.join(checkpoint::MODEL_FILE),
        )?;
        opt.load_state(&checkpoint::read_tensors(&dir.join(checkpoint::OPTIMIZER_FILE), device)?, state.step)?;
        if !opts.quiet {
            log::info(format!("resumed from {} (step {})", dir.display(), state.step));
        }
    }

    let world = 1usize;
    let micro = cfg.train.batch_size / (world * cfg.train.accum_steps);
    if micro == 0 {
        bail!("train.batch_size {} is too small for {} ranks × {} accumulation steps", cfg.train.batch_size, world, cfg.train.accum_steps);
    }
    let plan = ShardPlan {
        shards: spec::expand(&cfg.data.train)?,
        seed: cfg.run.seed,
        shuffle: cfg.data.shuffle_shards,
        resampled: cfg.data.resampled,
    };
    let settings = LoaderSettings {
        image: cfg.data.image.clone(),
        batch_size: micro,
        shuffle_buffer: cfg.data.shuffle_buffer,
        seed: cfg.run.seed,
        prefetch: cfg.data.prefetch,
    };
    let placement = Placement { rank: 0, world_size: world, worker: 0, workers: cfg.data.workers };
    let mut loader = TrainLoader::start(plan, placement, settings, tokenizer.clone(), state.loader.clone())?;

    let mut metrics = MetricsLog::open(&run_dir.join("metrics.jsonl"), Some(state.step))?;
    std::fs::write(run_dir.join("config.toml"), cfg.to_toml()?)?;
    let config_toml = cfg.to_toml()?;
    let spec_json = serde_json::to_string_pretty(&spec)?;

    let total = cfg.train.steps;
    let end = opts.stop_after.map_or(total, |n| (state.step + n).min(total));
    let bar = Progress::bar(total, "training", opts.quiet);
    bar.set_position(state.step);
    let started = Instant::now();
    let mut step = state.step;
    let mut samples_seen = state.samples_seen;
    let mut last_loss = state.last_loss;
    let mut wait = 0.0f64;
    let mut window = (Instant::now(), 0u64);
    let mut last_checkpoint: Option<PathBuf> = resume_dir.clone();
    let mut eval_results = EvalResults::default();
    let save = |step: u64, samples: u64, loss: Option<f64>, loader: &TrainLoader, opt: &Optimizer, elapsed: f64| -> Result<PathBuf> {
        let st = TrainState {
            step,
            samples_seen: samples,
            loader: Some(loader.position().clone()),
            seconds: state.seconds + elapsed,
            last_loss: loss,
        };
        let contents = CheckpointContents {
            weights: checkpoint::var_tensors(&varmap),
            optimizer: opt.state_tensors(),
            config_toml: config_toml.clone(),
            spec_json: spec_json.clone(),
            tokenizer: &tokenizer,
            state: &st,
        };
        checkpoint::save(&run_dir, &contents, cfg.train.keep_last)
    };

    while step < end {
        let lr = lr_at(step, cfg.train.lr, cfg.train.warmup_steps, total, cfg.train.schedule);
        let mut grads: Option<Grads> = None;
        let (mut loss_sum, mut i2t_sum, mut t2i_sum) = (0.0, 0.0, 0.0);
        for micro in 0..cfg.train.accum_steps {
            let t0 = Instant::now();
            let batch = loader.next_batch()?;
            wait += t0.elapsed().as_secs_f64();
            let n = batch.size as u64;
            let (images, ids, mask) = batch_tensors(batch, device)?;
            let img = model.image_embeddings(&images, &Ctx::train(derive_seed(cfg.run.seed, &[0x5354_4550, step, micro as u64])))?;
            let txt = model.text_embeddings(&ids, &mask)?;
            let parts = contrastive_loss(&img, &txt, &img, &txt, 0, &model.logit_scale()?, cfg.loss.label_smoothing)?;
            let loss_value = parts.total.to_scalar::<f32>()? as f64;
            if !loss_value.is_finite() {
                let keep = last_checkpoint.as_ref().map_or("none yet".to_string(), |p| p.display().to_string());
                bail!("non-finite loss ({loss_value}) at step {}; stopping without saving. Last good checkpoint: {keep}", step + 1);
            }
            loss_sum += loss_value;
            i2t_sum += parts.i2t.to_scalar::<f32>()? as f64;
            t2i_sum += parts.t2i.to_scalar::<f32>()? as f64;
            let g = opt.gather(&parts.total.backward()?);
            match grads.as_mut() {
                None => grads = Some(g),
                Some(acc) => acc.accumulate(g)?,
            }
            samples_seen += n;
            window.1 += n;
        }
        let mut grads = grads.expect("accum_steps >= 1");
        let k = cfg.train.accum_steps as f64;
        if cfg.train.accum_steps > 1 {
            grads.scale(1.0 / k)?;
        }
        let stats = opt.step(&grads, lr)?;
        if !stats.grad_norm.is_finite() {
            bail!("non-finite gradient norm at step {}; stopping without saving", step + 1);
        }
        step += 1;
        let loss = loss_sum / k;
        last_loss = Some(loss);
        bar.set_position(step);

        if step % cfg.train.log_every.max(1) == 0 || step == end {
            let secs = window.0.elapsed().as_secs_f64().max(1e-9);
            let rate = window.1 as f64 / secs;
            window = (Instant::now(), 0);
            let temperature = model.temperature_value()?;
            bar.set_message(format!("loss {loss:.3} σ {temperature:.4} lr {lr:.2e} {rate:.0} img/s"));
            metrics.write(&serde_json::json!({
                "step": step, "loss": loss, "i2t": i2t_sum / k, "t2i": t2i_sum / k, "temperature": temperature,
                "lr": lr, "grad_norm": stats.grad_norm, "samples_per_s": rate, "samples_seen": samples_seen,
                "data_wait_s": wait, "skipped": loader.skips().total(), "elapsed_s": state.seconds + started.elapsed().as_secs_f64(),
            }))?;
        }
        let last = step == end;
        if (cfg.train.checkpoint_every > 0 && step % cfg.train.checkpoint_every == 0) || last {
            last_checkpoint = Some(save(step, samples_seen, last_loss, &loader, &opt, started.elapsed().as_secs_f64())?);
        }
        if suite::configured(cfg) && ((cfg.train.eval_every > 0 && step % cfg.train.eval_every == 0) || (last && step == total)) {
            eval_results = suite::run(&model, &tokenizer, cfg, device, true)?;
            if !opts.quiet {
                log::info(format!("step {step}: {}", eval_results.line()));
            }
            metrics.write(&serde_json::json!({"step": step, "eval": eval_results}))?;
        }
    }
    bar.finish();
    let seconds = started.elapsed().as_secs_f64();
    let trained = samples_seen - state.samples_seen;
    let checkpoint = match last_checkpoint {
        Some(p) => p,
        None => save(step, samples_seen, last_loss, &loader, &opt, seconds)?,
    };
    Ok(TrainSummary {
        steps: step,
        samples_seen,
        seconds: state.seconds + seconds,
        samples_per_second: trained as f64 / seconds.max(1e-9),
        data_wait_share: wait / seconds.max(1e-9),
        final_loss: last_loss,
        temperature: model.temperature_value()?,
        skipped: loader.skips(),
        checkpoint,
        eval: eval_results,
    })
}
