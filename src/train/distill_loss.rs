//! Distillation from a teacher's image-text similarities: the student's logits over the gathered
//! batch are pulled towards the teacher's, each at its own scale.
//!
//! - A softmax student (open_clip's `DistillClipLoss`): for every image, the cross-entropy between
//!   the teacher's softmax over the batch's texts and the student's log-softmax, and the same for
//!   every text over the images; the mean over rows, the two directions averaged. The `kl` form
//!   (MobileCLIP) subtracts the teacher's entropy: the same gradient, a value that is 0 when the
//!   student matches the teacher.
//! - A sigmoid student (SigLIP): for every image-text pair, the binary cross-entropy between the
//!   teacher's probability σ(t'·x'·y' + b') and the student's logit t·x·y + b, summed and divided
//!   by the batch as the sigmoid loss is; `kl` again subtracts the teacher's entropy.
//!
//! Across ranks each rank computes its own rows against every column (the texts and images of all
//! ranks, the student's gathered with their gradient, the teacher's as constants), and its value is
//! its share: the mean over ranks is the loss of the global batch and the gradients averaged over
//! ranks are its gradient, whatever the ranks' batch sizes, as for the local softmax loss.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor, D};

use super::collective::Collective;
use super::gather::{gather, row_counts};
pub use crate::config::DistillLoss;

/// The teacher's logit scale (the factor its cosines are multiplied by) and, for a sigmoid
/// teacher, its bias.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TeacherLogits {
    pub scale: f64,
    pub bias: Option<f64>,
}

fn f32_or_f64(t: &Tensor) -> Result<Tensor> {
    if t.dtype() == DType::F64 {
        Ok(t.clone())
    } else {
        t.to_dtype(DType::F32)
    }
}

/// Mean over rows of −Σ p_teacher · log p_student (softmax over columns), less the teacher's
/// entropy for `kl`.
fn soft_cross_entropy(student: &Tensor, teacher: &Tensor, kind: DistillLoss) -> Result<Tensor> {
    let rows = student.dim(0)?;
    let log_q = candle_nn::ops::log_softmax(student, D::Minus1)?;
    let log_p = candle_nn::ops::log_softmax(teacher, D::Minus1)?;
    let p = log_p.exp()?;
    let terms = match kind {
        DistillLoss::CrossEntropy => (&p * log_q)?.neg()?,
        DistillLoss::Kl => (&p * (log_p - log_q)?)?,
    };
    terms.sum_all()? / rows.max(1) as f64
}

