use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use align::config::Config;
use align::data::distribute::{Placement, ShardPlan};
use align::data::loader::{LoaderSettings, TrainLoader};
use align::data::spec;
use align::data::tokenizer::{captions_from_shards, train_wordpiece, TextTokenizer};
use align::util::progress::Progress;
use anyhow::Result;
use clap::Args;
use serde::Serialize;

use super::table::Table;

#[derive(Args)]
pub struct LoaderArgs {
    #[arg(long)]
    pub data: String,
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Batches to time (after one warm-up batch per worker).
    #[arg(long, default_value_t = 50)]
    pub batches: usize,
    /// Take the image transform and text settings from this config (default: ALIGN's 346 → 289).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct LoaderBench {
    images_per_second: f64,
    batches: usize,
    batch_size: usize,
    workers: usize,
    image_size: usize,
    seconds: f64,
    skipped: u64,
}

pub fn loader(a: &LoaderArgs) -> Result<()> {
    let cfg = match &a.config {
        Some(p) => Config::load(p, &a.overrides)?,
        None => Config::from_str_with_overrides("", "defaults", &a.overrides)?,
    };
    let shards = spec::expand(&a.data)?;
    let captions = captions_from_shards(&shards, 5000);
    let tok = Arc::new(TextTokenizer::new(train_wordpiece(captions.iter(), 2000, true, 1)?, cfg.text.max_len)?);
    let plan = ShardPlan { shards, seed: 0, shuffle: true, resampled: true };
    let settings = LoaderSettings {
        image: cfg.data.image.clone(),
        batch_size: a.batch,
        shuffle_buffer: cfg.data.shuffle_buffer,
        seed: 0,
        prefetch: cfg.data.prefetch,
        // Nothing competes with the loader here: its raw throughput is what is measured.
        nice: 0,
    };
    let mut loader = TrainLoader::start(plan, Placement::single(a.workers), settings, tok, None)?;
    for _ in 0..a.workers {
        loader.next_batch()?;
    }
    let bar = Progress::bar(a.batches as u64, "batches", a.json);
    let t0 = Instant::now();
    for _ in 0..a.batches {
        loader.next_batch()?;
        bar.inc(1);
    }
    let seconds = t0.elapsed().as_secs_f64();
    bar.finish();
    let r = LoaderBench {
        images_per_second: (a.batches * a.batch) as f64 / seconds,
        batches: a.batches,
        batch_size: a.batch,
        workers: a.workers,
        image_size: cfg.data.image.image_size,
        seconds,
        skipped: loader.skips().total(),
    };
    if a.json {
        return super::print_json(&r);
    }
    let mut t = Table::new(&format!("Loader: {}", a.data));
    t.row("images/s", format!("{:.1}", r.images_per_second)).row("workers", r.workers.to_string()).row("batch", r.batch_size.to_string());
    t.row("image size", r.image_size.to_string()).row("seconds", format!("{:.2}", r.seconds)).row("skipped", r.skipped.to_string());
    t.print();
    Ok(())
}

#[derive(Args)]
pub struct ModelArgs {
    /// Image tower preset (e.g. efficientnet-b0, vit-ti16).
    #[arg(long, default_value = "efficientnet-b0")]
    pub image_tower: String,
    /// Text tower preset (e.g. bert-mini).
    #[arg(long, default_value = "bert-mini")]
    pub text_tower: String,
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    #[arg(long, default_value_t = 224)]
    pub image_size: usize,
    #[arg(long, default_value_t = 64)]
    pub text_len: usize,
    /// Timed steps (after `--warmup` untimed ones).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// EfficientNet depthwise convolution: our fused op or candle's grouped conv2d.
    #[arg(long, value_enum, default_value = "fused")]
    pub depthwise: align::model::efficientnet::DepthwiseImpl,
    /// Further config overrides (`--set optimizer.kind="adamw"`).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Time per phase and per op kind (also `ALIGN_PROFILE=1`).
    #[arg(long)]
    pub profile: bool,
    /// `f32`, or `bf16` (towers in bfloat16 over f32 master weights, as `train.precision`).
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// The device's peak FLOP/s in TFLOP/s for this precision, to report model FLOPs
    /// utilisation (e.g. 989 for an H100 SXM in bf16).
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct ModelBench {
    device: String,
    precision: String,
    image_tower: String,
    text_tower: String,
    batch: usize,
    image_size: usize,
    parameters: usize,
    forward_ms: f64,
    backward_ms: f64,
    optimizer_ms: f64,
    step_ms: f64,
    #[serde(rename = "samples_per_s")]
    samples_per_second: f64,
    /// Peak resident memory of the process, in MiB (2²⁰ bytes).
    #[serde(rename = "peak_rss_mb")]
    peak_rss_mib: Option<f64>,
    /// Most GPU memory in use at the sampled points (after each phase), all processes.
    peak_gpu_mib: Option<f64>,
    /// Forward FLOPs per (image, caption) pair, counted from the architecture.
    forward_gflops_per_sample: f64,
    /// 3 × forward FLOPs × samples/s.
    model_tflops_per_s: f64,
    mfu: Option<f64>,
}

/// GPU memory in use on the device (total − free), in MiB.
fn gpu_used_mib(device: &candle_core::Device) -> Option<f64> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        let (free, total) = d.cuda_stream().context().mem_get_info().ok()?;
        return Some((total - free) as f64 / (1024.0 * 1024.0));
    }
    let _ = device;
    None
}

