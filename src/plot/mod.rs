//! Training curves as a PNG (`align plot`): several runs on one figure, one panel per quantity.

pub mod canvas;
pub mod figure;
pub mod runs;
