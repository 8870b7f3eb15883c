//! What a rank prepares before its first step: the run directory and what a resumed run
//! restores, the vocabulary, the model and its optimizer (initialised from pretrained weights,
//! restored from the checkpoint, then broadcast from rank 0), and the loader at its position.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

use super::teacher::Teacher;
use super::TrainOptions;
use crate::config::{value_at, Config};
use crate::data::distribute::{Placement, ShardPlan};
use crate::data::loader::{LoaderPosition, LoaderSettings, TrainLoader};
use crate::data::spec;
use crate::data::token_budget::TokenBudget;
use crate::data::tokenizer::{captions_from_shards, train_wordpiece, TextTokenizer};
use crate::io::run_dir::{self, TrainState, EMA_FILE, MODEL_FILE, TOKENIZER_FILE};
use crate::io::run_lock::RunLock;
use crate::io::tensors::{load_strict, read_tensors};
use crate::model::batch_norm::trainable_vars;
use crate::model::dual_encoder::{DualEncoder, ModelSpec};
use crate::model::init::SeededVars;
use crate::train::collective::Collective;
use crate::train::ema::{EmaSchedule, WeightEma};
use crate::train::optim::Optimizer;
use crate::train::start::Start;
use crate::util::log;

/// A rank's run as it goes: set up here, advanced by the step loop.
pub(super) struct Run {
    pub run_dir: PathBuf,
    /// The checkpoint this invocation resumed from, if any.
    pub resumed_from: Option<PathBuf>,
    /// The state at the start of this invocation (zero for a fresh run).
    pub start: TrainState,
    pub tokenizer: Arc<TextTokenizer>,
    pub spec: ModelSpec,
    pub varmap: VarMap,
    pub model: DualEncoder,
    pub opt: Optimizer,
    /// The weights' moving average (rank 0, with `train.ema_decay`).
    pub ema: Option<WeightEma>,
    pub loader: TrainLoader,
    pub device: Device,
    /// The distillation teacher, when the run has one.
    pub teacher: Option<Teacher>,
    /// Rank 0's hold on the run directory, for the whole run.
    _lock: Option<RunLock>,
}

