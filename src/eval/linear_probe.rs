//! Linear probe (ALIGN §5.2, CLIP_benchmark's `linear_probe`): a linear classifier (weights and a
//! bias) on frozen, L2-normalised image embeddings, trained with AdamW and cross-entropy, the
//! learning rate on a cosine schedule stepped per batch, batches reshuffled every epoch from the
//! seed. The weight decay is chosen on a held-out part of the training split, as CLIP_benchmark
//! chooses it: 97 values from 1e-6 to 1e2 (log-spaced), first every 16th of them, then around the
//! best one at steps of 8, 4, 2 and 1, keeping the earlier value on ties; the final classifier is
//! trained on the whole training split with the chosen decay and scored on the test split.

use serde::Serialize;

use super::metrics::Embeddings;
use crate::util::rng::Rng;

#[derive(Debug, Clone)]
pub struct ProbeConfig {
    pub epochs: usize,
    pub lr: f64,
    pub batch: usize,
    /// Share of the training split held out to choose the weight decay (0: no search, no decay).
    pub val_proportion: f64,
    pub seed: u64,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        // CLIP_benchmark's defaults.
        ProbeConfig { epochs: 10, lr: 0.1, batch: 64, val_proportion: 0.2, seed: 0 }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProbeReport {
    pub acc1: f64,
    /// None below five classes, as CLIP_benchmark reports it.
    pub acc5: Option<f64>,
    pub mean_per_class_recall: f64,
    pub weight_decay: f64,
    pub epochs: usize,
    pub train: usize,
    pub test: usize,
    pub classes: usize,
}

/// A linear classifier: `classes × dim` weights and `classes` biases.
#[derive(Debug, Clone, PartialEq)]
struct Linear {
    w: Vec<f64>,
    b: Vec<f64>,
    dim: usize,
}

impl Linear {
    fn logits(&self, x: &[f32]) -> Vec<f64> {
        self.b
            .iter()
            .enumerate()
            .map(|(c, &b)| b + self.w[c * self.dim..][..self.dim].iter().zip(x).map(|(w, &v)| w * v as f64).sum::<f64>())
            .collect()
    }
}

/// Cross-entropy of `rows` (indices into `x`) and its gradient, averaged over the rows.
fn loss_and_grad(m: &Linear, x: &Embeddings, y: &[usize], rows: &[usize]) -> (f64, Linear) {
    let mut g = Linear { w: vec![0.0; m.w.len()], b: vec![0.0; m.b.len()], dim: m.dim };
    let mut loss = 0.0;
    let n = rows.len().max(1) as f64;
    for &r in rows {
        let z = m.logits(x.row(r));
        let max = z.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v));
        let sum: f64 = z.iter().map(|v| (v - max).exp()).sum();
        loss += (sum.ln() + max - z[y[r]]) / n;
        for (c, zc) in z.iter().enumerate() {
            let d = ((zc - max).exp() / sum - f64::from(u8::from(c == y[r]))) / n;
            g.b[c] += d;
            for (gw, &v) in g.w[c * m.dim..][..m.dim].iter_mut().zip(x.row(r)) {
                *gw += d * v as f64;
            }
        }
    }
    (loss, g)
}

/// Trains on `rows` of `x` with weight decay `wd`.
fn train(x: &Embeddings, y: &[usize], rows: &[usize], classes: usize, wd: f64, cfg: &ProbeConfig) -> Linear {
    let dim = x.dim;
    // PyTorch's nn.Linear initialisation: uniform in ±1/√dim, from the seed.
    let mut rng = Rng::new(cfg.seed);
    let bound = 1.0 / (dim as f64).sqrt();
    let mut m = Linear { w: (0..classes * dim).map(|_| rng.uniform(-bound, bound)).collect(), b: vec![0.0; classes], dim };
    m.b.iter_mut().for_each(|b| *b = rng.uniform(-bound, bound));
    let mut adam = AdamW::new(m.w.len() + m.b.len());
    let batches = rows.len().div_ceil(cfg.batch.max(1));
    let total = (cfg.epochs * batches).max(1);
    let mut order = rows.to_vec();
    let mut step = 0;
    for epoch in 0..cfg.epochs {
        Rng::derived(cfg.seed, &[epoch as u64]).shuffle(&mut order);
        for chunk in order.chunks(cfg.batch.max(1)) {
            let lr = 0.5 * (1.0 + (std::f64::consts::PI * step as f64 / total as f64).cos()) * cfg.lr;
            let (_, g) = loss_and_grad(&m, x, y, chunk);
            adam.step(&mut m, &g, lr, wd);
            step += 1;
        }
    }
    m
}

