//! Towers and the dual encoder. Parameter names are Hugging Face's so checkpoints interoperate;
//! nothing here knows about files, shards or training.

pub mod bert;
pub mod config;
pub mod dual_encoder;
pub mod init;
pub mod layers;
pub mod vit;
