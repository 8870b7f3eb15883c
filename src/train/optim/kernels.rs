//! The optimizer update of f32 parameters on CUDA GPUs (`kernels/optim.cu`), by the design of
//! the CPU's in-place update: the moments (one buffer `[m | v]`) and the parameter are rewritten
//! in place, and LAMB's trust ratio is summed and divided on the device into a small buffer the
//! parameter keeps. Per tensor and step that is three launches (four for LAMB), no
//! parameter-sized temporaries and no copy to the host; candle's composition
//! (`optim::device_update`) takes about ten temporaries and, for LAMB, two host round trips.
//!
//! The ops' CPU side exists for the tests only: there each launch runs the kernel's source in the
//! host emulation (`model::ops::kernel_host`), so the optimizer's GPU path, from its moments'
//! layout through the launch plans to the kernels, is checked against the CPU update.

use candle_core::{CpuStorage, InplaceOp2, InplaceOp3, Layout, Result};

use super::Coefficients;

/// `struct OptimParams` of `kernels/optim.cu`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct OptimParams {
    n: i64,
    ratio_at: i64,
    lr: f32,
    clip: f32,
    b1: f32,
    b2: f32,
    inv_bc1: f32,
    inv_bc2: f32,
    eps: f32,
    wd: f32,
    lamb: i32,
    unused: i32,
}

#[cfg(feature = "cuda")]
// SAFETY: a #[repr(C)] struct of plain numbers, laid out as the kernels' struct.
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for OptimParams {}

const THREADS: u32 = 256;
/// Blocks summing LAMB's norms: at most this many partial pairs for the ratio's one block.
const NORM_BLOCKS: usize = 256;
const MAX_GRID: usize = 65_535;

/// Length of a parameter's partial-sum buffer: `[(|w|², |u|²) per norm block | ratio]`.
pub(super) fn partials_len(n: usize) -> usize {
    2 * norm_blocks(n) + 1
}

fn norm_blocks(n: usize) -> usize {
    n.div_ceil(THREADS as usize).clamp(1, NORM_BLOCKS)
}

