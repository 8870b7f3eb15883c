//! Collectives between data-parallel ranks: all-gather, all-reduce, reduce-scatter, broadcast,
//! barrier.
//!
//! Three implementations share one trait: [`SingleProcess`] (identity), [`ThreadGroup`] (ranks as
//! threads of one process: the tests and `align train --nproc N` on the CPU), and NCCL for GPUs
//! (behind `--features nccl`). Tensors cross as host vectors in the thread
//! group; every call blocks until all ranks have made the same call, or fails after the timeout,
//! or as soon as any rank aborts (a failing rank takes the others down with its error).

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("collective {op} timed out after {secs:.0} s on rank {rank}: waiting for ranks {missing:?}")]
    Timeout { op: &'static str, secs: f64, rank: usize, missing: Vec<usize> },
    #[error("rank {rank} failed: {message}")]
    Aborted { rank: usize, message: String },
    #[error("collective {op}: rank {rank} sent {got} values where {want} were expected")]
    Mismatch { op: &'static str, rank: usize, got: usize, want: usize },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, CollectiveError>;

/// A collective failing inside candle's arithmetic (a loss that passes blocks around the ring,
/// a step that all-reduces its gradients): candle's own error as it was, any other whole.
impl From<CollectiveError> for candle_core::Error {
    fn from(e: CollectiveError) -> Self {
        match e {
            CollectiveError::Candle(c) => c,
            other => candle_core::Error::Msg(other.to_string()),
        }
    }
}

pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Concatenates every rank's tensor along dimension 0, in rank order (equal shapes).
    fn all_gather(&self, t: &Tensor) -> Result<Tensor>;
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;
    /// One step around the ring: sends `t` to rank + 1 and returns what rank − 1 sent (same
    /// shapes). The sigmoid loss passes text blocks this way instead of gathering them all.
    fn shift(&self, t: &Tensor) -> Result<Tensor>;
    /// Every rank's bytes, in rank order (lengths may differ).
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>>;
    fn barrier(&self) -> Result<()>;
    /// Tells the other ranks this one failed, so their pending and future calls return an error.
    fn abort(&self, message: &str);

    fn all_reduce_mean(&self, t: &Tensor) -> Result<Tensor> {
        Ok((self.all_reduce_sum(t)? / self.world_size() as f64)?)
    }

    /// Sums the 1-D `t` (`counts` summed long, the same layout on every rank) over ranks and
    /// returns this rank's segment of the sum: `counts[rank]` elements after the segments of the
    /// ranks before it. Sharded training reduces gradients this way, each rank receiving only
    /// the part it updates. This fallback all-reduces and keeps the segment.
    fn reduce_scatter_sum(&self, t: &Tensor, counts: &[usize]) -> Result<Tensor> {
        check_counts("reduce_scatter", self, t, counts, true)?;
        let offset = counts[..self.rank()].iter().sum();
        Ok(self.all_reduce_sum(t)?.narrow(0, offset, counts[self.rank()])?)
    }

    /// Every rank's 1-D `t` of `counts[rank]` elements, concatenated in rank order (lengths may
    /// differ). This fallback pads each to the longest and all-gathers.
    fn all_gather_varlen(&self, t: &Tensor, counts: &[usize]) -> Result<Tensor> {
        check_counts("all_gather_varlen", self, t, counts, false)?;
        let width = counts.iter().copied().max().unwrap_or(0);
        if width == 0 {
            return Ok(t.clone());
        }
        let padded =
            if t.dim(0)? < width { Tensor::cat(&[t, &Tensor::zeros(width - t.dim(0)?, t.dtype(), t.device())?], 0)? } else { t.clone() };
        let all = self.all_gather(&padded)?;
        let parts: Vec<Tensor> = counts
            .iter()
            .enumerate()
            .filter(|(_, &n)| n > 0)
            .map(|(r, &n)| all.narrow(0, r * width, n))
            .collect::<candle_core::Result<_>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    }
}

/// `counts` has one entry a rank and `t` is the 1-D tensor it implies: the whole layout
/// (`whole`) or this rank's segment.
fn check_counts<C: Collective + ?Sized>(op: &'static str, c: &C, t: &Tensor, counts: &[usize], whole: bool) -> Result<()> {
    if counts.len() != c.world_size() {
        return Err(CollectiveError::Mismatch { op, rank: c.rank(), got: counts.len(), want: c.world_size() });
    }
    let want = if whole { counts.iter().sum() } else { counts[c.rank()] };
    let got = t.elem_count();
    if t.rank() != 1 || got != want {
        return Err(CollectiveError::Mismatch { op, rank: c.rank(), got, want });
    }
    Ok(())
}

/// One rank: every collective is the identity.
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn broadcast(&self, t: &Tensor, _root: usize) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn shift(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![bytes.to_vec()])
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn abort(&self, _message: &str) {}
}

