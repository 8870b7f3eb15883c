//! `--precision` of the forward-only commands (embedding, scoring, evaluation), and the
//! arguments every command that loads one model for its forward pass shares.

use std::path::PathBuf;

use align::config::Precision;
use align::io::load::{load_model_with, LoadedModel};
use anyhow::{bail, Result};
use candle_core::Device;

#[derive(clap::Args, Clone, Copy, Debug)]
pub struct PrecisionArg {
    /// Precision of the towers' matrix products: `f32` (the reference's numbers), `bf16`
    /// (bfloat16 operands, f32 sums; CPUs with AVX-512 BF16; cosines within about 1e-3 of
    /// f32's), or `int8` (linear layers on 8-bit integers: per-channel weights, per-token inputs,
    /// 32-bit sums; CPUs with AVX-512 VNNI; the other large products as bf16 where the CPU has
    /// it).
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: Precision,
}

impl PrecisionArg {
    /// Switches the process's products to the precision asked for, or says why it cannot.
    pub fn apply(self) -> Result<Precision> {
        use align::ops::kernels::{bf16_gemm, int8_gemm};
        if self.precision == Precision::F32 {
            return Ok(Precision::F32);
        }
        let name = self.precision.name();
        if !super::default_device().is_cpu() {
            bail!("--precision {name} is the CPU's forward path; on a GPU leave it out (the towers run in f32)");
        }
        match self.precision {
            Precision::Bf16 if !bf16_gemm::set_forward_bf16(true) => {
                bail!("--precision bf16 needs a CPU with AVX-512 BF16 (avx512_bf16 in /proc/cpuinfo), which this one lacks")
            }
            Precision::Bf16 => {
                if let Some(note) = bf16_gemm::kernel_note() {
                    align::util::log::info(note);
                }
            }
            Precision::Int8 => {
                if !int8_gemm::set_forward_int8(true) {
                    bail!("--precision int8 needs a CPU with AVX-512 VNNI (avx512_vnni in /proc/cpuinfo), which this one lacks");
                }
                // The products that are not a linear layer's (convolutions, attention) take
                // bf16 where the CPU has it, f32 where not.
                bf16_gemm::set_forward_bf16(true);
            }
            _ => {}
        }
        Ok(self.precision)
    }
}

/// The model a forward-only command runs: the checkpoint, its weights or their moving average,
/// and the precision of its products.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    #[command(flatten)]
    pub precision: PrecisionArg,
    /// The model: an align run or checkpoint, a Hugging Face or open_clip folder, or hf:ORG/NAME.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Use the weights' moving average the checkpoint holds (`train.ema_decay`).
    #[arg(long)]
    pub ema: bool,
}

impl ModelArgs {
    /// Sets the process's precision and loads the model on `device`.
    pub fn load(&self, device: &Device) -> Result<LoadedModel> {
        let precision = self.precision.apply()?;
        let mut m = load_model_with(&self.checkpoint, device, self.ema)?;
        m.set_precision(precision);
        Ok(m)
    }
}
