//! The GPU side of the per-op kernels: the transformer towers' row-wise ops (`kernels/rows.cu`:
//! LayerNorm, softmax, bias + GELU, column sums) and the convolutional towers' per-channel ops
//! (`kernels/channels.cu`: batch moments, BatchNorm + SiLU, channel scaling, plane sums, the
//! scaled residual). Which kernels each op launches, in what order, on which buffers and with
//! what grid is a [`Program`] of plain data.
//!
//! A program is run by one of two executors: cudarc's on a GPU (`--features cuda`), and in the
//! tests a host emulation that compiles the same `.cu` sources as C++ (`kernels/host/`) and runs
//! each launch with real threads meeting at `__syncthreads`. So the kernels, their launch
//! geometry and their argument wiring are all checked against the CPU ops on machines without a
//! GPU; only cudarc's copying of arguments is not.

#[cfg(any(test, feature = "cuda"))]
use super::Float;

/// `struct RowParams` of `kernels/rows.cu`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RowParams {
    rows: i64,
    cols: i32,
    rows_per_bias: i32,
    chunk: i32,
    act: i32,
    value: f64,
}

/// `struct ChannelParams` of `kernels/channels.cu`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ChannelParams {
    n: i32,
    c: i32,
    hw: i64,
    silu: i32,
    batch_stats: i32,
}

#[cfg(feature = "cuda")]
// SAFETY (both): #[repr(C)] structs of plain numbers, laid out as the kernels' structs.
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for RowParams {}
#[cfg(feature = "cuda")]
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for ChannelParams {}

/// A kernel file, and the parameter struct its kernels take.
#[derive(Clone, Copy, Debug)]
pub(super) enum Params {
    /// `kernels/rows.cu`; its side buffer is the softmax's f32 key bias.
    Row(RowParams),
    /// `kernels/channels.cu`; its side buffer is f64 (BatchNorm statistics, sample factors).
    Channel(ChannelParams),
}

/// An op's side buffer: values computed on the host that a kernel reads besides its operands.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Side<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
}

/// Where a launch reads an operand from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Src {
    /// The op's n-th input.
    Operand(usize),
    /// A scratch buffer an earlier launch wrote.
    Scratch(usize),
    /// Not read by the kernel (a null pointer).
    Null,
}

/// Where a launch writes: `len` elements from `offset` of the op's output or of a scratch buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dst {
    Out { offset: usize, len: usize },
    Scratch(usize),
}

#[derive(Clone, Debug)]
pub(super) struct Launch {
    /// The kernel's name without its dtype suffix.
    pub kernel: &'static str,
    pub inputs: [Src; 3],
    /// Whether the kernel reads the op's side buffer.
    pub side: bool,
    pub out: Dst,
    pub params: Params,
    pub grid: u32,
    pub block: u32,
    pub shared_bytes: u32,
}

/// An op's launches, the lengths of the scratch buffers they pass between them, and the length
/// of the op's output.
#[derive(Clone, Debug)]
pub(super) struct Program {
    pub launches: Vec<Launch>,
    pub scratch: Vec<usize>,
    pub out_len: usize,
}

/// Launch limits. Grids are capped so that the kernels' grid-stride loops are exercised in the
/// tests with a small cap; on a GPU the cap only bounds the launch.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    pub max_grid: u32,
    /// Dynamic shared memory a block may ask for without opting in (48 KiB on every CUDA GPU).
    pub max_shared: usize,
}

pub(super) const GPU: Limits = Limits { max_grid: 65_535, max_shared: 48 * 1024 };

/// Threads for the elementwise and column kernels.
const THREADS: u32 = 256;
/// Partial sums over rows: at most this many chunks, so the second pass is short.
const MAX_CHUNKS: usize = 512;

/// Threads per block for a row of `cols`: a power of two (the tree reduction halves it), at
/// least a warp, at most [`THREADS`].
fn row_threads(cols: usize) -> u32 {
    (cols.next_power_of_two() as u32).clamp(32, THREADS)
}

/// Shared memory of the LayerNorm parameter gradients' kernel: the reduction scratch and the
/// block's sums of two rows' worth of values.
fn layer_norm_grad_shared(cols: usize, elem: usize) -> usize {
    (row_threads(cols) as usize + 2 * cols) * elem
}

