pub mod clock;
pub mod device;
pub mod interrupt;
pub mod log;
pub mod profile;
pub mod progress;
pub mod rng;
pub mod threads;
