//! ALIGN's normalised-softmax contrastive loss: image→text plus text→image, one shared learnable
//! temperature, label smoothing, negatives from the whole (gathered) batch.
//!
//! The loss takes this rank's embeddings and the embeddings of the whole global batch, plus the
//! offset of this rank's rows in it. Each rank computes the loss of its own rows against all
//! columns (local × global logits, open_clip's `--local-loss`); with gathered embeddings that
//! carry gradients, the mean over ranks of these losses equals the single-device loss of the
//! global batch, and averaging the ranks' gradients gives the single-device gradient. On one
//! device, pass the local embeddings as the global ones with offset 0.

use candle_core::{DType, Result, Tensor, D};

pub struct LossParts {
    /// `i2t + t2i` (ALIGN eq. 1 + eq. 2), a 0-d tensor, or their mean (see
    /// [`LossParts::mean_of_directions`]).
    pub total: Tensor,
    pub i2t: Tensor,
    pub t2i: Tensor,
}

impl LossParts {
    /// The loss as CLIP and open_clip state it: the mean of the two directions, not their sum
    /// (half the gradient, and a logged value that compares with open_clip's `ClipLoss`).
    pub fn mean_of_directions(self) -> candle_core::Result<LossParts> {
        Ok(LossParts { total: (self.total * 0.5)?, ..self })
    }
}

/// Cross-entropy of each row of `logits` (`[rows, cols]`) against target column `offset + row`,
/// with the target distribution `(1 - ε)·onehot + ε/cols`, averaged over rows.
pub fn smoothed_cross_entropy(logits: &Tensor, offset: usize, smoothing: f64) -> Result<Tensor> {
    let (rows, cols) = logits.dims2()?;
    if offset + rows > cols {
        candle_core::bail!("local rows {offset}..{} exceed the {cols} gathered columns", offset + rows);
    }
    let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let mut q = vec![smoothing / cols as f64; rows * cols];
    for r in 0..rows {
        q[r * cols + offset + r] += 1.0 - smoothing;
    }
    let q = Tensor::from_vec(q, (rows, cols), logits.device())?.to_dtype(logp.dtype())?;
    // A rank without rows (it still joins the gathers) adds nothing.
    (logp * q)?.sum_all()?.neg()? / rows.max(1) as f64
}

