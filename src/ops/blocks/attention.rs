//! Multi-head attention over `[batch, len, heads·head_dim]` tensors as one op (scores, softmax
//! and probabilities·values) that reads each head's columns in place through strided matmuls.
//!
//! Composed, every head split and merge is a transposed copy (q, k, v and the context: four
//! activation-sized tensors per block, each kept for the backward pass along with its source),
//! and the raw scores stay alive next to the probabilities. Here the graph keeps q, k, v and the
//! context, and the op the probabilities. Each (image, head) pair is one task; its products run
//! on the task's thread.

use std::sync::Mutex;

use candle_core::{DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::ops::kernels::bf16_gemm::Scope;
use crate::ops::kernels::matmul::{gemm_serial, gemm_shared, SharedDst};
use crate::ops::kernels::operands::{Dims, Mat};
use crate::ops::kernels::softmax::{scaled_masked_softmax, softmax_grad_row, softmax_row_in_place};
use crate::ops::op::{Kernel, Op};
use crate::ops::{output_buffer, simd, with_cpu_slice, Float};

#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    batch: usize,
    len: usize,
    width: usize,
    heads: usize,
    pub head_dim: usize,
    /// Each query attends to itself and the keys before it only (a causal text tower's).
    causal: bool,
}

impl Geometry {
    pub fn new(dims: &[usize], heads: usize) -> Result<Self> {
        match dims {
            [batch, len, width] if heads > 0 && width % heads == 0 => {
                Ok(Geometry { batch: *batch, len: *len, width: *width, heads, head_dim: width / heads, causal: false })
            }
            _ => candle_core::bail!("attention: {dims:?} is not [batch, len, width] with width divisible by {heads} heads"),
        }
    }

    /// The same attention, causal or not.
    pub fn causal(self, causal: bool) -> Self {
        Geometry { causal, ..self }
    }

    /// Where head `h` of batch element `b` starts in a `[batch, len, width]` buffer.
    fn head_offset(&self, task: usize) -> usize {
        (task / self.heads) * self.len * self.width + (task % self.heads) * self.head_dim
    }

    fn tasks(&self) -> usize {
        self.batch * self.heads
    }

    fn check(&self, what: &str, dims: &[usize], want: &[usize]) -> Result<()> {
        if dims != want {
            candle_core::bail!("attention: {what} is {dims:?}, expected {want:?}");
        }
        Ok(())
    }

    fn probs_dims(&self) -> [usize; 4] {
        [self.batch, self.heads, self.len, self.len]
    }

    fn token_dims(&self) -> [usize; 3] {
        [self.batch, self.len, self.width]
    }
}

/// `softmax(scale·q·kᵀ + key_bias)` per head: `[batch, heads, len, len]`. `key_bias` is
/// `[batch, len]`, added to every query's scores of that batch element. A causal geometry's
/// query i takes its softmax over keys 0..=i, the later keys' probabilities exactly 0 (which
/// also zeroes their gradients in [`scores_grad`]).
pub(crate) fn scores<T: Float>(g: Geometry, scale: f64, key_bias: Option<&[f32]>, q: &[T], k: &[T]) -> Vec<T> {
    let (l, scale) = (g.len, T::from(scale));
    // SAFETY: each task's product fills its own l×l block.
    let mut probs = unsafe { output_buffer::<T>(g.tasks() * l * l) };
    let scope = Scope::current();
    probs.par_chunks_mut(l * l).enumerate().for_each(|(task, p)| {
        let off = g.head_offset(task);
        let d = Dims { m: l, n: l, k: g.head_dim };
        scope.run(|| gemm_serial(p, l, d, Mat::rows(q, off, g.width), Mat::transposed(k, off, g.width), false));
        let bias = key_bias.map(|b| &b[(task / g.heads) * l..(task / g.heads + 1) * l]);
        simd(
            #[inline(always)]
            || {
                for (i, row) in p.chunks_mut(l).enumerate() {
                    if g.causal {
                        let (seen, later) = row.split_at_mut(i + 1);
                        softmax_row_in_place(seen, scale, bias.map(|b| &b[..=i]));
                        later.fill(T::default());
                    } else {
                        softmax_row_in_place(row, scale, bias);
                    }
                }
            },
        )
    });
    probs
}

