//! Building blocks shared by the towers, written only with ops whose gradients candle 0.11
//! computes correctly (its fused LayerNorm and last-dim softmax silently drop gradients) or with
//! our own fused ops (`super::ops`).

use candle_core::{Module, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

use crate::ops::blocks::attention as fused_attention;
use crate::ops::blocks::mlp::{linear_bias_act, mlp as fused_mlp};
use crate::ops::blocks::sublayer;
pub use crate::ops::blocks::sublayer::Norm;
pub use crate::ops::kernels::bias_act::Activation;
use crate::ops::kernels::layer_norm::layer_norm;
use crate::ops::kernels::linear::{linear_bias, linear_no_bias};

/// LayerNorm over the last dimension (our fused op with its own backward).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// Hugging Face names: `weight` and `bias` (BERT's old `gamma`/`beta` are not used).
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(dim, "weight", Init::Const(1.0))?;
        let bias = vb.get_with_hints(dim, "bias", Init::Const(0.0))?;
        Ok(Self { weight, bias, eps })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

/// Truncated-normal init whose scale follows the fan-in: std = 0.02·√(768 / fan).
///
/// BERT and ViT initialise every weight with std 0.02 (`initializer_range`), a value tuned for
/// width 768. At demo widths (32–256) that leaves attention and MLP outputs tiny next to the
/// residual stream, every [CLS] state starts out nearly identical, and contrastive training sits
/// at the collapsed solution (all embeddings equal, loss = ln N). Scaling by fan-in keeps 0.02 at
/// width 768 and gives small towers the same signal propagation.
pub fn scaled_normal(fan: usize) -> Init {
    Init::Randn { mean: 0.0, stdev: 0.02 * (768.0 / fan.max(1) as f64).sqrt() }
}

/// A linear layer (PyTorch layout: `[out, in]`) applied as one 2-D matmul over all leading
/// dimensions. candle_nn's `Linear` broadcasts the weight over the batch instead: its backward
/// then makes one weight gradient per batch element and sums them with candle's one-threaded
/// strided reduce.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// `act(x·Wᵀ + b)`, the bias and activation fused into one op.
    pub fn forward_act(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        let (out_dim, in_dim) = self.weight.dims2()?;
        let mut shape = x.dims().to_vec();
        match shape.last_mut() {
            Some(last) if *last == in_dim => *last = out_dim,
            _ => candle_core::bail!("linear layer of {in_dim} inputs applied to a tensor of shape {:?}", x.dims()),
        }
        let x = x.reshape(((), in_dim))?;
        let y = match (&self.bias, act) {
            (Some(b), Activation::Identity) => linear_bias(&x, &self.weight, b)?,
            (Some(b), act) => linear_bias_act(&x, &self.weight, b, act)?,
            (None, Activation::Identity) => linear_no_bias(&x, &self.weight)?,
            (None, Activation::GeluErf) => linear_no_bias(&x, &self.weight)?.gelu_erf()?,
            (None, Activation::QuickGelu) => {
                let y = linear_no_bias(&x, &self.weight)?;
                (&y * candle_nn::ops::sigmoid(&(&y * 1.702)?)?)?
            }
            (None, Activation::GeluTanh) => linear_no_bias(&x, &self.weight)?.gelu()?,
        };
        y.reshape(shape)
    }
}

/// A transformer's MLP: `fc2(act(fc1(x)))` over the last dimension, as one op where both layers
/// have biases and the operands allow (see `ops::blocks::mlp::mlp`).
pub fn mlp(fc1: &Linear, fc2: &Linear, x: &Tensor, act: Activation) -> Result<Tensor> {
    let (Some(b1), Some(b2)) = (&fc1.bias, &fc2.bias) else {
        return fc2.forward(&fc1.forward_act(x, act)?);
    };
    let (in_dim, out_dim) = (fc1.weight.dim(1)?, fc2.weight.dim(0)?);
    let mut shape = x.dims().to_vec();
    match shape.last_mut() {
        Some(last) if *last == in_dim => *last = out_dim,
        _ => candle_core::bail!("MLP of {in_dim} inputs applied to a tensor of shape {:?}", x.dims()),
    }
    fused_mlp(&x.reshape(((), in_dim))?, (&fc1.weight, b1), (&fc2.weight, b2), act)?.reshape(shape)
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_act(x, Activation::Identity)
    }
}

