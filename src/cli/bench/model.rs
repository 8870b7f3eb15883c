//! `align bench model`: forward, backward and optimiser time, throughput, peak memory and model
//! FLOPs utilisation of one training step; `scripts/bench_torch.py` is the PyTorch side.

use std::time::Instant;

use align::config::Config;
use align::util::progress::Progress;
use anyhow::Result;
use clap::Args;
use serde::Serialize;

use crate::cli::table::Table;

#[derive(Args)]
pub struct ModelArgs {
    /// Image tower preset (e.g. efficientnet-b0, vit-ti16).
    #[arg(long, default_value = "efficientnet-b0")]
    pub image_tower: String,
    /// Text tower preset (e.g. bert-mini).
    #[arg(long, default_value = "bert-mini")]
    pub text_tower: String,
    /// Pairs per step.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Image side in pixels.
    #[arg(long, default_value_t = 224)]
    pub image_size: usize,
    /// Tokens per caption.
    #[arg(long, default_value_t = 64)]
    pub text_len: usize,
    /// Timed steps (after `--warmup` untimed ones).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Untimed steps before the timed ones.
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
    /// `f32`, or `bf16` (as `train.precision`: on the CPU the kernels' large products on bf16
    /// operands, on a GPU the towers in bfloat16, over f32 master weights).
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// The device's peak FLOP/s in TFLOP/s for this precision, to report model FLOPs
    /// utilisation (e.g. 989 for an H100 SXM in bf16).
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// A distillation teacher (any checkpoint align reads): also time what it adds to a step,
    /// online (its forward pass on the batch at its own image size and text length) against
    /// stored embeddings (the distillation loss alone).
    #[arg(long)]
    pub teacher: Option<std::path::PathBuf>,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// What a distillation teacher adds to a step.
#[derive(Serialize)]
struct TeacherBench {
    teacher: String,
    /// The teacher's forward pass on the batch (images and captions): an online teacher's cost.
    forward_ms: f64,
    /// The distillation loss and its backward pass: all that stored embeddings cost.
    loss_ms: f64,
    online_step_ms: f64,
    stored_step_ms: f64,
}

#[derive(Serialize)]
struct ModelBench {
    device: String,
    precision: String,
    /// Where bf16 products run on the CPU: the instruction their multiply-adds take.
    #[serde(skip_serializing_if = "Option::is_none")]
    bf16_instruction: Option<&'static str>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    distillation: Option<TeacherBench>,
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
    rss_mib("VmHWM:")
}

/// A memory figure of this process from `/proc/self/status` (`VmRSS:`, `VmHWM:`), in MiB.
pub(super) fn rss_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

pub fn model(a: &ModelArgs) -> Result<()> {
    if a.profile {
        align::util::profile::enable(true);
    }
    if a.precision == "bf16" && crate::cli::default_device().is_cpu() && !align::ops::kernels::bf16_gemm::available() {
        anyhow::bail!("--precision bf16 on the CPU needs AVX-512 BF16 (avx512_bf16 in /proc/cpuinfo), which this one lacks");
    }
    let mut bench = Bench::new(a)?;
    let (times, peak_gpu) = bench.run(a)?;
    let mut r = bench.result(a, times, peak_gpu);
    if let Some(path) = &a.teacher {
        r.distillation = Some(teacher_cost(&bench, a, path, r.step_ms)?);
    }
    report(a, &r)
}

/// Times a teacher's forward pass on a batch of `a.batch` random images and captions at its own
/// sizes, and the distillation loss of the student's embeddings against its embeddings.
fn teacher_cost(bench: &Bench, a: &ModelArgs, path: &std::path::Path, step_ms: f64) -> Result<TeacherBench> {
    use align::train::distill_loss::{distill_loss, DistillLoss, TeacherLogits};
    use candle_core::Tensor;
    let t = align::io::load::load_model(path, &bench.device)?;
    let layout = align::data::batch::ImageLayout::of(&t.usage.image);
    let images = Tensor::randn(0f32, 1.0, layout.numel * a.batch, &bench.device)?;
    let images = layout.tensor(images.to_vec1::<f32>()?, a.batch, &bench.device)?;
    let len = t.tokenizer.max_len();
    let ids: Vec<u32> = (0..a.batch * len).map(|i| 5 + (i as u32 * 7919) % (t.tokenizer.vocab_size() as u32 - 5)).collect();
    let ids = Tensor::from_vec(ids, (a.batch, len), &bench.device)?;
    let mask = Tensor::ones((a.batch, len), candle_core::DType::U32, &bench.device)?;
    let group: std::sync::Arc<dyn align::train::collective::Collective> = std::sync::Arc::new(align::train::collective::SingleProcess);
    let logits = TeacherLogits { scale: 100.0, bias: None };
    let (mut forward, mut loss) = (0.0, 0.0);
    for rep in 0..a.warmup + a.steps {
        bench.device.synchronize()?;
        let t0 = Instant::now();
        // On the CPU on the compute pool, as the training step that runs it does.
        let teacher = || -> candle_core::Result<_> {
            Ok((t.model.image_embeddings(&images, &align::model::Ctx::EVAL)?.detach(), t.model.text_embeddings(&ids, &mask)?.detach()))
        };
        let (ti, tt) = align::ops::pool::compute_on(&bench.device, teacher)?;
        bench.device.synchronize()?;
        let t1 = Instant::now();
        // The student's embeddings as leaves: the loss and its gradient, nothing of the towers.
        let img = candle_core::Var::from_tensor(&bench.model.image_embeddings(&bench.images, &align::model::Ctx::EVAL)?.detach())?;
        let txt = candle_core::Var::from_tensor(&bench.model.text_embeddings(&bench.ids, &bench.mask)?.detach())?;
        bench.device.synchronize()?;
        let t2 = Instant::now();
        let l = distill_loss(
            img.as_tensor(),
            txt.as_tensor(),
            &ti,
            &tt,
            &bench.model.logit_scale()?,
            None,
            logits,
            DistillLoss::CrossEntropy,
            &group,
        )?;
        l.backward()?;
        bench.device.synchronize()?;
        if rep >= a.warmup {
            forward += (t1 - t0).as_secs_f64();
            loss += t2.elapsed().as_secs_f64();
        }
    }
    let n = a.steps.max(1) as f64;
    let (forward_ms, loss_ms) = (1000.0 * forward / n, 1000.0 * loss / n);
    Ok(TeacherBench {
        teacher: t.dir.display().to_string(),
        forward_ms,
        loss_ms,
        online_step_ms: step_ms + forward_ms + loss_ms,
        stored_step_ms: step_ms + loss_ms,
    })
}

/// The model, its optimizer and one synthetic batch.
struct Bench {
    cfg: Config,
    spec: align::model::dual_encoder::ModelSpec,
    vm: candle_nn::VarMap,
    model: align::model::dual_encoder::DualEncoder,
    opt: align::train::optim::Optimizer,
    parameters: usize,
    device: candle_core::Device,
    images: candle_core::Tensor,
    ids: candle_core::Tensor,
    mask: candle_core::Tensor,
}

/// Seconds spent in forward, backward and the optimiser over the timed steps.
struct Times {
    forward: f64,
    backward: f64,
    optimizer: f64,
}

impl Bench {
    fn new(a: &ModelArgs) -> Result<Bench> {
        use align::model::dual_encoder::ImageSpec;
        use align::model::init::SeededVars;
        use candle_core::Tensor;

        let mut overrides = vec![
            format!("model.image_tower={:?}", a.image_tower),
            format!("model.text_tower={:?}", a.text_tower),
            format!("data.image.image_size={}", a.image_size),
            format!("data.image.resize={}", a.image_size),
            format!("text.max_len={}", a.text_len),
            // Any tower at any embedding size; `--set model.image_projection=false` for ALIGN's.
            "model.image_projection=true".into(),
        ];
        overrides.extend(a.overrides.iter().cloned());
        overrides.push(format!("train.precision={:?}", a.precision));
        let cfg = Config::from_str_with_overrides("", "bench", &overrides)?;
        let mut spec = align::train::start::scratch_spec(&cfg, 30522)?;
        if let ImageSpec::EfficientNet(e) = &mut spec.image {
            e.depthwise = a.depthwise;
        }
        let device = crate::cli::default_device();
        let vm = candle_nn::VarMap::new();
        let model = Self::build(&cfg, &spec, SeededVars::builder(&vm, 0, &device))?;
        let (vars, _) = align::model::lock::split(align::model::batch_norm::trainable_vars(&vm), &spec, &cfg.model.lock());
        let parameters = vars.iter().map(|(_, v)| v.elem_count()).sum();
        let opt = align::train::optim::Optimizer::new(vars, cfg.optimizer.clone())?;
        let images = Tensor::randn(0f32, 1.0, (a.batch, 3, a.image_size, a.image_size), &device)?;
        let ids: Vec<u32> = (0..a.batch * a.text_len).map(|i| 1000 + (i as u32 * 7919) % 20000).collect();
        let ids = Tensor::from_vec(ids, (a.batch, a.text_len), &device)?;
        let mask = Tensor::ones((a.batch, a.text_len), candle_core::DType::U32, &device)?;
        Ok(Bench { cfg, spec, vm, model, opt, parameters, device, images, ids, mask })
    }