/// This rank's share of the distillation loss (a 0-d tensor joined to the student's graph).
/// `img`, `txt`: the student's L2-normalised embeddings of this rank's rows; `t_img`, `t_txt`: the
/// teacher's of the same rows; `scale` (and `bias`, for a sigmoid student): the student's.
#[allow(clippy::too_many_arguments)]
pub fn distill_loss(
    img: &Tensor,
    txt: &Tensor,
    t_img: &Tensor,
    t_txt: &Tensor,
    scale: &Tensor,
    bias: Option<&Tensor>,
    teacher: TeacherLogits,
    kind: DistillLoss,
    group: &Arc<dyn Collective>,
) -> Result<Tensor> {
    let _profile = crate::util::profile::region("loss");
    let n = img.dim(0)?;
    let counts = row_counts(n, group)?;
    let (global, world) = (counts.iter().sum::<usize>(), counts.len());
    let (img, txt, scale) = (f32_or_f64(img)?, f32_or_f64(txt)?, f32_or_f64(scale)?);
    let (t_img, t_txt) = (t_img.detach().to_dtype(img.dtype())?, t_txt.detach().to_dtype(img.dtype())?);
    let all_txt = gather(&txt, &counts, group, true)?;
    let all_t_txt = gather(&t_txt, &counts, group, false)?;
    let student_i2t = img.matmul(&all_txt.t()?)?.broadcast_mul(&scale)?;
    let teacher_i2t = (t_img.matmul(&all_t_txt.t()?)? * teacher.scale)?;
    match bias {
        None => {
            let all_img = gather(&img, &counts, group, true)?;
            let all_t_img = gather(&t_img, &counts, group, false)?;
            let student_t2i = txt.matmul(&all_img.t()?)?.broadcast_mul(&scale)?;
            let teacher_t2i = (t_txt.matmul(&all_t_img.t()?)? * teacher.scale)?;
            let both = (soft_cross_entropy(&student_i2t, &teacher_i2t, kind)? + soft_cross_entropy(&student_t2i, &teacher_t2i, kind)?)?;
            // The mean of the two directions over this rank's rows, weighed by its part of the
            // global batch.
            both * (0.5 * (n * world) as f64 / global.max(1) as f64)
        }
        Some(b) => {
            let Some(t_bias) = teacher.bias else {
                candle_core::bail!("a sigmoid student distils from a teacher with a logit bias (a SigLIP teacher)");
            };
            let s = student_i2t.broadcast_add(&f32_or_f64(b)?)?;
            let p = candle_nn::ops::sigmoid(&(teacher_i2t + t_bias)?)?;
            // −[p·log σ(s) + (1 − p)·log(1 − σ(s))] = softplus(s) − p·s, stable for any s.
            let softplus = (s.relu()? + (s.abs()?.neg()?.exp()? + 1.0)?.log()?)?;
            let mut terms = (softplus - (&p * &s)?)?;
            if kind == DistillLoss::Kl {
                // Less the teacher's binary entropy, with 0·log 0 = 0.
                let plogp = |q: &Tensor| -> Result<Tensor> { (q * q.clamp(1e-30, 1.0)?.log()?)?.to_dtype(q.dtype()) };
                let entropy = (plogp(&p)? + plogp(&p.affine(-1.0, 1.0)?)?)?.neg()?;
                terms = (terms - entropy)?;
            }
            // Summed over pairs and divided by the mean rows per rank, as the sigmoid loss is.
            terms.sum_all()? / (global as f64 / world as f64).max(1e-12)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::collective::{on_thread_ranks, SingleProcess};
    use crate::train::gather::row_offset;
    use crate::train::gather::tests::normalised;
    use candle_core::{Device, Var};

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    fn log_softmax(v: &[f64]) -> Vec<f64> {
        let m = v.iter().cloned().fold(f64::MIN, f64::max);
        let lse = m + v.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        v.iter().map(|x| x - lse).collect()
    }

    /// Plain f64 from the definitions.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        img: &[Vec<f64>],
        txt: &[Vec<f64>],
        t_img: &[Vec<f64>],
        t_txt: &[Vec<f64>],
        s: f64,
        b: Option<f64>,
        t: TeacherLogits,
        kl: bool,
    ) -> f64 {
        let n = img.len();
        match b {
            None => {
                let direction = |a: &[Vec<f64>], c: &[Vec<f64>], ta: &[Vec<f64>], tc: &[Vec<f64>]| -> f64 {
                    (0..n)
                        .map(|i| {
                            let q = log_softmax(&c.iter().map(|y| s * dot(&a[i], y)).collect::<Vec<_>>());
                            let lp = log_softmax(&tc.iter().map(|y| t.scale * dot(&ta[i], y)).collect::<Vec<_>>());
                            lp.iter().zip(&q).map(|(lp, lq)| lp.exp() * (if kl { lp - lq } else { -lq })).sum::<f64>()
                        })
                        .sum::<f64>()
                        / n as f64
                };
                0.5 * (direction(img, txt, t_img, t_txt) + direction(txt, img, t_txt, t_img))
            }
            Some(b) => {
                let mut total = 0.0;
                for i in 0..n {
                    for j in 0..n {
                        let z = s * dot(&img[i], &txt[j]) + b;
                        let p = 1.0 / (1.0 + (-(t.scale * dot(&t_img[i], &t_txt[j]) + t.bias.unwrap())).exp());
                        let q = 1.0 / (1.0 + (-z).exp());
                        total += -(p * q.ln() + (1.0 - p) * (1.0 - q).ln());
                        if kl {
                            total += p * p.ln() + (1.0 - p) * (1.0 - p).ln();
                        }
                    }
                }
                total / n as f64
            }
        }
    }

    struct Case {
        img: Vec<Vec<f64>>,
        txt: Vec<Vec<f64>>,
        t_img: Vec<Vec<f64>>,
        t_txt: Vec<Vec<f64>>,
    }

    fn case(n: usize, seed: u64) -> Case {
        Case {
            img: normalised(n, 4, seed),
            txt: normalised(n, 4, seed + 1),
            t_img: normalised(n, 6, seed + 2),
            t_txt: normalised(n, 6, seed + 3),
        }
    }

    /// Loss and gradients (images, texts, scale, bias) of `rows` of `c` on a rank of `group`.
    #[allow(clippy::type_complexity)]
    fn run(
        c: &Case,
        rows: std::ops::Range<usize>,
        s: f64,
        b: Option<f64>,
        t: TeacherLogits,
        kind: DistillLoss,
        group: &Arc<dyn Collective>,
    ) -> (f64, Vec<Vec<f64>>, Vec<Vec<f64>>, f64, Option<f64>) {
        let dev = Device::Cpu;
        let iv = Var::new(c.img[rows.clone()].to_vec(), &dev).unwrap();
        let tv = Var::new(c.txt[rows.clone()].to_vec(), &dev).unwrap();
        let sv = Var::new(s, &dev).unwrap();
        let bv = b.map(|b| Var::new(b, &dev).unwrap());
        let ti = Tensor::new(c.t_img[rows.clone()].to_vec(), &dev).unwrap();
        let tt = Tensor::new(c.t_txt[rows].to_vec(), &dev).unwrap();
        let loss =
            distill_loss(iv.as_tensor(), tv.as_tensor(), &ti, &tt, sv.as_tensor(), bv.as_ref().map(|v| v.as_tensor()), t, kind, group)
                .unwrap();
        let g = loss.backward().unwrap();
        let value = group.all_reduce_mean(&loss).unwrap().to_scalar::<f64>().unwrap();
        let f = 1.0 / group.world_size() as f64;
        let counts = row_counts(iv.as_tensor().dim(0).unwrap(), group).unwrap();
        let rows_of =
            |v: &Var| gather(&(g.get(v.as_tensor()).unwrap() * f).unwrap(), &counts, group, false).unwrap().to_vec2::<f64>().unwrap();
        let sum = |v: &Var| group.all_reduce_sum(&(g.get(v.as_tensor()).unwrap() * f).unwrap()).unwrap().to_scalar::<f64>().unwrap();
        (value, rows_of(&iv), rows_of(&tv), sum(&sv), bv.as_ref().map(sum))
    }

    const SOFTMAX_TEACHER: TeacherLogits = TeacherLogits { scale: 20.0, bias: None };
    const SIGMOID_TEACHER: TeacherLogits = TeacherLogits { scale: 12.0, bias: Some(-6.0) };

    /// Two orthogonal pairs, student and teacher alike, both scales log 3: every row's logits are
    /// (log 3, 0), so both softmaxes are (3/4, 1/4) and the cross-entropy is the entropy
    /// −(3/4·log 3/4 + 1/4·log 1/4); the KL form is 0.
    #[test]
    fn two_pairs_by_hand() {
        let e = vec![vec![1.0, 0.0], vec![0.0, 1.0]];
        let c = Case { img: e.clone(), txt: e.clone(), t_img: e.clone(), t_txt: e };
        let single: Arc<dyn Collective> = Arc::new(SingleProcess);
        let t = TeacherLogits { scale: 3f64.ln(), bias: None };
        let (ce, ..) = run(&c, 0..2, 3f64.ln(), None, t, DistillLoss::CrossEntropy, &single);
        let want = -(0.75 * 0.75f64.ln() + 0.25 * 0.25f64.ln());
        assert!((ce - want).abs() < 1e-12, "{ce} vs {want}");
        let (kl, ..) = run(&c, 0..2, 3f64.ln(), None, t, DistillLoss::Kl, &single);
        assert!(kl.abs() < 1e-12, "{kl}");
    }

    #[test]
    fn loss_and_gradients_match_the_definition_and_finite_differences() {
        let single: Arc<dyn Collective> = Arc::new(SingleProcess);
        let c = case(5, 1);
        for (b, t) in [(None, SOFTMAX_TEACHER), (Some(-2.0), SIGMOID_TEACHER)] {
            for kind in [DistillLoss::CrossEntropy, DistillLoss::Kl] {
                let kl = kind == DistillLoss::Kl;
                let s = 7.0;
                let (loss, gi, gt, gs, gb) = run(&c, 0..5, s, b, t, kind, &single);
                let want = reference(&c.img, &c.txt, &c.t_img, &c.t_txt, s, b, t, kl);
                assert!((loss - want).abs() < 1e-10 * want.abs().max(1.0), "{b:?} {kind:?}: {loss} vs {want}");
                let h = 1e-6;
                let fd = |f: &dyn Fn(f64) -> f64| (f(h) - f(-h)) / (2.0 * h);
                for (r, k) in [(0, 0), (2, 3), (4, 1)] {
                    let bump = |m: &[Vec<f64>], d: f64| {
                        let mut m = m.to_vec();
                        m[r][k] += d;
                        m
                    };
                    let want_i = fd(&|d| reference(&bump(&c.img, d), &c.txt, &c.t_img, &c.t_txt, s, b, t, kl));
                    let want_t = fd(&|d| reference(&c.img, &bump(&c.txt, d), &c.t_img, &c.t_txt, s, b, t, kl));
                    assert!((gi[r][k] - want_i).abs() < 1e-6, "{b:?} {kind:?} image ({r},{k}): {} vs {want_i}", gi[r][k]);
                    assert!((gt[r][k] - want_t).abs() < 1e-6, "{b:?} {kind:?} text ({r},{k}): {} vs {want_t}", gt[r][k]);
                }
                let want_s = fd(&|d| reference(&c.img, &c.txt, &c.t_img, &c.t_txt, s + d, b, t, kl));
                assert!((gs - want_s).abs() < 1e-6, "{b:?} {kind:?} scale: {gs} vs {want_s}");
                if let (Some(b), Some(gb)) = (b, gb) {
                    let want_b = fd(&|d| reference(&c.img, &c.txt, &c.t_img, &c.t_txt, s, Some(b + d), t, kl));
                    assert!((gb - want_b).abs() < 1e-6, "{kind:?} bias: {gb} vs {want_b}");
                }
            }
        }
    }

    /// 2, 3 and 4 thread ranks, equal and unequal batches: the mean of the ranks' values is the
    /// one-rank loss of all the rows, and the ranks' gradients averaged are its gradients.
    #[test]
    fn ranks_give_the_loss_and_gradients_of_one_batch() {
        let single: Arc<dyn Collective> = Arc::new(SingleProcess);
        for counts in [vec![3usize, 3], vec![2, 2, 2, 2], vec![4, 1], vec![1, 3, 2], vec![2, 5, 1, 3]] {
            let total: usize = counts.iter().sum();
            let c = case(total, total as u64);
            for (b, t) in [(None, SOFTMAX_TEACHER), (Some(-2.0), SIGMOID_TEACHER)] {
                let want = run(&c, 0..total, 5.0, b, t, DistillLoss::CrossEntropy, &single);
                let results = on_thread_ranks(counts.len(), |r, group| {
                    let from = row_offset(&counts, r);
                    run(&c, from..from + counts[r], 5.0, b, t, DistillLoss::CrossEntropy, &group)
                });
                let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
                for got in results {
                    assert!(close(got.0, want.0), "{counts:?} {b:?}: {} vs {}", got.0, want.0);
                    for (x, y) in got.1.iter().chain(&got.2).flatten().zip(want.1.iter().chain(&want.2).flatten()) {
                        assert!(close(*x, *y), "{counts:?} {b:?}: gradient {x} vs {y}");
                    }
                    assert!(close(got.3, want.3), "{counts:?} {b:?}: scale gradient {} vs {}", got.3, want.3);
                    if let (Some(x), Some(y)) = (got.4, want.4) {
                        assert!(close(x, y), "{counts:?}: bias gradient {x} vs {y}");
                    }
                }
            }
        }
    }
}
