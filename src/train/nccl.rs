//! NCCL collectives for GPU ranks (`--features nccl`): one communicator per process, on the
//! rank's CUDA stream, set up through [`super::rendezvous`] with torchrun's or SLURM's variables.
//!
//! Tensors on the rank's GPU go through NCCL as they are; host tensors are copied to the GPU and
//! back. A failing rank exits; `align launch`, torchrun and srun then stop the others (NCCL has
//! no way to interrupt a peer blocked in a collective short of its own watchdog).

use std::sync::Mutex;
use std::time::Duration;

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::cudarc::nccl::{Comm, Id, NcclType, ReduceOp};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{CudaDevice, DType, Device, Storage, Tensor};

use super::collective::{Collective, CollectiveError, DistEnv, Result};
use super::rendezvous;

pub struct NcclGroup {
    comm: Mutex<Comm>,
    device: Device,
    rank: usize,
    world: usize,
}

// SAFETY: the communicator is only used under the mutex, one collective at a time, which is
// what NCCL requires of a communicator shared between threads.
unsafe impl Send for NcclGroup {}
unsafe impl Sync for NcclGroup {}

fn err(e: impl std::fmt::Debug) -> CollectiveError {
    CollectiveError::Candle(candle_core::Error::Msg(format!("NCCL: {e:?}")))
}

impl NcclGroup {
    /// Joins the job described by `env` on `cuda:LOCAL_RANK`.
    pub fn join(env: &DistEnv, timeout: Duration) -> anyhow::Result<Self> {
        let (addr, port) = env.master.clone().ok_or_else(|| anyhow::anyhow!("a multi-process job needs MASTER_ADDR and MASTER_PORT"))?;
        let device = Device::new_cuda(env.local_rank)?;
        let id = if env.rank == 0 { Some(Id::new().map_err(|e| anyhow::anyhow!("ncclGetUniqueId: {e:?}"))?) } else { None };
        let bytes = id.map(|id| id.internal().map(|c| c as u8));
        let shared = rendezvous::share_id(&addr, port, env.rank, env.world_size, bytes, timeout)?;
        let id = Id::uninit(shared.map(|b| b as std::ffi::c_char));
        let stream = device.as_cuda_device()?.cuda_stream();
        let comm = Comm::from_rank(stream, env.rank, env.world_size, id).map_err(|e| anyhow::anyhow!("ncclCommInitRank: {e:?}"))?;
        Ok(NcclGroup { comm: Mutex::new(comm), device, rank: env.rank, world: env.world_size })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    fn cuda(&self) -> Result<&CudaDevice> {
        Ok(self.device.as_cuda_device()?)
    }

    /// The tensor's elements as a contiguous slice on this rank's GPU.
    fn on_gpu(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.to_device(&self.device)?.contiguous()?)
    }

    /// Runs `f(src, dst)` over the tensor's data for every dtype NCCL knows, and wraps `dst`.
    fn run<F>(&self, t: &Tensor, out_len: usize, out_shape: Vec<usize>, f: F) -> Result<Tensor>
    where
        F: Fn(&Comm, &dyn Ops) -> Result<()>,
    {
        let g = self.on_gpu(t)?;
        let dev = self.cuda()?.clone();
        let (storage, layout) = g.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else { unreachable!("moved to the GPU above") };
        let (lo, hi) = layout.contiguous_offsets().expect("made contiguous above");
        let comm = self.comm.lock().unwrap();
        let out = match g.dtype() {
            DType::F32 => typed::<f32, F>(&comm, cs, lo..hi, out_len, &dev, &f)?,
            DType::F64 => typed::<f64, F>(&comm, cs, lo..hi, out_len, &dev, &f)?,
            DType::U8 => typed::<u8, F>(&comm, cs, lo..hi, out_len, &dev, &f)?,
            DType::I64 => typed::<i64, F>(&comm, cs, lo..hi, out_len, &dev, &f)?,
            d => return Err(err(format!("no NCCL type for {d:?}"))),
        };
        drop(storage);
        let out = Tensor::from((Storage::Cuda(out), out_shape));
        Ok(out.to_device(t.device())?)
    }
}

/// The operations a collective may run on one dtype's source and destination buffers.
trait Ops {
    fn all_gather(&self, comm: &Comm) -> Result<()>;
    fn all_reduce_sum(&self, comm: &Comm) -> Result<()>;
    fn reduce_scatter_sum(&self, comm: &Comm) -> Result<()>;
    fn broadcast(&self, comm: &Comm, root: usize) -> Result<()>;
    fn shift(&self, comm: &Comm, next: usize, prev: usize) -> Result<()>;
}

struct Buffers<'a, T: NcclType + DeviceRepr> {
    src: candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>,
    dst: std::cell::RefCell<CudaSlice<T>>,
}

