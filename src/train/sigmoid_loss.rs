//! SigLIP's sigmoid loss (Zhai et al. 2023): every image-text pair is its own binary problem,
//! `−log σ(z · (t·x·y + b))` with z = +1 for a matching pair and −1 otherwise, summed over all
//! pairs of the global batch and divided by its size. t = exp(s) and b are learned.
//!
//! Across ranks the loss is computed without the global batch's logits or texts on any rank.
//! With `exchange = "shift"` (open_clip's name), each rank keeps its images, and the text blocks
//! travel around the ring: at step k rank r scores its images against rank r−k's texts, an
//! `n × n` logits block, with positives only at k = 0. The gradient of each text block is carried
//! along with it and arrives back at its owner after the last step, so neither the forward nor the
//! backward pass holds more than one foreign block. `exchange = "gather"` all-gathers the texts
//! instead (`n × N` logits); it is kept as the reference the ring is tested against.
//!
//! The loss and its gradients are computed together, in one pass around the ring, outside
//! candle's graph; a surrogate whose gradient is exactly those gradients joins them to the graph
//! (as the GradCache step does). Rank r's value is the loss of its own images over the mean rows
//! per rank (`N / world`, its own `n` when ranks hold equal batches); their mean over ranks is the
//! global loss, and the trainer's gradient all-reduce (scaled by 1/world, as for the local
//! softmax loss) gives the single-device gradient. Ranks may hold different batches: the ring's
//! blocks travel padded to the largest, and each rank scores only a block's real rows.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

use super::collective::Collective;
use super::gather::{gather, row_counts, row_offset};
use super::loss::LossParts;
pub use crate::config::Exchange;

/// z for an `n × m` block: −1 everywhere but +1 at `(i, offset + i)` when `diagonal` is
/// Some(offset). Built on the block's device (a host matrix would cross the bus every step).
fn signs(n: usize, m: usize, diagonal: Option<usize>, like: &Tensor) -> Result<Tensor> {
    let Some(offset) = diagonal else { return Tensor::full(-1.0, (n, m), like.device())?.to_dtype(like.dtype()) };
    let mut parts = Vec::with_capacity(3);
    if offset > 0 {
        parts.push(Tensor::zeros((n, offset), like.dtype(), like.device())?);
    }
    parts.push(Tensor::eye(n, like.dtype(), like.device())?);
    if offset + n < m {
        parts.push(Tensor::zeros((n, m - offset - n), like.dtype(), like.device())?);
    }
    Tensor::cat(&parts, 1)?.affine(2.0, -1.0)
}

/// The terms of one block, `x` (`n × d`) against `y` (`m × d`), positives as [`signs`] places
/// them, all 0-d or matrices on the device: the summed loss, dL/dlogits (divided by the mean
/// rows per rank `per_rank`), and the block's parts of dL/dt and dL/db.
fn block(x: &Tensor, y: &Tensor, t: f64, b: f64, diagonal: Option<usize>, per_rank: f64) -> Result<[Tensor; 4]> {
    let dots = x.matmul(&y.t()?)?;
    let (n, m) = dots.dims2()?;
    let z = signs(n, m, diagonal, &dots)?;
    // ℓ = softplus(u) = max(u, 0) + log(1 + exp(−|u|)) with u = −z·logit, stable for any u.
    let u = (&z * dots.affine(t, b)?)?.neg()?;
    let loss = (u.relu()? + (u.abs()?.neg()?.exp()? + 1.0)?.log()?)?.to_dtype(DType::F64)?.sum_all()?;
    // dℓ/dlogit = −z·σ(u).
    let g = ((z.neg()? * candle_nn::ops::sigmoid(&u)?)? / per_rank)?;
    let d_t = (&g * &dots)?.to_dtype(DType::F64)?.sum_all()?;
    let d_b = g.to_dtype(DType::F64)?.sum_all()?;
    Ok([loss, g, d_t, d_b])
}

/// The texts of a travelling `[texts | their gradients]` block: its first `m` rows and `d`
/// columns, packed, since a GPU product refuses a column block of the wider matrix.
fn ring_block(travelling: &Tensor, m: usize, d: usize) -> Result<Tensor> {
    crate::ops::gemm_layout::packed(&travelling.narrow(0, 0, m)?.narrow(1, 0, d)?)
}

