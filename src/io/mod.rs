//! Everything align reads and writes besides data shards: tensors files, run directories
//! (checkpoints, `latest`, pruning, resumption; optimizer state sharded over ranks in
//! `state_shards`), the checkpoint formats (`format`: the trait,
//! and below it align's own, Hugging Face's in `hf/` and open_clip's in `open_clip/`), the
//! `registry` above them (the list of formats, the location a checkpoint is resolved from, and
//! export), the bounds sizes read from files must respect (`limits`), a forward-only model from
//! any checkpoint (`load`), and a run's logs. Dependencies run one way: `io` uses `model`, `data`
//! and `config`; `train`, `eval` and the CLI load and save models through `io`.

pub mod format;
pub mod limits;
pub mod load;
pub mod metrics_log;
pub mod registry;
pub mod run_dir;
pub mod run_lock;
pub mod state_shards;
pub mod tensorboard;
pub mod tensors;