impl OptimParams {
    pub(super) fn new(n: usize, c: &Coefficients) -> Self {
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
}

/// One launch: kernel, grid, block, shared bytes, and its parameters.
#[derive(Clone, Copy, Debug)]
struct Launch {
    kernel: &'static str,
    dims: (u32, u32, u32),
    params: OptimParams,
}

fn elementwise(kernel: &'static str, p: &OptimParams) -> Launch {
    let grid = (p.n as usize).div_ceil(THREADS as usize).clamp(1, MAX_GRID) as u32;
    Launch { kernel, dims: (grid, THREADS, 0), params: *p }
}

/// The launches of each op, shared by the CUDA launcher and the host emulation.
fn plan(op: Op, p: &OptimParams) -> Vec<Launch> {
    let reduce_shared = THREADS * 8;
    match op {
        Op::Moments => vec![elementwise("adam_moments", p)],
        Op::TrustRatio => {
            let blocks = norm_blocks(p.n as usize);
            vec![
                Launch { kernel: "adam_norms", dims: (blocks as u32, THREADS, reduce_shared), params: *p },
                Launch { kernel: "adam_ratio", dims: (1, THREADS, reduce_shared), params: OptimParams { n: blocks as i64, ..*p } },
            ]
        }
        Op::Apply => vec![elementwise("adam_apply", p)],
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Moments,
    TrustRatio,
    Apply,
}

/// Checks the lengths of an op's updated buffer and operands against the parameter's `n`: the
/// kernels index them by `n` alone.
fn check_lengths(op: Op, n: usize, out: usize, operands: &[usize]) -> Result<()> {
    let (want_out, want): (usize, &[usize]) = match op {
        Op::Moments => (2 * n, &[n]),
        Op::TrustRatio => (partials_len(n), &[n, 2 * n]),
        Op::Apply => (n, &[2 * n, partials_len(n)]),
    };
    if out != want_out || operands != want {
        candle_core::bail!("{op:?} for {n} parameters: buffers of {out} and {operands:?} values, expected {want_out} and {want:?}");
    }
    Ok(())
}

/// One of the update's ops on the buffer it rewrites in place:
/// - [`Update::moments`]: `[m | v]` from the gradient (`mv.inplace_op2(g, ..)`);
/// - [`Update::trust_ratio`]: LAMB's partial sums and trust ratio from the parameter and the new
///   moments (`partials.inplace_op3(w, mv, ..)`);
/// - [`Update::apply`]: the parameter from the moments and the ratio buffer
///   (`w.inplace_op3(mv, partials, ..)`; AdamW ignores the ratio).
pub(super) struct Update {
    op: Op,
    params: OptimParams,
}

impl Update {
    pub fn moments(params: OptimParams) -> Self {
        Update { op: Op::Moments, params }
    }

    pub fn trust_ratio(params: OptimParams) -> Self {
        Update { op: Op::TrustRatio, params }
    }

    pub fn apply(params: OptimParams) -> Self {
        Update { op: Op::Apply, params }
    }

    fn op_name(&self) -> &'static str {
        match self.op {
            Op::Moments => "adam-moments",
            Op::TrustRatio => "lamb-trust-ratio",
            Op::Apply => "adam-apply",
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
fn on_host(op: Op, p: &OptimParams, out: &mut [f32], [a, b]: [Option<&[f32]>; 2]) -> Result<()> {
    let lens: Vec<usize> = [a, b].iter().flatten().map(|v| v.len()).collect();
    check_lengths(op, p.n as usize, out.len(), &lens)?;
    #[cfg(test)]
    {
        use crate::model::ops::kernel_host;
        for l in plan(op, p) {
            kernel_host::launch::<f32>(l.kernel, l.dims, kernel_host::param_bytes(&l.params), &[a, b, None], None, out);
        }
        Ok(())
    }
    #[cfg(not(test))]
    {
        let _ = (p, out, a, b);
        candle_core::bail!("{op:?}: the optimizer kernels run on CUDA GPUs; the CPU has its own update")
    }
}

impl InplaceOp2 for Update {
    fn name(&self) -> &'static str {
        self.op_name()
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        on_host(self.op, &self.params, f32_slice_mut(s1, l1)?, [Some(f32_slice(s2, l2)?), None])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &mut candle_core::CudaStorage, l1: &Layout, s2: &candle_core::CudaStorage, l2: &Layout) -> Result<()> {
        cuda::run(self.op, &self.params, (s1, l1), [(s2, l2)])
    }
}

impl InplaceOp3 for Update {
    fn name(&self) -> &'static str {
        self.op_name()
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<()> {
        on_host(self.op, &self.params, f32_slice_mut(s1, l1)?, [Some(f32_slice(s2, l2)?), Some(f32_slice(s3, l3)?)])
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
        cuda::run(self.op, &self.params, (s1, l1), [(s2, l2), (s3, l3)])
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
    use candle_core::{CudaStorage, Layout, Result};

    use super::{plan, Op, OptimParams};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/optim.ptx"));

    /// The op's launches on `out` (updated in place) and its operands.
    pub fn run<const N: usize>(
        op: Op,
        p: &OptimParams,
        (out, lo): (&mut CudaStorage, &Layout),
        operands: [(&CudaStorage, &Layout); N],
    ) -> Result<()> {
        let dev = out.device.clone();
        let views = operands
            .iter()
            .map(|(s, l)| match (&s.slice, l.contiguous_offsets()) {
                (CudaStorageSlice::F32(d), Some((a, b))) => Ok(d.slice(a..b)),
                _ => candle_core::bail!("{op:?}: the optimizer kernels take contiguous f32 tensors"),
            })
            .collect::<Result<Vec<_>>>()?;
        let (CudaStorageSlice::F32(out), Some((a, b))) = (&mut out.slice, lo.contiguous_offsets()) else {
            candle_core::bail!("{op:?}: the optimizer kernels update contiguous f32 tensors")
        };
        let lens: Vec<usize> = views.iter().map(|v| v.len()).collect();
        super::check_lengths(op, p.n as usize, b - a, &lens)?;
        let mut target = out.slice_mut(a..b);
        let null = 0u64;
        for l in plan(op, p) {
            let func = dev.get_or_load_custom_func(&format!("{}_f32", l.kernel), "align_optim", PTX)?;
            let mut args = func.builder();
            for i in 0..3 {
                match views.get(i) {
                    Some(v) => args.arg(v),
                    None => args.arg(&null),
                };
            }
            args.arg(&null);
            args.arg(&mut target);
            args.arg(&l.params);
            let (grid, block, shared) = l.dims;
            let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: shared };
            // SAFETY: the arguments match the kernels' signature (a, b, c, aux, out, params) and
            // the launch's bounds are the plan's.
            unsafe { args.launch(cfg) }.w()?;
        }
        Ok(())
    }
}