enum Payload {
    F64(Vec<f64>),
    Bytes(Vec<u8>),
}

struct Round {
    slots: Vec<Option<Payload>>,
    /// Ranks that have read the completed round; the last one clears it.
    read: usize,
    generation: u64,
}

/// The current round and, once a rank has failed, its rank and message.
type State = (Round, Option<(usize, String)>);

struct Shared {
    world: usize,
    state: Mutex<State>,
    changed: Condvar,
    timeout: Duration,
}

/// Ranks as threads of one process. `ThreadGroup::new(w, timeout)` returns one handle per rank.
pub struct ThreadGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadGroup {
    pub fn new(world: usize, timeout: Duration) -> Vec<ThreadGroup> {
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new((Round { slots: (0..world).map(|_| None).collect(), read: 0, generation: 0 }, None)),
            changed: Condvar::new(),
            timeout,
        });
        (0..world).map(|rank| ThreadGroup { rank, shared: shared.clone() }).collect()
    }

    /// Deposits this rank's payload and, once all have deposited, returns what `read` makes of
    /// everyone's (in rank order; read under the round's lock, so a rank can take just its part
    /// without copying the others').
    fn exchange<R>(&self, op: &'static str, mine: Payload, read: impl FnOnce(&[&Payload]) -> R) -> Result<R> {
        let s = &*self.shared;
        let deadline = Instant::now() + s.timeout;
        let mut guard = s.state.lock().unwrap();
        // Wait until the previous round has been read by everyone and our slot is free.
        loop {
            if let Some((rank, message)) = &guard.1 {
                return Err(CollectiveError::Aborted { rank: *rank, message: message.clone() });
            }
            if guard.0.slots[self.rank].is_none() && guard.0.read == 0 {
                break;
            }
            guard = self.wait(guard, deadline, op)?;
        }
        guard.0.slots[self.rank] = Some(mine);
        let generation = guard.0.generation;
        s.changed.notify_all();
        loop {
            if let Some((rank, message)) = &guard.1 {
                return Err(CollectiveError::Aborted { rank: *rank, message: message.clone() });
            }
            if guard.0.generation != generation || guard.0.slots.iter().all(Option::is_some) {
                break;
            }
            guard = self.wait(guard, deadline, op)?;
        }
        let all: Vec<&Payload> = guard.0.slots.iter().map(|p| p.as_ref().expect("complete round")).collect();
        let out = read(&all);
        guard.0.read += 1;
        if guard.0.read == s.world {
            guard.0.read = 0;
            guard.0.generation += 1;
            guard.0.slots.iter_mut().for_each(|p| *p = None);
            s.changed.notify_all();
        } else {
            // Hold the round until everyone has read it.
            while guard.0.generation == generation {
                if let Some((rank, message)) = &guard.1 {
                    return Err(CollectiveError::Aborted { rank: *rank, message: message.clone() });
                }
                guard = self.wait(guard, deadline, op)?;
            }
        }
        Ok(out)
    }

    fn wait<'a>(
        &self,
        guard: std::sync::MutexGuard<'a, State>,
        deadline: Instant,
        op: &'static str,
    ) -> Result<std::sync::MutexGuard<'a, State>> {
        let now = Instant::now();
        if now >= deadline {
            let missing = guard.0.slots.iter().enumerate().filter(|(_, p)| p.is_none()).map(|(r, _)| r).collect();
            return Err(CollectiveError::Timeout { op, secs: self.shared.timeout.as_secs_f64(), rank: self.rank, missing });
        }
        Ok(self.shared.changed.wait_timeout(guard, deadline - now).unwrap().0)
    }

    /// `t`'s values as f64; a contiguous f32 tensor on the CPU (gradients, weights) is read
    /// straight from its buffer, without an f64 tensor beside the vector.
    fn values(t: &Tensor) -> Result<Vec<f64>> {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(d)), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            return Ok(d[a..b].iter().map(|&x| x as f64).collect());
        }
        drop(storage);
        Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?)
    }

    /// Exchanges `t`'s values (as f64, which holds every f32 and bf16 exactly) and returns what
    /// `read` makes of all ranks' values, after checking they have the same length.
    fn floats_with<R>(&self, op: &'static str, t: &Tensor, read: impl FnOnce(&[&[f64]]) -> R) -> Result<R> {
        self.floats_checked(op, t, |all| {
            let n = all[0].len();
            match all.iter().position(|v| v.len() != n) {
                Some(r) => Err(CollectiveError::Mismatch { op, rank: r, got: all[r].len(), want: n }),
                None => Ok(read(all)),
            }
        })
    }

    /// Exchanges `t`'s values and returns what `read` makes of them, lengths unchecked.
    fn floats_checked<R>(&self, op: &'static str, t: &Tensor, read: impl FnOnce(&[&[f64]]) -> Result<R>) -> Result<R> {
        self.exchange(op, Payload::F64(Self::values(t)?), |all| {
            let values: Vec<&[f64]> = all.iter().map(|p| if let Payload::F64(v) = p { v.as_slice() } else { &[] }).collect();
            read(&values)
        })?
    }
}