/// Peak resident memory of this process (Linux `VmHWM`).
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

pub fn model(a: &ModelArgs) -> Result<()> {
    if a.profile {
        align::util::profile::enable(true);
    }
    use align::model::dual_encoder::{DualEncoder, ImageSpec};
    use align::model::init::SeededVars;
    use align::model::Ctx;
    use align::train::loss::contrastive_loss;
    use align::train::optim::Optimizer;
    use candle_core::Tensor;

    let mut overrides = vec![
        format!("model.image_tower={:?}", a.image_tower),
        format!("model.text_tower={:?}", a.text_tower),
        format!("data.image.image_size={}", a.image_size),
        format!("data.image.resize={}", a.image_size),
        format!("text.max_len={}", a.text_len),
    ];
    overrides.extend(a.overrides.iter().cloned());
    overrides.push(format!("train.precision={:?}", a.precision));
    let cfg = Config::from_str_with_overrides("", "bench", &overrides)?;
    let mut spec = cfg.model_spec(30522)?;
    if let ImageSpec::EfficientNet(e) = &mut spec.image {
        e.depthwise = a.depthwise;
    }
    let device = super::default_device();
    let vm = candle_nn::VarMap::new();
    let build = |vb| DualEncoder::new(&spec, vb).map(|m| m.with_grad_checkpointing(cfg.train.grad_checkpointing));
    let model = build(SeededVars::builder(&vm, 0, &device))?;
    let vars = align::model::batch_norm::trainable_vars(&vm);
    let parameters = vars.iter().map(|(_, v)| v.elem_count()).sum();
    let mut opt = Optimizer::new(vars, cfg.optimizer.clone())?;
    let images = Tensor::randn(0f32, 1.0, (a.batch, 3, a.image_size, a.image_size), &device)?;
    let ids: Vec<u32> = (0..a.batch * a.text_len).map(|i| 1000 + (i as u32 * 7919) % 20000).collect();
    let ids = Tensor::from_vec(ids, (a.batch, a.text_len), &device)?;
    let mask = Tensor::ones((a.batch, a.text_len), candle_core::DType::U32, &device)?;
    let (mut fwd, mut bwd, mut opt_t) = (0.0, 0.0, 0.0);
    let mut peak_gpu: Option<f64> = None;
    let mut sample_gpu = || {
        if let Some(m) = gpu_used_mib(&device) {
            peak_gpu = Some(peak_gpu.map_or(m, |p: f64| p.max(m)));
        }
    };
    let compute = cfg.train.precision.compute_dtype();
    let bar = Progress::bar((a.warmup + a.steps) as u64, "steps", a.json);
    for step in 0..a.warmup + a.steps {
        if step == a.warmup {
            // Only the timed steps are profiled.
            align::util::profile::take();
        }
        device.synchronize()?;
        let t0 = Instant::now();
        // As in training: the mixed-precision view is rebuilt from the master weights every step.
        let view;
        let model = if compute == candle_core::DType::F32 {
            &model
        } else {
            view = build(SeededVars::builder_dtype(&vm, 0, compute, &device))?;
            &view
        };
        let img = model.image_embeddings(&images, &Ctx::train(step as u64))?;
        let txt = model.text_embeddings(&ids, &mask)?;
        let loss = align::util::profile::timed("loss", || contrastive_loss(&img, &txt, &img, &txt, 0, &model.logit_scale()?, 0.1))?.total;
        loss.to_scalar::<f32>()?;
        let t1 = Instant::now();
        sample_gpu();
        let grads = align::train::step::backward(model, &opt, &loss)?;
        device.synchronize()?;
        let t2 = Instant::now();
        sample_gpu();
        opt.step(&grads, 1e-4)?;
        device.synchronize()?;
        let t3 = Instant::now();
        sample_gpu();
        if step >= a.warmup {
            fwd += (t1 - t0).as_secs_f64();
            bwd += (t2 - t1).as_secs_f64();
            opt_t += (t3 - t2).as_secs_f64();
        }
        bar.inc(1);
    }
    bar.finish();
    let n = a.steps.max(1) as f64;
    let step_ms = 1000.0 * (fwd + bwd + opt_t) / n;
    let samples_per_second = a.batch as f64 * 1000.0 / step_ms;
    let flops = model.forward_flops_per_pair(a.text_len);
    let model_tflops_per_s = 3.0 * flops * samples_per_second / 1e12;
    let r = ModelBench {
        device: align::util::device::describe(&device),
        precision: a.precision.clone(),
        image_tower: a.image_tower.clone(),
        text_tower: a.text_tower.clone(),
        batch: a.batch,
        image_size: a.image_size,
        parameters,
        forward_ms: 1000.0 * fwd / n,
        backward_ms: 1000.0 * bwd / n,
        optimizer_ms: 1000.0 * opt_t / n,
        step_ms,
        samples_per_second,
        peak_rss_mib: peak_rss_mib(),
        peak_gpu_mib: peak_gpu,
        forward_gflops_per_sample: flops / 1e9,
        model_tflops_per_s,
        mfu: a.peak_tflops.map(|p| model_tflops_per_s / p),
    };
    let profile = align::util::profile::take();
    if a.json {
        if align::util::profile::enabled() {
            let regions: serde_json::Map<String, serde_json::Value> = profile
                .iter()
                .map(|(k, (secs, calls))| (k.to_string(), serde_json::json!({"ms_per_step": 1000.0 * secs / n, "calls": calls})))
                .collect();
            let mut v = serde_json::to_value(&r)?;
            v["profile"] = serde_json::Value::Object(regions);
            return super::print_json(&v);
        }
        return super::print_json(&r);
    }
    if align::util::profile::enabled() {
        println!("{}", align::util::profile::report(&profile, a.steps));
    }
    let mut t = Table::new(&format!(
        "Model step: {} + {}, batch {}, {} px, {} on {}",
        r.image_tower, r.text_tower, r.batch, r.image_size, r.precision, r.device
    ));
    t.row("parameters", format!("{:.2} M", r.parameters as f64 / 1e6));
    t.row("forward", format!("{:.1} ms", r.forward_ms))
        .row("backward", format!("{:.1} ms", r.backward_ms))
        .row("optimizer", format!("{:.1} ms", r.optimizer_ms));
    t.row("samples/s", format!("{:.2}", r.samples_per_second));
    t.row("peak RSS", r.peak_rss_mib.map_or("-".into(), |m| format!("{m:.0} MiB")));
    if let Some(m) = r.peak_gpu_mib {
        t.row("peak GPU memory", format!("{m:.0} MiB"));
    }
    t.row("forward GFLOPs / sample", format!("{:.2}", r.forward_gflops_per_sample));
    t.row("model TFLOP/s", format!("{:.3}", r.model_tflops_per_s));
    if let Some(m) = r.mfu {
        t.row("MFU", format!("{:.1}%", 100.0 * m));
    }
    t.print();
    Ok(())
}

