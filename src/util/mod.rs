pub mod log;
pub mod progress;
pub mod rng;
