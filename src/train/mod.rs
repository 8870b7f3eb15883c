//! Training: what a run starts from (`start`), the losses, the exchange between ranks, optimisers
//! and schedules, the moving average, and the run itself (`trainer`).

pub mod collective;
pub mod distill_loss;
pub mod ema;
pub mod gather;
pub mod length;
pub mod loss;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod optim;
pub mod rendezvous;
pub mod schedule;
pub mod shard;
pub mod sigmoid_loss;
pub mod start;
pub mod step;
pub mod trainer;
pub mod validation;