/// dS = scale·P·(dP − Σ P·dP) per row, then dq = dS·k and dk = dSᵀ·q per head: `[dq | dk]`.
pub(crate) fn scores_grad<T: Float>(g: Geometry, scale: f64, p: &[T], dp: &[T], q: &[T], k: &[T]) -> Vec<T> {
    let (l, n) = (g.len, g.batch * g.len * g.width);
    // SAFETY: every (image, head) task fills its head's columns of dq and dk.
    let mut out = unsafe { output_buffer::<T>(2 * n) };
    let dst = SharedDst::new(&mut out);
    let scope = Scope::current();
    (0..g.tasks()).into_par_iter().for_each(|task| {
        let (pt, dpt) = (&p[task * l * l..(task + 1) * l * l], &dp[task * l * l..(task + 1) * l * l]);
        // SAFETY: softmax_grad_row writes every element of each row.
        let mut ds = unsafe { output_buffer::<T>(l * l) };
        simd(
            #[inline(always)]
            || {
                for ((o, y), gr) in ds.chunks_mut(l).zip(pt.chunks(l)).zip(dpt.chunks(l)) {
                    softmax_grad_row(o, y, gr, T::from(scale));
                }
            },
        );
        let off = g.head_offset(task);
        let d = Dims { m: l, n: g.head_dim, k: l };
        // SAFETY: each task writes only its own head's columns of its own batch element.
        scope.run(|| unsafe {
            gemm_shared(&dst, off, g.width, d, Mat::rows(&ds, 0, l), Mat::rows(k, off, g.width));
            gemm_shared(&dst, n + off, g.width, d, Mat::transposed(&ds, 0, l), Mat::rows(q, off, g.width));
        });
    });
    out
}

/// [`scores_grad`] as an op on (P, dP), with q and k read from the tensors it holds.
struct ScoresGrad {
    g: Geometry,
    scale: f64,
    q: Tensor,
    k: Tensor,
}

impl Kernel<2> for ScoresGrad {
    const NAME: &'static str = "attention-scores-grad";
    const PROFILE: &'static str = "op/attention-grad";
    type Geometry = ();

    fn geometry(&self, [p, dp]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        self.g.check("probabilities", p.dims(), &self.g.probs_dims())?;
        self.g.check("their gradient", dp.dims(), &self.g.probs_dims())?;
        Ok(((), Shape::from(2 * self.g.batch * self.g.len * self.g.width)))
    }

    fn cpu<T: Float>(&self, _: &Self::Geometry, [p, dp]: [&[T]; 2]) -> Result<Vec<T>> {
        with_cpu_slice(&self.q, "attention's q", |q| {
            with_cpu_slice(&self.k, "attention's k", |k| Ok(scores_grad(self.g, self.scale, p, dp, q, k)))
        })
    }
}

/// probabilities · v per head, written into each head's columns: `[batch, len, width]`.
pub(crate) fn context<T: Float>(g: Geometry, p: &[T], v: &[T]) -> Vec<T> {
    let l = g.len;
    // SAFETY: every (image, head) task fills its head's columns.
    let mut out = unsafe { output_buffer::<T>(g.batch * l * g.width) };
    let dst = SharedDst::new(&mut out);
    let scope = Scope::current();
    (0..g.tasks()).into_par_iter().for_each(|task| {
        let off = g.head_offset(task);
        let d = Dims { m: l, n: g.head_dim, k: l };
        // SAFETY: each task writes only its own head's columns of its own batch element.
        scope.run(|| unsafe { gemm_shared(&dst, off, g.width, d, Mat::rows(p, task * l * l, l), Mat::rows(v, off, g.width)) })
    });
    out
}

