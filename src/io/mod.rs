//! Everything align reads and writes besides data shards: tensors files, run directories
//! (checkpoints, `latest`, pruning, resumption), the checkpoint formats (`format`: align's own,
//! Hugging Face's in `hf/`, open_clip's in `open_clip/`), the bounds sizes read from files must
//! respect (`limits`), a forward-only model from any checkpoint (`load`) and a run's logs.
//! Dependencies run one way:
//! `io` uses `model`, `data` and `config`; `train`, `eval` and the CLI load and save models
//! through `io`.

pub mod format;
pub mod hf;
pub mod limits;
pub mod load;
pub mod metrics_log;
pub mod open_clip;
pub mod run_dir;
pub mod run_lock;
pub mod tensorboard;
pub mod tensors;