/// Whether the LayerNorm backward kernels take rows of `cols` values of `elem` bytes; wider ones
/// (above about 6000 in f32) compose candle ops on the GPU.
pub(super) fn layer_norm_fits(cols: usize, elem: usize) -> bool {
    layer_norm_grad_shared(cols, elem) <= GPU.max_shared
}

fn grid(units: usize, limits: &Limits) -> u32 {
    units.clamp(1, limits.max_grid as usize) as u32
}

fn params(rows: usize, cols: usize) -> RowParams {
    RowParams { rows: rows as i64, cols: cols as i32, ..Default::default() }
}

impl Program {
    fn one(launch: Launch, out_len: usize) -> Program {
        Program { launches: vec![launch], scratch: vec![], out_len }
    }

    /// A kernel with one block per row and a reduction scratch of one element per thread.
    fn per_row(kernel: &'static str, inputs: [Src; 3], side: bool, p: RowParams, elem: usize, limits: &Limits) -> Launch {
        let block = row_threads(p.cols as usize);
        let out = Dst::Out { offset: 0, len: p.rows as usize * p.cols as usize };
        let grid = grid(p.rows as usize, limits);
        Launch { kernel, inputs, side, out, params: Params::Row(p), grid, block, shared_bytes: block * elem as u32 }
    }

    /// An elementwise kernel over `rows × cols`.
    fn elementwise(kernel: &'static str, inputs: [Src; 3], p: RowParams, limits: &Limits) -> Launch {
        let len = p.rows as usize * p.cols as usize;
        let out = Dst::Out { offset: 0, len };
        let grid = grid(len.div_ceil(THREADS as usize), limits);
        Launch { kernel, inputs, side: false, out, params: Params::Row(p), grid, block: THREADS, shared_bytes: 0 }
    }

    /// `column_sums` of `src` as `[rows, cols]` in chunks of `chunk` rows, to `out`.
    fn column_sums_launch(src: Src, rows: usize, cols: usize, chunk: usize, out: Dst, limits: &Limits) -> Launch {
        let p = RowParams { chunk: chunk as i32, ..params(rows, cols) };
        let units = rows.div_ceil(chunk) * cols;
        let grid = grid(units.div_ceil(THREADS as usize), limits);
        Launch {
            kernel: "column_sums",
            inputs: [src, Src::Null, Src::Null],
            side: false,
            out,
            params: Params::Row(p),
            grid,
            block: THREADS,
            shared_bytes: 0,
        }
    }

    /// Rows per chunk of a two-pass sum over `rows`.
    fn chunk(rows: usize) -> usize {
        rows.div_ceil(MAX_CHUNKS).max(1)
    }

    /// `LayerNormOp` on operands `[x, weight, bias]`, rows of `cols`.
    pub fn layer_norm(rows: usize, cols: usize, eps: f64, elem: usize, limits: &Limits) -> Program {
        let p = RowParams { value: eps, ..params(rows, cols) };
        let ops = [Src::Operand(0), Src::Operand(1), Src::Operand(2)];
        Program::one(Program::per_row("layer_norm_fwd", ops, false, p, elem, limits), rows * cols)
    }

    /// `LayerNormGrad` on operands `[x, weight, dy]`: the output is `[dx | dweight | dbias]`.
    /// dx is one block per row; the parameter gradients are summed per chunk of rows into a
    /// scratch `[chunks, 2·cols]` and the chunks then added in order.
    pub fn layer_norm_grad(rows: usize, cols: usize, eps: f64, elem: usize, limits: &Limits) -> candle_core::Result<Program> {
        let p = RowParams { value: eps, ..params(rows, cols) };
        let dx = Program::per_row("layer_norm_grad_input", [Src::Operand(0), Src::Operand(1), Src::Operand(2)], false, p, elem, limits);
        let chunk = Program::chunk(rows);
        let chunks = rows.div_ceil(chunk);
        let block = row_threads(cols);
        let shared = layer_norm_grad_shared(cols, elem);
        if shared > limits.max_shared {
            candle_core::bail!(
                "layer norm backward on the GPU: rows of {cols} need {shared} bytes of shared memory, more than {}",
                limits.max_shared
            );
        }
        let partial = Launch {
            kernel: "layer_norm_grad_params",
            inputs: [Src::Operand(0), Src::Null, Src::Operand(2)],
            side: false,
            out: Dst::Scratch(0),
            params: Params::Row(RowParams { chunk: chunk as i32, ..p }),
            grid: grid(chunks, limits),
            block,
            shared_bytes: shared as u32,
        };
        let total = Program::column_sums_launch(
            Src::Scratch(0),
            chunks,
            2 * cols,
            chunks.max(1),
            Dst::Out { offset: rows * cols, len: 2 * cols },
            limits,
        );
        Ok(Program { launches: vec![dx, partial, total], scratch: vec![chunks * 2 * cols], out_len: rows * cols + 2 * cols })
    }

