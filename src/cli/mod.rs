//! One module per subcommand group; each function parses nothing and prints results.

pub mod bench;
pub mod config;
pub mod data;
pub mod demo;
pub mod embed;
pub mod eval;
pub mod eval_suite;
pub mod inspect;
pub mod launch;
pub mod plot;
pub mod precision;
pub mod stall;
pub mod table;
pub mod train;

use candle_core::Device;

static DEVICE: std::sync::OnceLock<Device> = std::sync::OnceLock::new();

/// Chooses the device from `--device` (`cpu`, `cuda`, `cuda:N`); without it, the first CUDA GPU
/// when the binary has CUDA and one is present, else the CPU. Says which, once.
pub fn select_device(requested: Option<&str>) -> anyhow::Result<()> {
    let device = match align::util::device::parse(requested)? {
        Some(d) => d,
        None => align::util::device::auto(),
    };
    align::util::log::info(format!("device: {}", align::util::device::describe(&device)));
    let _ = DEVICE.set(device);
    Ok(())
}

/// The device chosen by [`select_device`] (the CPU if none was).
pub fn default_device() -> Device {
    DEVICE.get().cloned().unwrap_or(Device::Cpu)
}

pub fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}
