//! A convolution (1×1 or depthwise) and the BatchNorm (+ SiLU) after it as one graph node.
//!
//! candle's backward pass starts every node's gradient as a zero-filled tensor and adds the
//! incoming gradient into it. Between a convolution and its BatchNorm that is an activation-sized
//! fill and add per layer that buys nothing; in EfficientNet they are the expanded tensors, the
//! largest of each block. Here the convolution's output is state of this op (it is kept for the
//! backward pass either way), and the BatchNorm's input gradient goes straight into the
//! convolution's backward.

use candle_core::{Layout, Result, Shape, Tensor};

use super::stage::Stage;
use crate::ops::kernels::batch_norm::{BatchNormAct, BnGrad, Statistics};
use crate::ops::kernels::depthwise::{self, Padding};
use crate::ops::kernels::pointwise;
use crate::ops::op::{Kernel, Op};
use crate::ops::{with_cpu_slice, Float};

/// The convolution in front of the BatchNorm; neither has a bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conv {
    /// `w` is `[out, in, 1, 1]`.
    Pointwise,
    /// `w` is `[C, 1, k, k]`.
    Depthwise { stride: usize, pad: Padding },
}

impl Conv {
    /// The convolution alone, differentiable: what runs where the fused op does not.
    pub fn apply(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        match *self {
            Conv::Pointwise => pointwise::pointwise_conv2d(x, w),
            Conv::Depthwise { stride, pad } => depthwise::depthwise_conv2d(x, w, stride, pad),
        }
    }

    /// Whether [`conv_norm`] can run these operands: CPU tensors of one f32 / f64 dtype.
    pub fn fusable(x: &Tensor, w: &Tensor, gamma: &Tensor) -> bool {
        crate::ops::fusable(x, &[w, gamma])
    }

    /// The convolution's output as a graph leaf. Operands as [`Conv::fusable`] requires.
    pub fn forward_detached(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        match *self {
            Conv::Pointwise => pointwise::forward_detached(&x, &w),
            Conv::Depthwise { stride, pad } => depthwise::forward_detached(&x, &w, stride, pad),
        }
    }

    fn backward(&self, x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
        match *self {
            Conv::Pointwise => pointwise::backward(x, w, grad),
            Conv::Depthwise { stride, pad } => depthwise::backward(x, w, stride, pad, grad),
        }
    }
}

/// Arguments: the convolution's input and weight, and γ and β stacked as `[2, C]` (so that
/// BatchNorm's two parameter gradients come back as the one `[2, C]` block its backward writes).
pub struct ConvNorm {
    conv: Conv,
    norm: BatchNormAct,
    /// The convolution's output, computed once by the caller (BatchNorm's batch statistics
    /// are taken from it before this op exists).
    z: Tensor,
}

impl Kernel<3> for ConvNorm {
    const NAME: &'static str = "conv-batch-norm-act";
    const PROFILE: &'static str = "op/batch-norm";
    /// The input and weight are the convolution's, which ran before the op: only `[γ; β]` is read.
    const READS: [bool; 3] = [false, false, true];
    /// Channels and plane size.
    type Geometry = (usize, usize);

    fn geometry(&self, [_, _, gb]: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        let (_, c, h, w) = self.z.dims4()?;
        if gb.dims() != [2, c] {
            candle_core::bail!("conv + BatchNorm: γ and β are {:?}, expected [2, {c}]", gb.dims());
        }
        Ok(((c, h * w), self.z.shape().clone()))
    }

    fn cpu<T: Float>(&self, &(c, hw): &Self::Geometry, [_, _, gb]: [&[T]; 3]) -> Result<Vec<T>> {
        let (gamma, beta) = gb.split_at(c);
        with_cpu_slice(&self.z, "the convolution's output", |z| Ok(self.norm.apply(z, gamma, beta, c, hw)))
    }

    fn backward(&self, [x, w, gamma_beta]: [&Tensor; 3], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let c = gamma_beta.dim(1)?;
        let n = self.z.elem_count();
        let grad_op = BnGrad { op: self.norm.clone(), gamma: gamma_beta.get(0)?, beta: gamma_beta.get(1)? };
        let out = self.z.apply_op2_no_bwd(&grad.contiguous()?, &Op(grad_op))?;
        let dz = out.narrow(0, 0, n)?.reshape(self.z.dims())?;
        let (dx, dw) = self.conv.backward(x, w, &dz)?;
        Ok([Some(dx), Some(dw), Some(out.narrow(0, n, 2 * c)?.reshape((2, c))?)])
    }
}

/// The BatchNorm after the convolution: statistics, γ, β and whether SiLU follows.
pub struct Norm<'a> {
    pub stats: &'a Statistics<'a>,
    pub gamma: &'a Tensor,
    pub beta: &'a Tensor,
    pub silu: bool,
}

/// `act(BatchNorm(conv(x, w)))` as one graph node, given the convolution's output `z` (from
/// [`Conv::forward_detached`]). Operands as [`Conv::fusable`] requires.
pub fn conv_norm(conv: Conv, x: &Tensor, w: &Tensor, z: Tensor, norm: &Norm) -> Result<Tensor> {
    let gamma_beta = Tensor::stack(&[norm.gamma, norm.beta], 0)?;
    let op = ConvNorm { conv, norm: BatchNormAct::new(norm.stats, norm.silu), z: z.contiguous()? };
    x.contiguous()?.apply_op3(&w.contiguous()?, &gamma_beta, Op(op))
}