    /// `softmax(scale·x + key_bias)` per row on operand `[x]`; the key bias (`[batch, cols]`)
    /// serves `rows_per_bias` consecutive rows per batch element.
    pub fn softmax(rows: usize, cols: usize, scale: f64, key_bias: Option<usize>, elem: usize, limits: &Limits) -> Program {
        let p = RowParams { value: scale, rows_per_bias: key_bias.unwrap_or(1).max(1) as i32, ..params(rows, cols) };
        let ops = [Src::Operand(0), Src::Null, Src::Null];
        Program::one(Program::per_row("softmax_fwd", ops, key_bias.is_some(), p, elem, limits), rows * cols)
    }

    /// The softmax's input gradient on operands `[y, dy]`.
    pub fn softmax_grad(rows: usize, cols: usize, scale: f64, elem: usize, limits: &Limits) -> Program {
        let p = RowParams { value: scale, ..params(rows, cols) };
        let ops = [Src::Operand(0), Src::Operand(1), Src::Null];
        Program::one(Program::per_row("softmax_grad", ops, false, p, elem, limits), rows * cols)
    }

    /// `act(y + b)` on operands `[y, b]`; `gelu` picks GELU over the identity.
    pub fn bias_act(rows: usize, cols: usize, gelu: bool, limits: &Limits) -> Program {
        let p = RowParams { act: i32::from(gelu), ..params(rows, cols) };
        Program::one(Program::elementwise("bias_act", [Src::Operand(0), Src::Operand(1), Src::Null], p, limits), rows * cols)
    }

    /// `dy · gelu'(y + b)` on operands `[y, b, dy]`.
    pub fn bias_gelu_grad(rows: usize, cols: usize, limits: &Limits) -> Program {
        let ops = [Src::Operand(0), Src::Operand(1), Src::Operand(2)];
        Program::one(Program::elementwise("bias_gelu_grad", ops, params(rows, cols), limits), rows * cols)
    }

    /// Sums over rows of operand `[x]` (`[rows, cols]` → `[cols]`), in two passes.
    pub fn column_sums(rows: usize, cols: usize, limits: &Limits) -> Program {
        let chunk = Program::chunk(rows);
        let chunks = rows.div_ceil(chunk);
        let partial = Program::column_sums_launch(Src::Operand(0), rows, cols, chunk, Dst::Scratch(0), limits);
        let total = Program::column_sums_launch(Src::Scratch(0), chunks, cols, chunks.max(1), Dst::Out { offset: 0, len: cols }, limits);
        Program { launches: vec![partial, total], scratch: vec![chunks * cols], out_len: cols }
    }

    /// A per-channel kernel over NCHW `(n, c, hw)` operands: one block per channel (`Channel`),
    /// per plane (`Plane`), or a thread per element (`Element`); the reductions' scratch is one
    /// f64 per thread.
    fn channel(
        kernel: &'static str,
        inputs: [Src; 3],
        side: bool,
        p: ChannelParams,
        shape: Spread,
        out_len: usize,
        limits: &Limits,
    ) -> Program {
        let (n, c, hw) = (p.n as usize, p.c as usize, p.hw as usize);
        let (units, block, shared_bytes) = match shape {
            Spread::Channel => (c, THREADS, THREADS * 8),
            Spread::Plane => (n * c, row_threads(hw), row_threads(hw) * 8),
            Spread::Element => ((n * c * hw).div_ceil(THREADS as usize), THREADS, 0),
        };
        let out = Dst::Out { offset: 0, len: out_len };
        let launch = Launch { kernel, inputs, side, out, params: Params::Channel(p), grid: grid(units, limits), block, shared_bytes };
        Program::one(launch, out_len)
    }