/// The contrastive loss of this rank's rows. Embeddings must be L2-normalised; `logit_scale` is
/// the 0-d factor 1/σ (or CLIP's exp(s)). Computed in f32 whatever the towers' dtype.
pub fn contrastive_loss(
    local_img: &Tensor,
    local_txt: &Tensor,
    all_img: &Tensor,
    all_txt: &Tensor,
    offset: usize,
    logit_scale: &Tensor,
    smoothing: f64,
) -> Result<LossParts> {
    let f = |t: &Tensor| if t.dtype() == DType::F64 { Ok(t.clone()) } else { t.to_dtype(DType::F32) };
    let (li, lt, ai, at) = (f(local_img)?, f(local_txt)?, f(all_img)?, f(all_txt)?);
    let scale = f(logit_scale)?;
    let i2t_logits = li.matmul(&at.t()?)?.broadcast_mul(&scale)?;
    let t2i_logits = lt.matmul(&ai.t()?)?.broadcast_mul(&scale)?;
    let i2t = smoothed_cross_entropy(&i2t_logits, offset, smoothing)?;
    let t2i = smoothed_cross_entropy(&t2i_logits, offset, smoothing)?;
    Ok(LossParts { total: (&i2t + &t2i)?, i2t, t2i })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Plain-f64 reference of one direction: rows of `a` against rows of `b`.
    fn reference(a: &[Vec<f64>], b: &[Vec<f64>], offset: usize, scale: f64, eps: f64) -> f64 {
        let n = b.len();
        let mut total = 0.0;
        for (r, x) in a.iter().enumerate() {
            let logits: Vec<f64> = b.iter().map(|y| scale * x.iter().zip(y).map(|(p, q)| p * q).sum::<f64>()).collect();
            let m = logits.iter().cloned().fold(f64::MIN, f64::max);
            let lse = m + logits.iter().map(|l| (l - m).exp()).sum::<f64>().ln();
            for (j, l) in logits.iter().enumerate() {
                let q = eps / n as f64 + if j == offset + r { 1.0 - eps } else { 0.0 };
                total -= q * (l - lse);
            }
        }
        total / a.len() as f64
    }

    fn normalized(rows: &[[f64; 3]]) -> Vec<Vec<f64>> {
        rows.iter()
            .map(|r| {
                let n = r.iter().map(|v| v * v).sum::<f64>().sqrt();
                r.iter().map(|v| v / n).collect()
            })
            .collect()
    }

    fn t(rows: &[Vec<f64>]) -> Tensor {
        Tensor::new(rows.to_vec(), &Device::Cpu).unwrap()
    }

    #[test]
    fn two_pairs_by_hand() {
        // Orthogonal unit embeddings, σ = 1: each row has logits [1, 0] in the right place.
        let img = t(&[vec![1.0, 0.0], vec![0.0, 1.0]]);
        let scale = Tensor::new(1.0f64, &Device::Cpu).unwrap();
        let plain = contrastive_loss(&img, &img, &img, &img, 0, &scale, 0.0).unwrap();
        let want = -(1f64.exp() / (1f64.exp() + 1.0)).ln();
        assert!((plain.i2t.to_scalar::<f64>().unwrap() - want).abs() < 1e-12);
        assert!((plain.total.to_scalar::<f64>().unwrap() - 2.0 * want).abs() < 1e-12);
        // With smoothing 0.1 over 2 columns: q = [0.95, 0.05].
        let smooth = contrastive_loss(&img, &img, &img, &img, 0, &scale, 0.1).unwrap();
        let lse = (1f64.exp() + 1.0).ln();
        let want = -(0.95 * (1.0 - lse) + 0.05 * (0.0 - lse));
        assert!((smooth.i2t.to_scalar::<f64>().unwrap() - want).abs() < 1e-12);
    }

    #[test]
    fn matches_an_independent_reference_in_both_parameterisations() {
        let img = normalized(&[[1.0, 2.0, 0.5], [-0.3, 1.0, 2.0], [0.7, -1.0, 0.2], [0.0, 0.4, -1.0]]);
        let txt = normalized(&[[0.9, 2.1, 0.4], [0.1, 0.8, 1.5], [1.0, -0.5, 0.0], [0.2, 0.1, -0.9]]);
        for (scale, eps) in [(1.0 / 1.0, 0.1), (1.0 / 0.07, 0.0), (100.0, 0.1)] {
            let s = Tensor::new(scale, &Device::Cpu).unwrap();
            let got = contrastive_loss(&t(&img), &t(&txt), &t(&img), &t(&txt), 0, &s, eps).unwrap();
            let want_i2t = reference(&img, &txt, 0, scale, eps);
            let want_t2i = reference(&txt, &img, 0, scale, eps);
            assert!((got.i2t.to_scalar::<f64>().unwrap() - want_i2t).abs() < 1e-10);
            assert!((got.t2i.to_scalar::<f64>().unwrap() - want_t2i).abs() < 1e-10);
        }
    }

    #[test]
    fn local_rows_against_the_gathered_batch_average_to_the_global_loss() {
        let img = normalized(&[[1.0, 2.0, 0.5], [-0.3, 1.0, 2.0], [0.7, -1.0, 0.2], [0.0, 0.4, -1.0]]);
        let txt = normalized(&[[0.9, 2.1, 0.4], [0.1, 0.8, 1.5], [1.0, -0.5, 0.0], [0.2, 0.1, -0.9]]);
        let s = Tensor::new(3.0f64, &Device::Cpu).unwrap();
        let global = contrastive_loss(&t(&img), &t(&txt), &t(&img), &t(&txt), 0, &s, 0.1).unwrap().total.to_scalar::<f64>().unwrap();
        let mut sum = 0.0;
        for rank in 0..2 {
            let li = t(&img[2 * rank..2 * rank + 2]);
            let lt = t(&txt[2 * rank..2 * rank + 2]);
            sum += contrastive_loss(&li, &lt, &t(&img), &t(&txt), 2 * rank, &s, 0.1).unwrap().total.to_scalar::<f64>().unwrap();
        }
        assert!((sum / 2.0 - global).abs() < 1e-12);
    }

    #[test]
    fn gradients_match_central_finite_differences() {
        let dev = Device::Cpu;
        let img0 = normalized(&[[1.0, 2.0, 0.5], [-0.3, 1.0, 2.0], [0.7, -1.0, 0.2]]);
        let txt0 = normalized(&[[0.9, 2.1, 0.4], [0.1, 0.8, 1.5], [1.0, -0.5, 0.0]]);
        let img = Var::new(img0.clone(), &dev).unwrap();
        let txt = Var::new(txt0.clone(), &dev).unwrap();
        let sigma = Var::new(0.5f64, &dev).unwrap();
        let loss_of = |i: &Tensor, x: &Tensor, sg: &Tensor| {
            let scale = sg.recip().unwrap();
            contrastive_loss(i, x, i, x, 0, &scale, 0.1).unwrap().total
        };
        let grads = loss_of(img.as_tensor(), txt.as_tensor(), sigma.as_tensor()).backward().unwrap();
        let h = 1e-6;
        let eval = |i: Vec<Vec<f64>>, x: Vec<Vec<f64>>, sg: f64| {
            loss_of(&t(&i), &t(&x), &Tensor::new(sg, &dev).unwrap()).to_scalar::<f64>().unwrap()
        };
        let gi = grads.get(img.as_tensor()).unwrap().to_vec2::<f64>().unwrap();
        let gt = grads.get(txt.as_tensor()).unwrap().to_vec2::<f64>().unwrap();
        for r in 0..3 {
            for c in 0..3 {
                let (mut p, mut m) = (img0.clone(), img0.clone());
                p[r][c] += h;
                m[r][c] -= h;
                let fd = (eval(p, txt0.clone(), 0.5) - eval(m, txt0.clone(), 0.5)) / (2.0 * h);
                assert!((fd - gi[r][c]).abs() < 1e-6, "d/dimg[{r}][{c}]: fd {fd} vs {}", gi[r][c]);
                let (mut p, mut m) = (txt0.clone(), txt0.clone());
                p[r][c] += h;
                m[r][c] -= h;
                let fd = (eval(img0.clone(), p, 0.5) - eval(img0.clone(), m, 0.5)) / (2.0 * h);
                assert!((fd - gt[r][c]).abs() < 1e-6, "d/dtxt[{r}][{c}]");
            }
        }
        let gs = grads.get(sigma.as_tensor()).unwrap().to_scalar::<f64>().unwrap();
        let fd = (eval(img0.clone(), txt0.clone(), 0.5 + h) - eval(img0.clone(), txt0.clone(), 0.5 - h)) / (2.0 * h);
        assert!((fd - gs).abs() < 1e-6, "dσ: fd {fd} vs {gs}");
    }
}
