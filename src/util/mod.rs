//! What every folder uses and that uses none of them: seeded random numbers, logging, progress
//! bars, the profiler, threads, devices, files and locks, interruption, clocks.

pub mod clock;
pub mod device;
pub mod errors;
pub mod files;
pub mod host;
pub mod interrupt;
pub mod log;
pub mod profile;
pub mod progress;
pub mod rng;
pub mod threads;
