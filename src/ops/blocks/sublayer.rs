//! A transformer layer's residual branch as one op: `x + F(LN(x))` (pre-norm, as ViT has it) or
//! `LN(x + F(x))` (post-norm, as BERT has it), where F is the attention with its four
//! projections or the MLP.
//!
//! candle's backward pass gives every graph edge a zero-filled gradient buffer and adds each
//! contribution into it. Built from separate ops, a ViT block has about fourteen edges the size
//! of its activations (the LayerNorm outputs, q, k, v, the context, the residual sums); as two of
//! these ops it has two, and the LayerNorm output is recomputed in the backward pass instead of
//! kept. Parameters arrive as one flat tensor (an op has at most three inputs), laid out as
//! [`Branch::param_layout`] says; their gradient comes back in the same layout.

use std::sync::Mutex;

use candle_core::{DType, Layout, Result, Shape, Tensor};

use super::attention::{context, context_grad, scores, scores_grad, Geometry};
use crate::ops::kernels::bias_act::{ActGrad, Activation, BiasAct};
use crate::ops::kernels::layer_norm::{LayerNormGrad, LayerNormOp};
use crate::ops::kernels::linear::{linear_act, linear_grads, linear_onto, product, sum_into};
use crate::ops::kernels::matmul::slice_f32;
use crate::ops::kernels::operands::Dims;
use crate::ops::kernels::prepared::{self, Prepared};
use crate::ops::op::{Kernel, Op};
use crate::ops::{cpu_slices, output_buffer, Float};

/// Where the branch's LayerNorm sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// `x + F(LN(x))`.
    Pre,
    /// `LN(x + F(x))`.
    Post,
}

/// The branch's function F.
#[derive(Clone, Copy, Debug)]
enum Body {
    /// q, k, v and output projections, each `[width, width]` with a bias; `causal`: each query
    /// attends to itself and the tokens before it only.
    Attention { batch: usize, len: usize, heads: usize, causal: bool },
    /// `act(x·W1ᵀ + b1)·W2ᵀ + b2` with W1 `[hidden, width]`.
    Mlp { hidden: usize, act: Activation },
}

#[derive(Clone, Copy, Debug)]
struct Branch {
    norm: Norm,
    body: Body,
    width: usize,
    eps: f64,
}

impl Branch {
    /// Lengths of the parameters in the flat tensor, in order: attention `[Wq, bq, Wk, bk, Wv,
    /// bv, Wo, bo, γ, β]`, MLP `[W1, b1, W2, b2, γ, β]`.
    fn param_layout(&self) -> Vec<usize> {
        let w = self.width;
        match self.body {
            Body::Attention { .. } => vec![w * w, w, w * w, w, w * w, w, w * w, w, w, w],
            Body::Mlp { hidden, .. } => vec![hidden * w, hidden, w * hidden, w, w, w],
        }
    }