pub(super) fn prepare(cfg: &Config, from: &Start, opts: &TrainOptions, shared: &Arc<dyn Collective>) -> Result<Run> {
    let group = &**shared;
    let run_dir = cfg.run_dir();
    // Every rank learns whether rank 0 got the directory before any of them reads from it.
    let lock = if group.rank() == 0 { Some(lock_run_dir(&run_dir)) } else { None };
    group.barrier()?;
    let lock = lock.transpose()?;
    let resumed_from = from.resumed_from().map(Path::to_path_buf);
    let start = resume_state(resumed_from.as_deref(), group.world_size(), cfg.data.workers, opts.quiet)?;
    if let (Some(dir), Some(saved)) = (&resumed_from, from.saved_config()) {
        if start.step > cfg.train.steps {
            bail!(
                "{} is at step {}, past this run's length of {} steps: there is nothing to train; to go on, raise train.steps (with --allow-change train.steps)",
                dir.display(),
                start.step,
                cfg.train.steps
            );
        }
        for change in changes_on_resume(cfg, saved, dir, &opts.allow_change)? {
            if !opts.quiet {
                log::info(format!("resuming with {change} (--allow-change)"));
            }
        }
    }
    let tokenizer = Arc::new(shared_tokenizer(cfg, from, opts.quiet, &run_dir, group)?);
    let spec = from.spec(cfg, tokenizer.vocab_size())?;
    let varmap = VarMap::new();
    let device = opts.device.clone();
    cpu_bf16_training(cfg.train.precision, &device, crate::ops::kernels::bf16_gemm::available())?;
    if cfg.train.precision == crate::config::Precision::Bf16 && device.is_cpu() && group.rank() == 0 && !opts.quiet {
        if let Some(note) = crate::ops::kernels::bf16_gemm::kernel_note() {
            log::info(note);
        }
    }
    let model = build_model(cfg, &spec, SeededVars::builder(&varmap, cfg.run.seed, &device))?;
    if group.rank() == 0 {
        for line in from.load_weights(cfg, &spec, &varmap, &device)? {
            if !opts.quiet {
                log::info(format!("initialised {line}"));
            }
        }
    }
    // BatchNorm running statistics are model state, not parameters; locked towers are neither.
    let (vars, frozen) = crate::model::lock::split(trainable_vars(&varmap), &spec, &cfg.model.lock());
    if frozen > 0 && !opts.quiet {
        log::info(format!(
            "{:.1}M parameters locked: no gradient, optimizer moments or all-reduce for them ({:.0} MiB of f32 gradient and moments not kept)",
            frozen as f64 / 1e6,
            frozen as f64 * 12.0 / (1 << 20) as f64
        ));
    }
    let mut opt = Optimizer::sharded(vars, cfg.optimizer.clone(), cfg.train.shard, shared.clone())?;
    if let (Some((mode, _, world)), false) = (opt.sharding(), opts.quiet) {
        log::info(format!(
            "train.shard = \"{}\": each of {world} ranks keeps the optimizer moments of its own tensors ({:.0} MiB here){}",
            mode.name(),
            opt.state_bytes() as f64 / (1 << 20) as f64,
            if mode == crate::config::ShardMode::Gradients { " and receives only their summed gradients" } else { "" }
        ));
    }
    let (image_decay, text_decay) = (cfg.optimizer.layer_decay_image, cfg.optimizer.layer_decay_text);
    if image_decay < 1.0 || text_decay < 1.0 {
        opt.set_lr_scales(|name| crate::model::lock::layer_lr_scale(name, &spec, image_decay, text_decay));
    }
    if let Some(dir) = &resumed_from {
        restore(dir, &varmap, &mut opt, &start, &device, opts.quiet)?;
    }
    broadcast_weights(&varmap, group)?;
    let ema = match EmaSchedule::from_config(&cfg.train) {
        Some(s) if group.rank() == 0 => Some(start_ema(&varmap, s, resumed_from.as_deref(), &device, opts)?),
        _ => None,
    };
    let teacher = Teacher::of(cfg, &device, opts.quiet || group.rank() != 0)?;
    if let Some(dir) = &resumed_from {
        let now = teacher.as_ref().map(|t| t.identity.clone());
        if start.teacher != now && !opts.allow_change.iter().any(|a| a == "distill") {
            let name = |t: &Option<String>| t.clone().unwrap_or_else(|| "no teacher".into());
            bail!(
                "{} was trained distilling from {}, and this run distils from {}: a resume keeps its teacher (--allow-change distill continues anyway)",
                dir.display(),
                name(&start.teacher),
                name(&now)
            );
        }
    }
    let loader = start_loader(cfg, group, tokenizer.clone(), &start, teacher.as_ref().map(|t| t.feed.clone()))?;
    if !opts.quiet {
        // open_clip's --batch-size is per GPU; align's train.batch_size is the whole step's.
        let (world, accum) = (group.world_size(), cfg.train.accum_steps);
        let micro = cfg.train.batch_size / (world * accum);
        log::info(format!(
            "{} steps of a global batch of {} pairs: {world} rank(s) × {accum} micro-batch(es) × {micro} pairs",
            cfg.train.steps, cfg.train.batch_size,
        ));
        if let Some(b) = TokenBudget::of(&cfg.data.naflex_seq_lens, cfg.data.naflex_batch_divisor, micro) {
            let sizes: Vec<String> = b.seq_lens.iter().map(|&s| format!("{} × {s}", b.batch_size(s))).collect();
            log::info(format!(
                "token-budget batches (images × patches per micro-batch, one drawn per batch): {}; the batch above is the one at {} patches",
                sizes.join(", "),
                b.longest()
            ));
        }
        log::info(format!("loss: {}", describe_loss(cfg)));
    }
    Ok(Run { run_dir, resumed_from, start, tokenizer, spec, varmap, model, opt, ema, loader, device, teacher, _lock: lock })
}