    /// Per-channel mean and biased variance of operand `[x]`: `[2, c]`.
    pub fn channel_moments((n, c, hw): (usize, usize, usize), limits: &Limits) -> Program {
        let ops = [Src::Operand(0), Src::Null, Src::Null];
        Program::channel("channel_moments", ops, false, channel_params(n, c, hw), Spread::Channel, 2 * c, limits)
    }

    /// `act(γ·(x − μ)·r + β)` on operands `[x, γ, β]`; the side buffer is `[μ (c) | r (c)]`.
    pub fn batch_norm_act((n, c, hw): (usize, usize, usize), silu: bool, limits: &Limits) -> Program {
        let p = ChannelParams { silu: i32::from(silu), ..channel_params(n, c, hw) };
        let ops = [Src::Operand(0), Src::Operand(1), Src::Operand(2)];
        Program::channel("batch_norm_act", ops, true, p, Spread::Element, n * c * hw, limits)
    }

    /// BatchNorm's backward on operands `[x, dy, γ|β]` with the side buffer `[μ (c) | r (c)]`:
    /// `[dx | Σdz·x̂ (c) | Σdz (c)]`.
    pub fn batch_norm_act_grad((n, c, hw): (usize, usize, usize), silu: bool, batch_stats: bool, limits: &Limits) -> Program {
        let p = ChannelParams { silu: i32::from(silu), batch_stats: i32::from(batch_stats), ..channel_params(n, c, hw) };
        let ops = [Src::Operand(0), Src::Operand(1), Src::Operand(2)];
        Program::channel("batch_norm_act_grad", ops, true, p, Spread::Channel, n * c * hw + 2 * c, limits)
    }

    /// `h · s[plane]` on operands `[h, s]`.
    pub fn channel_scale((n, c, hw): (usize, usize, usize), limits: &Limits) -> Program {
        let ops = [Src::Operand(0), Src::Operand(1), Src::Null];
        Program::channel("channel_scale", ops, false, channel_params(n, c, hw), Spread::Element, n * c * hw, limits)
    }

    /// `Σ_hw a·b` per plane on operands `[a, b]`: `[n, c]`.
    pub fn dot_per_plane((n, c, hw): (usize, usize, usize), limits: &Limits) -> Program {
        let ops = [Src::Operand(0), Src::Operand(1), Src::Null];
        Program::channel("dot_per_plane", ops, false, channel_params(n, c, hw), Spread::Plane, n * c, limits)
    }

    /// The mean of each plane of operand `[x]`: `[n, c]`.
    pub fn spatial_mean((n, c, hw): (usize, usize, usize), limits: &Limits) -> Program {
        let ops = [Src::Operand(0), Src::Null, Src::Null];
        Program::channel("spatial_mean", ops, false, channel_params(n, c, hw), Spread::Plane, n * c, limits)
    }

    /// `h·keep[image] + x` on operands `[h, x]`, the side buffer `keep` (n).
    pub fn scaled_residual((n, c, hw): (usize, usize, usize), limits: &Limits) -> Program {
        let ops = [Src::Operand(0), Src::Operand(1), Src::Null];
        Program::channel("scaled_residual", ops, true, channel_params(n, c, hw), Spread::Element, n * c * hw, limits)
    }
}

/// How a per-channel kernel spreads over the GPU.
#[derive(Clone, Copy, Debug)]
enum Spread {
    Channel,
    Plane,
    Element,
}

fn channel_params(n: usize, c: usize, hw: usize) -> ChannelParams {
    ChannelParams { n: n as i32, c: c as i32, hw: hw as i64, ..Default::default() }
}

#[cfg(feature = "cuda")]
pub(super) mod cuda {
    //! The cudarc executor.

    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
    use candle_core::{CudaDevice, CudaStorage, Layout, Result};

    use super::{Dst, Params, Program, Side, Src};

    const ROWS_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rows.ptx"));
    const CHANNELS_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/channels.ptx"));

    /// The side buffer on the device.
    enum DeviceSide {
        F32(CudaSlice<f32>),
        F64(CudaSlice<f64>),
    }