    /// The profile region of its forward pass.
    fn profile(&self) -> &'static str {
        match self.body {
            Body::Attention { .. } => "op/attention-branch",
            Body::Mlp { .. } => "op/mlp-branch",
        }
    }

    fn param_len(&self) -> usize {
        self.param_layout().iter().sum()
    }

    /// F's parameters (the flat ones without the LayerNorm's γ and β at the end) split as
    /// [`Branch::param_layout`] says.
    fn split<'a, S: Splittable<'a>>(&self, p: S) -> Vec<S> {
        let layout = self.param_layout();
        let mut rest = p;
        let mut parts = Vec::new();
        for &n in &layout[..layout.len() - 2] {
            let (head, tail) = rest.split(n);
            parts.push(head);
            rest = tail;
        }
        parts
    }

    fn geometry(&self) -> Result<Geometry> {
        match self.body {
            Body::Attention { batch, len, heads, causal } => Ok(Geometry::new(&[batch, len, self.width], heads)?.causal(causal)),
            Body::Mlp { .. } => candle_core::bail!("an MLP branch has no attention geometry"),
        }
    }

    /// `x + F(fin)` with F's parameters `ps` (split as [`Branch::split`] does); pushes what F's
    /// backward needs onto `saved` when there is a backward pass to come (`saved` is `Some`).
    fn body_forward<T: Float>(
        &self,
        x: &[T],
        fin: &[T],
        ps: &[&[T]],
        key_bias: Option<&[f32]>,
        saved: Option<&mut Vec<Vec<T>>>,
    ) -> Result<Vec<T>> {
        let (rows, w) = (x.len() / self.width, self.width);
        match (self.body, saved) {
            (Body::Attention { .. }, saved) => {
                let project = |i: usize| linear_act(None, fin, ps[2 * i], ps[2 * i + 1], Activation::Identity, (rows, w, w));
                self.attend(x, [project(0), project(1), project(2)], ps, key_bias, saved)
            }
            (Body::Mlp { hidden, act }, Some(saved)) => {
                // The product before the bias and activation is what the backward pass reads.
                let y = product(fin, ps[0], (rows, w, hidden));
                let h = BiasAct(act).run(&y, ps[1], hidden);
                let out = linear_onto(Some(x), &h, ps[2], ps[3], (rows, hidden, w));
                saved.extend([y, h]);
                Ok(out)
            }
            (Body::Mlp { hidden, act }, None) => {
                let h = linear_act(None, fin, ps[0], ps[1], act, (rows, w, hidden));
                Ok(linear_act(Some(x), &h, ps[2], ps[3], Activation::Identity, (rows, hidden, w)))
            }
        }
    }

    /// `x` plus the attention of `q`, `k`, `v` through the output projection (`ps[6]`, `ps[7]`);
    /// with `saved`, what the backward pass needs goes there.
    fn attend<T: Float>(
        &self,
        x: &[T],
        [q, k, v]: [Vec<T>; 3],
        ps: &[&[T]],
        key_bias: Option<&[f32]>,
        saved: Option<&mut Vec<Vec<T>>>,
    ) -> Result<Vec<T>> {
        let (g, w) = (self.geometry()?, self.width);
        let probs = scores(g, attention_scale(g), key_bias, &q, &k);
        let ctx = context(g, &probs, &v);
        let out = linear_act(Some(x), &ctx, ps[6], ps[7], Activation::Identity, (x.len() / w, w, w));
        if let Some(saved) = saved {
            saved.extend([q, k, v, probs, ctx]);
        }
        Ok(out)
    }

    /// The branch's output from x and its parameters (`params` F's, then γ, β); with `saved`,
    /// what the backward pass needs besides x and the parameters goes there.
    fn forward<T: Float>(
        &self,
        x: &[T],
        params: &[&[T]],
        (gamma, beta): (&[T], &[T]),
        key_bias: Option<&[f32]>,
        mut saved: Option<&mut Vec<Vec<T>>>,
    ) -> Result<Vec<T>> {
        let ln_op = LayerNormOp { eps: self.eps };
        Ok(match self.norm {
            Norm::Pre => {
                if saved.is_none() {
                    if let Some(out) = self.prepared_forward(x, params, (gamma, beta), key_bias)? {
                        return Ok(out);
                    }
                }
                // Not kept: the backward pass recomputes it from x.
                let normed = ln_op.run(x, gamma, beta);
                self.body_forward(x, &normed, params, key_bias, saved)?
            }
            Norm::Post => {
                let sum = self.body_forward(x, x, params, key_bias, saved.as_deref_mut())?;
                let out = ln_op.run(&sum, gamma, beta);
                if let Some(saved) = saved {
                    saved.push(sum);
                }
                out
            }
        })
    }

    /// A pre-norm branch without a backward pass, where its products all go through the bf16
    /// or the int8 kernel: the LayerNorm's rows packed or quantized as they are made, once for
    /// all the products that read them, and (bf16) the MLP's hidden layer packed by the first
    /// product as it stores it (see `kernels::prepared`). The same numbers as the f32 route
    /// through [`Branch::body_forward`]. None where it does not apply.
    fn prepared_forward<T: Float>(
        &self,
        x: &[T],
        params: &[&[T]],
        (gamma, beta): (&[T], &[T]),
        key_bias: Option<&[f32]>,
    ) -> Result<Option<Vec<T>>> {
        let (Some(x), Some(gamma), Some(beta)) = (slice_f32(x), slice_f32(gamma), slice_f32(beta)) else { return Ok(None) };
        let Some(ps) = params.iter().map(|p| slice_f32(p)).collect::<Option<Vec<_>>>() else { return Ok(None) };
        let (w, rows) = (self.width, x.len() / self.width);
        let products = match self.body {
            Body::Attention { .. } => vec![Dims { m: rows, n: w, k: w }],
            Body::Mlp { hidden, .. } => vec![Dims { m: rows, n: hidden, k: w }, Dims { m: rows, n: w, k: hidden }],
        };
        let Some(route) = prepared::route(&products) else { return Ok(None) };
        let ln_op = LayerNormOp { eps: self.eps };
        let normed = Prepared::from_rows(route, rows, w, |i, r| ln_op.normalize_row(&x[i * w..(i + 1) * w], gamma, beta, r));
        let out = match self.body {
            Body::Attention { .. } => {
                let project = |i: usize| normed.linear(ps[2 * i], ps[2 * i + 1], None, Activation::Identity, w);
                let qkv = [project(0), project(1), project(2)];
                drop(normed);
                self.attend(x, qkv, &ps, key_bias, None)?
            }
            Body::Mlp { hidden, act } => {
                let h = normed.linear_prepared(ps[0], ps[1], act, hidden);
                drop(normed);
                h.linear(ps[2], ps[3], Some(x), Activation::Identity, w)
            }
        };
        // T is f32 here (the slices above are).
        Ok(Some(
            (Box::new(out) as Box<dyn std::any::Any>)
                .downcast::<Vec<T>>()
                .map(|b| *b)
                .map_err(|_| candle_core::Error::Msg("residual branch: not f32".into()))?,
        ))
    }

    /// The gradient with respect to F's input from the gradient `dz` of F's output; F's
    /// parameter gradients go into `dp` (the flat layout).
    fn body_backward<T: Float>(&self, fin: &[T], dz: &[T], p: &[T], saved: &[&[T]], dp: &mut [T]) -> Result<Vec<T>> {
        let (rows, w) = (fin.len() / self.width, self.width);
        let ps = self.split(p);
        let mut dps = self.split(dp);
        // SAFETY: the first product into it overwrites it (`accumulate` false).
        let mut dfin = unsafe { output_buffer::<T>(rows * w) };
        match self.body {
            Body::Attention { .. } => {
                let g = self.geometry()?;
                let &[q, k, v, probs, ctx] = saved else { candle_core::bail!("attention branch: saved state incomplete") };
                // SAFETY: the product overwrites it.
                let mut dctx = unsafe { output_buffer::<T>(rows * w) };
                let [.., dwo, dbo] = &mut dps[..] else { unreachable!() };
                linear_grads(ctx, ps[6], dz, (rows, w, w), Some((&mut dctx, false)), dwo, dbo);
                let dp_dv = context_grad(g, probs, v, &dctx);
                let (dprobs, dv) = dp_dv.split_at(probs.len());
                let dq_dk = scores_grad(g, attention_scale(g), probs, dprobs, q, k);
                let (dq, dk) = dq_dk.split_at(rows * w);
                for (i, d) in [dq, dk, dv].into_iter().enumerate() {
                    let (dw, rest) = dps[2 * i..].split_first_mut().expect("layout");
                    linear_grads(fin, ps[2 * i], d, (rows, w, w), Some((&mut dfin, i > 0)), dw, &mut *rest[0]);
                }
            }
            Body::Mlp { hidden, act } => {
                let &[y, h] = saved else { candle_core::bail!("MLP branch: saved state incomplete") };
                // SAFETY: the product overwrites it.
                let mut dh = unsafe { output_buffer::<T>(rows * hidden) };
                let [dw1, db1, dw2, db2] = &mut dps[..] else { unreachable!() };
                linear_grads(h, ps[2], dz, (rows, hidden, w), Some((&mut dh, false)), dw2, db2);
                let dy = ActGrad(act).run(y, ps[1], &dh, hidden);
                linear_grads(fin, ps[0], &dy, (rows, w, hidden), Some((&mut dfin, false)), dw1, db1);
            }
        }
        Ok(dfin)
    }
}