/// PyTorch's AdamW (β = 0.9, 0.999, ε = 1e-8; decay applied to the weights as `p ← p(1 − lr·wd)`,
/// the bias included, as `torch.optim.AdamW` over all of `nn.Linear`'s parameters does).
struct AdamW {
    m: Vec<f64>,
    v: Vec<f64>,
    t: i32,
}

impl AdamW {
    fn new(n: usize) -> Self {
        AdamW { m: vec![0.0; n], v: vec![0.0; n], t: 0 }
    }

    fn step(&mut self, p: &mut Linear, g: &Linear, lr: f64, wd: f64) {
        self.t += 1;
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
        let (bc1, bc2) = (1.0 - b1.powi(self.t), 1.0 - b2.powi(self.t));
        let params = p.w.iter_mut().chain(p.b.iter_mut());
        let grads = g.w.iter().chain(g.b.iter());
        for (((p, &g), m), v) in params.zip(grads).zip(&mut self.m).zip(&mut self.v) {
            *p *= 1.0 - lr * wd;
            *m = b1 * *m + (1.0 - b1) * g;
            *v = b2 * *v + (1.0 - b2) * g * g;
            *p -= lr * (*m / bc1) / ((*v / bc2).sqrt() + eps);
        }
    }
}

/// Top-1 and top-5 hits and per-class recall of `m` on `rows`.
fn score(m: &Linear, x: &Embeddings, y: &[usize], rows: &[usize], classes: usize) -> (f64, f64, f64) {
    let (mut top1, mut top5) = (0usize, 0usize);
    let mut per_class = vec![(0usize, 0usize); classes];
    for &r in rows {
        let z = m.logits(x.row(r));
        let label = y[r];
        // Ties go to the smaller class index, as argmax and a stable sort give them.
        let rank = z.iter().enumerate().filter(|&(c, &v)| v > z[label] || (v == z[label] && c < label)).count();
        top1 += usize::from(rank < 1);
        top5 += usize::from(rank < 5);
        per_class[label].0 += 1;
        per_class[label].1 += usize::from(rank < 1);
    }
    let n = rows.len().max(1) as f64;
    let present: Vec<f64> = per_class.iter().filter(|(n, _)| *n > 0).map(|&(n, h)| h as f64 / n as f64).collect();
    (top1 as f64 / n, top5 as f64 / n, present.iter().sum::<f64>() / present.len().max(1) as f64)
}

/// The decays CLIP_benchmark searches: 97 values, log-spaced from 1e-6 to 1e2.
fn decays() -> Vec<f64> {
    (0..97).map(|i| 10f64.powf(-6.0 + 8.0 * i as f64 / 96.0)).collect()
}

/// The decay with the best validation top-1 (the earlier on ties).
fn choose_decay(x: &Embeddings, y: &[usize], fit: &[usize], val: &[usize], classes: usize, cfg: &ProbeConfig) -> f64 {
    let wds = decays();
    let mut cache: std::collections::HashMap<usize, f64> = std::collections::HashMap::new();
    let mut acc = |i: usize| *cache.entry(i).or_insert_with(|| score(&train(x, y, fit, classes, wds[i], cfg), x, y, val, classes).0);
    let best_of = |candidates: &[usize], acc: &mut dyn FnMut(usize) -> f64| {
        let mut best = (candidates[0], f64::NEG_INFINITY);
        for &i in candidates {
            let a = acc(i);
            if a > best.1 {
                best = (i, a);
            }
        }
        best.0
    };
    let mut peak = best_of(&(0..97).step_by(16).collect::<Vec<_>>(), &mut acc);
    for span in [8, 4, 2, 1] {
        peak = best_of(&[peak.saturating_sub(span), peak, (peak + span).min(96)], &mut acc);
    }
    wds[peak]
}

