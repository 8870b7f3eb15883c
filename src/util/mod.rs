pub mod log;
pub mod rng;
