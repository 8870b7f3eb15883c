//! The contrastive loss over the global batch: embeddings gathered from every rank, with the
//! gradient routed back to the rank that owns each row.
//!
//! Two choices, named as open_clip names them:
//! - `gather_with_grad`: the all-gather is differentiable; its backward sums every rank's gradient
//!   for this rank's rows (a reduce-scatter). Without it, gathered rows are constants and only this
//!   rank's own rows (spliced back in) carry gradient.
//! - `local_loss`: each rank computes the loss of its own rows against all columns (local × global
//!   logits, memory linear in the global batch) instead of the whole global × global loss.
//!
//! After the backward pass the trainer all-reduces parameter gradients and scales them by
//! [`gradient_scale`]; the result equals the single-device gradient of the global batch exactly
//! when `gather_with_grad` is on (either loss), and when both are off. `local_loss` without
//! `gather_with_grad` drops the other ranks' terms for this rank's rows: an approximation, as in
//! open_clip.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::collective::Collective;
use super::loss::{contrastive_loss, LossParts};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GatherOptions {
    pub gather_with_grad: bool,
    pub local_loss: bool,
}

impl Default for GatherOptions {
    fn default() -> Self {
        GatherOptions { gather_with_grad: true, local_loss: true }
    }
}

/// The factor the all-reduced (summed) parameter gradients are multiplied by.
pub fn gradient_scale(opts: GatherOptions, world: usize) -> f64 {
    if !opts.gather_with_grad && !opts.local_loss {
        // Every rank computes the whole loss but differentiates only its own rows.
        1.0
    } else {
        1.0 / world as f64
    }
}

/// Every rank's row count, in rank order (ranks may hold different batches: token-budget batches
/// whose workers fell out of step, the last batch of a run).
pub fn row_counts(rows: usize, group: &Arc<dyn Collective>) -> Result<Vec<usize>> {
    if group.world_size() == 1 {
        return Ok(vec![rows]);
    }
    let all = group.all_gather_bytes(&(rows as u64).to_le_bytes()).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    all.iter()
        .map(|b| {
            let b: [u8; 8] = b
                .get(..8)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| candle_core::Error::Msg("a rank sent a malformed row count".into()))?;
            Ok(u64::from_le_bytes(b) as usize)
        })
        .collect()
}

/// Rows before rank `rank`'s in the global batch.
pub fn row_offset(counts: &[usize], rank: usize) -> usize {
    counts[..rank].iter().sum()
}

struct AllGather {
    group: Arc<dyn Collective>,
    counts: Vec<usize>,
}

/// The collective's all-gather of `local`, for unequal row counts too: every rank sends its rows
/// padded to the longest (an all-gather moves equal blocks), and the padding is cut out.
fn gather_rows(local: &Tensor, counts: &[usize], group: &Arc<dyn Collective>) -> Result<Tensor> {
    let err = |e: crate::train::collective::CollectiveError| candle_core::Error::Msg(e.to_string());
    let longest = counts.iter().copied().max().unwrap_or(0);
    if counts.iter().all(|&c| c == longest) {
        return group.all_gather(local).map_err(err);
    }
    let rows = local.dim(0)?;
    let padded = if rows < longest {
        let mut dims = local.dims().to_vec();
        dims[0] = longest - rows;
        Tensor::cat(&[local, &Tensor::zeros(dims, local.dtype(), local.device())?], 0)?
    } else {
        local.clone()
    };
    let all = group.all_gather(&padded).map_err(err)?;
    let parts: Vec<Tensor> =
        counts.iter().enumerate().filter(|(_, &c)| c > 0).map(|(r, &c)| all.narrow(0, r * longest, c)).collect::<Result<_>>()?;
    Tensor::cat(&parts, 0)
}