/// `train.precision = "bf16"` on the CPU runs its matrix products on AVX-512 BF16; without it
/// the run is refused rather than trained in f32 under a bf16 label.
fn cpu_bf16_training(precision: crate::config::Precision, device: &Device, available: bool) -> Result<()> {
    if precision == crate::config::Precision::Bf16 && device.is_cpu() && !available {
        bail!(
            "train.precision = \"bf16\" on the CPU needs AVX-512 BF16 (avx512_bf16 in /proc/cpuinfo), which this one lacks: train in f32"
        );
    }
    Ok(())
}

/// The objective in the words of the family it comes from, so that a logged value can be
/// compared with the same family's other tools.
fn describe_loss(cfg: &Config) -> String {
    use crate::config::{Directions, LossKind};
    match (cfg.loss.kind, cfg.loss.directions) {
        (LossKind::Sigmoid, _) => "SigLIP's sigmoid loss over every image-text pair".into(),
        (LossKind::Softmax, Directions::Sum) => {
            format!("softmax, image→text plus text→image (ALIGN's sum), label smoothing {}", cfg.loss.label_smoothing)
        }
        (LossKind::Softmax, Directions::Mean) => {
            format!("softmax, the mean of image→text and text→image (open_clip's ClipLoss), label smoothing {}", cfg.loss.label_smoothing)
        }
    }
}

/// Creates the run directory, takes its lock and clears what an interrupted save or prune left.
fn lock_run_dir(run_dir: &Path) -> Result<RunLock> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let lock = RunLock::acquire(run_dir)?;
    run_dir::clean(run_dir)?;
    Ok(lock)
}

/// The towers for `spec` on the variables of `vb` (f32 master weights, or a bf16 view of them).
pub(super) fn build_model(cfg: &Config, spec: &ModelSpec, vb: VarBuilder) -> Result<DualEncoder> {
    let graph = crate::model::lock::image_graph(spec, &cfg.model.lock());
    Ok(DualEncoder::new(spec, vb)?.with_grad_checkpointing(cfg.train.grad_checkpointing).with_image_graph(graph))
}

/// A bf16 view of the f32 variables: its casts carry the gradients back to the master weights.
pub(super) fn bf16_view(cfg: &Config, run: &Run) -> Result<DualEncoder> {
    build_model(cfg, &run.spec, SeededVars::builder_dtype(&run.varmap, cfg.run.seed, DType::BF16, &run.device))
}

/// The checkpoint to resume from (with `--resume`, or `--resume PATH`), if any.
pub(super) fn resume_checkpoint(opts: &TrainOptions, run_dir: &Path) -> Result<Option<PathBuf>> {
    let resumed_from = match &opts.resume_from {
        Some(path) => Some(chosen_checkpoint(path, run_dir)?),
        None if opts.resume => run_dir::latest(run_dir)?,
        None => None,
    };
    if opts.resume && resumed_from.is_none() && !opts.quiet {
        log::info(format!("no checkpoint in {} yet: starting from scratch", run_dir.display()));
    }
    Ok(resumed_from)
}

/// The state a run resumes at (zero for a fresh run). A checkpoint of another number of ranks
/// has its loader positions regrouped onto this run's ranks (the same streams of data, which
/// needs as many loader workers in all); the weights and optimizer state are whole tensors by
/// name, which any number of ranks reads.
fn resume_state(resumed_from: Option<&Path>, world: usize, workers: usize, quiet: bool) -> Result<TrainState> {
    let Some(dir) = resumed_from else {
        return Ok(TrainState { step: 0, samples_seen: 0, loaders: Vec::new(), seconds: 0.0, last_loss: None, teacher: None });
    };
    let mut start = run_dir::read_state(dir)?;
    if start.loaders.len() != world {
        let before = start.loaders.len();
        start.loaders = LoaderPosition::regroup(&start.loaders, world, workers)
            .with_context(|| format!("resuming {} on {world} ranks", dir.display()))?;
        if !quiet {
            log::info(format!(
                "resuming a checkpoint of {before} ranks on {world}: each of the {} data streams continues where it stopped, grouped into the ranks' batches anew",
                world * workers
            ));
        }
    }
    Ok(start)
}

