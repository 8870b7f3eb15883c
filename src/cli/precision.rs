//! `--precision` of the forward-only commands (embedding, scoring, evaluation).

use align::config::Precision;
use anyhow::{bail, Result};

#[derive(clap::Args, Clone, Copy, Debug)]
pub struct PrecisionArg {
    /// Precision of the towers' matrix products: `f32` (the reference's numbers), or `bf16`
    /// (bfloat16 operands, f32 sums; CPUs with AVX-512 BF16; faster, cosines within about 1e-3
    /// of f32's).
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: Precision,
}

impl PrecisionArg {
    /// Switches the process's products to the precision asked for, or says why it cannot.
    pub fn apply(self) -> Result<()> {
        if self.precision == Precision::F32 {
            return Ok(());
        }
        if !super::default_device().is_cpu() {
            bail!("--precision bf16 is the CPU's forward path; on a GPU leave it out (the towers run in f32)");
        }
        if !align::ops::kernels::bf16_gemm::set_forward_bf16(true) {
            bail!("--precision bf16 needs a CPU with AVX-512 BF16 (avx512_bf16 in /proc/cpuinfo), which this one lacks");
        }
        Ok(())
    }
}