fn storage_tensor(s: &CpuStorage, l: &Layout) -> Result<Tensor> {
    let t = match s {
        CpuStorage::F32(d) => Tensor::from_slice(d, l.shape(), &candle_core::Device::Cpu)?,
        CpuStorage::F64(d) => Tensor::from_slice(d, l.shape(), &candle_core::Device::Cpu)?,
        _ => candle_core::bail!("all-gather supports f32 and f64"),
    };
    // The storage may be a strided view: rebuild the logical tensor.
    match l.contiguous_offsets() {
        Some((a, b)) if a == 0 && b == l.shape().elem_count() => Ok(t),
        _ => candle_core::bail!("all-gather input must be contiguous"),
    }
}

impl CustomOp1 for AllGather {
    fn name(&self) -> &'static str {
        "all-gather"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let local = storage_tensor(s, l)?;
        let all = gather_rows(&local, &self.counts, &self.group)?;
        let shape = all.shape().clone();
        let storage = match all.dtype() {
            candle_core::DType::F32 => CpuStorage::F32(all.flatten_all()?.to_vec1()?),
            _ => CpuStorage::F64(all.flatten_all()?.to_vec1()?),
        };
        Ok((storage, shape))
    }

    /// On the GPU the group (NCCL) gathers device buffers directly.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let local = Tensor::from((candle_core::Storage::Cuda(s.try_clone(l)?), l.shape().clone()));
        let all = gather_rows(&local, &self.counts, &self.group)?;
        let all = all.to_device(&local.device().clone())?.contiguous()?;
        let shape = all.shape().clone();
        let (storage, layout) = all.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cuda(c) => Ok((c.try_clone(layout)?, shape)),
            _ => candle_core::bail!("all-gather of a GPU tensor came back on another device"),
        }
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // Every rank's gradient has the global batch's shape: sum them, keep this rank's rows.
        let summed = self.group.all_reduce_sum(&grad.contiguous()?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let rank = self.group.rank();
        Ok(Some(summed.narrow(0, row_offset(&self.counts, rank), arg.dim(0)?)?))
    }
}

/// All-gathers `local` (`[rows, dim]`, `counts[r]` rows on rank r) along dimension 0.
pub fn gather(local: &Tensor, counts: &[usize], group: &Arc<dyn Collective>, with_grad: bool) -> Result<Tensor> {
    if group.world_size() == 1 {
        return Ok(local.clone());
    }
    let local = local.contiguous()?;
    if with_grad {
        return local.apply_op1(AllGather { group: group.clone(), counts: counts.to_vec() });
    }
    let all = gather_rows(&local.detach(), counts, group)?;
    // Splice this rank's own rows (with their gradient) back into the constant gathered rows.
    let rows = local.dim(0)?;
    let start = row_offset(counts, group.rank());
    let mut parts = Vec::new();
    if start > 0 {
        parts.push(all.narrow(0, 0, start)?);
    }
    parts.push(local.clone());
    let end = start + rows;
    if end < all.dim(0)? {
        parts.push(all.narrow(0, end, all.dim(0)? - end)?);
    }
    Tensor::cat(&parts, 0)
}

/// The contrastive loss of the global batch as seen from this rank. With `local_loss` the value is
/// this rank's share (the mean over ranks is the global loss); without it, the global loss itself.
/// A rank's share of a batch split unequally is its rows' mean loss weighed by its part of the
/// batch (`rows · world / global rows`), so that the mean over ranks and the averaged gradient
/// are still the global batch's.
pub fn distributed_loss(
    img: &Tensor,
    txt: &Tensor,
    logit_scale: &Tensor,
    smoothing: f64,
    group: &Arc<dyn Collective>,
    opts: GatherOptions,
) -> Result<LossParts> {
    let _profile = crate::util::profile::region("loss");
    let counts = row_counts(img.dim(0)?, group)?;
    let all_img = gather(img, &counts, group, opts.gather_with_grad)?;
    let all_txt = gather(txt, &counts, group, opts.gather_with_grad)?;
    if opts.local_loss {
        let offset = row_offset(&counts, group.rank());
        let parts = contrastive_loss(img, txt, &all_img, &all_txt, offset, logit_scale, smoothing)?;
        let global: usize = counts.iter().sum();
        let weight = (img.dim(0)? * counts.len()) as f64 / global.max(1) as f64;
        if weight == 1.0 {
            return Ok(parts);
        }
        Ok(LossParts { total: (parts.total * weight)?, i2t: (parts.i2t * weight)?, t2i: (parts.t2i * weight)? })
    } else {
        contrastive_loss(&all_img, &all_txt, &all_img, &all_txt, 0, logit_scale, smoothing)
    }
}

