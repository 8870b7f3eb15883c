//! Towers and the dual encoder. Parameter names are Hugging Face's so checkpoints interoperate;
//! nothing here knows about files, shards or training.

pub mod batch_norm;
pub mod bert;
pub mod clip;
pub mod dual_encoder;
pub mod efficientnet;
pub mod init;
pub mod layers;
pub mod lock;
pub mod naflex;
pub mod pos_embed;
pub mod prenorm;
pub mod presets;
pub mod recompute;
pub mod siglip;
pub mod vit;

/// A forward-only model's weights declared unchanging while it lives, so that the products that
/// read them pack each weight once instead of at every call.
pub use crate::ops::kernels::frozen::{freeze as freeze_weights, Frozen as FrozenWeights};

/// How a forward pass runs: training (batch statistics, stochastic depth drawn from `seed`, patch
/// dropout drawn per `masking`) or evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ctx {
    pub train: bool,
    pub seed: u64,
    /// Whether training-mode BatchNorm updates its running statistics. Off for the embedding-only
    /// pass of cached-gradient accumulation, which runs every micro-batch twice.
    pub update_stats: bool,
    /// The ViT's patch dropout, when it applies to this pass (the model's rate decides how many
    /// tokens it drops).
    pub masking: Option<Masking>,
}

/// Where a batch's patch-dropout draws come from: row `i` draws from `(seed, first_row + i)`. With
/// `first_row` the row's index in the global batch, a row keeps the same tokens whichever rank or
/// micro-batch holds it, so sharding and accumulation leave the gradient unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Masking {
    pub seed: u64,
    pub first_row: u64,
}

impl Ctx {
    pub const EVAL: Ctx = Ctx { train: false, seed: 0, update_stats: false, masking: None };

    /// A training pass, patch dropout included (drawn from `seed`, rows numbered from 0).
    pub fn train(seed: u64) -> Self {
        Ctx { train: true, seed, update_stats: true, masking: Some(Masking { seed, first_row: 0 }) }
    }
}