/// Something [`Branch::split`] cuts into consecutive pieces.
trait Splittable<'a>: Sized {
    fn split(self, at: usize) -> (Self, Self);
}

impl<'a, T> Splittable<'a> for &'a [T] {
    fn split(self, at: usize) -> (Self, Self) {
        self.split_at(at)
    }
}

impl<'a, T> Splittable<'a> for &'a mut [T] {
    fn split(self, at: usize) -> (Self, Self) {
        self.split_at_mut(at)
    }
}

fn attention_scale(g: Geometry) -> f64 {
    1.0 / (g.head_dim as f64).sqrt()
}

/// The forward op: arguments x and the flat parameters.
struct BranchOp {
    branch: Branch,
    /// Attention only: `[batch, len]`, added to every query's scores (padding masks).
    key_bias: Option<Vec<f32>>,
    /// What the backward pass needs besides x and the parameters (F's intermediates; for
    /// post-norm, the sum the LayerNorm normalised).
    saved: Mutex<Option<Vec<Tensor>>>,
}

impl BranchOp {
    fn run<T: Float>(&self, x: &[T], p: &[T]) -> Result<Vec<T>> {
        let b = self.branch;
        let (params, ln) = p.split_at(p.len() - 2 * b.width);
        let mut saved = Vec::new();
        let out = b.forward(x, &b.split(params), ln.split_at(b.width), self.key_bias.as_deref(), Some(&mut saved))?;
        let cpu = candle_core::Device::Cpu;
        let saved = saved
            .into_iter()
            .map(|v| {
                let n = v.len();
                Tensor::from_vec(v, n, &cpu)
            })
            .collect::<Result<Vec<_>>>()?;
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(saved);
        Ok(out)
    }
}