/// dP = dctx·vᵀ and dv = Pᵀ·dctx per head: `[dP | dv]`.
pub(crate) fn context_grad<T: Float>(g: Geometry, p: &[T], v: &[T], dc: &[T]) -> Vec<T> {
    let l = g.len;
    let np = g.tasks() * l * l;
    // SAFETY: every task fills its probability block and its head's columns.
    let mut out = unsafe { output_buffer::<T>(np + g.batch * l * g.width) };
    let dst = SharedDst::new(&mut out);
    let scope = Scope::current();
    (0..g.tasks()).into_par_iter().for_each(|task| {
        let off = g.head_offset(task);
        // SAFETY: each task writes only its own probability block and its own head's columns.
        scope.run(|| unsafe {
            let d = Dims { m: l, n: l, k: g.head_dim };
            gemm_shared(&dst, task * l * l, l, d, Mat::rows(dc, off, g.width), Mat::transposed(v, off, g.width));
            let d = Dims { m: l, n: g.head_dim, k: l };
            gemm_shared(&dst, np + off, g.width, d, Mat::transposed(p, task * l * l, l), Mat::rows(dc, off, g.width));
        });
    });
    out
}

/// [`context_grad`] as an op on (P, v, dctx).
struct ContextGrad {
    g: Geometry,
}

impl Kernel<3> for ContextGrad {
    const NAME: &'static str = "attention-context-grad";
    const PROFILE: &'static str = "op/attention-grad";
    type Geometry = ();

    fn geometry(&self, [p, v, dc]: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        let g = self.g;
        g.check("probabilities", p.dims(), &g.probs_dims())?;
        g.check("v", v.dims(), &g.token_dims())?;
        g.check("the context gradient", dc.dims(), &g.token_dims())?;
        Ok(((), Shape::from(g.tasks() * g.len * g.len + g.batch * g.len * g.width)))
    }

    fn cpu<T: Float>(&self, _: &Self::Geometry, [p, v, dc]: [&[T]; 3]) -> Result<Vec<T>> {
        Ok(context_grad(self.g, p, v, dc))
    }
}

/// The whole attention of (q, k, v) as one graph node. The probabilities are kept in the op for
/// the backward pass: as a node between two ops they got a zero-filled gradient buffer and an add
/// in every backward pass, `[batch, heads, len, len]` per layer.
struct Attention {
    g: Geometry,
    scale: f64,
    key_bias: Option<Vec<f32>>,
    probs: Mutex<Option<Tensor>>,
}

impl Attention {
    fn run<T: Float>(&self, q: &[T], k: &[T], v: &[T]) -> Result<Vec<T>> {
        let g = self.g;
        let probs = scores(g, self.scale, self.key_bias.as_deref(), q, k);
        let context = context(g, &probs, v);
        let probs = Tensor::from_vec(probs, g.probs_dims().to_vec(), &candle_core::Device::Cpu)?;
        *self.probs.lock().unwrap_or_else(|e| e.into_inner()) = Some(probs);
        Ok(context)
    }
}

impl Kernel<3> for Attention {
    const NAME: &'static str = "attention";
    const PROFILE: &'static str = "op/attention";
    type Geometry = ();

    fn geometry(&self, [q, k, v]: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        let g = self.g;
        for (what, l) in [("q", q), ("k", k), ("v", v)] {
            g.check(what, l.dims(), &g.token_dims())?;
        }
        Ok(((), Shape::from(g.token_dims().to_vec())))
    }

    fn cpu<T: Float>(&self, _: &Self::Geometry, [q, k, v]: [&[T]; 3]) -> Result<Vec<T>> {
        self.run(q, k, v)
    }

    fn backward(&self, [q, k, v]: [&Tensor; 3], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let Some(p) = self.probs.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            candle_core::bail!("attention backward before its forward pass")
        };
        let g = self.g;
        let (np, n) = (p.elem_count(), q.elem_count());
        let dp_dv = p.apply_op3_no_bwd(v, &grad.contiguous()?, &Op(ContextGrad { g }))?;
        let dp = dp_dv.narrow(0, 0, np)?.reshape(p.dims())?;
        let op = ScoresGrad { g, scale: self.scale, q: q.clone(), k: k.clone() };
        let dq_dk = p.apply_op2_no_bwd(&dp, &Op(op))?;
        let reshape = |t: &Tensor, at: usize| t.narrow(0, at, n)?.reshape(q.dims());
        Ok([Some(reshape(&dq_dk, 0)?), Some(reshape(&dq_dk, n)?), Some(reshape(&dp_dv, np)?)])
    }
}

/// Whether [`attention`] runs the fused ops for these operands (CPU, f32 / f64, one dtype).
pub fn fused(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    q.device().is_cpu() && matches!(q.dtype(), DType::F32 | DType::F64) && k.dtype() == q.dtype() && v.dtype() == q.dtype()
}