/// `--resume PATH`: a checkpoint (`RUN/step-N`) or a run directory (its latest checkpoint). An
/// earlier checkpoint of this run continues from there, refused while later ones exist (they
/// would be replaced); another run's checkpoint continues into this run's directory as a new
/// branch, refused when this run already has checkpoints of its own.
fn chosen_checkpoint(path: &Path, run_dir: &Path) -> Result<PathBuf> {
    let dir = if path.join(run_dir::STATE_FILE).is_file() {
        path.to_path_buf()
    } else {
        match run_dir::latest(path)? {
            Some(d) => d,
            None => bail!(
                "--resume {}: not a checkpoint of an align run (no {}) nor a run directory with one",
                path.display(),
                run_dir::STATE_FILE
            ),
        }
    };
    let state = run_dir::read_state(&dir)?;
    let canonical = |p: &Path| p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    let own = dir.parent().is_some_and(|parent| canonical(parent) == canonical(run_dir));
    let existing = run_dir::list_steps(run_dir)?;
    if own {
        let later: Vec<String> = existing.iter().filter(|(s, _)| *s > state.step).map(|(_, d)| d.display().to_string()).collect();
        if !later.is_empty() {
            bail!(
                "--resume {}: this run has later checkpoints ({}) that continuing from step {} would replace; move them away first, or branch into a new run (another run.name) with --resume {}",
                dir.display(),
                later.join(", "),
                state.step,
                dir.display()
            );
        }
    } else if let Some((_, d)) = existing.last() {
        bail!(
            "--resume {}: {} already has checkpoints of its own ({}); branch into a new run (another run.name), or resume this one with --resume",
            dir.display(),
            run_dir.display(),
            d.display()
        );
    }
    Ok(dir)
}

/// The fields whose change breaks a resumed run's promise (the same batches and weights as one
/// uninterrupted run): what `--allow-change FIELD` must name to change them.
/// The schedule's length is one of them: a longer `train.steps` re-stretches the learning rate's
/// decay under the steps already taken.
/// What a resume must keep: the data and its order, the length, the model, and the objective and
/// optimizer (whose moments the checkpoint holds; a start's family recipe is one of these, so a
/// run begun under another recipe is not silently continued under this one).
const RESUME_FIELDS: [&str; 11] = [
    "run.seed",
    "train.batch_size",
    "train.steps",
    "data.train",
    "data.upsampling_factors",
    "data.naflex_seq_lens",
    "data.naflex_batch_divisor",
    "model",
    "loss",
    "optimizer",
    "distill",
];

/// What `cfg` changes of the config the checkpoint at `dir` was trained with: an error naming
/// every change not allowed, else the allowed ones.
pub(super) fn changes_on_resume(cfg: &Config, saved: &Config, dir: &Path, allowed: &[String]) -> Result<Vec<String>> {
    let (now, before) = (toml::Table::try_from(cfg)?, toml::Table::try_from(saved)?);
    let mut changed = Vec::new();
    let mut refused = Vec::new();
    for field in RESUME_FIELDS {
        let (old, new) = (value_at(&before, field), value_at(&now, field));
        if old != new {
            // A section (`[model]`) is compared field by field, so that a change reads as the
            // one field that changed, not as two whole tables.
            let mut leaves = Vec::new();
            leaf_changes(field, old, new, &mut leaves);
            if allowed.iter().any(|a| a == field) {
                changed.extend(leaves);
            } else {
                refused.extend(leaves);
            }
        }
    }
    if !refused.is_empty() {
        bail!(
            "--resume from {} would change what the run trains on, so it would not continue the same run (resume with the checkpoint's values, or pass --allow-change FIELD for each change you mean):\n  {}",
            dir.display(),
            refused.join("\n  ")
        );
    }
    Ok(changed)
}

