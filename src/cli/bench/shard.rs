//! `align bench shard`: what each data-parallel rank holds of the optimizer state and of the
//! summed gradients under `train.shard = none | optimizer | gradients`, at several numbers of
//! ranks, measured on thread ranks running the real exchange and update (one step from synthetic
//! gradients) rather than computed from a formula.

use std::sync::Arc;
use std::time::{Duration, Instant};

use align::config::{Config, ShardMode};
use align::train::collective::{Collective, ThreadGroup};
use align::train::optim::{Grads, Optimizer};
use anyhow::{bail, Result};
use candle_core::{DType, Device};
use clap::Args;
use serde::Serialize;

use crate::cli::table::Table;

#[derive(Args)]
pub struct ShardArgs {
    /// Image tower preset (e.g. vit-b16, efficientnet-b7).
    #[arg(long, default_value = "vit-b16")]
    pub image_tower: String,
    /// Text tower preset (e.g. bert-base).
    #[arg(long, default_value = "bert-base")]
    pub text_tower: String,
    /// Image side in pixels (sets the ViT's position embeddings).
    #[arg(long, default_value_t = 224)]
    pub image_size: usize,
    /// Numbers of thread ranks to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub ranks: Vec<usize>,
    /// Further config overrides (`--set optimizer.kind="lamb"`).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One configuration's figures, the most any rank holds.
#[derive(Serialize)]
struct ShardRow {
    ranks: usize,
    shard: &'static str,
    parameters: usize,
    weights_mib: f64,
    /// Adam's two moments kept by the most loaded rank.
    optimizer_mib: f64,
    /// Summed gradients a rank keeps for its update, after the exchange.
    gradients_mib: f64,
    /// What each rank sends in a step's exchanges (gradients and, sharded, the new weights), as
    /// ring algorithms count it.
    exchanged_mib: f64,
    /// The exchange and update of one step on thread ranks (host memory, not a network).
    step_ms: f64,
}

pub fn shard(a: &ShardArgs) -> Result<()> {
    let mut overrides = vec![
        format!("model.image_tower={:?}", a.image_tower),
        format!("model.text_tower={:?}", a.text_tower),
        "model.image_projection=true".into(),
        format!("data.image.image_size={}", a.image_size),
        format!("data.image.resize={}", a.image_size),
    ];
    overrides.extend(a.overrides.iter().cloned());
    let cfg = Config::from_str_with_overrides("", "bench", &overrides)?;
    let spec = align::train::start::scratch_spec(&cfg, 30522)?;
    let mut rows = Vec::new();
    for &world in &a.ranks {
        if world == 0 {
            bail!("--ranks: a number of ranks is at least 1");
        }
        for mode in [ShardMode::None, ShardMode::Optimizer, ShardMode::Gradients] {
            if world == 1 && mode != ShardMode::None {
                continue;
            }
            rows.push(measure(&cfg, &spec, world, mode)?);
        }
    }
    if a.json {
        return crate::cli::print_json(&serde_json::json!({"image_tower": a.image_tower, "text_tower": a.text_tower, "rows": rows}));
    }
    let p = rows.first().map_or(0, |r| r.parameters);
    let mut t = Table::new(&format!(
        "{} + {}: {:.1}M trained parameters; per rank (the most loaded), f32 weights and Adam moments",
        a.image_tower,
        a.text_tower,
        p as f64 / 1e6
    ));
    t.row("ranks  shard       ", "weights MiB  optimizer MiB  gradients MiB  sent MiB  step ms");
    for r in &rows {
        t.row(
            format!("{:>5}  {:<10}", r.ranks, r.shard),
            format!(
                "{:>11.0}  {:>13.0}  {:>13.0}  {:>8.0}  {:>7.0}",
                r.weights_mib, r.optimizer_mib, r.gradients_mib, r.exchanged_mib, r.step_ms
            ),
        );
    }
    t.print();
    Ok(())
}

const MIB: f64 = (1 << 20) as f64;

/// `world` thread ranks, each with the model's weights and an optimizer sharded per `mode`,
/// exchanging one step's synthetic gradients and updating.
fn measure(cfg: &Config, spec: &align::model::dual_encoder::ModelSpec, world: usize, mode: ShardMode) -> Result<ShardRow> {
    use align::model::init::SeededVars;
    let groups = ThreadGroup::new(world, Duration::from_secs(3600));
    let results: Vec<Result<(usize, usize, usize, f64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || -> Result<(usize, usize, usize, f64)> {
                    let group: Arc<dyn Collective> = Arc::new(g);
                    let vm = candle_nn::VarMap::new();
                    align::model::dual_encoder::DualEncoder::new(spec, SeededVars::builder(&vm, 0, &Device::Cpu))?;
                    let (vars, _) = align::model::lock::split(align::model::batch_norm::trainable_vars(&vm), spec, &cfg.model.lock());
                    let mut opt = Optimizer::new(vars, cfg.optimizer.clone())?;
                    opt.shard(mode, group.clone());
                    let params: usize = opt.params().iter().map(|p| p.var.elem_count()).sum();
                    let grads = Grads(
                        opt.params()
                            .iter()
                            .enumerate()
                            .map(|(i, p)| Ok(Some(align::util::rng::randn(i as u64, 0.0, 1e-3, p.var.shape(), DType::F32, &Device::Cpu)?)))
                            .collect::<Result<_>>()?,
                    );
                    group.barrier()?;
                    let t0 = Instant::now();
                    let reduced = opt.reduce_gradients(grads, &group, 1.0 / world as f64)?;
                    let kept: usize = reduced.0.iter().flatten().map(|g| g.elem_count()).sum();
                    opt.step(&reduced, 1e-4)?;
                    group.barrier()?;
                    Ok((params, opt.state_bytes(), kept, t0.elapsed().as_secs_f64()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))).collect()
    });
    let results = results.into_iter().collect::<Result<Vec<_>>>()?;
    let params = results[0].0;
    let most = |f: fn(&(usize, usize, usize, f64)) -> usize| results.iter().map(f).max().unwrap_or(0);
    let (state, kept) = (most(|r| r.1), most(|r| r.2));
    // Traffic per rank as the ring algorithms NCCL uses count it: an all-reduce sends 2(N-1)/N
    // of the gradients, a reduce-scatter or an all-gather (N-1)/N; stage 2 reduce-scatters once
    // per micro-batch.
    let share = (world - 1) as f64 / world as f64 * params as f64;
    let exchanged = match mode {
        ShardMode::None => 2.0 * share,
        ShardMode::Optimizer => 2.0 * share,
        ShardMode::Gradients => (cfg.train.accum_steps as f64 + 1.0) * share,
    };
    Ok(ShardRow {
        ranks: world,
        shard: mode.name(),
        parameters: params,
        weights_mib: params as f64 * 4.0 / MIB,
        optimizer_mib: state as f64 / MIB,
        gradients_mib: kept as f64 * 4.0 / MIB,
        exchanged_mib: exchanged * 4.0 / MIB,
        step_ms: results.iter().map(|r| r.3).fold(0.0, f64::max) * 1e3,
    })
}
