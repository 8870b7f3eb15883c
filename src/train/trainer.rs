//! The training loop: batches in, optimiser steps out, with logging, checkpoints, evaluation and
//! exact resumption.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use serde::Serialize;

use super::checkpoint::{self, CheckpointContents, TrainState};
use super::collective::{Collective, DistEnv, SingleProcess, ThreadGroup};
use super::metrics_log::{self, MetricsLog};
use super::optim::Optimizer;
use super::schedule::lr_at;
use super::step::{self, MicroBatch};
use crate::config::{Config, Precision};
use crate::data::distribute::{Placement, ShardPlan};
use crate::data::loader::{Batch, LoaderSettings, TrainLoader};
use crate::data::skips::SkipCounts;
use crate::data::spec;
use crate::data::tokenizer::{captions_from_shards, train_wordpiece, TextTokenizer};
use crate::eval::suite::{self, EvalResults};
use crate::model::batch_norm::trainable_vars;
use crate::model::dual_encoder::DualEncoder;
use crate::model::init::SeededVars;
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
    /// Data-parallel ranks as threads of this process (`--nproc`); 1 = a single rank.
    pub nproc: usize,
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
    pub final_lr: f64,
    pub skipped: SkipCounts,
    pub checkpoint: PathBuf,
    /// Stopped early by Ctrl-C (after saving `checkpoint`).
    pub interrupted: bool,
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

fn batch_tensors(b: Batch, device: &Device) -> Result<MicroBatch> {
    let s = b.image_size;
    let images = Tensor::from_vec(b.images, (b.size, 3, s, s), device)?;
    let ids = Tensor::from_vec(b.ids, (b.size, b.max_len), device)?;
    let mask = Tensor::from_vec(b.mask, (b.size, b.max_len), device)?;
    Ok(MicroBatch { images, ids, mask })
}