fn rebuild(values: Vec<f64>, dims: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    Ok(Tensor::from_vec(values, dims, &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?)
}

impl Collective for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let all = self.floats_with("all_gather", t, |all| all.concat())?;
        let mut dims = t.dims().to_vec();
        dims[0] *= self.shared.world;
        rebuild(all, &dims, t.dtype(), t.device())
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        // Summed in rank order on every rank: every rank gets bit-identical results.
        let sum = self.floats_with("all_reduce", t, |all| {
            let mut sum = vec![0.0f64; all[0].len()];
            for p in all {
                sum.iter_mut().zip(p.iter()).for_each(|(a, b)| *a += b);
            }
            sum
        })?;
        rebuild(sum, t.dims(), t.dtype(), t.device())
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let values = self.floats_with("broadcast", t, |all| all[root].to_vec())?;
        rebuild(values, t.dims(), t.dtype(), t.device())
    }

    /// Through the common exchange (every rank sees every block for a moment): these ranks are
    /// threads of one process sharing its memory, where a point-to-point channel would save
    /// nothing; NCCL sends one block to one peer.
    fn shift(&self, t: &Tensor) -> Result<Tensor> {
        let world = self.shared.world;
        let values = self.floats_with("shift", t, |all| all[(self.rank + world - 1) % world].to_vec())?;
        rebuild(values, t.dims(), t.dtype(), t.device())
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.exchange("all_gather_bytes", Payload::Bytes(bytes.to_vec()), |all| {
            all.iter().map(|p| if let Payload::Bytes(b) = p { b.clone() } else { Vec::new() }).collect()
        })
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", Payload::Bytes(Vec::new()), |_| ())
    }

    /// Only this rank's segment is summed (in rank order, in f64, as `all_reduce_sum` sums every
    /// element: the same bits as the whole sum's segment).
    fn reduce_scatter_sum(&self, t: &Tensor, counts: &[usize]) -> Result<Tensor> {
        check_counts("reduce_scatter", self, t, counts, true)?;
        let offset: usize = counts[..self.rank].iter().sum();
        let n = counts[self.rank];
        let sum = self.floats_with("reduce_scatter", t, |all| {
            let mut sum = vec![0.0f64; n];
            for p in all {
                sum.iter_mut().zip(&p[offset..offset + n]).for_each(|(a, b)| *a += b);
            }
            sum
        })?;
        rebuild(sum, &[n], t.dtype(), t.device())
    }

    fn all_gather_varlen(&self, t: &Tensor, counts: &[usize]) -> Result<Tensor> {
        check_counts("all_gather_varlen", self, t, counts, false)?;
        let out = self.floats_checked("all_gather_varlen", t, |all| match all.iter().zip(counts).position(|(v, &n)| v.len() != n) {
            Some(r) => Err(CollectiveError::Mismatch { op: "all_gather_varlen", rank: r, got: all[r].len(), want: counts[r] }),
            None => Ok(all.concat()),
        })?;
        let n = out.len();
        rebuild(out, &[n], t.dtype(), t.device())
    }

    fn abort(&self, message: &str) {
        let mut guard = self.shared.state.lock().unwrap();
        if guard.1.is_none() {
            guard.1 = Some((self.rank, message.to_string()));
        }
        self.shared.changed.notify_all();
    }
}