/// The forward op where nothing needs a gradient (embedding, scoring, evaluation): it reads the
/// parameters where they are instead of concatenating them into one flat operand for every call
/// (a ViT-B/32 batch copied 0.5 GB that way), keeps nothing, and lets int8 and bf16 products
/// apply biases, residuals and activations as their tiles are stored.
struct BranchEval {
    branch: Branch,
    key_bias: Option<Vec<f32>>,
    /// In [`Branch::param_layout`]'s order, each contiguous.
    params: Vec<Tensor>,
}

impl Kernel<1> for BranchEval {
    const NAME: &'static str = "residual-branch-eval";
    const PROFILE: &'static str = "op/attention-branch";
    type Geometry = ();

    fn profile(&self) -> &'static str {
        self.branch.profile()
    }

    fn geometry(&self, [x]: [&Layout; 1]) -> Result<(Self::Geometry, Shape)> {
        let lens: Vec<usize> = self.params.iter().map(|p| p.elem_count()).collect();
        if lens != self.branch.param_layout() {
            candle_core::bail!("residual branch: parameters of {lens:?} values, expected {:?}", self.branch.param_layout());
        }
        self.branch.check(x.dims(), &[self.branch.param_len()])?;
        Ok(((), x.shape().clone()))
    }

    fn cpu<T: Float>(&self, _: &Self::Geometry, [x]: [&[T]; 1]) -> Result<Vec<T>> {
        let held: Vec<_> = self.params.iter().map(|t| t.storage_and_layout()).collect();
        let parts = cpu_slices::<T>(&held, "residual branch parameter")?;
        let [params @ .., gamma, beta] = &parts[..] else { candle_core::bail!("residual branch: no LayerNorm parameters") };
        self.branch.forward(x, params, (gamma, beta), self.key_bias.as_deref(), None)
    }
}