/// [`conv_norm`] outside candle's graph, for an op that chains several (`ops::mbconv`); its
/// backward pass gives the gradients of the input, the weight and `[γ; β]` (`[2, C]`).
pub(crate) type ConvNormStage = Stage<Op<ConvNorm>>;

impl ConvNormStage {
    /// The output and the stage. Operands as [`Conv::fusable`] requires; they are detached from
    /// any graph.
    pub fn conv_norm(conv: Conv, x: &Tensor, w: &Tensor, z: Tensor, norm: &Norm) -> Result<(Tensor, Self)> {
        let gamma_beta = Tensor::stack(&[norm.gamma, norm.beta], 0)?;
        let op = ConvNorm { conv, norm: BatchNormAct::new(norm.stats, norm.silu), z: z.detach().contiguous()? };
        Stage::run(Op(op), [x, w, &gamma_beta])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::kernels::batch_norm::composed as composed_batch_norm;
    use crate::ops::kernels::moments::channel_moments;
    use crate::util::rng::randn;
    use candle_core::{DType, Device, Var};

    fn max_rel_diff(a: &Tensor, b: &Tensor) -> f64 {
        let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        let m = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        let f = |t: Tensor| t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
        f(d) / f(m).max(1e-30)
    }

    const CONVS: [(Conv, [usize; 4]); 3] = [
        (Conv::Pointwise, [5, 4, 1, 1]),
        (Conv::Depthwise { stride: 2, pad: Padding { top: 0, bottom: 1, left: 0, right: 1 } }, [4, 1, 3, 3]),
        (Conv::Depthwise { stride: 1, pad: Padding { top: 2, bottom: 2, left: 2, right: 2 } }, [4, 1, 5, 5]),
    ];

    /// Forward and every gradient (input, weight, γ, β) against the convolution op followed by
    /// BatchNorm composed from candle primitives, with batch and with running statistics.
    fn check(dtype: DType, tol: f64) {
        let dev = Device::Cpu;
        for (i, (conv, wdims)) in CONVS.into_iter().enumerate() {
            for (batch_stats, silu) in [(true, true), (true, false), (false, true), (false, false)] {
                let seed = 300 + 10 * i as u64;
                let x = Var::from_tensor(&randn(seed, 0.3, 1.5, (3, 4, 7, 6), dtype, &dev).unwrap()).unwrap();
                let w = Var::from_tensor(&randn(seed + 1, 0.0, 0.5, wdims.to_vec(), dtype, &dev).unwrap()).unwrap();
                let c = wdims[0];
                let gamma = Var::from_tensor(&randn(seed + 2, 1.0, 0.3, c, dtype, &dev).unwrap()).unwrap();
                let beta = Var::from_tensor(&randn(seed + 3, 0.0, 0.3, c, dtype, &dev).unwrap()).unwrap();
                let (rm, rv): (Vec<f64>, Vec<f64>) =
                    ((0..c).map(|j| 0.1 * j as f64).collect(), (0..c).map(|j| 0.5 + 0.3 * j as f64).collect());

                let z = conv.forward_detached(x.as_tensor(), w.as_tensor()).unwrap();
                let (mean, var) = if batch_stats {
                    let m = channel_moments(&z).unwrap().to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
                    (m[0].clone(), m[1].clone())
                } else {
                    (rm.clone(), rv.clone())
                };
                let stats = Statistics { mean: &mean, var: &var, eps: 1e-3, from_batch: batch_stats };
                let norm = Norm { stats: &stats, gamma: gamma.as_tensor(), beta: beta.as_tensor(), silu };
                let ours = conv_norm(conv, x.as_tensor(), w.as_tensor(), z, &norm).unwrap();

                let ref_stats = Statistics { mean: &rm, var: &rv, eps: 1e-3, from_batch: batch_stats };
                let z_ref = conv.apply(x.as_tensor(), w.as_tensor()).unwrap();
                let reference = composed_batch_norm(&z_ref, &ref_stats, gamma.as_tensor(), beta.as_tensor(), silu).unwrap();
                let what = format!("{conv:?} batch statistics {batch_stats} silu {silu} {dtype:?}");
                assert!(max_rel_diff(&ours, &reference) < tol, "forward of {what}");

                let up = randn(seed + 4, 0.0, 1.0, ours.dims(), dtype, &dev).unwrap();
                let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
                let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
                for (name, v) in [("x", &x), ("w", &w), ("gamma", &gamma), ("beta", &beta)] {
                    let d = max_rel_diff(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap());
                    assert!(d < tol, "gradient of {name} in {what}: relative difference {d}");
                }
            }
        }
    }

    #[test]
    fn matches_the_convolution_then_composed_batch_norm_in_f64() {
        check(DType::F64, 1e-10);
    }

    #[test]
    fn matches_the_convolution_then_composed_batch_norm_in_f32() {
        check(DType::F32, 1e-5);
    }
}
