//! Custom candle ops with their own backward passes, for layers candle makes slow or cannot
//! differentiate.

pub mod channel;
pub mod depthwise;
pub mod softmax;