impl Kernel<2> for BranchOp {
    const NAME: &'static str = "residual-branch";
    const PROFILE: &'static str = "op/attention-branch";
    type Geometry = ();

    fn profile(&self) -> &'static str {
        self.branch.profile()
    }

    fn geometry(&self, [x, p]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        self.branch.check(x.dims(), p.dims())?;
        Ok(((), x.shape().clone()))
    }

    fn cpu<T: Float>(&self, _: &Self::Geometry, [x, p]: [&[T]; 2]) -> Result<Vec<T>> {
        self.run(x, p)
    }

    fn backward(&self, [x, p]: [&Tensor; 2], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let Some(saved) = self.saved.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            candle_core::bail!("residual branch backward before its forward pass")
        };
        let n = x.elem_count();
        let op = BranchGrad { branch: self.branch, saved };
        let all = x.apply_op3_no_bwd(p, &grad.contiguous()?, &Op(op))?;
        Ok([Some(all.narrow(0, 0, n)?.reshape(x.shape())?), Some(all.narrow(0, n, p.elem_count())?)])
    }
}

impl Branch {
    fn check(&self, x: &[usize], p: &[usize]) -> Result<()> {
        if x.last() != Some(&self.width) {
            candle_core::bail!("residual branch of width {}: input {x:?}", self.width);
        }
        if let Body::Attention { batch, len, .. } = self.body {
            if x != [batch, len, self.width] {
                candle_core::bail!("attention branch: input {x:?}, expected [{batch}, {len}, {}]", self.width);
            }
        }
        if p != [self.param_len()] {
            candle_core::bail!("residual branch: parameters {p:?}, expected [{}]", self.param_len());
        }
        Ok(())
    }
}

/// The backward op: arguments x, the flat parameters and the output's gradient; result
/// `[dx | dparams]`.
struct BranchGrad {
    branch: Branch,
    saved: Vec<Tensor>,
}

impl BranchGrad {
    fn run<T: Float>(&self, x: &[T], p: &[T], dy: &[T]) -> Result<Vec<T>> {
        let held: Vec<_> = self.saved.iter().map(|t| t.storage_and_layout()).collect();
        let saved = cpu_slices::<T>(&held, "residual branch state")?;
        let b = self.branch;
        let (n, w) = (x.len(), b.width);
        let (params, ln) = p.split_at(p.len() - 2 * w);
        let (gamma, beta) = ln.split_at(w);
        // SAFETY: dx is written below in full, and so is every parameter gradient (the body
        // writes its own; the LayerNorm's are copied in).
        let mut out = unsafe { output_buffer::<T>(n + p.len()) };
        let (dx, dp) = out.split_at_mut(n);
        let (dparams, dln) = dp.split_at_mut(params.len());
        let ln_grad = LayerNormGrad { eps: b.eps };
        match b.norm {
            Norm::Pre => {
                let normed = LayerNormOp { eps: b.eps }.run(x, gamma, beta);
                let dnormed = b.body_backward(&normed, dy, params, &saved, dparams)?;
                let g = ln_grad.run(x, gamma, &dnormed);
                dln.copy_from_slice(&g[n..]);
                sum_into(dx, &g[..n], dy);
            }
            Norm::Post => {
                let Some((sum, body_saved)) = saved.split_last() else { candle_core::bail!("residual branch: saved state incomplete") };
                let g = ln_grad.run(sum, gamma, dy);
                dln.copy_from_slice(&g[n..]);
                let dsum = &g[..n];
                let dfin = b.body_backward(x, dsum, params, body_saved, dparams)?;
                sum_into(dx, &dfin, dsum);
            }
        }
        Ok(out)
    }
}