#[derive(Args)]
pub struct DepthwiseArgs {
    #[arg(long, default_value = "efficientnet-b0")]
    pub image_tower: String,
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    #[arg(long, default_value_t = 224)]
    pub image_size: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct DepthwiseRow {
    block: usize,
    channels: usize,
    input: usize,
    kernel: usize,
    stride: usize,
    fused_ms: f64,
    candle_ms: f64,
}

/// Forward + backward of every depthwise layer of a network, our op against candle's grouped conv.
pub fn depthwise(a: &DepthwiseArgs) -> Result<()> {
    use align::model::efficientnet::{candle_depthwise, EfficientNet, EfficientNetConfig};
    use align::model::init::SeededVars;
    use align::model::ops::depthwise::depthwise_conv2d;
    use candle_core::{Tensor, Var};

    let Some(cfg) = EfficientNetConfig::preset(&a.image_tower, a.image_size) else {
        anyhow::bail!("{} is not an EfficientNet preset", a.image_tower)
    };
    let device = super::default_device();
    let net = EfficientNet::new(&cfg, SeededVars::builder(&candle_nn::VarMap::new(), 0, &device))?;
    let layers = net.depthwise_layers();
    let bar = Progress::bar(layers.len() as u64, "layers", a.json);
    let mut rows = Vec::new();
    for (block, l) in layers.iter().enumerate() {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (a.batch, l.channels, l.input, l.input), &device)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.1, (l.channels, 1, l.kernel, l.kernel), &device)?)?;
        let time = |fused: bool| -> Result<f64> {
            let t0 = Instant::now();
            let y = if fused {
                depthwise_conv2d(x.as_tensor(), w.as_tensor(), l.stride, l.pad)?
            } else {
                candle_depthwise(x.as_tensor(), w.as_tensor(), l.stride, l.pad)?
            };
            let g = y.sum_all()?.backward()?;
            g.get(x.as_tensor()).map(|t| t.dims().len()).unwrap_or(0);
            Ok(1000.0 * t0.elapsed().as_secs_f64())
        };
        time(true)?;
        rows.push(DepthwiseRow {
            block,
            channels: l.channels,
            input: l.input,
            kernel: l.kernel,
            stride: l.stride,
            fused_ms: time(true)?,
            candle_ms: time(false)?,
        });
        bar.inc(1);
    }
    bar.finish();
    let (f, c): (f64, f64) = rows.iter().fold((0.0, 0.0), |(f, c), r| (f + r.fused_ms, c + r.candle_ms));
    if a.json {
        return super::print_json(&serde_json::json!({"layers": rows, "fused_ms": f, "candle_ms": c, "speedup": c / f}));
    }
    println!(
        "{:>5} {:>8} {:>6} {:>3} {:>3} {:>10} {:>10} {:>8}",
        "block", "channels", "input", "k", "s", "fused ms", "candle ms", "speedup"
    );
    for r in &rows {
        println!(
            "{:>5} {:>8} {:>6} {:>3} {:>3} {:>10.1} {:>10.1} {:>7.1}x",
            r.block,
            r.channels,
            r.input,
            r.kernel,
            r.stride,
            r.fused_ms,
            r.candle_ms,
            r.candle_ms / r.fused_ms
        );
    }
    println!("total: fused {f:.0} ms, candle {c:.0} ms, {:.1}x (forward + backward, batch {})", c / f, a.batch);
    Ok(())
}

