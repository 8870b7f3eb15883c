//! `align bench`: the training step (`model`), forward-only embedding (`embed`), the sigmoid loss across ranks (`loss`),
//! what each rank holds with sharded optimizer state (`shard`), the
//! loader (`loader`), EfficientNet's depthwise layers (`depthwise`), the matrix product kernels
//! against the CPU's ceiling (`products`) and every per-op kernel on a device against the CPU
//! (`ops`).

mod depthwise;
mod embed;
mod loader;
mod loss;
mod model;
mod ops;
mod products;
mod shard;

pub use depthwise::{depthwise, DepthwiseArgs};
pub use embed::{embed, EmbedArgs};
pub use loader::{loader, LoaderArgs};
pub use loss::{loss, LossArgs};
pub use model::{model, ModelArgs};
pub use products::{products, ProductsArgs};
pub use shard::{shard, ShardArgs};

use align::util::progress::Progress;
use anyhow::Result;
use clap::Args;

use crate::cli::table::Table;

#[derive(Args)]
pub struct OpsArgs {
    /// Timed forward + backward calls per op (after the checked one).
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `align bench ops`: each kernel on the selected device against the CPU in f64; fails when one
/// is off by more than the tolerance.
pub fn ops(a: &OpsArgs) -> Result<()> {
    // This command checks align's kernels, whatever ALIGN_KERNELS says for training.
    align::ops::set_gpu_kernels(align::ops::GpuKernels::Align);
    use ops::{check_count, check_ops, TOLERANCE};
    let device = crate::cli::default_device();
    let bar = Progress::bar(check_count() as u64, "ops", a.json);
    let checks = check_ops(&device, a.reps, |c| {
        bar.set_message(c.op.clone());
        bar.inc(1);
    })?;
    bar.finish();
    let failed: Vec<&str> = checks.iter().filter(|c| !c.passed()).map(|c| c.op.as_str()).collect();
    if a.json {
        crate::cli::print_json(
            &serde_json::json!({"device": align::util::device::describe(&device), "tolerance": TOLERANCE, "ops": checks}),
        )?;
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