/// A linear layer whose weights follow `init`.
pub fn linear(in_dim: usize, out_dim: usize, bias: bool, init: Init, vb: VarBuilder) -> Result<Linear> {
    let weight = vb.get_with_hints((out_dim, in_dim), "weight", init)?;
    let bias = if bias { Some(vb.get_with_hints(out_dim, "bias", Init::Const(0.0))?) } else { None };
    Ok(Linear { weight, bias })
}

/// Multi-head scaled dot-product attention on already projected `q`, `k`, `v` of shape
/// `[batch, len, heads * head_dim]`. `key_bias` (`[batch, len]`: 0 for tokens, a large negative
/// number for padding) is added to every query's scores before the softmax; `causal`: each query
/// attends to itself and the keys before it only.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, key_bias: Option<&Tensor>, causal: bool) -> Result<Tensor> {
    if fused_attention::fused(q, k, v) {
        return fused_attention::attention(q, k, v, heads, key_bias, causal);
    }
    fused_attention::composed(q, k, v, heads, key_bias, causal)
}

/// A transformer layer's attention sub-layer on `x` `[batch, len, width]`: `x + O(A(LN(x)))`
/// (pre-norm) or `LN(x + O(A(x)))` (post-norm), where A is the attention of the q, k and v
/// projections (`proj[..3]`) and O the output projection (`proj[3]`), masked as `mask` says. One
/// op on the CPU in f32 / f64 (`ops::blocks::sublayer`), [`composed_attention_branch`]
/// elsewhere.
pub fn attention_branch(x: &Tensor, norm: Norm, ln: &LayerNorm, proj: [&Linear; 4], heads: usize, mask: &Mask) -> Result<Tensor> {
    if let Some(p) = fusable_params(x, ln, &proj) {
        let (ln, proj) = ((&ln.weight, &ln.bias, ln.eps), [p[0], p[1], p[2], p[3]]);
        return sublayer::attention_branch(x, norm, ln, proj, heads, mask.key_bias.as_ref(), mask.causal);
    }
    composed_attention_branch(x, norm, ln, proj, heads, mask)
}

/// What each query of a transformer's attention may see.
#[derive(Clone, Debug, Default)]
pub struct Mask {
    /// `[batch, len]`, added to every query's scores: 0 for tokens, a large negative number for
    /// padding.
    pub key_bias: Option<Tensor>,
    /// Each query attends to itself and the tokens before it only (CLIP's text tower).
    pub causal: bool,
}

impl Mask {
    /// Padding keys, from an attention mask `[batch, len]` of 1 (token) and 0 (padding).
    pub fn padding(mask: &Tensor) -> Result<Tensor> {
        (mask.to_dtype(candle_core::DType::F32)? - 1.0)? * 1e9
    }
}

/// [`attention_branch`] from the separate layers.
pub fn composed_attention_branch(
    x: &Tensor,
    norm: Norm,
    ln: &LayerNorm,
    [q, k, v, o]: [&Linear; 4],
    heads: usize,
    mask: &Mask,
) -> Result<Tensor> {
    let attend = |q: &Tensor, k: &Tensor, v: &Tensor| attention(q, k, v, heads, mask.key_bias.as_ref(), mask.causal);
    let branch = |h: &Tensor| o.forward(&attend(&q.forward(h)?, &k.forward(h)?, &v.forward(h)?)?);
    match norm {
        Norm::Pre => branch(&ln.forward(x)?)? + x,
        Norm::Post => ln.forward(&(branch(x)? + x)?),
    }
}

/// Position `at[i]` of each sequence `i` of `x` `[batch, len, width]`: `[batch, width]`.
pub fn positions(x: &Tensor, at: &[usize]) -> Result<Tensor> {
    let (b, l, w) = x.dims3()?;
    if at.len() != b || at.iter().any(|&p| p >= l) {
        candle_core::bail!("positions {at:?} for a batch of {b} sequences of {l} tokens");
    }
    let rows = Tensor::from_vec(at.iter().enumerate().map(|(i, &p)| (i * l + p) as u32).collect::<Vec<_>>(), b, x.device())?;
    x.reshape((b * l, w))?.index_select(&rows, 0)
}