/// Bytes of one f32 logits matrix per rank for a global batch (one direction; the loss keeps a few
/// such matrices alive: logits, log-softmax and their gradients, in both directions).
pub fn logits_bytes(global_batch: usize, world: usize, local_loss: bool) -> usize {
    let rows = if local_loss { global_batch / world } else { global_batch };
    rows * global_batch * 4
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::train::collective::on_thread_ranks;
    use candle_core::{Device, Var};

    /// `rows` random unit vectors of `dim`, from `seed`.
    pub(crate) fn normalised(rows: usize, dim: usize, seed: u64) -> Vec<Vec<f64>> {
        let mut rng = crate::util::rng::Rng::new(seed);
        (0..rows)
            .map(|_| {
                let v: Vec<f64> = (0..dim).map(|_| rng.normal()).collect();
                let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
                v.into_iter().map(|x| x / n).collect()
            })
            .collect()
    }

    /// W ranks each holding B rows: loss and the gradient of the embeddings (as summed by the
    /// data-parallel all-reduce and scaled) equal the single-rank loss and gradient of W·B rows.
    #[test]
    fn gathered_loss_and_gradients_equal_one_big_batch() {
        let (b, dim) = (3, 5);
        for world in [2usize, 3, 4] {
            let img = normalised(world * b, dim, 1);
            let txt = normalised(world * b, dim, 2);
            // Reference: one rank, the whole batch.
            let dev = Device::Cpu;
            let (iv, tv) = (Var::new(img.clone(), &dev).unwrap(), Var::new(txt.clone(), &dev).unwrap());
            let scale = Tensor::new(4.0f64, &dev).unwrap();
            let whole = contrastive_loss(iv.as_tensor(), tv.as_tensor(), iv.as_tensor(), tv.as_tensor(), 0, &scale, 0.1).unwrap();
            let g = whole.total.backward().unwrap();
            let want_loss = whole.total.to_scalar::<f64>().unwrap();
            let want_gi = g.get(iv.as_tensor()).unwrap().to_vec2::<f64>().unwrap();
            let want_gt = g.get(tv.as_tensor()).unwrap().to_vec2::<f64>().unwrap();
            for opts in [
                GatherOptions { gather_with_grad: true, local_loss: true },
                GatherOptions { gather_with_grad: true, local_loss: false },
                GatherOptions { gather_with_grad: false, local_loss: false },
            ] {
                let results = on_thread_ranks(world, |r, group| {
                    let dev = Device::Cpu;
                    let iv = Var::new(img[r * b..(r + 1) * b].to_vec(), &dev).unwrap();
                    let tv = Var::new(txt[r * b..(r + 1) * b].to_vec(), &dev).unwrap();
                    let scale = Tensor::new(4.0f64, &dev).unwrap();
                    let parts = distributed_loss(iv.as_tensor(), tv.as_tensor(), &scale, 0.1, &group, opts).unwrap();
                    let loss = group.all_reduce_mean(&parts.total).unwrap().to_scalar::<f64>().unwrap();
                    let grads = parts.total.backward().unwrap();
                    // Parameter gradients are Σ_r h_r·∂e_r/∂θ scaled by f, so data-parallel
                    // training is exact iff f·h_r equals the single-batch gradient of the rows
                    // e_r, for every rank r.
                    let f = gradient_scale(opts, group.world_size());
                    let gi = (grads.get(iv.as_tensor()).unwrap() * f).unwrap();
                    let gt = (grads.get(tv.as_tensor()).unwrap() * f).unwrap();
                    let all_gi = group.all_gather(&gi).unwrap().to_vec2::<f64>().unwrap();
                    let all_gt = group.all_gather(&gt).unwrap().to_vec2::<f64>().unwrap();
                    (loss, all_gi, all_gt)
                });
                for (loss, gi, gt) in results {
                    assert!((loss - want_loss).abs() < 1e-12 * want_loss.abs().max(1.0), "W={world} {opts:?}: loss {loss} vs {want_loss}");
                    for (got, want) in [(gi, &want_gi), (gt, &want_gt)] {
                        for (rg, rw) in got.iter().zip(want.iter()) {
                            for (x, y) in rg.iter().zip(rw) {
                                assert!((x - y).abs() < 1e-10 * y.abs().max(1.0), "W={world} {opts:?}: gradient {x} vs {y}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Ranks holding different batches (3 + 1 rows, 1 + 3 + 2, 2 + 2 + 1 + 4): the loss and
    /// the scaled gradients are still those of one batch of all the rows, for every option that
    /// is exact with equal batches.
    #[test]
    fn unequal_batches_give_the_loss_and_gradients_of_one_batch() {
        let dim = 5;
        for counts in [vec![3usize, 1], vec![1, 3, 2], vec![2, 2, 1, 4]] {
            let total: usize = counts.iter().sum();
            let (img, txt) = (normalised(total, dim, 3), normalised(total, dim, 4));
            let dev = Device::Cpu;
            let (iv, tv) = (Var::new(img.clone(), &dev).unwrap(), Var::new(txt.clone(), &dev).unwrap());
            let scale = Tensor::new(3.0f64, &dev).unwrap();
            let whole = contrastive_loss(iv.as_tensor(), tv.as_tensor(), iv.as_tensor(), tv.as_tensor(), 0, &scale, 0.1).unwrap();
            let g = whole.total.backward().unwrap();
            let want_loss = whole.total.to_scalar::<f64>().unwrap();
            let want: Vec<f64> = [g.get(iv.as_tensor()).unwrap(), g.get(tv.as_tensor()).unwrap()]
                .iter()
                .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f64>().unwrap())
                .collect();
            for opts in [
                GatherOptions { gather_with_grad: true, local_loss: true },
                GatherOptions { gather_with_grad: true, local_loss: false },
                GatherOptions { gather_with_grad: false, local_loss: false },
            ] {
                let results = on_thread_ranks(counts.len(), |r, group| {
                    let dev = Device::Cpu;
                    let (from, n) = (row_offset(&counts, r), counts[r]);
                    let iv = Var::new(img[from..from + n].to_vec(), &dev).unwrap();
                    let tv = Var::new(txt[from..from + n].to_vec(), &dev).unwrap();
                    let scale = Tensor::new(3.0f64, &dev).unwrap();
                    let parts = distributed_loss(iv.as_tensor(), tv.as_tensor(), &scale, 0.1, &group, opts).unwrap();
                    let loss = group.all_reduce_mean(&parts.total).unwrap().to_scalar::<f64>().unwrap();
                    let grads = parts.total.backward().unwrap();
                    let f = gradient_scale(opts, group.world_size());
                    let all = |v: &Var| {
                        let g = (grads.get(v.as_tensor()).unwrap() * f).unwrap();
                        gather(&g, &counts, &group, false).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
                    };
                    (loss, [all(&iv), all(&tv)].concat())
                });
                for (loss, got) in results {
                    assert!((loss - want_loss).abs() < 1e-12 * want_loss.abs().max(1.0), "{counts:?} {opts:?}: loss {loss} vs {want_loss}");
                    for (x, y) in got.iter().zip(&want) {
                        assert!((x - y).abs() < 1e-10 * y.abs().max(1.0), "{counts:?} {opts:?}: gradient {x} vs {y}");
                    }
                }
            }
        }
    }

    #[test]
    fn logits_memory_for_align_batch() {
        // 16,384 pairs over 8 ranks: 134 MB per logits matrix with local loss, 1.07 GB without.
        assert_eq!(logits_bytes(16384, 8, true), 134_217_728);
        assert_eq!(logits_bytes(16384, 8, false), 1_073_741_824);
    }
}