#[derive(Args)]
pub struct OpsArgs {
    /// Timed forward + backward calls per op (after the checked one).
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
    #[arg(long)]
    pub json: bool,
}

/// `align bench ops`: each kernel on the selected device against the CPU in f64; fails when one
/// is off by more than the tolerance.
pub fn ops(a: &OpsArgs) -> Result<()> {
    use align::model::ops::check::{check_count, check_ops, TOLERANCE};
    let device = super::default_device();
    let bar = Progress::bar(check_count() as u64, "ops", a.json);
    let checks = check_ops(&device, a.reps, |c| {
        bar.set_message(c.op.clone());
        bar.inc(1);
    })?;
    bar.finish();
    let failed: Vec<&str> = checks.iter().filter(|c| !c.passed()).map(|c| c.op.as_str()).collect();
    if a.json {
        super::print_json(&serde_json::json!({"device": align::util::device::describe(&device), "tolerance": TOLERANCE, "ops": checks}))?;
    } else {
        let mut t = Table::new(&format!(
            "ops on {} (f32) against the CPU in f64: relative error forward / backward, ms per call",
            align::util::device::describe(&device)
        ));
        for c in &checks {
            let mark = if c.passed() { "" } else { "  FAIL" };
            t.row(
                format!("{} [{}]", c.op, c.shape),
                format!("{:.1e} / {:.1e}   {:>8.3} ms{mark}", c.forward_error, c.backward_error, c.ms_per_call),
            );
        }
        t.print();
    }
    if !failed.is_empty() {
        anyhow::bail!("{} of {} ops exceed the tolerance {TOLERANCE:e}: {}", failed.len(), checks.len(), failed.join(", "));
    }
    Ok(())
}