/// The changes between two values of `path`, one line per leaf field that differs.
fn leaf_changes(path: &str, old: Option<&toml::Value>, new: Option<&toml::Value>, out: &mut Vec<String>) {
    if let (Some(toml::Value::Table(a)), Some(toml::Value::Table(b))) = (old, new) {
        let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
        keys.sort();
        keys.dedup();
        for k in keys {
            if a.get(k) != b.get(k) {
                leaf_changes(&format!("{path}.{k}"), a.get(k), b.get(k), out);
            }
        }
        return;
    }
    let show = |v: Option<&toml::Value>| v.map_or("(none)".to_string(), |v| v.to_string());
    out.push(format!("{path} changed from {} to {}", show(old), show(new)));
}

/// The run's vocabulary, the same on every rank: rank 0 settles it (training one if needed,
/// which is not reproducible run to run) and writes it to the run directory, where the others
/// read it.
fn shared_tokenizer(cfg: &Config, from: &Start, quiet: bool, run_dir: &Path, group: &dyn Collective) -> Result<TextTokenizer> {
    let lead = group.rank() == 0;
    let resumed = from.resumed_from().is_some();
    if lead || resumed || !cfg.text.tokenizer.as_os_str().is_empty() {
        let t = resolve_tokenizer(cfg, from, quiet)?;
        if lead && !resumed {
            t.save(&run_dir.join(TOKENIZER_FILE))?;
        }
        group.barrier()?;
        return Ok(t);
    }
    group.barrier()?;
    TextTokenizer::from_file(&run_dir.join(TOKENIZER_FILE), cfg.text.max_len)
}

