//! Towers and the dual encoder. Parameter names are Hugging Face's so checkpoints interoperate;
//! nothing here knows about files, shards or training.

pub mod batch_norm;
pub mod bert;
pub mod config;
pub mod dual_encoder;
pub mod efficientnet;
pub mod init;
pub mod layers;
pub mod ops;
pub mod vit;

/// How a forward pass runs: training (batch statistics, stochastic depth drawn from `seed`) or
/// evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ctx {
    pub train: bool,
    pub seed: u64,
}

impl Ctx {
    pub const EVAL: Ctx = Ctx { train: false, seed: 0 };

    pub fn train(seed: u64) -> Self {
        Ctx { train: true, seed }
    }
}
