//! `align bench shard`: what each data-parallel rank holds of the optimizer state and of the
//! summed gradients under `train.shard = none | optimizer | gradients`, at several numbers of
//! ranks: the buffers the optimizer allocates when training shards it, not a formula (the deal of
//! tensors to ranks is what sets them). The traffic column counts, for NCCL's ring algorithms,
//! what each setting's exchanges send.

use std::sync::Arc;
use std::time::Duration;

use align::config::{Config, ShardMode};
use align::train::collective::ThreadGroup;
use align::train::optim::Optimizer;
use anyhow::{bail, Result};
use candle_core::Device;
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
    /// NCCL's ring algorithms count it, padding included.
    exchanged_mib: f64,
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
    let vm = candle_nn::VarMap::new();
    align::model::dual_encoder::DualEncoder::new(&spec, align::model::init::SeededVars::builder(&vm, 0, &Device::Cpu))?;
    let (vars, _) = align::model::lock::split(align::model::batch_norm::trainable_vars(&vm), &spec, &cfg.model.lock());
    let mut rows = Vec::new();
    for &world in &a.ranks {
        if world == 0 {
            bail!("--ranks: a number of ranks is at least 1");
        }
        for mode in [ShardMode::None, ShardMode::Optimizer, ShardMode::Gradients] {
            if world == 1 && mode != ShardMode::None {
                continue;
            }
            rows.push(measure(&cfg, &vars, world, mode)?);
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
    t.row("ranks  shard       ", "weights MiB  optimizer MiB  gradients MiB  sent MiB");
    for r in &rows {
        t.row(
            format!("{:>5}  {:<10}", r.ranks, r.shard),
            format!("{:>11.0}  {:>13.0}  {:>13.0}  {:>8.0}", r.weights_mib, r.optimizer_mib, r.gradients_mib, r.exchanged_mib),
        );
    }
    t.print();
    Ok(())
}

const MIB: f64 = (1 << 20) as f64;

/// Every rank of `world`: the optimizer it builds over the model's variables, sharded per
/// `mode` as training shards it (each rank a handle of a real group of `world`), and what it then
/// holds: the moments it allocated and the summed gradients it receives (its own tensors').
/// Ranks are measured one after another, sharing one copy of the weights: a host with room for
/// N copies of a large model is not needed to learn what each would hold.
fn measure(cfg: &Config, vars: &[(String, candle_core::Var)], world: usize, mode: ShardMode) -> Result<ShardRow> {
    let mut most: (usize, usize) = (0, 0);
    let mut params = 0;
    for group in ThreadGroup::new(world, Duration::from_secs(1)) {
        let opt = Optimizer::sharded(vars.to_vec(), cfg.optimizer.clone(), mode, Arc::new(group))?;
        params = opt.params().iter().map(|p| p.var.elem_count()).sum();
        let state = opt.state_bytes();
        let owned = if opt.sharding().is_some() { state / 8 } else { params };
        most = (most.0.max(state), most.1.max(owned));
    }
    let (state, kept) = most;
    // Traffic per rank as NCCL's ring algorithms count it: an all-reduce sends 2(N-1)/N of the
    // buffer; a reduce-scatter or an all-gather (N-1) segments, each padded to the largest rank's
    // share (NCCL gives every rank the same count), so an unbalanced deal costs traffic too.
    // Stage 2 reduce-scatters once per micro-batch.
    let (n, largest) = ((world - 1) as f64, kept as f64);
    let exchanged = match mode {
        ShardMode::None => 2.0 * n / world as f64 * params as f64,
        ShardMode::Optimizer => 2.0 * n * largest,
        ShardMode::Gradients => (cfg.train.accum_steps as f64 + 1.0) * n * largest,
    };
    Ok(ShardRow {
        ranks: world,
        shard: mode.name(),
        parameters: params,
        weights_mib: params as f64 * 4.0 / MIB,
        optimizer_mib: state as f64 / MIB,
        gradients_mib: kept as f64 * 4.0 / MIB,
        exchanged_mib: exchanged * 4.0 / MIB,
    })
}
