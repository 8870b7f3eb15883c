//! The plumbing every custom op shares, written once: an op states its shapes, its CPU kernel, its
//! GPU launches and its backward pass as a [`Kernel`], and [`Op`] turns that into candle's
//! `CustomOp1/2/3` (operand dtype dispatch, contiguity, the profile region, the CUDA executor).
//!
//! Adding an op is then one file: a struct, its `Kernel` impl, and the function layers call
//! (which picks the op or, where [`super::has_kernels`] says no, the op's composition of candle
//! ops; that composition is also what the op's tests hold it to).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::gpu::{Limits, Program, SideBuf};
use super::Float;

// Without the `cuda` feature only the tests run GPU plans (on the host emulation).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
/// What a GPU run of an op needs besides its operands: the launches, the side buffer they read,
/// and tensors the op reads besides its operands (appended to them, in order).
pub(crate) struct GpuPlan {
    pub program: Program,
    pub side: Option<SideBuf>,
    pub extra: Vec<Tensor>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl GpuPlan {
    pub fn new(program: Program) -> Self {
        GpuPlan { program, side: None, extra: Vec::new() }
    }

    pub fn with_side(mut self, side: SideBuf) -> Self {
        self.side = Some(side);
        self
    }

    pub fn with_extra(mut self, extra: Vec<Tensor>) -> Self {
        self.extra = extra;
        self
    }
}

/// An op of `N` operands.
pub(crate) trait Kernel<const N: usize>: Send + Sync {
    /// candle's name for the op.
    const NAME: &'static str;
    /// The `--profile` region its CPU time counts under.
    const PROFILE: &'static str;
    /// The operands the CPU kernel reads; an unread one may have any layout and gets an empty
    /// slice.
    const READS: [bool; N] = [true; N];

    /// What the kernels need to know of the operands' shapes.
    type Geometry;

    /// Checks the operands' shapes: the geometry, and the shape of the output.
    fn geometry(&self, layouts: [&Layout; N]) -> Result<(Self::Geometry, Shape)>;

    /// The CPU kernel on contiguous operands of one float type.
    fn cpu<T: Float>(&self, g: &Self::Geometry, operands: [&[T]; N]) -> Result<Vec<T>>;

    /// The profile region of one call, for ops whose time splits by configuration.
    fn profile(&self) -> &'static str {
        Self::PROFILE
    }

    /// The GPU launches for operands of `elem` bytes; `None` where the op has no GPU kernels (its
    /// callers compose candle ops on GPUs).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn gpu(&self, _g: &Self::Geometry, _elem: usize, _limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(None)
    }

    /// The operands' gradients from the output's.
    fn backward(&self, _operands: [&Tensor; N], _out: &Tensor, _grad: &Tensor) -> Result<[Option<Tensor>; N]> {
        candle_core::bail!("{} has no backward pass", Self::NAME)
    }
}

/// A [`Kernel`] as a candle op: `x.apply_op2(&w, Op(MyKernel { .. }))`.
pub(crate) struct Op<K>(pub K);

/// The contiguous elements of an operand the kernel reads.
fn operand<'a, T>(data: &'a [T], l: &Layout, reads: bool, what: &str) -> Result<&'a [T]> {
    if !reads {
        return Ok(&[]);
    }
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{what}: operands must be contiguous"),
    }
}

fn cpu<K: Kernel<N>, const N: usize>(k: &K, storages: [&CpuStorage; N], layouts: [&Layout; N]) -> Result<(CpuStorage, Shape)> {
    let _profile = crate::util::profile::region(k.profile());
    let (g, shape) = k.geometry(layouts)?;
    macro_rules! typed {
        ($variant:ident, $t:ty) => {{
            let mut slices: [&[$t]; N] = [&[]; N];
            for i in 0..N {
                let CpuStorage::$variant(d) = storages[i] else { candle_core::bail!("{}: operands of mixed dtypes", K::NAME) };
                slices[i] = operand(d, layouts[i], K::READS[i], K::NAME)?;
            }
            CpuStorage::$variant(k.cpu(&g, slices)?)
        }};
    }
    // The first operand the kernel reads sets the dtype.
    let first = (0..N).find(|&i| K::READS[i]).unwrap_or(0);
    let out = match storages[first] {
        CpuStorage::F32(_) => typed!(F32, f32),
        CpuStorage::F64(_) => typed!(F64, f64),
        _ => candle_core::bail!("{} supports f32 and f64", K::NAME),
    };
    Ok((out, shape))
}

#[cfg(feature = "cuda")]
fn cuda<K: Kernel<N>, const N: usize>(
    k: &K,
    storages: [&candle_core::CudaStorage; N],
    layouts: [&Layout; N],
) -> Result<(candle_core::CudaStorage, Shape)> {
    let (g, shape) = k.geometry(layouts)?;
    let elem = super::gpu::cuda::elem_size(storages[0]);
    let Some(plan) = k.gpu(&g, elem, &super::gpu::program::GPU)? else {
        candle_core::bail!("{} has no CUDA kernels; its callers compose candle ops on GPUs", K::NAME)
    };
    let extra: Vec<_> = plan.extra.iter().map(|t| t.storage_and_layout()).collect();
    let mut operands: Vec<(&candle_core::CudaStorage, &Layout)> = storages.iter().copied().zip(layouts.iter().copied()).collect();
    for (storage, layout) in &extra {
        let candle_core::Storage::Cuda(s) = &**storage else { candle_core::bail!("{}: an operand is not on the GPU", K::NAME) };
        operands.push((s, layout));
    }
    Ok((super::gpu::cuda::run(&plan.program, &operands, plan.side.as_ref())?, shape))
}

fn one<const N: usize>(grads: [Option<Tensor>; N]) -> Option<Tensor> {
    grads.into_iter().next().flatten()
}

impl<K: Kernel<1>> CustomOp1 for Op<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu(&self.0, [s], [l])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda(&self.0, [s], [l])
    }

    fn bwd(&self, x: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(one(self.0.backward([x], out, grad)?))
    }
}

impl<K: Kernel<2>> CustomOp2 for Op<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu(&self.0, [s1, s2], [l1, l2])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda(&self.0, [s1, s2], [l1, l2])
    }

    fn bwd(&self, a: &Tensor, b: &Tensor, out: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let [da, db] = self.0.backward([a, b], out, grad)?;
        Ok((da, db))
    }
}

impl<K: Kernel<3>> CustomOp3 for Op<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu(&self.0, [s1, s2, s3], [l1, l2, l3])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda(&self.0, [s1, s2, s3], [l1, l2, l3])
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [da, db, dc] = self.0.backward([a, b, c], out, grad)?;
        Ok((da, db, dc))
    }
}

/// Runs an op's CPU kernel through the adapter, for tests that call kernels on plain slices.
#[cfg(test)]
pub(crate) fn run_cpu<K: Kernel<N>, T: Float, const N: usize>(k: &K, operands: [(&[T], &[usize]); N]) -> Vec<T> {
    let layouts: Vec<Layout> = operands.iter().map(|(_, d)| Layout::contiguous(d.to_vec())).collect();
    let layouts: [&Layout; N] = std::array::from_fn(|i| &layouts[i]);
    let (g, _) = k.geometry(layouts).expect("shapes");
    k.cpu(&g, operands.map(|(s, _)| s)).expect("kernel")
}
