//! align: contrastive image-text dual encoders (ALIGN, CLIP) trained on candle.
//!
//! The modules follow a sample's journey: `data` (shards to batches), `ops` (the kernels the towers
//! compute with), `model` (towers and the dual encoder), `config` (the experiment), `io`
//! (checkpoints and their formats, a run's files), `train` (the start, loss, optimisers, the
//! loop) and `eval` (retrieval, zero-shot, probes, scoring); `plot` draws a run's curves and
//! `util` serves them all. ARCHITECTURE.md says what may use what.

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