/// The checkpoint's vocabulary, a pretrained start's, `text.tokenizer`, or one trained on the
/// training captions.
fn resolve_tokenizer(cfg: &Config, from: &Start, quiet: bool) -> Result<TextTokenizer> {
    if let Some(t) = from.tokenizer(cfg)? {
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

/// The weights and optimizer moments of the checkpoint at `dir`.
fn restore(dir: &Path, varmap: &VarMap, opt: &mut Optimizer, start: &TrainState, device: &Device, quiet: bool) -> Result<()> {
    load_strict(varmap, &read_tensors(&dir.join(MODEL_FILE), device)?, &dir.join(MODEL_FILE))?;
    let state = run_dir::read_optimizer(dir, device, &opt.state_names())?;
    opt.load_state(&state, start.step).with_context(|| format!("restoring the optimizer from {}", dir.display()))?;
    if !quiet {
        log::info(format!("resumed from {} (step {})", dir.display(), start.step));
    }
    Ok(())
}

/// The weights' moving average: the checkpoint's when resuming, else one starting at the
/// weights (which its first update overwrites anyway). A resumed checkpoint without one is an
/// error (the average would silently restart) unless `--allow-change train.ema_decay` says to
/// start a new one.
fn start_ema(
    varmap: &VarMap,
    schedule: EmaSchedule,
    resumed_from: Option<&Path>,
    device: &Device,
    opts: &TrainOptions,
) -> Result<WeightEma> {
    let mut ema = WeightEma::new(varmap, schedule)?;
    if let Some(dir) = resumed_from {
        let path = dir.join(EMA_FILE);
        if path.is_file() {
            ema.restore(&read_tensors(&path, device)?, &path)?;
        } else if opts.allow_change.iter().any(|f| f == "train.ema_decay") {
            log::warn(format!(
                "{} is missing: starting a new weight average from the weights (--allow-change train.ema_decay)",
                path.display()
            ));
        } else {
            bail!(
                "{} is missing: the run keeps a moving average of the weights (train.ema_decay) and resuming would restart it; restore the file, or add --allow-change train.ema_decay to start a new average",
                path.display()
            );
        }
    }
    Ok(ema)
}

/// Identical starting weights on every rank, whatever each built.
fn broadcast_weights(varmap: &VarMap, group: &dyn Collective) -> Result<()> {
    if group.world_size() == 1 {
        return Ok(());
    }
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let var = &data[name];
        var.set(&group.broadcast(var.as_tensor(), 0)?)?;
    }
    Ok(())
}

/// This rank's loader: its share of the shards, at the position the checkpoint saved.
fn start_loader(
    cfg: &Config,
    group: &dyn Collective,
    tokenizer: Arc<TextTokenizer>,
    start: &TrainState,
    teacher: Option<Arc<crate::data::teacher_feed::TeacherFeed>>,
) -> Result<TrainLoader> {
    let (rank, world) = (group.rank(), group.world_size());
    let micro = cfg.train.batch_size / (world * cfg.train.accum_steps);
    if micro == 0 || !cfg.train.batch_size.is_multiple_of(world * cfg.train.accum_steps) {
        bail!("train.batch_size {} does not split over {world} ranks × {} accumulation steps", cfg.train.batch_size, cfg.train.accum_steps);
    }
    let parts = spec::expand_parts(&cfg.data.train)?;
    let factors = &cfg.data.upsampling_factors;
    let weights: Vec<f64> = if factors.is_empty() {
        Vec::new()
    } else {
        parts.iter().zip(factors).flat_map(|(p, &f)| std::iter::repeat_n(f, p.len())).collect()
    };
    let sources: Vec<usize> = parts.iter().enumerate().flat_map(|(i, p)| std::iter::repeat_n(i, p.len())).collect();
    let plan = ShardPlan {
        shards: parts.into_iter().flatten().collect(),
        seed: cfg.run.seed,
        shuffle: cfg.data.shuffle_shards,
        resampled: cfg.data.resampled,
        weights,
        sources,
    };
    let settings = LoaderSettings {
        image: cfg.data.image.clone(),
        batch_size: micro,
        shuffle_buffer: cfg.data.shuffle_buffer,
        seed: cfg.run.seed,
        prefetch: cfg.data.prefetch,
        nice: cfg.data.worker_nice,
        token_budget: TokenBudget::of(&cfg.data.naflex_seq_lens, cfg.data.naflex_batch_divisor, micro),
        teacher,
    };
    let placement = Placement { rank, world_size: world, worker: 0, workers: cfg.data.workers };
    TrainLoader::start(plan, placement, settings, tokenizer, start.loaders.get(rank).cloned())
}

#[cfg(test)]
mod tests {
    use super::leaf_changes;

    #[test]
    fn bf16_training_on_a_cpu_without_avx512_bf16_is_refused() {
        use crate::config::Precision;
        let cpu = candle_core::Device::Cpu;
        let err = super::cpu_bf16_training(Precision::Bf16, &cpu, false).unwrap_err().to_string();
        assert!(err.contains("AVX-512 BF16") && err.contains("train in f32"), "{err}");
        assert!(super::cpu_bf16_training(Precision::Bf16, &cpu, true).is_ok());
        assert!(super::cpu_bf16_training(Precision::F32, &cpu, false).is_ok());
    }

    /// A changed section reads as the fields that changed in it, one a line.
    #[test]
    fn a_changed_section_is_listed_field_by_field() {
        let a: toml::Value = toml::from_str("embed_dim = 16\n[vit]\npatch_size = 8\nwidth = 32\n").unwrap();
        let b: toml::Value = toml::from_str("embed_dim = 16\n[vit]\npatch_size = 4\nwidth = 32\ndepth = 2\n").unwrap();
        let mut out = Vec::new();
        leaf_changes("model", Some(&a), Some(&b), &mut out);
        assert_eq!(out, ["model.vit.depth changed from (none) to 2", "model.vit.patch_size changed from 8 to 4"]);
    }
}
