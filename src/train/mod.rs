//! Training: the loss, optimisers and schedules, checkpoints, and the loop.

pub mod loss;
pub mod optim;
pub mod schedule;
