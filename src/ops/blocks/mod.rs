//! Ops that chain kernels into a whole block and run the block's backward pass themselves, so
//! that the block's inner tensors are not graph edges (each of which candle's backward pass gives
//! a zero-filled gradient buffer and an add).

pub mod attention;
pub mod conv_norm;
pub mod mbconv;
pub mod mbconv_eval;
pub mod mlp;
pub mod squeeze_excite;
pub(crate) mod stage;
pub mod sublayer;
