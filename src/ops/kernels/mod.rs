//! One op per file, each one pass over its data with its own backward pass.

pub mod batch_norm;
pub mod bf16_gemm;
pub mod bias_act;
pub mod channel_scale;
pub mod column_sums;
pub mod dense_conv;
pub mod depthwise;
pub mod frozen;
pub mod int8_gemm;
pub(crate) mod issue_rate;
pub mod layer_norm;
pub mod linear;
pub(crate) mod matmul;
pub mod moments;
pub(crate) mod nchw;
pub(crate) mod operands;
pub mod peak;
pub mod pointwise;
pub(crate) mod prepared;
pub mod softmax;
pub mod spatial_mean;
pub mod stochastic_depth;