impl Kernel<3> for BranchGrad {
    const NAME: &'static str = "residual-branch-grad";
    const PROFILE: &'static str = "op/attention-branch-grad";
    type Geometry = ();

    fn profile(&self) -> &'static str {
        match self.branch.body {
            Body::Attention { .. } => "op/attention-branch-grad",
            Body::Mlp { .. } => "op/mlp-branch-grad",
        }
    }

    fn geometry(&self, [x, p, dy]: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        self.branch.check(x.dims(), p.dims())?;
        if dy.dims() != x.dims() {
            candle_core::bail!("residual branch backward: gradient {:?} for output {:?}", dy.dims(), x.dims());
        }
        Ok(((), Shape::from(x.shape().elem_count() + p.shape().elem_count())))
    }

    fn cpu<T: Float>(&self, _: &Self::Geometry, [x, p, dy]: [&[T]; 3]) -> Result<Vec<T>> {
        self.run(x, p, dy)
    }
}

/// A linear layer's `(weight [out, in], bias [out])`.
pub type LinearParams<'a> = (&'a Tensor, &'a Tensor);

/// A LayerNorm's `(γ, β, ε)`.
pub type NormParams<'a> = (&'a Tensor, &'a Tensor, f64);

fn flat(params: &[&Tensor]) -> Result<Tensor> {
    let parts = params.iter().map(|p| p.flatten_all()).collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0)
}