impl<T: NcclType + DeviceRepr> Ops for Buffers<'_, T> {
    fn all_gather(&self, comm: &Comm) -> Result<()> {
        comm.all_gather(&self.src, &mut *self.dst.borrow_mut()).map(|_| ()).map_err(err)
    }
    fn all_reduce_sum(&self, comm: &Comm) -> Result<()> {
        comm.all_reduce(&self.src, &mut *self.dst.borrow_mut(), &ReduceOp::Sum).map(|_| ()).map_err(err)
    }
    fn reduce_scatter_sum(&self, comm: &Comm) -> Result<()> {
        comm.reduce_scatter(&self.src, &mut *self.dst.borrow_mut(), &ReduceOp::Sum).map(|_| ()).map_err(err)
    }
    fn broadcast(&self, comm: &Comm, root: usize) -> Result<()> {
        let src = (comm.rank() == root).then_some(&self.src);
        comm.broadcast(src, &mut *self.dst.borrow_mut(), root as i32).map(|_| ()).map_err(err)
    }
    /// A send and a receive in one NCCL group, so that no rank waits on its neighbour's send.
    fn shift(&self, comm: &Comm, next: usize, prev: usize) -> Result<()> {
        let mut dst = self.dst.borrow_mut();
        let send = self.src.slice(..);
        let recv = dst.slice_mut(..);
        let mut group = comm.group();
        group.send(send, next as i32).map_err(err)?;
        group.recv(recv, prev as i32).map(|_| ()).map_err(err)
    }
}

fn typed<T, F>(comm: &Comm, cs: &CudaStorage, range: std::ops::Range<usize>, out_len: usize, dev: &CudaDevice, f: &F) -> Result<CudaStorage>
where
    T: NcclType + DeviceRepr + ValidAsZeroBits + CudaDType,
    F: Fn(&Comm, &dyn Ops) -> Result<()>,
{
    let src = cs.as_cuda_slice::<T>()?.slice(range);
    let dst = dev.alloc_zeros::<T>(out_len)?;
    let bufs = Buffers { src, dst: std::cell::RefCell::new(dst) };
    f(comm, &bufs)?;
    Ok(CudaStorage::wrap_cuda_slice(bufs.dst.into_inner(), dev.clone()))
}

impl Collective for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let mut shape = t.dims().to_vec();
        if shape.is_empty() {
            shape.push(1);
        }
        shape[0] *= self.world;
        self.run(t, t.elem_count() * self.world, shape, |c, b| b.all_gather(c))
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.run(t, t.elem_count(), t.dims().to_vec(), |c, b| b.all_reduce_sum(c))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.run(t, t.elem_count(), t.dims().to_vec(), |c, b| b.broadcast(c, root))
    }

    fn shift(&self, t: &Tensor) -> Result<Tensor> {
        let (next, prev) = ((self.rank + 1) % self.world, (self.rank + self.world - 1) % self.world);
        self.run(t, t.elem_count(), t.dims().to_vec(), |c, b| b.shift(c, next, prev))
    }

    /// NCCL's reduce-scatter gives every rank the same count: each rank's segment is padded
    /// with zeros to the longest, and the padding cut off the result.
    fn reduce_scatter_sum(&self, t: &Tensor, counts: &[usize]) -> Result<Tensor> {
        if counts.len() != self.world || t.rank() != 1 || t.elem_count() != counts.iter().sum::<usize>() {
            return Err(CollectiveError::Mismatch {
                op: "reduce_scatter",
                rank: self.rank,
                got: t.elem_count(),
                want: counts.iter().sum(),
            });
        }
        let width = counts.iter().copied().max().unwrap_or(0);
        if width == 0 {
            return Ok(t.clone());
        }
        let g = self.on_gpu(t)?;
        let mut parts = Vec::with_capacity(2 * self.world);
        let mut offset = 0;
        for &n in counts {
            if n > 0 {
                parts.push(g.narrow(0, offset, n)?);
            }
            if n < width {
                parts.push(Tensor::zeros(width - n, g.dtype(), g.device())?);
            }
            offset += n;
        }
        let padded = Tensor::cat(&parts, 0)?;
        let mine = self.run(&padded, width, vec![width], |c, b| b.reduce_scatter_sum(c))?;
        Ok(mine.narrow(0, 0, counts[self.rank])?.to_device(t.device())?)
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let lens = self.all_gather(&Tensor::new(&[bytes.len() as i64], &Device::Cpu)?)?.to_vec1::<i64>()?;
        // Every rank sends the same length (NCCL's all-gather needs it): the longest, at least 1.
        let width = lens.iter().copied().max().unwrap_or(0).max(1) as usize;
        let mut padded = bytes.to_vec();
        padded.resize(width, 0);
        let all = self.all_gather(&Tensor::from_vec(padded, width, &Device::Cpu)?)?.to_vec1::<u8>()?;
        Ok(lens.iter().enumerate().map(|(r, &n)| all[r * width..r * width + n as usize].to_vec()).collect())
    }

    fn barrier(&self) -> Result<()> {
        self.all_reduce_sum(&Tensor::zeros(1, DType::F32, &self.device)?)?.to_vec1::<f32>()?;
        Ok(())
    }

    fn abort(&self, _message: &str) {
        // The process is about to exit with this message; its launcher stops the other ranks.
    }
}