/// A pre-norm transformer layer (`x + O(A(LN1(x)))`, then `x + M(LN2(x))`) computed at one
/// position of each sequence only, `at[i]` of row `i`: `[batch, width]`. Where a tower keeps one
/// token of its last layer (a class token, an end-of-text token), the other positions' queries,
/// attention output and MLP feed nothing; only the keys and values need every position. The same
/// numbers as the whole layer at those positions, for 2/12 of its products instead of all of them.
#[allow(clippy::too_many_arguments)]
pub fn pre_norm_layer_at(
    x: &Tensor,
    at: &[usize],
    ln1: &LayerNorm,
    [q, k, v, o]: [&Linear; 4],
    heads: usize,
    mask: &Mask,
    ln2: &LayerNorm,
    [fc1, fc2]: [&Linear; 2],
    act: Activation,
) -> Result<Tensor> {
    let (b, l, w) = x.dims3()?;
    let h = ln1.forward(x)?;
    let (keys, values) = (k.forward(&h)?, v.forward(&h)?);
    let query = q.forward(&positions(&h, at)?)?;
    // Each query's keys: the padding bias, and under a causal mask every later key masked as
    // the softmax masks padding.
    let mut bias = match &mask.key_bias {
        Some(kb) => kb.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        None => vec![0.0; b * l],
    };
    if mask.causal {
        for (i, &p) in at.iter().enumerate() {
            bias[i * l + p + 1..(i + 1) * l].iter_mut().for_each(|v| *v = -1e9);
        }
    }
    let bias = Tensor::from_vec(bias, (b, l), x.device())?;
    let hd = w / heads;
    let split = |t: &Tensor, n: usize| t.reshape((b, n, heads, hd))?.transpose(1, 2)?.contiguous();
    let scores = split(&query, 1)?.matmul(&split(&keys, l)?.t()?)?;
    let softmax = |s: &Tensor| crate::ops::kernels::softmax::scaled_masked_softmax(s, 1.0 / (hd as f64).sqrt(), Some(&bias));
    let probs = match scores.dtype() {
        // As the whole layer's attention: exp and the row sums in f32 even for bf16 towers.
        candle_core::DType::BF16 | candle_core::DType::F16 => {
            softmax(&scores.to_dtype(candle_core::DType::F32)?)?.to_dtype(scores.dtype())?
        }
        _ => softmax(&scores)?,
    };
    let context = probs.matmul(&split(&values, l)?)?.reshape((b, w))?;
    let x = (o.forward(&context)? + positions(x, at)?)?;
    mlp(fc1, fc2, &ln2.forward(&x)?, act)? + x
}

/// A transformer layer's MLP sub-layer: `x + M(LN(x))` (pre-norm) or `LN(x + M(x))`
/// (post-norm) with `M = fc2 ∘ act ∘ fc1`. One op on the CPU in f32 / f64, the separate layers
/// elsewhere.
pub fn mlp_branch(x: &Tensor, norm: Norm, ln: &LayerNorm, fc1: &Linear, fc2: &Linear, act: Activation) -> Result<Tensor> {
    if let Some(p) = fusable_params(x, ln, &[fc1, fc2]) {
        return sublayer::mlp_branch(x, norm, (&ln.weight, &ln.bias, ln.eps), p[0], p[1], act);
    }
    composed_mlp_branch(x, norm, ln, fc1, fc2, act)
}

/// [`mlp_branch`] from the separate layers.
pub fn composed_mlp_branch(x: &Tensor, norm: Norm, ln: &LayerNorm, fc1: &Linear, fc2: &Linear, act: Activation) -> Result<Tensor> {
    match norm {
        Norm::Pre => mlp(fc1, fc2, &ln.forward(x)?, act)? + x,
        Norm::Post => ln.forward(&(mlp(fc1, fc2, x, act)? + x)?),
    }
}

/// The linear layers' (weight, bias) pairs when the residual-branch op can run them: every layer
/// has a bias and every tensor suits `ops::fusable`.
fn fusable_params<'a>(x: &Tensor, ln: &'a LayerNorm, layers: &[&'a Linear]) -> Option<Vec<(&'a Tensor, &'a Tensor)>> {
    let params = layers.iter().map(|l| l.bias.as_ref().map(|b| (&l.weight, b))).collect::<Option<Vec<_>>>()?;
    let mut all = vec![&ln.weight, &ln.bias];
    all.extend(params.iter().flat_map(|(w, b)| [*w, *b]));
    crate::ops::fusable(x, &all).then_some(params)
}

