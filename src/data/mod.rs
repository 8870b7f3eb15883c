//! The data's journey from shards to batches. See `loader` for how the stages chain.

pub mod batch;
pub mod build;
pub mod clip_bpe;
pub mod curate;
pub mod distribute;
pub mod eval_reader;
pub mod folders;
pub mod loader;
pub mod pipe_source;
pub mod reader_thread;
pub mod sample;
pub mod sentencepiece;
pub mod shard_writer;
pub mod shuffle;
pub mod skips;
pub mod spec;
pub mod stats;
pub mod synth;
pub mod tar_read;
pub mod teacher_feed;
pub mod text_clean;
pub mod token_budget;
pub mod tokenizer;
pub mod transform;
pub mod wordpiece;
