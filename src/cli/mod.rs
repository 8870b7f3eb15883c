//! One module per subcommand group; each function parses nothing and prints results.

pub mod bench;
pub mod data;
pub mod demo;
pub mod embed;
pub mod eval;
pub mod launch;
pub mod plot;
pub mod table;
pub mod train;

use candle_core::Device;

/// The compute device: the first CUDA GPU when built with `cuda` and one is present, else CPU.
pub fn default_device() -> Device {
    #[cfg(feature = "cuda")]
    if let Ok(d) = Device::new_cuda(0) {
        return d;
    }
    Device::Cpu
}

pub fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}
