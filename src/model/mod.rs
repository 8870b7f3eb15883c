//! Towers and the dual encoder. Parameter names are Hugging Face's so checkpoints interoperate;
//! nothing here knows about files, shards or training.

pub mod batch_norm;
pub mod bert;
pub mod dual_encoder;
pub mod efficientnet;
pub mod init;
pub mod layers;
pub mod presets;
pub mod recompute;
pub mod vit;

/// How a forward pass runs: training (batch statistics, stochastic depth drawn from `seed`) or
/// evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ctx {
    pub train: bool,
    pub seed: u64,
    /// Whether training-mode BatchNorm updates its running statistics. Off for the embedding-only
    /// pass of cached-gradient accumulation, which runs every micro-batch twice.
    pub update_stats: bool,
}

impl Ctx {
    pub const EVAL: Ctx = Ctx { train: false, seed: 0, update_stats: false };

    pub fn train(seed: u64) -> Self {
        Ctx { train: true, seed, update_stats: true }
    }
}
