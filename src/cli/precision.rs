//! `--precision` of the forward-only commands (embedding, scoring, evaluation).

use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ForwardPrecision {
    /// f32 products: the reference's numbers (cosines within 1e-5 of transformers').
    F32,
    /// bfloat16 operands summed in f32 on CPUs with AVX-512 BF16: about twice the products'
    /// speed, each operand rounded to 8 significant bits (as PyTorch's bf16 autocast rounds).
    Bf16,
}

#[derive(clap::Args, Clone, Copy, Debug)]
pub struct PrecisionArg {
    /// Precision of the towers' matrix products: `f32`, or `bf16` (bfloat16 operands, f32
    /// sums; CPUs with AVX-512 BF16; faster, cosines off by up to about 1e-2).
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: ForwardPrecision,
}

impl PrecisionArg {
    /// Switches the process's products to the precision asked for, or says why it cannot.
    pub fn apply(self) -> Result<()> {
        if self.precision == ForwardPrecision::F32 {
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