/// The sigmoid loss of this rank's pairs. `img`, `txt`: this rank's L2-normalised embeddings
/// (`n × d`, `n` the rank's own); `logit_scale`: t (0-d), `logit_bias`: b (0-d), both joined
/// to their parameters in the graph. Computed in f32 (f64 when the embeddings are f64).
pub fn sigmoid_loss(
    img: &Tensor,
    txt: &Tensor,
    logit_scale: &Tensor,
    logit_bias: &Tensor,
    group: &Arc<dyn Collective>,
    exchange: Exchange,
) -> Result<LossParts> {
    let _profile = crate::util::profile::region("loss");
    let dtype = if img.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let x = img.detach().to_dtype(dtype)?;
    let own = txt.detach().to_dtype(dtype)?;
    let t = logit_scale.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let b = logit_bias.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let (n, d, world, rank) = (x.dim(0)?, x.dim(1)?, group.world_size(), group.rank());
    let counts = row_counts(n, group)?;
    let per_rank = counts.iter().sum::<usize>() as f64 / world as f64;
    let longest = counts.iter().copied().max().unwrap_or(n);
    // A block padded with zero rows to the longest, so that every rank sends equal blocks.
    let pad = |t: Tensor| -> Result<Tensor> {
        let rows = t.dim(0)?;
        if rows == longest {
            return Ok(t);
        }
        Tensor::cat(&[&t, &Tensor::zeros((longest - rows, t.dim(1)?), t.dtype(), t.device())?], 0)
    };
    let zero = Tensor::zeros((), DType::F64, x.device())?;
    let (mut loss, mut d_t, mut d_b) = (zero.clone(), zero.clone(), zero);
    let mut add = |[l, g, dt, db]: [Tensor; 4]| -> Result<Tensor> {
        loss = (&loss + l)?;
        d_t = (&d_t + dt)?;
        d_b = (&d_b + db)?;
        Ok(g)
    };
    let (d_x, d_y) = match exchange {
        Exchange::Shift => {
            // The block and the gradient gathered for it so far travel together, side by side.
            let mut travelling = pad(Tensor::cat(&[&own, &own.zeros_like()?], 1)?)?;
            let mut d_x = x.zeros_like()?;
            for k in 0..world {
                if k > 0 {
                    travelling = group.shift(&travelling)?;
                }
                // At step k the block is rank (r − k)'s.
                let m = counts[(rank + world - k) % world];
                let y = ring_block(&travelling, m, d)?;
                let g = add(block(&x, &y, t, b, (k == 0).then_some(0), per_rank)?)?;
                d_x = (d_x + (g.matmul(&y)? * t)?)?;
                let d_y = (travelling.narrow(0, 0, m)?.narrow(1, d, d)? + (g.t()?.matmul(&x)? * t)?)?;
                travelling = pad(Tensor::cat(&[&y, &d_y], 1)?)?;
            }
            // After world − 1 steps rank r holds rank r+1's block: one more step takes each
            // block's gradient home.
            let d_y = travelling.narrow(1, d, d)?;
            let d_y = if world > 1 { group.shift(&d_y.contiguous()?)? } else { d_y };
            (d_x, d_y.narrow(0, 0, n)?)
        }
        Exchange::Gather => {
            let all = gather(&own, &counts, group, false)?;
            let offset = row_offset(&counts, rank);
            let g = add(block(&x, &all, t, b, Some(offset), per_rank)?)?;
            // Every rank's gradient for every text, summed, then this rank's rows.
            let d_all = group.all_reduce_sum(&(g.t()?.matmul(&x)? * t)?)?;
            ((g.matmul(&all)? * t)?, d_all.narrow(0, offset, n)?)
        }
    };
    let value = (loss / per_rank)?.to_dtype(dtype)?;
    // Σ ⟨param, its gradient⟩: differentiating it yields exactly the gradients computed above.
    let surrogate = ((img.to_dtype(dtype)? * d_x)?.sum_all()? + (txt.to_dtype(dtype)? * d_y)?.sum_all()?)?;
    let surrogate = (surrogate + logit_scale.to_dtype(dtype)?.mul(&d_t.to_dtype(dtype)?)?)?;
    let surrogate = (surrogate + logit_bias.to_dtype(dtype)?.mul(&d_b.to_dtype(dtype)?)?)?;
    let total = ((&surrogate - surrogate.detach())? + value)?;
    // The loss has no direction: both halves of the report are the loss itself.
    Ok(LossParts { i2t: total.detach(), t2i: total.detach(), total })
}

