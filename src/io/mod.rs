//! Everything align reads and writes besides data shards: tensors files, run directories
//! (checkpoints, `latest`, pruning, resumption), Hugging Face layouts and `hf:` locations, and the
//! weights a run starts from. Dependencies run one way: `io` uses `model`, `data` and `config`;
//! `train`, `eval` and the CLI load and save models through `io`.

pub mod hf;
pub mod init_from;
pub mod load;
pub mod run_dir;
pub mod run_lock;
pub mod tensors;
