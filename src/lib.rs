//! align: contrastive image-text dual encoders (ALIGN, CLIP) trained on candle.
//!
//! The modules follow a sample's journey: `data` (shards to batches), `model` (towers and the dual
//! encoder), `train` (loss, optimisers, the loop, checkpoints) and `eval` (retrieval, zero-shot).

pub mod config;
pub mod config_reference;
pub mod data;
pub mod eval;
pub mod io;
pub mod model;
pub mod ops;
pub mod plot;
pub mod train;
pub mod util;