    fn build(
        cfg: &Config,
        spec: &align::model::dual_encoder::ModelSpec,
        vb: candle_nn::VarBuilder,
    ) -> Result<align::model::dual_encoder::DualEncoder> {
        let graph = align::model::lock::image_graph(spec, &cfg.model.lock());
        Ok(align::model::dual_encoder::DualEncoder::new(spec, vb)?
            .with_grad_checkpointing(cfg.train.grad_checkpointing)
            .with_image_graph(graph))
    }

    /// Warm-up and timed steps; the most GPU memory seen after any phase.
    fn run(&mut self, a: &ModelArgs) -> Result<(Times, Option<f64>)> {
        let mut times = Times { forward: 0.0, backward: 0.0, optimizer: 0.0 };
        let mut peak_gpu: Option<f64> = None;
        let bar = Progress::bar((a.warmup + a.steps) as u64, "steps", a.json);
        for step in 0..a.warmup + a.steps {
            if step == a.warmup {
                // Only the timed steps are profiled.
                align::util::profile::take();
            }
            // As in training: on the CPU, bf16 is the f32 towers with bf16 matrix products.
            let cpu_bf16 = self.device.is_cpu() && self.cfg.train.precision == align::config::Precision::Bf16;
            let device = self.device.clone();
            let timed = || {
                if cpu_bf16 {
                    align::ops::kernels::bf16_gemm::with_bf16_products(|| self.step(step, &mut peak_gpu))
                } else {
                    self.step(step, &mut peak_gpu)
                }
            };
            // As in training: a lone CPU rank's step runs on the compute pool.
            let [forward, backward, optimizer] = align::ops::pool::compute_on(&device, timed)?;
            if step >= a.warmup {
                times.forward += forward;
                times.backward += backward;
                times.optimizer += optimizer;
            }
            bar.inc(1);
        }
        bar.finish();
        Ok((times, peak_gpu))
    }

