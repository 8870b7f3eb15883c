//! The cudarc executor of [`Program`]s: every launch of every kernel file goes through
//! [`run`] (a fresh output) or [`run_in_place`] (an existing buffer the kernels rewrite).

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, Layout, Result};

use super::program::{kernel_suffix, Dst, Params, Program, SideBuf, Src};

/// The side buffer on the device.
enum DeviceSide {
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
}

/// Bytes per element of a storage (the programs size shared memory by it).
pub fn elem_size(s: &CudaStorage) -> usize {
    candle_core::backend::BackendStorage::dtype(s).size_in_bytes()
}

fn launch_all<T: DeviceRepr + super::super::Float>(
    dev: &CudaDevice,
    program: &Program,
    operands: &[(&CudaSlice<T>, &Layout)],
    side: Option<&DeviceSide>,
    out: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let views = operands
        .iter()
        .map(|(s, l)| match l.contiguous_offsets() {
            Some((lo, hi)) => Ok(s.slice(lo..hi)),
            None => candle_core::bail!("GPU kernels: operands must be contiguous"),
        })
        .collect::<Result<Vec<_>>>()?;
    // SAFETY: the program's launches write every element of each scratch buffer before anything
    // reads it (the host emulation's tests fill them with NaN first and check).
    let mut scratch = program.scratch.iter().map(|&n| unsafe { dev.alloc::<T>(n) }.map(Some)).collect::<Result<Vec<_>>>()?;
    // Absent pointers (operands a kernel does not read, no side buffer) are passed as null.
    let null = 0u64;
    for launch in &program.launches {
        let module = launch.params.module();
        let name = format!("{}_{}", launch.kernel, kernel_suffix::<T>());
        let func = dev.get_or_load_custom_func(&name, &format!("align_{}", module.file()), module.ptx())?;
        // A launch writing a scratch buffer holds it alone; reading it in the same launch would
        // be an error of the program, reported below.
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
            match (launch.side, side, module.side_is_f32()) {
                (true, Some(DeviceSide::F32(b)), true) => args.arg(b),
                (true, Some(DeviceSide::F64(b)), false) => args.arg(b),
                (true, _, _) => candle_core::bail!("GPU kernels: {} needs its side buffer", launch.kernel),
                (false, _, _) => args.arg(&null),
            };
            args.arg(&mut view);
            match &launch.params {
                Params::Row(p) => args.arg(p),
                Params::Channel(p) => args.arg(p),
                Params::Depthwise(p) => args.arg(p),
                Params::Optim(p) => args.arg(p),
            };
            let cfg =
                LaunchConfig { grid_dim: (launch.grid, 1, 1), block_dim: (launch.block, 1, 1), shared_mem_bytes: launch.shared_bytes };
            // SAFETY: the arguments match the kernels' common signature (a, b, c, side, out,
            // params), and the launch's bounds are the program's.
            unsafe { args.launch(cfg) }.w()?;
        }
        if let Dst::Scratch(k) = launch.out {
            scratch[k] = target;
        }
    }
    Ok(())
}

fn device_side(dev: &CudaDevice, side: Option<&SideBuf>) -> Result<Option<DeviceSide>> {
    Ok(match side {
        Some(SideBuf::F32(v)) => Some(DeviceSide::F32(dev.clone_htod(v)?)),
        Some(SideBuf::F64(v)) => Some(DeviceSide::F64(dev.clone_htod(v)?)),
        None => None,
    })
}

macro_rules! typed_operands {
    ($operands:expr, $variant:ident) => {
        $operands
            .iter()
            .map(|(s, l)| match &s.slice {
                CudaStorageSlice::$variant(d) => Ok((d, *l)),
                _ => candle_core::bail!("GPU kernels: operands of mixed dtypes"),
            })
            .collect::<Result<Vec<_>>>()?
    };
}

/// Runs `program` on CUDA operands of one dtype (f32 or f64) into a new output, the side buffer
/// copied to the device here.
pub fn run(program: &Program, operands: &[(&CudaStorage, &Layout)], side: Option<&SideBuf>) -> Result<CudaStorage> {
    let Some((first, _)) = operands.first() else { candle_core::bail!("GPU kernels: no operands") };
    let dev = &first.device;
    let side = device_side(dev, side)?;
    macro_rules! typed {
        ($variant:ident, $t:ty) => {{
            let slices = typed_operands!(operands, $variant);
            // SAFETY: the program's launches write every element of the output before anything
            // reads it (the host emulation's tests start it as NaN and check).
            let mut out = unsafe { dev.alloc::<$t>(program.out_len)? };
            launch_all(dev, program, &slices, side.as_ref(), &mut out.slice_mut(..))?;
            CudaStorageSlice::$variant(out)
        }};
    }
    let slice = match &first.slice {
        CudaStorageSlice::F32(_) => typed!(F32, f32),
        CudaStorageSlice::F64(_) => typed!(F64, f64),
        _ => candle_core::bail!("GPU kernels support f32 and f64"),
    };
    Ok(CudaStorage { slice, device: dev.clone() })
}

/// Runs `program` with `target` as its output, which the kernels read and rewrite in place (the
/// optimizer's update). f32 only.
pub fn run_in_place(program: &Program, (target, layout): (&mut CudaStorage, &Layout), operands: &[(&CudaStorage, &Layout)]) -> Result<()> {
    let dev = target.device.clone();
    let slices = typed_operands!(operands, F32);
    let (CudaStorageSlice::F32(out), Some((a, b))) = (&mut target.slice, layout.contiguous_offsets()) else {
        candle_core::bail!("GPU kernels update contiguous f32 tensors in place")
    };
    if b - a != program.out_len {
        candle_core::bail!("GPU kernels: an in-place output of {} values for a program writing {}", b - a, program.out_len);
    }
    launch_all(&dev, program, &slices, None, &mut out.slice_mut(a..b))
}