/// The attention branch on `x` `[batch, len, width]`: projections `[q, k, v, out]`, `heads`
/// heads, `key_bias` `[batch, len]` added to every query's scores, `causal`: each query attends
/// to itself and the tokens before it only. Needs operands `ops::fusable` accepts.
#[allow(clippy::too_many_arguments)]
pub fn attention_branch(
    x: &Tensor,
    norm: Norm,
    (gamma, beta, eps): NormParams,
    proj: [LinearParams; 4],
    heads: usize,
    key_bias: Option<&Tensor>,
    causal: bool,
) -> Result<Tensor> {
    let (batch, len, width) = x.dims3()?;
    let branch = Branch { norm, body: Body::Attention { batch, len, heads, causal }, width, eps };
    branch.geometry()?;
    let key_bias = match key_bias {
        Some(b) => {
            if b.dims() != [batch, len] {
                candle_core::bail!("attention branch: key bias {:?}, expected [{batch}, {len}]", b.dims());
            }
            Some(b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        }
        None => None,
    };
    let [(wq, bq), (wk, bk), (wv, bv), (wo, bo)] = proj;
    apply(x, branch, key_bias, &[wq, bq, wk, bk, wv, bv, wo, bo, gamma, beta])
}

/// The branch as [`BranchEval`] where nothing needs a gradient, else as [`BranchOp`].
fn apply(x: &Tensor, branch: Branch, key_bias: Option<Vec<f32>>, params: &[&Tensor]) -> Result<Tensor> {
    let x = x.contiguous()?;
    if !x.track_op() && params.iter().all(|p| !p.track_op()) {
        let params = params.iter().map(|p| p.contiguous()).collect::<Result<Vec<_>>>()?;
        return x.apply_op1(Op(BranchEval { branch, key_bias, params }));
    }
    x.apply_op2(&flat(params)?, Op(BranchOp { branch, key_bias, saved: Mutex::new(None) }))
}

/// The MLP branch on `x` `[.., width]`: `fc1` `[hidden, width]`, `act`, `fc2` `[width, hidden]`.
/// Needs operands `ops::fusable` accepts.
pub fn mlp_branch(
    x: &Tensor,
    norm: Norm,
    (gamma, beta, eps): NormParams,
    fc1: LinearParams,
    fc2: LinearParams,
    act: Activation,
) -> Result<Tensor> {
    let width = x.dim(candle_core::D::Minus1)?;
    let hidden = fc1.0.dim(0)?;
    let branch = Branch { norm, body: Body::Mlp { hidden, act }, width, eps };
    apply(x, branch, None, &[fc1.0, fc1.1, fc2.0, fc2.1, gamma, beta])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::kernels::{bf16_gemm, int8_gemm};

    fn randn(seed: u64, mean: f64, std: f64, len: usize) -> Vec<f32> {
        crate::util::rng::randn(seed, mean, std, &[len], DType::F32, &candle_core::Device::Cpu).unwrap().to_vec1().unwrap()
    }

    /// A forward-only pre-norm branch whose products all take the bf16 or the int8 kernel makes
    /// the inputs they share once, packed or quantized as they are produced; its outputs are the
    /// f32-input route's, bit for bit: attention with a key bias (causal and not) and the MLP.
    #[test]
    fn prepared_inputs_leave_the_branch_outputs_unchanged() {
        // Every product at least the kernels' smallest (2²¹ multiply-adds).
        let (batch, len, width, heads, hidden) = (3, 20, 192, 3, 768);
        let x = randn(430, 0.3, 1.0, batch * len * width);
        let (gamma, beta) = (randn(431, 1.0, 0.1, width), randn(432, 0.0, 0.1, width));
        let mut key_bias = vec![0f32; batch * len];
        key_bias[2 * len - 4..2 * len].fill(-1e4);
        let bodies = [
            Body::Attention { batch, len, heads, causal: false },
            Body::Attention { batch, len, heads, causal: true },
            Body::Mlp { hidden, act: Activation::QuickGelu },
        ];
        for route in ["bf16", "int8"] {
            let have = if route == "bf16" { bf16_gemm::available() } else { int8_gemm::available() };
            if !have {
                eprintln!("skipped {route}: this CPU lacks its instructions");
                continue;
            }
            for (b, body) in bodies.into_iter().enumerate() {
                let branch = Branch { norm: Norm::Pre, body, width, eps: 1e-5 };
                let params: Vec<Vec<f32>> = branch.param_layout()[..branch.param_layout().len() - 2]
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| randn(440 + 10 * b as u64 + i as u64, 0.0, 0.08, n))
                    .collect();
                let ps: Vec<&[f32]> = params.iter().map(|p| &p[..]).collect();
                let bias = matches!(body, Body::Attention { .. }).then_some(&key_bias[..]);
                let run = || {
                    let prepared = branch.prepared_forward(&x, &ps, (&gamma, &beta), bias).unwrap();
                    let normed = LayerNormOp { eps: branch.eps }.run(&x, &gamma, &beta);
                    (prepared, branch.body_forward(&x, &normed, &ps, bias, None).unwrap())
                };
                let (prepared, plain) =
                    if route == "bf16" { bf16_gemm::with_bf16_products(run) } else { int8_gemm::with_int8_products(run) };
                let prepared = prepared.unwrap_or_else(|| panic!("{route} {body:?}: the prepared route was not taken"));
                let same = prepared.iter().zip(&plain).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same && prepared.len() == plain.len(), "{route} {body:?}: the outputs differ");
            }
        }
        let plain_f32 = Branch { norm: Norm::Pre, body: bodies[2], width, eps: 1e-5 };
        let ps: Vec<Vec<f32>> = plain_f32.param_layout()[..4].iter().map(|&n| vec![0.0; n]).collect();
        let ps: Vec<&[f32]> = ps.iter().map(|p| &p[..]).collect();
        assert!(plain_f32.prepared_forward(&x, &ps, (&gamma, &beta), None).unwrap().is_none(), "f32 products took the prepared route");
    }
}