    /// One training step, its phases' seconds.
    fn step(&mut self, step: usize, peak_gpu: &mut Option<f64>) -> Result<[f64; 3]> {
        use align::model::init::SeededVars;
        use align::train::loss::contrastive_loss;

        let mut sample_gpu = || {
            if let Some(m) = gpu_used_mib(&self.device) {
                *peak_gpu = Some(peak_gpu.map_or(m, |p: f64| p.max(m)));
            }
        };
        let compute = self.cfg.train.precision.compute_dtype();
        self.device.synchronize()?;
        let t0 = Instant::now();
        // As in training: the mixed-precision view is rebuilt from the master weights every step.
        let view;
        let model = if compute == candle_core::DType::F32 || self.device.is_cpu() {
            &self.model
        } else {
            view = Self::build(&self.cfg, &self.spec, SeededVars::builder_dtype(&self.vm, 0, compute, &self.device))?;
            &view
        };
        let img = model.image_embeddings(&self.images, &align::model::Ctx::train(step as u64))?;
        let txt = model.text_embeddings(&self.ids, &self.mask)?;
        let loss = align::util::profile::timed("loss", || contrastive_loss(&img, &txt, &img, &txt, 0, &model.logit_scale()?, 0.1))?.total;
        loss.to_scalar::<f32>()?;
        let t1 = Instant::now();
        sample_gpu();
        let grads = align::train::step::backward(model, &self.opt, &loss)?;
        self.device.synchronize()?;
        let t2 = Instant::now();
        sample_gpu();
        self.opt.step(&grads, 1e-4)?;
        self.device.synchronize()?;
        let t3 = Instant::now();
        sample_gpu();
        Ok([(t1 - t0).as_secs_f64(), (t2 - t1).as_secs_f64(), (t3 - t2).as_secs_f64()])
    }