/// Where this process sits in a job, from torchrun's or SLURM's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master: Option<(String, u16)>,
}

impl DistEnv {
    /// Reads `RANK`/`WORLD_SIZE`/`LOCAL_RANK`/`LOCAL_WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`
    /// (torchrun), else `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_LOCALID`/`SLURM_NTASKS_PER_NODE`;
    /// a single process when neither is set.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> std::result::Result<Self, String> {
        let num = |k: &str| -> std::result::Result<Option<usize>, String> {
            match get(k) {
                None => Ok(None),
                Some(v) => {
                    v.trim().split('(').next().unwrap_or("").parse::<usize>().map(Some).map_err(|_| format!("{k}={v:?} is not a number"))
                }
            }
        };
        let (rank, world, local, local_world) = if let (Some(r), Some(w)) = (num("RANK")?, num("WORLD_SIZE")?) {
            (r, w, num("LOCAL_RANK")?.unwrap_or(r), num("LOCAL_WORLD_SIZE")?.unwrap_or(w))
        } else if let (Some(r), Some(w)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
            (r, w, num("SLURM_LOCALID")?.unwrap_or(r), num("SLURM_NTASKS_PER_NODE")?.unwrap_or(w))
        } else {
            (0, 1, 0, 1)
        };
        if world == 0 || rank >= world || local >= local_world.max(1) {
            return Err(format!("inconsistent ranks: rank {rank} of {world}, local rank {local} of {local_world}"));
        }
        let master = match (get("MASTER_ADDR"), num("MASTER_PORT")?) {
            (Some(a), Some(p)) if p <= u16::MAX as usize => Some((a, p as u16)),
            (Some(_), Some(p)) => return Err(format!("MASTER_PORT {p} is not a port")),
            _ => None,
        };
        Ok(DistEnv { rank, world_size: world, local_rank: local, local_world_size: local_world.max(1), master })
    }
}

