//! `align bench loss`: the sigmoid loss over thread ranks, its texts passed around the ring or
//! gathered, with the time per forward + backward and the process's peak memory. Run each form in
//! its own process: the peak is the process's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use align::config::Exchange;
use align::train::collective::{Collective, ThreadGroup};
use align::train::sigmoid_loss::sigmoid_loss;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var};
use clap::Args;
use serde::Serialize;

use crate::cli::table::Table;

#[derive(Args)]
pub struct LossArgs {
    /// `shift` (the ring) or `gather`.
    #[arg(long, default_value = "shift")]
    pub dist_impl: String,
    /// Ranks, as threads of this process.
    #[arg(long, default_value_t = 8)]
    pub world: usize,
    /// The global batch (pairs over all ranks).
    #[arg(long, default_value_t = 8192)]
    pub batch: usize,
    /// Embedding width.
    #[arg(long, default_value_t = 256)]
    pub dim: usize,
    /// Timed forward + backward steps.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct LossBench {
    dist_impl: String,
    world: usize,
    global_batch: usize,
    dim: usize,
    /// Forward + backward of the loss, per step (all ranks at once).
    step_ms: f64,
    /// Resident memory once every rank holds its embeddings, before the first loss.
    rss_before_mib: Option<f64>,
    /// Peak resident memory of the process.
    peak_rss_mib: Option<f64>,
    /// One rank's logits block at a time, from the shapes (f32).
    logits_block_mib: f64,
}

pub fn loss(a: &LossArgs) -> Result<()> {
    let exchange = match a.dist_impl.as_str() {
        "shift" => Exchange::Shift,
        "gather" => Exchange::Gather,
        other => bail!("--dist-impl {other}: use shift or gather"),
    };
    if a.world == 0 || !a.batch.is_multiple_of(a.world) {
        bail!("--batch {} does not split over {} ranks", a.batch, a.world);
    }
    let local = a.batch / a.world;
    let groups = ThreadGroup::new(a.world, Duration::from_secs(600));
    let ready = Arc::new(std::sync::Barrier::new(a.world + 1));
    let go = Arc::new(std::sync::Barrier::new(a.world + 1));
    let (steps, dim) = (a.steps, a.dim);
    let handles: Vec<_> = groups
        .into_iter()
        .map(|g| {
            let (ready, go) = (ready.clone(), go.clone());
            std::thread::spawn(move || -> Result<()> {
                let rank = g.rank() as u64;
                let group: Arc<dyn Collective> = Arc::new(g);
                let unit = |seed: u64| -> Result<Var> {
                    let x = align::util::rng::randn(seed, 0.0, 1.0, (local, dim), DType::F32, &Device::Cpu)?;
                    Ok(Var::from_tensor(&x.broadcast_div(&x.sqr()?.sum_keepdim(1)?.sqrt()?)?)?)
                };
                let (img, txt) = (unit(2 * rank)?, unit(2 * rank + 1)?);
                let scale = Var::from_tensor(&Tensor::new(10f32.ln(), &Device::Cpu)?)?;
                let bias = Var::from_tensor(&Tensor::new(-10f32, &Device::Cpu)?)?;
                ready.wait();
                go.wait();
                for _ in 0..steps {
                    let parts = sigmoid_loss(&img, &txt, &scale.exp()?, &bias, &group, exchange)?;
                    let grads = parts.total.backward()?;
                    anyhow::ensure!(grads.get(&img).is_some() && grads.get(&txt).is_some(), "no embedding gradient");
                }
                Ok(())
            })
        })
        .collect();
    ready.wait();
    let rss_before_mib = super::model::rss_mib("VmRSS:");
    go.wait();
    let t0 = Instant::now();
    for h in handles {
        h.join().map_err(|_| anyhow::anyhow!("a rank panicked"))??;
    }
    let r = LossBench {
        dist_impl: a.dist_impl.clone(),
        world: a.world,
        global_batch: a.batch,
        dim: a.dim,
        step_ms: t0.elapsed().as_secs_f64() * 1e3 / a.steps.max(1) as f64,
        rss_before_mib,
        peak_rss_mib: super::model::rss_mib("VmHWM:"),
        logits_block_mib: local as f64 * if exchange == Exchange::Shift { local } else { a.batch } as f64 * 4.0 / (1 << 20) as f64,
    };
    if a.json {
        return crate::cli::print_json(&r);
    }
    let mut t =
        Table::new(&format!("sigmoid loss, {} over {} thread ranks, global batch {}, dim {}", r.dist_impl, r.world, r.global_batch, r.dim));
    t.row("step (forward + backward)", format!("{:.1} ms", r.step_ms));
    t.row("logits block per rank", format!("{:.1} MiB", r.logits_block_mib));
    let mib = |m: Option<f64>| m.map_or("-".into(), |m| format!("{m:.0} MiB"));
    t.row("RSS before the loss", mib(r.rss_before_mib));
    t.row("peak RSS", mib(r.peak_rss_mib));
    t.print();
    Ok(())
}