/// L2-normalises rows.
pub fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
    x.broadcast_div(&(norm + 1e-12)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn layer_norm_matches_hand_computation_and_passes_gradients() {
        let dev = Device::Cpu;
        let x = Var::new(&[[1.0f32, 2.0, 3.0, 6.0]], &dev).unwrap();
        let ln = LayerNorm {
            weight: Tensor::new(&[1.0f32, 2.0, 1.0, 1.0], &dev).unwrap(),
            bias: Tensor::new(&[0.0f32, 0.0, 0.5, 0.0], &dev).unwrap(),
            eps: 0.0,
        };
        let y = ln.forward(x.as_tensor()).unwrap();
        // mean 3, var (4+1+0+9)/4 = 3.5
        let s = 3.5f32.sqrt();
        let want = [-2.0 / s, -2.0 / s, 0.5, 3.0 / s];
        for (g, w) in y.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().zip(want) {
            assert!((g - w).abs() < 1e-5);
        }
        let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        assert!(grads.get(x.as_tensor()).is_some(), "LayerNorm must pass gradients to its input");
    }

    #[test]
    fn attention_ignores_masked_keys() {
        let dev = Device::Cpu;
        let q = Tensor::new(&[[[1.0f32, 0.0], [0.0, 1.0], [1.0, 1.0]]], &dev).unwrap();
        let v = Tensor::new(&[[[1.0f32, 2.0], [3.0, 4.0], [100.0, 100.0]]], &dev).unwrap();
        let mask = Tensor::new(&[[0.0f32, 0.0, -1e9]], &dev).unwrap();
        let out = attention(&q, &q, &v, 1, Some(&mask), false).unwrap().to_vec3::<f32>().unwrap();
        for row in &out[0] {
            assert!(row[0] <= 3.0 && row[1] <= 4.0, "{row:?}");
        }
        // Query 0 = [1,0] scores keys [1, 0]/sqrt(2): softmax weights by hand.
        let (a, b) = ((1.0f32 / 2f32.sqrt()).exp(), 1.0f32);
        let w0 = a / (a + b);
        assert!((out[0][0][0] - (w0 * 1.0 + (1.0 - w0) * 3.0)).abs() < 1e-5);
    }
}

/// The transformer sub-layer ops against the separate layers they replace.
#[cfg(test)]
mod sublayer_tests {
    use super::{self as layers, composed_attention_branch, composed_mlp_branch, Activation, LayerNorm, Linear, Mask, Norm};
    use crate::ops::testing::{check_fd, max_abs, max_diff};
    use crate::util::rng::randn;
    use candle_core::{DType, Tensor};
    use candle_core::{Device, Var};
    use candle_nn::{Init, VarBuilder, VarMap};

    const WIDTH: usize = 8;

    /// A LayerNorm and linear layers with random parameters (γ around 1, the rest around 0), and
    /// all their variables by name.
    struct Sublayer {
        ln: LayerNorm,
        linears: Vec<Linear>,
        vars: Vec<(String, Var)>,
    }