/// Bytes of the f32 logits one rank holds at once for a global batch: one `n × n` block with the
/// ring, `n × N` with the texts gathered (the loss keeps about four such matrices alive: logits,
/// signs, loss terms and their gradient).
pub fn logits_bytes(global_batch: usize, world: usize, exchange: Exchange) -> usize {
    let n = global_batch / world;
    match exchange {
        Exchange::Shift => n * n * 4,
        Exchange::Gather => n * global_batch * 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::collective::{on_thread_ranks, SingleProcess};
    use crate::train::gather::tests::normalised;
    use candle_core::{Device, Var};

    #[test]
    fn the_ring_hands_its_products_texts_a_gpu_takes_as_they_lie() {
        use crate::ops::gemm_layout::gpu_accepts;
        // [texts | gradients], 5 real rows of a block padded to 6, 4 columns each.
        let travelling = Tensor::arange(0f32, 48.0, &Device::Cpu).unwrap().reshape((6, 8)).unwrap();
        let y = ring_block(&travelling, 5, 4).unwrap();
        assert!(gpu_accepts(&y) && gpu_accepts(&y.t().unwrap()), "{:?}", y.stride());
        let rows = y.to_vec2::<f32>().unwrap();
        assert_eq!(rows.len(), 5);
        assert_eq!(rows[4], [32.0, 33.0, 34.0, 35.0]);
    }

    /// Plain f64: the loss of all pairs divided by the batch, from the definition.
    fn reference(img: &[Vec<f64>], txt: &[Vec<f64>], t: f64, b: f64) -> f64 {
        let mut total = 0.0;
        for (i, x) in img.iter().enumerate() {
            for (j, y) in txt.iter().enumerate() {
                let z = if i == j { 1.0 } else { -1.0 };
                let logit = t * x.iter().zip(y).map(|(p, q)| p * q).sum::<f64>() + b;
                total += -(1.0 / (1.0 + (-z * logit).exp())).ln();
            }
        }
        total / img.len() as f64
    }

    struct Inputs {
        img: Var,
        txt: Var,
        s: Var,
        b: Var,
    }

    fn inputs(img: &[Vec<f64>], txt: &[Vec<f64>], s: f64, b: f64) -> Inputs {
        let dev = Device::Cpu;
        Inputs {
            img: Var::new(img.to_vec(), &dev).unwrap(),
            txt: Var::new(txt.to_vec(), &dev).unwrap(),
            s: Var::new(s, &dev).unwrap(),
            b: Var::new(b, &dev).unwrap(),
        }
    }

    /// Loss and gradients of (img, txt, s, b) on one rank.
    fn single(v: &Inputs) -> (f64, Vec<Vec<f64>>, Vec<Vec<f64>>, f64, f64) {
        let group: Arc<dyn Collective> = Arc::new(SingleProcess);
        let scale = v.s.as_tensor().exp().unwrap();
        let parts = sigmoid_loss(v.img.as_tensor(), v.txt.as_tensor(), &scale, v.b.as_tensor(), &group, Exchange::Shift).unwrap();
        let g = parts.total.backward().unwrap();
        let get2 = |x: &Var| g.get(x.as_tensor()).unwrap().to_vec2::<f64>().unwrap();
        let get0 = |x: &Var| g.get(x.as_tensor()).unwrap().to_scalar::<f64>().unwrap();
        (parts.total.to_scalar::<f64>().unwrap(), get2(&v.img), get2(&v.txt), get0(&v.s), get0(&v.b))
    }

    #[test]
    fn two_pairs_by_hand() {
        // Orthogonal unit embeddings, t = 1, b = 0: the matching logits are 1, the others 0.
        // Loss = [2·(−log σ(1)) + 2·(−log σ(0))] / 2 = log(1 + e⁻¹) + log 2.
        let e = vec![vec![1.0, 0.0], vec![0.0, 1.0]];
        let (loss, ..) = single(&inputs(&e, &e, 0.0, 0.0));
        let want = (1.0 + (-1f64).exp()).ln() + 2f64.ln();
        assert!((loss - want).abs() < 1e-12, "{loss} vs {want}");
        // With SigLIP's initial t = 10, b = −10 the 2 positives cost −log σ(0) = log 2 each and the
        // negatives −log σ(10) each.
        let (loss, ..) = single(&inputs(&e, &e, 10f64.ln(), -10.0));
        let want = (2.0 * 2f64.ln() + 2.0 * (1.0 + (-10f64).exp()).ln()) / 2.0;
        assert!((loss - want).abs() < 1e-12, "{loss} vs {want}");
    }

    #[test]
    fn loss_and_gradients_match_the_definition_and_finite_differences() {
        let (img, txt) = (normalised(5, 4, 1), normalised(5, 4, 2));
        let (s, b) = (2.0f64.ln() + 1.0, -1.5);
        let (loss, gi, gt, gs, gb) = single(&inputs(&img, &txt, s, b));
        assert!((loss - reference(&img, &txt, s.exp(), b)).abs() < 1e-12);
        let h = 1e-6;
        let fd = |f: &dyn Fn(f64) -> f64| (f(h) - f(-h)) / (2.0 * h);
        for (r, c) in [(0, 0), (2, 3), (4, 1)] {
            let bump = |m: &[Vec<f64>], d: f64| {
                let mut m = m.to_vec();
                m[r][c] += d;
                m
            };
            let want_i = fd(&|d| reference(&bump(&img, d), &txt, s.exp(), b));
            let want_t = fd(&|d| reference(&img, &bump(&txt, d), s.exp(), b));
            assert!((gi[r][c] - want_i).abs() < 1e-7, "image ({r},{c}): {} vs {want_i}", gi[r][c]);
            assert!((gt[r][c] - want_t).abs() < 1e-7, "text ({r},{c}): {} vs {want_t}", gt[r][c]);
        }
        let want_s = fd(&|d| reference(&img, &txt, (s + d).exp(), b));
        let want_b = fd(&|d| reference(&img, &txt, s.exp(), b + d));
        assert!((gs - want_s).abs() < 1e-7, "log scale: {gs} vs {want_s}");
        assert!((gb - want_b).abs() < 1e-7, "bias: {gb} vs {want_b}");
    }

    /// 2, 3 and 4 ranks, each exchange, equal batches and unequal ones: the mean of the ranks'
    /// losses is the single-device loss of the whole batch, and the ranks' summed gradients
    /// scaled by 1/world its gradients.
    #[test]
    fn ranks_give_the_single_device_loss_and_gradients() {
        let splits = [vec![3, 3], vec![3, 3, 3], vec![3, 3, 3, 3], vec![4, 1], vec![1, 3, 2], vec![2, 5, 1, 3]];
        for (case, counts) in splits.iter().enumerate() {
            let (world, total) = (counts.len(), counts.iter().sum::<usize>());
            let (img, txt) = (normalised(total, 6, 10 + case as u64), normalised(total, 6, 20 + case as u64));
            let (want, want_gi, want_gt, want_gs, want_gb) = single(&inputs(&img, &txt, 1.7, -3.0));
            for exchange in [Exchange::Shift, Exchange::Gather] {
                let results = on_thread_ranks(world, |r, group| {
                    let (from, n) = (row_offset(counts, r), counts[r]);
                    let v = inputs(&img[from..from + n], &txt[from..from + n], 1.7, -3.0);
                    let scale = v.s.as_tensor().exp().unwrap();
                    let parts = sigmoid_loss(v.img.as_tensor(), v.txt.as_tensor(), &scale, v.b.as_tensor(), &group, exchange).unwrap();
                    let loss = group.all_reduce_mean(&parts.total).unwrap().to_scalar::<f64>().unwrap();
                    let g = parts.total.backward().unwrap();
                    let f = 1.0 / world as f64;
                    let rows = |x: &Var| {
                        let t = (g.get(x.as_tensor()).unwrap() * f).unwrap();
                        gather(&t, counts, &group, false).unwrap().to_vec2::<f64>().unwrap()
                    };
                    let sum =
                        |x: &Var| group.all_reduce_sum(&(g.get(x.as_tensor()).unwrap() * f).unwrap()).unwrap().to_scalar::<f64>().unwrap();
                    (loss, rows(&v.img), rows(&v.txt), sum(&v.s), sum(&v.b))
                });
                for (loss, gi, gt, gs, gb) in results {
                    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
                    assert!(close(loss, want), "{counts:?} {exchange:?}: loss {loss} vs {want}");
                    assert!(close(gs, want_gs) && close(gb, want_gb), "{counts:?} {exchange:?}: {gs} {gb} vs {want_gs} {want_gb}");
                    for (got, want) in [(gi, &want_gi), (gt, &want_gt)] {
                        for (x, y) in got.iter().flatten().zip(want.iter().flatten()) {
                            assert!(close(*x, *y), "{counts:?} {exchange:?}: gradient {x} vs {y}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn logits_memory_at_a_global_batch_of_32k() {
        // 32,768 pairs over 8 ranks: one 4096² block (64 MiB) against 4096 × 32,768 (512 MiB).
        assert_eq!(logits_bytes(32768, 8, Exchange::Shift), 64 << 20);
        assert_eq!(logits_bytes(32768, 8, Exchange::Gather), 512 << 20);
        // Over 256 ranks the ring's block shrinks with the local batch; gathering does not.
        assert_eq!(logits_bytes(32768, 256, Exchange::Shift), 64 << 10);
        assert_eq!(logits_bytes(32768, 256, Exchange::Gather), 16 << 20);
    }
}
