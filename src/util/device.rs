//! `--device cpu | cuda | cuda:N`.

use anyhow::{bail, Result};
use candle_core::Device;

/// The device a `--device` value names (None: not given). A CUDA device in a build without the
/// `cuda` feature, or one that cannot be opened, is an error saying so.
pub fn parse(spec: Option<&str>) -> Result<Option<Device>> {
    let Some(spec) = spec.map(str::trim) else { return Ok(None) };
    let ordinal = match spec.to_lowercase().as_str() {
        "cpu" => return Ok(Some(Device::Cpu)),
        "cuda" | "gpu" => 0,
        s => match s.strip_prefix("cuda:").and_then(|n| n.parse::<usize>().ok()) {
            Some(n) => n,
            None => bail!("--device {spec:?}: expected cpu, cuda or cuda:N"),
        },
    };
    if !cfg!(feature = "cuda") {
        bail!("--device {spec}: this binary was built without CUDA (build with --features cuda)");
    }
    match Device::new_cuda(ordinal) {
        Ok(d) => Ok(Some(d)),
        Err(e) => bail!("--device {spec}: cannot open CUDA device {ordinal}: {e}"),
    }
}

/// The first CUDA GPU when the build has CUDA and one is present, else the CPU.
pub fn auto() -> Device {
    #[cfg(feature = "cuda")]
    if let Ok(d) = Device::new_cuda(0) {
        return d;
    }
    Device::Cpu
}

pub fn describe(d: &Device) -> String {
    match d {
        // The cores, not rayon's pool: asking the pool its size would build it, before
        // `train.compute_threads` can size it.
        Device::Cpu => format!("CPU ({} cores)", std::thread::available_parallelism().map_or(1, |n| n.get())),
        Device::Cuda(_) => "CUDA GPU".to_string(),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_or_are_refused_clearly() {
        assert!(parse(None).unwrap().is_none());
        assert!(matches!(parse(Some("cpu")).unwrap(), Some(Device::Cpu)));
        assert!(parse(Some("tpu")).unwrap_err().to_string().contains("expected cpu, cuda or cuda:N"));
        assert!(parse(Some("cuda:x")).is_err());
        if !cfg!(feature = "cuda") {
            assert!(parse(Some("cuda:1")).unwrap_err().to_string().contains("built without CUDA"));
        }
    }
}