    fn run_typed<T: DeviceRepr + super::Float>(
        dev: &CudaDevice,
        program: &Program,
        operands: &[(&CudaSlice<T>, &Layout)],
        side: Option<&DeviceSide>,
    ) -> Result<CudaSlice<T>> {
        let views = operands
            .iter()
            .map(|(s, l)| match l.contiguous_offsets() {
                Some((lo, hi)) => Ok(s.slice(lo..hi)),
                None => candle_core::bail!("GPU kernels: operands must be contiguous"),
            })
            .collect::<Result<Vec<_>>>()?;
        // SAFETY (both allocations): the program's launches write every element of the output
        // and of each scratch buffer before anything reads it (the host emulation's tests fill
        // them with NaN first and check).
        let mut out = unsafe { dev.alloc::<T>(program.out_len)? };
        let mut scratch = program.scratch.iter().map(|&n| unsafe { dev.alloc::<T>(n) }.map(Some)).collect::<Result<Vec<_>>>()?;
        // Absent pointers (operands a kernel does not read, no side buffer) are passed as null.
        let null = 0u64;
        for launch in &program.launches {
            let (module, ptx) = match launch.params {
                Params::Row(_) => ("align_rows", ROWS_PTX),
                Params::Channel(_) => ("align_channels", CHANNELS_PTX),
            };
            let func = dev.get_or_load_custom_func(&format!("{}_{}", launch.kernel, super::super::kernel_suffix::<T>()), module, ptx)?;
            // A launch writing a scratch buffer holds it alone; reading it in the same launch
            // would be an error of the program, reported below.
            let mut target = match launch.out {
                Dst::Scratch(k) => scratch[k].take(),
                Dst::Out { .. } => None,
            };
            {
                let inputs = launch
                    .inputs
                    .iter()
                    .map(|src| match *src {
                        Src::Operand(i) => match views.get(i) {
                            Some(v) => Ok(Some(v.slice(..))),
                            None => candle_core::bail!("GPU kernels: {} reads operand {i} of {}", launch.kernel, views.len()),
                        },
                        Src::Scratch(k) => match &scratch[k] {
                            Some(s) => Ok(Some(s.slice(..))),
                            None => candle_core::bail!("GPU kernels: {} reads the scratch buffer it writes", launch.kernel),
                        },
                        Src::Null => Ok(None),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let mut view = match (&mut target, launch.out) {
                    (Some(t), _) => t.slice_mut(..),
                    (None, Dst::Out { offset, len }) => out.slice_mut(offset..offset + len),
                    (None, Dst::Scratch(_)) => candle_core::bail!("GPU kernels: {} writes a scratch buffer in use", launch.kernel),
                };
                let mut args = func.builder();
                for input in &inputs {
                    match input {
                        Some(v) => args.arg(v),
                        None => args.arg(&null),
                    };
                }
                match (launch.side, side, launch.params) {
                    (true, Some(DeviceSide::F32(b)), Params::Row(_)) => args.arg(b),
                    (true, Some(DeviceSide::F64(b)), Params::Channel(_)) => args.arg(b),
                    (true, _, _) => candle_core::bail!("GPU kernels: {} needs its side buffer", launch.kernel),
                    (false, _, _) => args.arg(&null),
                };
                args.arg(&mut view);
                match &launch.params {
                    Params::Row(p) => args.arg(p),
                    Params::Channel(p) => args.arg(p),
                };
                let cfg = candle_core::cuda_backend::cudarc::driver::LaunchConfig {
                    grid_dim: (launch.grid, 1, 1),
                    block_dim: (launch.block, 1, 1),
                    shared_mem_bytes: launch.shared_bytes,
                };
                // SAFETY: the arguments match the kernels' common signature (a, b, c, side, out,
                // params), and the launch's bounds are the program's.
                unsafe { args.launch(cfg) }.w()?;
            }
            if let Dst::Scratch(k) = launch.out {
                scratch[k] = target;
            }
        }
        Ok(out)
    }

    /// Bytes per element of a storage (the programs size shared memory by it).
    pub fn elem_size(s: &CudaStorage) -> usize {
        candle_core::backend::BackendStorage::dtype(s).size_in_bytes()
    }

    /// Runs `program` on CUDA operands of one dtype (f32 or f64), the side buffer copied to the
    /// device here.
    pub fn run(program: &Program, operands: &[(&CudaStorage, &Layout)], side: Option<Side>) -> Result<CudaStorage> {
        let Some((first, _)) = operands.first() else { candle_core::bail!("GPU kernels: no operands") };
        let dev = &first.device;
        let side = match side {
            Some(Side::F32(v)) => Some(DeviceSide::F32(dev.clone_htod(v)?)),
            Some(Side::F64(v)) => Some(DeviceSide::F64(dev.clone_htod(v)?)),
            None => None,
        };
        macro_rules! typed {
            ($variant:ident) => {{
                let slices = operands
                    .iter()
                    .map(|(s, l)| match &s.slice {
                        CudaStorageSlice::$variant(d) => Ok((d, *l)),
                        _ => candle_core::bail!("GPU kernels: operands of mixed dtypes"),
                    })
                    .collect::<Result<Vec<_>>>()?;
                CudaStorageSlice::$variant(run_typed(dev, program, &slices, side.as_ref())?)
            }};
        }
        let slice = match &first.slice {
            CudaStorageSlice::F32(_) => typed!(F32),
            CudaStorageSlice::F64(_) => typed!(F64),
            _ => candle_core::bail!("GPU kernels support f32 and f64"),
        };
        Ok(CudaStorage { slice, device: dev.clone() })
    }
}

#[cfg(test)]
use super::kernel_host::{self, Pod};

/// Small grids, so that every kernel's grid-stride loop takes more than one turn.
#[cfg(test)]
pub(super) const SMALL_GRID: Limits = Limits { max_grid: 7, max_shared: 48 * 1024 };

/// Runs `program` on the host (`kernel_host`) on `operands`; every output and scratch element
/// starts as NaN, so one the launches miss shows in the result.
#[cfg(test)]
pub(super) fn run_on_host<T: Float + Pod>(program: &Program, operands: &[&[T]], side: Option<Side>) -> Vec<T> {
    let nan = T::from(f64::NAN);
    let mut out = vec![nan; program.out_len];
    let mut scratch: Vec<Vec<T>> = program.scratch.iter().map(|&n| vec![nan; n]).collect();
    for l in &program.launches {
        let inputs: Vec<Option<Vec<T>>> = l
            .inputs
            .iter()
            .map(|src| match *src {
                Src::Operand(i) => Some(operands[i].to_vec()),
                Src::Scratch(k) => Some(scratch[k].clone()),
                Src::Null => None,
            })
            .collect();
        let inputs: Vec<Option<&[T]>> = inputs.iter().map(|v| v.as_deref()).collect();
        let region: &mut [T] = match l.out {
            Dst::Out { offset, len } => &mut out[offset..offset + len],
            Dst::Scratch(k) => &mut scratch[k],
        };
        let side = match (l.side, side) {
            (true, Some(b)) => Some(b),
            (true, None) => panic!("{} needs its side buffer", l.kernel),
            (false, _) => None,
        };
        let params = match &l.params {
            Params::Row(p) => kernel_host::param_bytes(p),
            Params::Channel(p) => kernel_host::param_bytes(p),
        };
        kernel_host::launch(l.kernel, (l.grid, l.block, l.shared_bytes), params, &inputs, side, region);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::kernel_host::values;
    use super::*;

    #[test]
    fn launches_that_miss_elements_are_caught_as_nan() {
        // Two column-sum launches whose second writes only half the output: the host executor
        // starts every buffer as NaN, so the unwritten half shows.
        let mut program = Program::column_sums(40, 6, &SMALL_GRID);
        let last = program.launches.last_mut().unwrap();
        last.out = Dst::Out { offset: 0, len: 3 };
        let Params::Row(p) = &mut last.params else { unreachable!("column sums are a row kernel") };
        p.cols = 3;
        let x = values(1, 0.0, 1.0, 240);
        let out = run_on_host(&program, &[&x], None);
        assert!(out[..3].iter().all(|v| v.is_finite()) && out[3..].iter().all(|v| v.is_nan()), "{out:?}");
    }

    #[test]
    fn row_blocks_are_powers_of_two_from_a_warp_to_the_cap() {
        assert_eq!([1, 32, 33, 48, 197, 256, 3000].map(row_threads), [32, 32, 64, 64, 256, 256, 256]);
    }

    #[test]
    fn layer_norm_backward_refuses_rows_that_overflow_shared_memory() {
        let err = Program::layer_norm_grad(4, 6000, 1e-5, 8, &GPU).unwrap_err().to_string();
        assert!(err.contains("shared memory"), "{err}");
    }
}