fn resolve_tokenizer(cfg: &Config, resume_dir: Option<&PathBuf>, quiet: bool) -> Result<TextTokenizer> {
    if let Some(dir) = resume_dir {
        return TextTokenizer::from_file(&dir.join(checkpoint::TOKENIZER_FILE), cfg.text.max_len);
    }
    if let Some(t) = super::init_from::tokenizer(cfg)? {
        return Ok(t);
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

/// Trains per `cfg`: one rank, `opts.nproc` ranks on threads, or (from torchrun / SLURM variables)
/// one rank of a multi-process job. Returns rank 0's summary.
pub fn train(cfg: &Config, opts: &TrainOptions) -> Result<TrainSummary> {
    let threads = crate::util::threads::set_compute_threads(cfg.train.compute_threads);
    if !opts.quiet {
        log::info(format!("{threads} compute threads; {} loader workers at nice +{}", cfg.data.workers, cfg.data.worker_nice));
    }
    let env = DistEnv::from_env(|k| std::env::var(k).ok()).map_err(anyhow::Error::msg)?;
    if env.world_size > 1 {
        #[cfg(feature = "nccl")]
        {
            let timeout = std::time::Duration::from_secs_f64(cfg.train.collective_timeout_s);
            let group = super::nccl::NcclGroup::join(&env, timeout).with_context(|| format!("rank {} of {}", env.rank, env.world_size))?;
            let opts = TrainOptions {
                resume: opts.resume,
                quiet: opts.quiet || env.rank > 0,
                device: group.device().clone(),
                stop_after: opts.stop_after,
                nproc: 1,
            };
            return train_rank(cfg, &opts, Arc::new(group));
        }
        #[cfg(not(feature = "nccl"))]
        bail!(
            "this process is rank {} of {} (from RANK/WORLD_SIZE or SLURM): multi-process training runs over NCCL, which this build does not include (build with --features nccl)",
            env.rank,
            env.world_size
        );
    }
    if opts.nproc <= 1 {
        return train_rank(cfg, opts, Arc::new(SingleProcess));
    }
    let timeout = std::time::Duration::from_secs_f64(cfg.train.collective_timeout_s);
    let groups = ThreadGroup::new(opts.nproc, timeout);
    let results: Vec<Result<TrainSummary>> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let rank = g.rank();
                let opts = TrainOptions {
                    resume: opts.resume,
                    quiet: opts.quiet || rank > 0,
                    device: opts.device.clone(),
                    stop_after: opts.stop_after,
                    nproc: opts.nproc,
                };
                scope.spawn(move || {
                    let group: Arc<dyn Collective> = Arc::new(g);
                    let out = train_rank(cfg, &opts, group.clone());
                    if let Err(e) = &out {
                        group.abort(&format!("{e:#}"));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a training rank panicked")))).collect()
    });
    // Report the failing rank's own error rather than the others' "rank N failed" echoes.
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

fn coll(e: super::collective::CollectiveError) -> anyhow::Error {
    anyhow::Error::new(e)
}

/// One rank's training loop.
fn train_rank(cfg: &Config, opts: &TrainOptions, group: Arc<dyn Collective>) -> Result<TrainSummary> {
    let device = &opts.device;
    let (rank, world) = (group.rank(), group.world_size());
    let lead = rank == 0;
    let run_dir = cfg.run_dir();
    if lead {
        std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    }
    group.barrier().map_err(coll)?;
    let resume_dir = if opts.resume { checkpoint::latest(&run_dir)? } else { None };
    if opts.resume && resume_dir.is_none() && !opts.quiet {
        log::info(format!("no checkpoint in {} yet: starting from scratch", run_dir.display()));
    }
    let state = match &resume_dir {
        Some(dir) => checkpoint::read_state(dir)?,
        None => TrainState { step: 0, samples_seen: 0, loaders: Vec::new(), seconds: 0.0, last_loss: None },
    };
    if resume_dir.is_some() && state.loaders.len() != world {
        bail!("the checkpoint was written by {} ranks but this run has {world}: resume with the same number of ranks", state.loaders.len());
    }
    // Rank 0 settles the vocabulary (training one if needed, which is not reproducible run to run)
    // and the others read what it wrote.
    let tokenizer = if lead || resume_dir.is_some() || !cfg.text.tokenizer.as_os_str().is_empty() {
        let t = resolve_tokenizer(cfg, resume_dir.as_ref(), opts.quiet)?;
        if lead && resume_dir.is_none() {
            t.save(&run_dir.join(checkpoint::TOKENIZER_FILE))?;
        }
        group.barrier().map_err(coll)?;
        t
    } else {
        group.barrier().map_err(coll)?;
        TextTokenizer::from_file(&run_dir.join(checkpoint::TOKENIZER_FILE), cfg.text.max_len)?
    };
    let tokenizer = Arc::new(tokenizer);
    let spec = super::init_from::spec(cfg, tokenizer.vocab_size())?;
    let varmap = VarMap::new();
    let build = |vb| DualEncoder::new(&spec, vb).map(|m| m.with_grad_checkpointing(cfg.train.grad_checkpointing));
    let model = build(SeededVars::builder(&varmap, cfg.run.seed, device))?;
    if resume_dir.is_none() && lead {
        for line in super::init_from::load_weights(cfg, &varmap, device)? {
            if !opts.quiet {
                log::info(format!("initialised {line}"));
            }
        }
    }
    // BatchNorm running statistics are model state, not parameters.
    let vars = trainable_vars(&varmap);
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
    if world > 1 {
        // Identical starting weights on every rank, whatever each built.
        let mut names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
        names.sort();
        let data = varmap.data().lock().unwrap();
        for name in names {
            let var = &data[&name];
            var.set(&group.broadcast(var.as_tensor(), 0).map_err(coll)?)?;
        }
    }

    let micro = cfg.train.batch_size / (world * cfg.train.accum_steps);
    if micro == 0 || !cfg.train.batch_size.is_multiple_of(world * cfg.train.accum_steps) {
        bail!("train.batch_size {} does not split over {world} ranks × {} accumulation steps", cfg.train.batch_size, cfg.train.accum_steps);
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
        nice: cfg.data.worker_nice,
    };
    let placement = Placement { rank, world_size: world, worker: 0, workers: cfg.data.workers };
    let mut loader = TrainLoader::start(plan, placement, settings, tokenizer.clone(), state.loaders.get(rank).cloned())?;

    let mut metrics = if lead { Some(MetricsLog::open(&run_dir.join("metrics.jsonl"), Some(state.step))?) } else { None };
    // The TensorBoard files are derived from the metrics log's records, so every record goes
    // through `record` to reach both.
    let tb = if lead { Some(super::tensorboard::EventWriter::create(&run_dir.join("tb"))?) } else { None };
    let mut record = |r: serde_json::Value| -> Result<()> {
        if let Some(m) = metrics.as_mut() {
            m.write(&r)?;
        }
        if let (Some(tb), Some(step)) = (&tb, r.get("step").and_then(serde_json::Value::as_u64)) {
            let scalars = metrics_log::scalars(&r);
            tb.scalars(step, &scalars.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>());
        }
        Ok(())
    };
    let config_toml = cfg.to_toml()?;
    if lead {
        std::fs::write(run_dir.join("config.toml"), &config_toml)?;
    }
    if let Some(tb) = &tb {
        tb.text(state.step, "config", &format!("```toml\n{config_toml}\n```"));
    }
    let spec_json = serde_json::to_string_pretty(&spec)?;
    let gather = cfg.train.gather_options();

    let total = cfg.train.steps;
    let end = opts.stop_after.map_or(total, |n| (state.step + n).min(total));
    let bar = Progress::bar(total, "training", opts.quiet);
    bar.set_position(state.step);
    let started = Instant::now();
    let mut step = state.step;
    let mut samples_seen = state.samples_seen;
    let mut last_loss = state.last_loss;
    let mut wait = 0.0f64;
    let mut window = (Instant::now(), 0u64, 0.0f64);
    let mut lr = lr_at(step, cfg.train.lr, cfg.train.warmup_steps, total, cfg.train.schedule);
    let mut interrupted = false;
    let mut last_checkpoint: Option<PathBuf> = resume_dir.clone();
    let mut eval_results = EvalResults::default();
    // Every rank contributes its loader position; rank 0 writes the checkpoint. Every rank gets
    // the same path back, so all of them agree on whether a final save is still due.
    let save = |step: u64, samples: u64, loss: Option<f64>, loader: &TrainLoader, opt: &Optimizer, elapsed: f64| -> Result<PathBuf> {
        let mine = serde_json::to_vec(loader.position())?;
        let all = group.all_gather_bytes(&mine).map_err(coll)?;
        if !lead {
            return Ok(run_dir.join(format!("step-{step}")));
        }
        let loaders = all.iter().map(|b| serde_json::from_slice(b)).collect::<std::result::Result<Vec<_>, _>>()?;
        let st = TrainState { step, samples_seen: samples, loaders, seconds: state.seconds + elapsed, last_loss: loss };
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
        lr = lr_at(step, cfg.train.lr, cfg.train.warmup_steps, total, cfg.train.schedule);
        let mut micro_batches = Vec::with_capacity(cfg.train.accum_steps);
        for _ in 0..cfg.train.accum_steps {
            let t0 = Instant::now();
            let batch = loader.next_batch()?;
            let waited = t0.elapsed().as_secs_f64();
            wait += waited;
            window.2 += waited;
            micro_batches.push(batch_tensors(batch, device)?);
        }
        let local: u64 = micro_batches.iter().map(|m| m.images.dim(0).unwrap_or(0) as u64).sum();
        let seed = derive_seed(cfg.run.seed, &[0x5354_4550, step]);
        // Mixed precision: a bf16 view of the f32 variables, rebuilt after every update; its
        // casts carry the gradients back to the f32 master weights.
        let view;
        let compute_model = match cfg.train.precision {
            Precision::F32 => &model,
            Precision::Bf16 => {
                view = build(SeededVars::builder_dtype(&varmap, cfg.run.seed, DType::BF16, device))?;
                &view
            }
        };
        let out = step::compute(compute_model, &opt, &micro_batches, &group, gather, cfg.loss.label_smoothing, seed)?;
        drop(micro_batches);
        if !out.loss.is_finite() {
            let keep = last_checkpoint.as_ref().map_or("none yet".to_string(), |p| p.display().to_string());
            bail!("non-finite loss ({}) at step {}; stopping without saving. Last good checkpoint: {keep}", out.loss, step + 1);
        }
        let stats = opt.step(&out.grads, lr)?;
        if !stats.grad_norm.is_finite() {
            bail!("non-finite gradient norm at step {}; stopping without saving", step + 1);
        }
        step += 1;
        samples_seen += local * world as u64;
        window.1 += local * world as u64;
        last_loss = Some(out.loss);
        bar.set_position(step);

        if step % cfg.train.log_every.max(1) == 0 || step == end {
            let secs = window.0.elapsed().as_secs_f64().max(1e-9);
            let rate = window.1 as f64 / secs;
            let wait_share = window.2 / secs;
            window = (Instant::now(), 0, 0.0);
            let temperature = model.temperature_value()?;
            bar.set_message(format!("loss {:.3} σ {temperature:.4} lr {lr:.2e} {rate:.0} img/s", out.loss));
            let elapsed = started.elapsed().as_secs_f64();
            record(serde_json::json!({
                "step": step, "loss": out.loss, "loss_i2t": out.i2t, "loss_t2i": out.t2i, "temperature": temperature,
                "lr": lr, "grad_norm": stats.grad_norm, "samples_per_s": rate, "samples_seen": samples_seen,
                "data_wait_share": wait_share, "skipped": loader.skips().total(), "elapsed_s": state.seconds + elapsed,
            }))?;
        }
        let last = step == end;
        if (cfg.train.checkpoint_every > 0 && step % cfg.train.checkpoint_every == 0) || last {
            last_checkpoint = Some(save(step, samples_seen, last_loss, &loader, &opt, started.elapsed().as_secs_f64())?);
        }
        if lead && suite::configured(cfg) && ((cfg.train.eval_every > 0 && step % cfg.train.eval_every == 0) || (last && step == total)) {
            eval_results = suite::run(&model, &tokenizer, cfg, device, true)?;
            if !opts.quiet {
                log::info(format!("step {step}: {}", eval_results.line()));
            }
            record(serde_json::json!({"step": step, "eval": eval_results}))?;
        }
        if !last && stop_requested(&*group)? {
            interrupted = true;
            if !opts.quiet {
                log::info(format!("interrupted at step {step}; saving a checkpoint"));
            }
            last_checkpoint = Some(save(step, samples_seen, last_loss, &loader, &opt, started.elapsed().as_secs_f64())?);
            break;
        }
    }
    bar.finish();
    if let Some(tb) = tb {
        tb.close()?;
    }
    let best_eval = if lead {
        metrics_log::best_eval(&metrics_log::read(&run_dir.join("metrics.jsonl"))?)
            .into_iter()
            .map(|(metric, value, step)| BestMetric { metric, value, step })
            .collect()
    } else {
        Vec::new()
    };
    let seconds = started.elapsed().as_secs_f64();
    let trained = samples_seen - state.samples_seen;
    let checkpoint = match last_checkpoint {
        Some(p) => p,
        None => save(step, samples_seen, last_loss, &loader, &opt, seconds)?,
    };
    // Skips summed over ranks.
    let skipped = {
        let all = group.all_gather_bytes(&serde_json::to_vec(&loader.skips())?).map_err(coll)?;
        let mut total = SkipCounts::default();
        for b in all {
            total.merge(&serde_json::from_slice(&b)?);
        }
        total
    };
    Ok(TrainSummary {
        steps: step,
        samples_seen,
        seconds: state.seconds + seconds,
        samples_per_second: trained as f64 / seconds.max(1e-9),
        data_wait_share: wait / seconds.max(1e-9),
        final_loss: last_loss,
        temperature: model.temperature_value()?,
        final_lr: lr,
        skipped,
        checkpoint,
        interrupted,
        eval: eval_results,
        best_eval,
    })
}

/// Whether to stop for Ctrl-C. Ranks agree, so every rank leaves the loop at the same step
/// even when the signal reached them between two of their checks.
fn stop_requested(group: &dyn Collective) -> Result<bool> {
    let mine = crate::util::interrupt::requested();
    if group.world_size() == 1 {
        return Ok(mine);
    }
    let all = group.all_gather_bytes(&[mine as u8]).map_err(coll)?;
    Ok(all.iter().any(|b| b.first() == Some(&1)))
}