    fn result(&self, a: &ModelArgs, t: Times, peak_gpu: Option<f64>) -> ModelBench {
        let n = a.steps.max(1) as f64;
        let step_ms = 1000.0 * (t.forward + t.backward + t.optimizer) / n;
        let samples_per_second = a.batch as f64 * 1000.0 / step_ms;
        let flops = self.model.forward_flops_per_pair(a.text_len);
        let model_tflops_per_s = 3.0 * flops * samples_per_second / 1e12;
        ModelBench {
            device: align::util::device::describe(&self.device),
            precision: a.precision.clone(),
            bf16_instruction: (self.device.is_cpu() && self.cfg.train.precision == align::config::Precision::Bf16)
                .then(super::products::bf16_products_instruction),
            image_tower: a.image_tower.clone(),
            text_tower: a.text_tower.clone(),
            batch: a.batch,
            image_size: a.image_size,
            parameters: self.parameters,
            forward_ms: 1000.0 * t.forward / n,
            backward_ms: 1000.0 * t.backward / n,
            optimizer_ms: 1000.0 * t.optimizer / n,
            step_ms,
            samples_per_second,
            peak_rss_mib: peak_rss_mib(),
            peak_gpu_mib: peak_gpu,
            forward_gflops_per_sample: flops / 1e9,
            model_tflops_per_s,
            mfu: a.peak_tflops.map(|p| model_tflops_per_s / p),
            distillation: None,
        }
    }
}

/// The result as JSON (with the profile's regions per step when profiling) or as a table.
fn report(a: &ModelArgs, r: &ModelBench) -> Result<()> {
    let profile = align::util::profile::take();
    let n = a.steps.max(1) as f64;
    if a.json {
        if align::util::profile::enabled() {
            let regions: serde_json::Map<String, serde_json::Value> = profile
                .iter()
                .map(|(k, (secs, calls))| (k.to_string(), serde_json::json!({"ms_per_step": 1000.0 * secs / n, "calls": calls})))
                .collect();
            let mut v = serde_json::to_value(r)?;
            v["profile"] = serde_json::Value::Object(regions);
            return crate::cli::print_json(&v);
        }
        return crate::cli::print_json(r);
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
    if let Some(i) = r.bf16_instruction {
        t.row("bf16 products on", i);
    }
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
    if let Some(d) = &r.distillation {
        t.row("teacher", d.teacher.clone())
            .row("  its forward pass (online)", format!("{:.1} ms", d.forward_ms))
            .row("  distillation loss", format!("{:.2} ms", d.loss_ms))
            .row(
                "  step, online teacher",
                format!("{:.1} ms ({:.2} samples/s)", d.online_step_ms, a.batch as f64 * 1000.0 / d.online_step_ms),
            )
            .row(
                "  step, stored embeddings",
                format!("{:.1} ms ({:.2} samples/s)", d.stored_step_ms, a.batch as f64 * 1000.0 / d.stored_step_ms),
            );
    }
    t.print();
    Ok(())
}