    fn sublayer(dtype: DType, shapes: &[(usize, usize)]) -> Sublayer {
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, dtype, &Device::Cpu);
        let ln = LayerNorm::new(WIDTH, 1e-5, vb.pp("ln")).unwrap();
        let linears =
            shapes.iter().enumerate().map(|(i, &(inp, out))| layers::linear(inp, out, true, Init::Const(0.0), vb.pp(i)).unwrap()).collect();
        let mut vars: Vec<(String, Var)> = map.data().lock().unwrap().iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (seed, (name, var)) in vars.iter().enumerate() {
            let mean = if name == "ln.weight" { 1.0 } else { 0.0 };
            var.set(&randn(400 + seed as u64, mean, 0.4, var.dims(), dtype, &Device::Cpu).unwrap()).unwrap();
        }
        Sublayer { ln, linears, vars }
    }

    /// Batch element 1 masks its last two keys.
    fn mask(dtype: DType, b: usize, l: usize) -> Tensor {
        let m: Vec<f64> = (0..b * l).map(|i| if i / l == 1 && i % l >= l - 2 { -1e9 } else { 0.0 }).collect();
        Tensor::from_vec(m, (b, l), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    type Forward<'a> = Box<dyn Fn(&Tensor) -> Tensor + 'a>;

    /// Each sub-layer kind: the op and the composition of separate layers, on one set of
    /// parameters.
    fn cases<'a>(dtype: DType, s: &'a [Sublayer; 2], key_bias: &Tensor) -> Vec<(String, Forward<'a>, Forward<'a>)> {
        let (att, mlp) = (&s[0], &s[1]);
        let proj = || [&att.linears[0], &att.linears[1], &att.linears[2], &att.linears[3]];
        let mut out: Vec<(String, Forward<'a>, Forward<'a>)> = Vec::new();
        for norm in [Norm::Pre, Norm::Post] {
            for (bias, causal) in [(None, false), (Some(key_bias.clone()), false), (None, true), (Some(key_bias.clone()), true)] {
                let mask = Mask { key_bias: bias, causal };
                let m2 = mask.clone();
                out.push((
                    format!("{dtype:?} attention {norm:?} mask {} causal {causal}", mask.key_bias.is_some()),
                    Box::new(move |x| layers::attention_branch(x, norm, &att.ln, proj(), 2, &mask).unwrap()),
                    Box::new(move |x| composed_attention_branch(x, norm, &att.ln, proj(), 2, &m2).unwrap()),
                ));
            }
            for act in [Activation::GeluErf, Activation::QuickGelu] {
                out.push((
                    format!("{dtype:?} MLP {norm:?} {act:?}"),
                    Box::new(move |x| layers::mlp_branch(x, norm, &mlp.ln, &mlp.linears[0], &mlp.linears[1], act).unwrap()),
                    Box::new(move |x| composed_mlp_branch(x, norm, &mlp.ln, &mlp.linears[0], &mlp.linears[1], act).unwrap()),
                ));
            }
        }
        out
    }

    fn sublayers(dtype: DType) -> [Sublayer; 2] {
        [sublayer(dtype, &[(WIDTH, WIDTH); 4]), sublayer(dtype, &[(WIDTH, 12), (12, WIDTH)])]
    }

    /// The op against the separate layers (each checked against candle on its own): output and
    /// the gradients of x and of every parameter, twice over one graph.
    #[test]
    fn matches_the_separate_layers_forward_and_backward() {
        for (dtype, tol) in [(DType::F64, 1e-11), (DType::F32, 2e-5)] {
            let s = sublayers(dtype);
            let x = Var::from_tensor(&randn(410, 0.2, 1.0, (2, 5, WIDTH), dtype, &Device::Cpu).unwrap()).unwrap();
            let up = randn(411, 0.0, 1.0, (2, 5, WIDTH), dtype, &Device::Cpu).unwrap();
            for (what, ours, reference) in cases(dtype, &s, &mask(dtype, 2, 5)) {
                let (y, r) = (ours(&x), reference(&x));
                assert!(max_diff(&y, &r) <= tol * max_abs(&r), "{what}: output");
                let loss = (y * &up).unwrap().sum_all().unwrap();
                let (g1, again) = (loss.backward().unwrap(), loss.backward().unwrap());
                let g2 = (r * &up).unwrap().sum_all().unwrap().backward().unwrap();
                let vars = s.iter().flat_map(|s| s.vars.iter().map(|(n, v)| (n.as_str(), v)));
                for (name, v) in std::iter::once(("x", &x)).chain(vars) {
                    let (Some(a), Some(r)) = (g1.get(v), g2.get(v)) else {
                        assert!(g1.get(v).is_none() && g2.get(v).is_none(), "{what}: {name} has a gradient on one side only");
                        continue;
                    };
                    assert_eq!(a.dims(), v.dims(), "{what}: {name}");
                    // The key projection's bias gets no gradient but rounding (a shift of every
                    // key adds q·b to a query's scores, which its softmax ignores): a floor on
                    // the scale keeps its rounding from counting as an error.
                    let scale = max_abs(r).max(1e-2);
                    assert!(max_diff(a, r) <= tol * scale, "{what}: gradient of {name}: {} vs {}", max_diff(a, r), max_abs(r));
                    assert_eq!(max_diff(a, again.get(v).unwrap()), 0.0, "{what}: {name} on the second pass");
                }
            }
        }
    }

    /// Inputs and parameters outside any graph take the forward-only op (parameters read in
    /// place, nothing kept): the same outputs as the separate layers, and as the op on
    /// variables. With bf16 products its tiles add the bias and residual and apply the
    /// activation as they are stored; against the separate steps on the same rounded operands
    /// that moves nothing beyond f32 rounding.
    #[test]
    fn the_forward_only_op_matches_the_separate_layers() {
        let plain = |s: &Sublayer| Sublayer {
            ln: LayerNorm { weight: s.ln.weight.detach(), bias: s.ln.bias.detach(), eps: s.ln.eps },
            linears: s.linears.iter().map(|l| Linear { weight: l.weight.detach(), bias: l.bias.as_ref().map(|b| b.detach()) }).collect(),
            vars: Vec::new(),
        };
        for (dtype, tol) in [(DType::F64, 1e-11), (DType::F32, 2e-5)] {
            let tracked = sublayers(dtype);
            let s = [plain(&tracked[0]), plain(&tracked[1])];
            let x = randn(414, 0.2, 1.0, (2, 5, WIDTH), dtype, &Device::Cpu).unwrap();
            let bias = mask(dtype, 2, 5);
            let on_vars = cases(dtype, &tracked, &bias);
            for ((what, ours, reference), (_, graph, _)) in cases(dtype, &s, &bias).into_iter().zip(on_vars) {
                let (y, r) = (ours(&x), reference(&x));
                assert!(max_diff(&y, &r) <= tol * max_abs(&r), "{what}: output");
                assert!(max_diff(&y, &graph(&x)) <= tol * max_abs(&r), "{what}: against the op on variables");
            }
        }
        if !crate::ops::kernels::bf16_gemm::available() {
            eprintln!("skipped the bf16 half: this CPU has no AVX-512 BF16");
            return;
        }
        // Wide enough that every product of the branch goes through bf16.
        let (map, dev) = (VarMap::new(), Device::Cpu);
        let vb = VarBuilder::from_varmap(&map, DType::F32, &dev);
        let (width, hidden) = (256, 1024);
        let ln = LayerNorm::new(width, 1e-5, vb.pp("ln")).unwrap();
        let fc1 = layers::linear(width, hidden, true, Init::Const(0.0), vb.pp("fc1")).unwrap();
        let fc2 = layers::linear(hidden, width, true, Init::Const(0.0), vb.pp("fc2")).unwrap();
        for (seed, (_, v)) in map.data().lock().unwrap().iter().enumerate() {
            v.set(&randn(420 + seed as u64, 0.0, 0.1, v.dims(), DType::F32, &dev).unwrap()).unwrap();
        }
        let x = Var::from_tensor(&randn(415, 0.0, 1.0, (4, 12, width), DType::F32, &dev).unwrap()).unwrap();
        for act in [Activation::QuickGelu, Activation::GeluTanh] {
            let (eval, graph) = crate::ops::kernels::bf16_gemm::with_bf16_products(|| {
                let eval = layers::mlp_branch(&x.as_tensor().detach(), Norm::Pre, &ln, &fc1, &fc2, act);
                (eval, layers::mlp_branch(&x, Norm::Pre, &ln, &fc1, &fc2, act))
            });
            let (eval, graph) = (eval.unwrap(), graph.unwrap());
            assert!(max_diff(&eval, &graph) <= 1e-5 * max_abs(&graph), "bf16 {act:?}: {}", max_diff(&eval, &graph));
        }
    }

    /// A layer run at one position per sequence against the whole layer read at those positions,
    /// under every mask: the same outputs, and the same gradients for x and every parameter.
    #[test]
    fn a_layer_at_chosen_positions_equals_the_whole_layer_there() {
        let s = sublayers(DType::F64);
        let (att, mlp) = (&s[0], &s[1]);
        let proj = [&att.linears[0], &att.linears[1], &att.linears[2], &att.linears[3]];
        let x = Var::from_tensor(&randn(416, 0.2, 1.0, (2, 5, WIDTH), DType::F64, &Device::Cpu).unwrap()).unwrap();
        let up = randn(417, 0.0, 1.0, (2, WIDTH), DType::F64, &Device::Cpu).unwrap();
        // Row 1 masks its last two keys: its position 2 is its last token.
        let (at, rows) = ([4usize, 2], Tensor::new(&[4u32, 7], &Device::Cpu).unwrap());
        let act = Activation::QuickGelu;
        for (bias, causal) in [(None, false), (Some(mask(DType::F64, 2, 5)), false), (None, true), (Some(mask(DType::F64, 2, 5)), true)] {
            let what = format!("mask {} causal {causal}", bias.is_some());
            let m = Mask { key_bias: bias, causal };
            let whole = layers::attention_branch(&x, Norm::Pre, &att.ln, proj, 2, &m).unwrap();
            let whole = layers::mlp_branch(&whole, Norm::Pre, &mlp.ln, &mlp.linears[0], &mlp.linears[1], act).unwrap();
            let whole = whole.reshape((10, WIDTH)).unwrap().index_select(&rows, 0).unwrap();
            let part = layers::pre_norm_layer_at(&x, &at, &att.ln, proj, 2, &m, &mlp.ln, [&mlp.linears[0], &mlp.linears[1]], act).unwrap();
            assert!(max_diff(&part, &whole) <= 1e-12 * max_abs(&whole), "{what}: output {}", max_diff(&part, &whole));
            let g1 = (part * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (whole * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let vars = s.iter().flat_map(|s| s.vars.iter().map(|(n, v)| (n.as_str(), v)));
            for (name, v) in std::iter::once(("x", &x)).chain(vars) {
                let (a, r) = (g1.get(v).unwrap(), g2.get(v).unwrap());
                let scale = max_abs(r).max(1e-2);
                assert!(max_diff(a, r) <= 1e-10 * scale, "{what}: gradient of {name}: {} vs {}", max_diff(a, r), max_abs(r));
            }
        }
        let wrong =
            layers::pre_norm_layer_at(&x, &[5, 0], &att.ln, proj, 2, &Mask::default(), &mlp.ln, [&mlp.linears[0], &mlp.linears[1]], act);
        assert!(wrong.unwrap_err().to_string().contains("positions [5, 0]"));
    }

    #[test]
    fn gradients_match_finite_differences() {
        let s = sublayers(DType::F64);
        let x = Var::from_tensor(&randn(412, 0.2, 1.0, (2, 5, WIDTH), DType::F64, &Device::Cpu).unwrap()).unwrap();
        let up = randn(413, 0.0, 1.0, (2, 5, WIDTH), DType::F64, &Device::Cpu).unwrap();
        let scalar = |t: Tensor| (t * &up).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        for (what, ours, _) in cases(DType::F64, &s, &mask(DType::F64, 2, 5)) {
            let g = (ours(&x) * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let err = check_fd(|t| scalar(ours(t)), &x, g.get(&x).unwrap(), &[0, 13, 41, 79]);
            assert!(err < 1e-7, "{what}: x {err}");
            for (name, v) in s.iter().flat_map(|s| &s.vars) {
                let Some(gv) = g.get(v) else { continue };
                if max_abs(gv) < 1e-9 {
                    // The key projection's bias: zero gradient (see above), nothing to compare.
                    continue;
                }
                let original = v.as_tensor().copy().unwrap();
                let n = v.elem_count();
                let err = check_fd(
                    |t| {
                        v.set(t).unwrap();
                        let loss = scalar(ours(&x));
                        v.set(&original).unwrap();
                        loss
                    },
                    &original,
                    gv,
                    &[0, n / 2, n - 1],
                );
                assert!(err < 1e-7, "{what}: {name} {err}");
            }
        }
    }

    #[test]
    fn parameters_that_do_not_fit_are_errors() {
        let s = sublayer(DType::F32, &[(WIDTH, WIDTH); 4]);
        let x = Tensor::zeros((2, 5, WIDTH + 1), DType::F32, &Device::Cpu).unwrap();
        let proj = [&s.linears[0], &s.linears[1], &s.linears[2], &s.linears[3]];
        assert!(layers::attention_branch(&x, Norm::Pre, &s.ln, proj, 2, &Mask::default()).is_err());
        let x = Tensor::zeros((2, 5, WIDTH), DType::F32, &Device::Cpu).unwrap();
        let err = layers::attention_branch(&x, Norm::Pre, &s.ln, proj, 3, &Mask::default()).unwrap_err().to_string();
        assert!(err.contains("heads"), "{err}");
    }
}