/// The probe: decay chosen on a held-out part of `train`, the classifier trained on all of
/// `train`, scored on `test`. Labels are class indices below `classes`.
pub fn probe(
    train_x: &Embeddings,
    train_y: &[usize],
    test_x: &Embeddings,
    test_y: &[usize],
    classes: usize,
    cfg: &ProbeConfig,
) -> ProbeReport {
    let mut rows: Vec<usize> = (0..train_x.rows()).collect();
    let wd = if cfg.val_proportion > 0.0 && rows.len() >= 2 {
        Rng::derived(cfg.seed, &[0x0056_414c]).shuffle(&mut rows);
        let n_val = ((rows.len() as f64 * cfg.val_proportion).round() as usize).clamp(1, rows.len() - 1);
        let (val, fit) = rows.split_at(n_val);
        choose_decay(train_x, train_y, fit, val, classes, cfg)
    } else {
        0.0
    };
    let all: Vec<usize> = (0..train_x.rows()).collect();
    let m = train(train_x, train_y, &all, classes, wd, cfg);
    let test_rows: Vec<usize> = (0..test_x.rows()).collect();
    let (acc1, acc5, mpcr) = score(&m, test_x, test_y, &test_rows, classes);
    ProbeReport {
        acc1,
        acc5: (classes >= 5).then_some(acc5),
        mean_per_class_recall: mpcr,
        weight_decay: wd,
        epochs: cfg.epochs,
        train: train_x.rows(),
        test: test_x.rows(),
        classes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emb(rows: &[Vec<f32>]) -> Embeddings {
        Embeddings { data: rows.iter().flatten().copied().collect(), dim: rows[0].len() }
    }

    #[test]
    fn the_gradient_matches_finite_differences() {
        let x = emb(&[vec![0.6, 0.8], vec![-1.0, 0.0], vec![0.0, -1.0]]);
        let y = [0, 1, 2];
        let m = Linear { w: vec![0.1, -0.2, 0.3, 0.4, -0.5, 0.6], b: vec![0.05, -0.1, 0.2], dim: 2 };
        let (_, g) = loss_and_grad(&m, &x, &y, &[0, 1, 2]);
        let h = 1e-6;
        for i in 0..9 {
            let bump = |d: f64| {
                let mut p = m.clone();
                if i < 6 {
                    p.w[i] += d
                } else {
                    p.b[i - 6] += d
                }
                loss_and_grad(&p, &x, &y, &[0, 1, 2]).0
            };
            let fd = (bump(h) - bump(-h)) / (2.0 * h);
            let an = if i < 6 { g.w[i] } else { g.b[i - 6] };
            assert!((fd - an).abs() < 1e-8, "parameter {i}: {fd} vs {an}");
        }
    }

    #[test]
    fn one_adamw_step_by_hand() {
        // First step: m̂ = g, v̂ = g², so p ← p(1 − lr·wd) − lr·g/(|g| + ε) = p(1 − lr·wd) − lr·sign(g).
        let mut p = Linear { w: vec![1.0, -2.0], b: vec![0.5], dim: 2 };
        let g = Linear { w: vec![0.3, -0.01], b: vec![0.0], dim: 2 };
        AdamW::new(3).step(&mut p, &g, 0.1, 0.5);
        assert!((p.w[0] - (1.0 * 0.95 - 0.1 * 0.3 / (0.3 + 1e-8))).abs() < 1e-12);
        assert!((p.w[1] - (-2.0 * 0.95 + 0.1 * 0.01 / (0.01 + 1e-8))).abs() < 1e-12);
        assert_eq!(p.b[0], 0.5 * 0.95);
    }

    #[test]
    fn separable_classes_are_learned_and_the_search_is_reproducible() {
        let mut rng = Rng::new(7);
        let centres = [[1.0f32, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, -1.0]];
        let mut sample = |n: usize| {
            let mut rows = Vec::new();
            let mut labels = Vec::new();
            for i in 0..n {
                let c = i % centres.len();
                let mut v: Vec<f32> = centres[c].iter().map(|&x| x + 0.15 * rng.normal() as f32).collect();
                let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
                v.iter_mut().for_each(|x| *x /= norm);
                rows.push(v);
                labels.push(c);
            }
            (emb(&rows), labels)
        };
        let (tx, ty) = sample(120);
        let (vx, vy) = sample(60);
        let cfg = ProbeConfig { epochs: 5, batch: 16, ..Default::default() };
        let a = probe(&tx, &ty, &vx, &vy, 6, &cfg);
        assert!(a.acc1 > 0.95 && a.mean_per_class_recall > 0.95, "{a:?}");
        assert_eq!(a.acc5, Some(1.0));
        assert!(decays().contains(&a.weight_decay));
        assert_eq!(a, probe(&tx, &ty, &vx, &vy, 6, &cfg));
    }
}