/// `softmax(q·kᵀ/√head_dim + key_bias)·v` per head on `[batch, len, heads·head_dim]` operands;
/// `key_bias` is `[batch, len]` (0 for tokens, a large negative number for padding); `causal`:
/// each query attends to itself and the keys before it only. Needs [`fused`] operands.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, key_bias: Option<&Tensor>, causal: bool) -> Result<Tensor> {
    let g = Geometry::new(q.dims(), heads)?.causal(causal);
    g.check("k", k.dims(), &g.token_dims())?;
    g.check("v", v.dims(), &g.token_dims())?;
    let key_bias = match key_bias {
        Some(b) => {
            g.check("the key bias", b.dims(), &[g.batch, g.len])?;
            Some(b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        }
        None => None,
    };
    let op = Attention { g, scale: 1.0 / (g.head_dim as f64).sqrt(), key_bias, probs: Mutex::new(None) };
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, Op(op))
}

/// [`attention`] from candle primitives and the fused softmax: what GPUs and bf16 towers run,
/// and what the tests hold the fused attention to.
pub fn composed(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, key_bias: Option<&Tensor>, causal: bool) -> Result<Tensor> {
    let _profile = crate::util::profile::region("op/attention");
    let (b, l, d) = q.dims3()?;
    let hd = d / heads;
    let split = |t: &Tensor| t.reshape((b, l, heads, hd))?.transpose(1, 2)?.contiguous();
    let (q, k, v) = (split(q)?, split(k)?, split(v)?);
    let mut scores = q.matmul(&k.t()?)?;
    let scale = 1.0 / (hd as f64).sqrt();
    if causal {
        // −1e9 after the softmax's scale: exp of it is 0, as the fused op's later keys are.
        let later: Vec<f32> = (0..l).flat_map(|i| (0..l).map(move |j| if j > i { (-1e9 / scale) as f32 } else { 0.0 })).collect();
        let later = Tensor::from_vec(later, (1, 1, l, l), scores.device())?.to_dtype(scores.dtype())?;
        scores = scores.broadcast_add(&later)?;
    }
    // The softmax runs in f32 even for bf16 towers: exp and the row sums lose too many digits
    // at 8 bits of mantissa.
    let probs = match scores.dtype() {
        DType::BF16 | DType::F16 => scaled_masked_softmax(&scores.to_dtype(DType::F32)?, scale, key_bias)?.to_dtype(scores.dtype())?,
        _ => scaled_masked_softmax(&scores, scale, key_bias)?,
    };
    probs.matmul(&v)?.transpose(1, 2)?.reshape((b, l, d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{check_fd, max_abs, max_diff};
    use candle_core::{Device, Var};

    fn operands(dtype: DType, (b, l, w): (usize, usize, usize)) -> [Var; 3] {
        let v = |seed| Var::from_tensor(&crate::util::rng::randn(seed, 0.0, 1.0, (b, l, w), dtype, &Device::Cpu).unwrap()).unwrap();
        [v(180), v(181), v(182)]
    }

    /// Batch element 1 masks its last three keys, element 0 none.
    fn mask(dtype: DType, b: usize, l: usize) -> Tensor {
        let m: Vec<f64> = (0..b * l).map(|i| if i / l == 1 && i % l >= l - 3 { -1e9 } else { 0.0 }).collect();
        Tensor::from_vec(m, (b, l), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    #[test]
    fn matches_the_composed_attention_forward_and_backward() {
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            for (shape, heads) in [((2, 7, 12), 3), ((3, 5, 8), 1), ((2, 19, 32), 4)] {
                let [q, k, v] = operands(dtype, shape);
                let masks = [None, Some(mask(dtype, shape.0, shape.1))];
                for (bias, causal) in masks.iter().flat_map(|b| [(b, false), (b, true)]) {
                    let ours = attention(&q, &k, &v, heads, bias.as_ref(), causal).unwrap();
                    let reference = composed(&q, &k, &v, heads, bias.as_ref(), causal).unwrap();
                    let what = format!("{dtype:?} {shape:?} {heads} heads, mask {}, causal {causal}", bias.is_some());
                    assert!(max_diff(&ours, &reference) <= tol * max_abs(&reference), "{what}");
                    let up = crate::util::rng::randn(183, 0.0, 1.0, ours.dims(), dtype, &Device::Cpu).unwrap();
                    let loss = (ours * &up).unwrap().sum_all().unwrap();
                    // Twice over one graph: the probabilities the op keeps outlive a backward pass.
                    let (g1, again) = (loss.backward().unwrap(), loss.backward().unwrap());
                    let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
                    for t in [&q, &k, &v] {
                        let (a, r) = (g1.get(t).unwrap(), g2.get(t).unwrap());
                        assert!(max_diff(a, r) <= tol * max_abs(r), "{what}: gradient");
                        assert_eq!(max_diff(a, again.get(t).unwrap()), 0.0);
                    }
                }
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let [q, k, v] = operands(DType::F64, (2, 5, 6));
        let m = mask(DType::F64, 2, 5);
        let up = crate::util::rng::randn(184, 0.0, 1.0, (2, 5, 6), DType::F64, &Device::Cpu).unwrap();
        for causal in [false, true] {
            let loss =
                |q: &Tensor, k: &Tensor, v: &Tensor| (attention(q, k, v, 2, Some(&m), causal).unwrap() * &up).unwrap().sum_all().unwrap();
            let g = loss(&q, &k, &v).backward().unwrap();
            let scalar = |t: Tensor| t.to_scalar::<f64>().unwrap();
            let at = [0, 7, 31, 44, 59];
            let errs = [
                check_fd(|t| scalar(loss(t, &k, &v)), &q, g.get(&q).unwrap(), &at),
                check_fd(|t| scalar(loss(&q, t, &v)), &k, g.get(&k).unwrap(), &at),
                check_fd(|t| scalar(loss(&q, &k, t)), &v, g.get(&v).unwrap(), &at),
            ];
            assert!(errs.iter().all(|e| *e < 1e-7), "causal {causal}: {errs:?}");
            // Masked keys (element 1, keys 2..5) get no attention, so their k and v no gradient.
            let dv = g.get(&v).unwrap().narrow(0, 1, 1).unwrap().narrow(1, 2, 3).unwrap();
            assert_eq!(max_abs(&dv), 0.0);
        }
    }

    /// Causal attention by its definition: the first query sees only its own key (its output is
    /// v's first row), and no query's output moves when later keys and values change.
    #[test]
    fn causal_queries_see_only_themselves_and_earlier_keys() {
        let (b, l, w) = (2, 6, 8);
        let [q, k, v] = operands(DType::F64, (b, l, w));
        let out = attention(&q, &k, &v, 2, None, true).unwrap();
        let first = out.narrow(1, 0, 1).unwrap();
        assert!(max_diff(&first, &v.narrow(1, 0, 1).unwrap()) < 1e-15);
        for cut in 1..l {
            // Keys and values from position `cut` on replaced by other numbers.
            let other = |t: &Tensor, seed| {
                let fresh = crate::util::rng::randn(seed, 0.0, 1.0, (b, l - cut, w), DType::F64, &Device::Cpu).unwrap();
                Tensor::cat(&[&t.narrow(1, 0, cut).unwrap(), &fresh], 1).unwrap()
            };
            let moved = attention(&q, &other(&k, 190), &other(&v, 191), 2, None, true).unwrap();
            let (a, c) = (out.narrow(1, 0, cut).unwrap(), moved.narrow(1, 0, cut).unwrap());
            assert_eq!(max_diff(&a, &c), 0.0, "queries before {cut}");
            assert!(max_diff(&out, &moved) > 1e-3, "the later queries do see them");
        }
    }

    #[test]
    fn operands_that_do_not_fit_are_errors() {
        let [q, k, _] = operands(DType::F32, (2, 4, 6));
        let v = Tensor::zeros((2, 5, 6), DType::F32, &Device::Cpu).unwrap();
        let err = attention(&q, &k, &v, 2, None, false).unwrap_err().to_string();
        assert!(err.contains("v is [2, 5, 6]"), "{err}");
        assert!(attention(&q, &k, &k, 4, None, false).unwrap_err().to_string().contains("divisible by 4 heads"));
    }
}
