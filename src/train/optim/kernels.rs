//! The optimizer update of f32 parameters on CUDA GPUs (`kernels/optim.cu`), by the design of
//! the CPU's in-place update: the moments (one buffer `[m | v]`) and the parameter are rewritten
//! in place, and LAMB's trust ratio is summed and divided on the device into a small buffer the
//! parameter keeps. Per tensor and step that is three launches (four for LAMB), no
//! parameter-sized temporaries and no copy to the host; candle's composition
//! (`optim::device_update`) takes about ten temporaries and, for LAMB, two host round trips.
//!
//! The ops' CPU side exists for the tests only: there each launch runs the kernel's source in the
//! host emulation (`ops::gpu::host`), so the optimizer's GPU path, from its moments'
//! layout through the launch plans to the kernels, is checked against the CPU update.

use candle_core::{CpuStorage, InplaceOp2, InplaceOp3, Layout, Result};

use super::Coefficients;
pub(super) use crate::ops::gpu::optim::partials_len;
use crate::ops::gpu::optim::{check_lengths, norm_blocks, Step};
use crate::ops::gpu::program::OptimParams;
#[cfg(any(test, feature = "cuda"))]
use crate::ops::gpu::Program;

/// The kernels' parameters for a tensor of `n` values and this step's coefficients.
pub(super) fn params(n: usize, c: &Coefficients) -> OptimParams {
    OptimParams {
        n: n as i64,
        ratio_at: 2 * norm_blocks(n) as i64,
        lr: c.lr as f32,
        clip: c.clip as f32,
        b1: c.b1 as f32,
        b2: c.b2 as f32,
        inv_bc1: (1.0 / c.bc1) as f32,
        inv_bc2: (1.0 / c.bc2) as f32,
        eps: c.eps as f32,
        wd: c.wd as f32,
        lamb: i32::from(c.lamb),
        unused: 0,
    }
}

/// One of the update's ops on the buffer it rewrites in place:
/// - [`Update::moments`]: `[m | v]` from the gradient (`mv.inplace_op2(g, ..)`);
/// - [`Update::trust_ratio`]: LAMB's partial sums and trust ratio from the parameter and the new
///   moments (`partials.inplace_op3(w, mv, ..)`);
/// - [`Update::apply`]: the parameter from the moments and the ratio buffer
///   (`w.inplace_op3(mv, partials, ..)`; AdamW ignores the ratio).
pub(super) struct Update {
    step: Step,
    params: OptimParams,
}

impl Update {
    pub fn moments(params: OptimParams) -> Self {
        Update { step: Step::Moments, params }
    }

    pub fn trust_ratio(params: OptimParams) -> Self {
        Update { step: Step::TrustRatio, params }
    }

    pub fn apply(params: OptimParams) -> Self {
        Update { step: Step::Apply, params }
    }

    fn op_name(&self) -> &'static str {
        match self.step {
            Step::Moments => "adam-moments",
            Step::TrustRatio => "lamb-trust-ratio",
            Step::Apply => "adam-apply",
        }
    }
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(d), Some((a, b))) => Ok(&d[a..b]),
        _ => candle_core::bail!("the optimizer kernels take contiguous f32 tensors"),
    }
}

fn f32_slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(d), Some((a, b))) => Ok(&mut d[a..b]),
        _ => candle_core::bail!("the optimizer kernels take contiguous f32 tensors"),
    }
}

/// The CPU side: the kernels in the host emulation (tests only).
fn on_host(step: Step, p: &OptimParams, out: &mut [f32], [a, b]: [Option<&[f32]>; 2]) -> Result<()> {
    let lens: Vec<usize> = [a, b].iter().flatten().map(|v| v.len()).collect();
    check_lengths(step, p.n as usize, out.len(), &lens)?;
    #[cfg(test)]
    {
        let operands: Vec<&[f32]> = [a, b].into_iter().flatten().collect();
        crate::ops::gpu::run_on_host_in_place(&Program::optim(step, p), out, &operands, None);
        Ok(())
    }
    #[cfg(not(test))]
    {
        let _ = (p, out, a, b);
        candle_core::bail!("{step:?}: the optimizer kernels run on CUDA GPUs; the CPU has its own update")
    }
}

#[cfg(feature = "cuda")]
fn on_gpu(
    step: Step,
    p: &OptimParams,
    target: (&mut candle_core::CudaStorage, &Layout),
    operands: &[(&candle_core::CudaStorage, &Layout)],
) -> Result<()> {
    let lens = operands.iter().map(|(_, l)| l.shape().elem_count()).collect::<Vec<_>>();
    check_lengths(step, p.n as usize, target.1.shape().elem_count(), &lens)?;
    crate::ops::gpu::cuda::run_in_place(&Program::optim(step, p), target, operands)
}

impl InplaceOp2 for Update {
    fn name(&self) -> &'static str {
        self.op_name()
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        on_host(self.step, &self.params, f32_slice_mut(s1, l1)?, [Some(f32_slice(s2, l2)?), None])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &mut candle_core::CudaStorage, l1: &Layout, s2: &candle_core::CudaStorage, l2: &Layout) -> Result<()> {
        on_gpu(self.step, &self.params, (s1, l1), &[(s2, l2)])
    }
}

impl InplaceOp3 for Update {
    fn name(&self) -> &'static str {
        self.op_name()
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<()> {
        on_host(self.step, &self.params, f32_slice_mut(s1, l1)?, [Some(f32_slice(s2, l2)?), Some(f32_slice(s3, l3)?)])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<()> {
        on_gpu(self.step, &self.params, (s1, l1), &[(s2, l2), (s3, l3)])
    }
}
