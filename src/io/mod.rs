//! Everything align reads and writes besides data shards: tensors files, run directories
//! (checkpoints, `latest`, pruning, resumption), the checkpoint formats (`format`: align's own,
//! Hugging Face's in `hf/`, open_clip's in `open_clip/`), the bounds sizes read from files must
//! respect (`limits`), and the weights a run starts from (`init_from`). Dependencies run one way:
//! `io` uses `model`, `data` and `config`; `train`, `eval` and the CLI load and save models
//! through `io`.

pub mod adopt;
pub mod format;
pub mod hf;
pub mod init_from;
pub mod limits;
pub mod load;
pub mod metrics_log;
pub mod open_clip;
pub mod run_dir;
pub mod run_lock;
pub mod tensorboard;
pub mod tensors;
