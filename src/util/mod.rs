pub mod device;
pub mod interrupt;
pub mod log;
pub mod progress;
pub mod rng;