/// `f(rank, group)` on `world` thread ranks at once; each rank's result, in rank order.
#[cfg(test)]
pub(crate) fn on_thread_ranks<T: Send>(world: usize, f: impl Fn(usize, Arc<dyn Collective>) -> T + Sync) -> Vec<T> {
    let groups = ThreadGroup::new(world, std::time::Duration::from_secs(30));
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = groups.into_iter().map(|g| s.spawn(move || f(g.rank(), Arc::new(g)))).collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send + 'static>(world: usize, f: impl Fn(ThreadGroup) -> T + Send + Sync + 'static) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = ThreadGroup::new(world, Duration::from_secs(10))
            .into_iter()
            .map(|g| {
                let f = f.clone();
                std::thread::spawn(move || f(g))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn gather_reduce_and_broadcast_across_thread_ranks() {
        let out = run(3, |g| {
            let r = g.rank() as f32;
            let t = Tensor::new(&[[r, 10.0 * r]], &Device::Cpu).unwrap();
            let mut results = Vec::new();
            // Many rounds in a row exercise the round hand-over.
            for _ in 0..20 {
                let gathered = g.all_gather(&t).unwrap().to_vec2::<f32>().unwrap();
                let sum = g.all_reduce_sum(&t).unwrap().to_vec2::<f32>().unwrap();
                let b = g.broadcast(&t, 2).unwrap().to_vec2::<f32>().unwrap();
                results.push((gathered, sum, b));
            }
            let bytes = g.all_gather_bytes(format!("rank{}", g.rank()).as_bytes()).unwrap();
            g.barrier().unwrap();
            (results, bytes)
        });
        for (results, bytes) in out {
            for (gathered, sum, b) in results {
                assert_eq!(gathered, vec![vec![0.0, 0.0], vec![1.0, 10.0], vec![2.0, 20.0]]);
                assert_eq!(sum, vec![vec![3.0, 30.0]]);
                assert_eq!(b, vec![vec![2.0, 20.0]]);
            }
            assert_eq!(bytes, vec![b"rank0".to_vec(), b"rank1".to_vec(), b"rank2".to_vec()]);
        }
    }

    /// Reduce-scatter and the all-gather of unequal parts on thread ranks equal the segments of
    /// an all-reduce and a plain concatenation, as do the trait's fallbacks (one rank, and a
    /// group that has only the basic collectives).
    #[test]
    fn reduce_scatter_and_unequal_all_gather_give_each_rank_its_part() {
        let counts = [3usize, 0, 2];
        let out = run(3, move |g| {
            let r = g.rank() as f32;
            let whole: Vec<f32> = (0..5).map(|i| i as f32 + 10.0 * r).collect();
            let t = Tensor::new(whole.as_slice(), &Device::Cpu).unwrap();
            let mine = g.reduce_scatter_sum(&t, &counts).unwrap().to_vec1::<f32>().unwrap();
            let part = Tensor::new(&whole[..counts[g.rank()]], &Device::Cpu).unwrap();
            let all = g.all_gather_varlen(&part, &counts).unwrap().to_vec1::<f32>().unwrap();
            let bad = g.reduce_scatter_sum(&t, &[5, 0]).unwrap_err().to_string();
            (mine, all, bad)
        });
        // Sums over ranks of i + 10r: 3i + 30.
        assert_eq!(out[0].0, vec![30.0, 33.0, 36.0]);
        assert!(out[1].0.is_empty());
        assert_eq!(out[2].0, vec![39.0, 42.0]);
        for (_, all, bad) in &out {
            assert_eq!(all, &vec![0.0, 1.0, 2.0, 20.0, 21.0]);
            assert!(bad.contains("reduce_scatter"), "{bad}");
        }
        let fallback = run(3, move |g| {
            let g = Basic(g);
            let r = g.rank() as f32;
            let whole: Vec<f32> = (0..5).map(|i| i as f32 + 10.0 * r).collect();
            let t = Tensor::new(whole.as_slice(), &Device::Cpu).unwrap();
            let mine = g.reduce_scatter_sum(&t, &counts).unwrap().to_vec1::<f32>().unwrap();
            let part = Tensor::new(&whole[..counts[g.rank()]], &Device::Cpu).unwrap();
            (mine, g.all_gather_varlen(&part, &counts).unwrap().to_vec1::<f32>().unwrap())
        });
        assert_eq!(fallback, out.iter().map(|(m, a, _)| (m.clone(), a.clone())).collect::<Vec<_>>());
        let one = SingleProcess;
        let t = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        assert_eq!(one.reduce_scatter_sum(&t, &[2]).unwrap().to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
        assert_eq!(one.all_gather_varlen(&t, &[2]).unwrap().to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
    }

    /// A group with only the required collectives: the trait's fallbacks for the others.
    struct Basic(ThreadGroup);

    impl Collective for Basic {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world_size(&self) -> usize {
            self.0.world_size()
        }
        fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
            self.0.all_gather(t)
        }
        fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
            self.0.all_reduce_sum(t)
        }
        fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
            self.0.broadcast(t, root)
        }
        fn shift(&self, t: &Tensor) -> Result<Tensor> {
            self.0.shift(t)
        }
        fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
            self.0.all_gather_bytes(bytes)
        }
        fn barrier(&self) -> Result<()> {
            self.0.barrier()
        }
        fn abort(&self, message: &str) {
            self.0.abort(message)
        }
    }

    #[test]
    fn a_failing_rank_releases_the_others_with_its_error() {
        let out = run(3, |g| {
            if g.rank() == 1 {
                g.abort("out of memory");
                return String::new();
            }
            g.barrier().unwrap_err().to_string()
        });
        assert!(out[0].contains("rank 1 failed: out of memory"), "{out:?}");
        assert!(out[2].contains("rank 1 failed"), "{out:?}");
    }

    #[test]
    fn a_missing_rank_times_out_naming_it() {
        let groups = ThreadGroup::new(2, Duration::from_millis(200));
        let err = groups[0].barrier().unwrap_err().to_string();
        assert!(err.contains("timed out") && err.contains("[1]"), "{err}");
    }

    #[test]
    fn torchrun_and_slurm_variables_give_the_rank() {
        let env =
            |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(a, _)| *a == k).map(|(_, v)| v.to_string());
        let t = DistEnv::from_env(env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!(t, DistEnv { rank: 3, world_size: 8, local_rank: 1, local_world_size: 2, master: Some(("node0".into(), 29500)) });
        let s = DistEnv::from_env(env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x4)"),
        ]))
        .unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank, s.local_world_size), (5, 16, 1, 4));
        assert_eq!(DistEnv::from_env(|_| None).unwrap().world_size, 1);
        assert!(DistEnv::from_env(env(&[("RANK", "4"), ("WORLD_SIZE", "4")])).is_err());
    }
}
