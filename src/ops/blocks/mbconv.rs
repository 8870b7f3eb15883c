//! An EfficientNet MBConv block (expand, depthwise, squeeze-excite, project, each convolution with
//! its BatchNorm, then the shortcut) as one graph node.
//!
//! As separate nodes, each of the block's internal tensors is a graph edge, and candle's backward
//! pass gives every edge a zero-filled gradient buffer and adds the incoming gradient into it:
//! three fills and adds of the expanded (widest) tensor per block, one more for the block's output
//! at the shortcut. Here the stages run outside the graph ([`ConvNormStage`],
//! [`SqueezeExciteStage`]) and the block's backward hands each stage's input gradient straight to
//! the stage before it. The block's output is computed in the op (the shortcut's sum), so the
//! projection's own output is not kept for the backward pass.
//!
//! The parameters arrive as one flat tensor (a custom op takes at most three operands),
//! [`MbConvParams::flat`]; the backward pass returns their gradients in the same order.

use std::sync::Mutex;

use candle_core::{Layout, Result, Shape, Tensor};

use super::conv_norm::ConvNormStage;
use super::squeeze_excite::SqueezeExciteStage;
use crate::ops::kernels::stochastic_depth::{scale_samples, scaled_sum};
use crate::ops::op::{Kernel, Op};
use crate::ops::{with_cpu_slice, Float};

/// How the block's input joins its output.
#[derive(Debug, Clone, PartialEq)]
pub enum Shortcut {
    /// No shortcut (the first block of a stage).
    None,
    /// `out = branch + x`.
    Identity,
    /// `out = branch·keep[n] + x`: stochastic depth, one factor per sample.
    Scaled(Vec<f64>),
}

/// A convolution's weight and its BatchNorm's γ and β.
#[derive(Clone, Copy)]
pub struct ConvParams<'a> {
    pub w: &'a Tensor,
    pub gamma: &'a Tensor,
    pub beta: &'a Tensor,
}

/// The block's parameters.
#[derive(Clone, Copy)]
pub struct MbConvParams<'a> {
    pub expand: Option<ConvParams<'a>>,
    pub depthwise: ConvParams<'a>,
    /// Squeeze-excite's reduce weight `[R, C]` and bias, expand weight `[C, R]` and bias.
    pub excite: [&'a Tensor; 4],
    pub project: ConvParams<'a>,
}

impl<'a> MbConvParams<'a> {
    /// Every parameter in the order [`MbConvParams::flat`] lays them out: expand (w, γ, β),
    /// depthwise (w, γ, β), squeeze-excite (W1, b1, W2, b2), project (w, γ, β).
    pub fn tensors(&self) -> Vec<&'a Tensor> {
        let conv = |c: &ConvParams<'a>| [c.w, c.gamma, c.beta];
        let mut all: Vec<&Tensor> = self.expand.as_ref().map(conv).into_iter().flatten().collect();
        all.extend(conv(&self.depthwise));
        all.extend(self.excite);
        all.extend(conv(&self.project));
        all
    }

    /// Every parameter flattened, in one tensor.
    pub fn flat(&self) -> Result<Tensor> {
        let flat: Vec<Tensor> = self.tensors().into_iter().map(|t| t.flatten_all()).collect::<Result<_>>()?;
        Tensor::cat(&flat, 0)
    }
}

/// The block's stages, already run in order on detached operands.
pub struct MbConvStages {
    pub(crate) expand: Option<ConvNormStage>,
    pub(crate) depthwise: ConvNormStage,
    pub(crate) excite: SqueezeExciteStage,
    pub(crate) project: ConvNormStage,
    pub shortcut: Shortcut,
}

struct MbConv {
    stages: MbConvStages,
    /// The flat parameters' length, to check the backward pass's result against.
    params: usize,
    /// The branch's storage is only needed until the forward pass has added the shortcut.
    branch: Mutex<Option<Tensor>>,
}

impl Kernel<2> for MbConv {
    const NAME: &'static str = "mbconv";
    const PROFILE: &'static str = "op/channel";
    /// The stages ran before the op: only the shortcut `x` is read.
    const READS: [bool; 2] = [true, false];
    type Geometry = ();

    fn geometry(&self, [x, params]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        if params.shape().elem_count() != self.params {
            candle_core::bail!("MBConv block: {} parameters, expected {}", params.shape().elem_count(), self.params);
        }
        let branch = self.branch.lock().unwrap_or_else(|e| e.into_inner());
        let Some(branch) = branch.as_ref() else { candle_core::bail!("MBConv block: forward pass run twice") };
        if self.stages.shortcut != Shortcut::None && x.dims() != branch.dims() {
            candle_core::bail!("MBConv block: shortcut {:?} does not match the branch {:?}", x.dims(), branch.dims());
        }
        Ok(((), branch.shape().clone()))
    }

    fn cpu<T: Float>(&self, _: &Self::Geometry, [x, _]: [&[T]; 2]) -> Result<Vec<T>> {
        let Some(branch) = self.branch.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            candle_core::bail!("MBConv block: forward pass run twice")
        };
        let keep = match &self.stages.shortcut {
            Shortcut::None => None,
            Shortcut::Identity => Some(vec![1.0; branch.dim(0)?]),
            Shortcut::Scaled(keep) => Some(keep.clone()),
        };
        if let Some(k) = &keep {
            if k.len() != branch.dim(0)? {
                candle_core::bail!("MBConv block: {} stochastic-depth factors for {} samples", k.len(), branch.dim(0)?);
            }
        }
        with_cpu_slice(&branch, "MBConv branch", |h| {
            Ok(match &keep {
                Some(keep) => scaled_sum(h, keep, x),
                None => h.to_vec(),
            })
        })
    }

    fn backward(&self, [_, params]: [&Tensor; 2], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let s = &self.stages;
        let grad = grad.detach().contiguous()?;
        let branch_grad = match &s.shortcut {
            Shortcut::Scaled(keep) => scale_samples(&grad, keep)?,
            _ => grad.clone(),
        };
        let (d_excite, dw_project, dgb_project) = s.project.backward(&branch_grad)?;
        drop(branch_grad);
        let (d_depthwise, dw1, drest) = s.excite.backward(&d_excite)?;
        drop(d_excite);
        let (d_expand, dw_depthwise, dgb_depthwise) = s.depthwise.backward(&d_depthwise)?;
        drop(d_depthwise);
        let mut pieces = Vec::with_capacity(8);
        let dx = match &s.expand {
            Some(expand) => {
                let (dx, dw, dgb) = expand.backward(&d_expand)?;
                pieces.extend([dw, dgb]);
                dx
            }
            None => d_expand,
        };
        pieces.extend([dw_depthwise, dgb_depthwise, dw1, drest, dw_project, dgb_project]);
        let flat: Vec<Tensor> = pieces.iter().map(|t| t.flatten_all()).collect::<Result<_>>()?;
        let dparams = Tensor::cat(&flat, 0)?.to_dtype(params.dtype())?;
        if dparams.elem_count() != self.params {
            candle_core::bail!("MBConv block: {} parameter gradients for {} parameters", dparams.elem_count(), self.params);
        }
        let dx = match s.shortcut {
            Shortcut::None => dx,
            _ => (dx + grad)?,
        };
        Ok([Some(dx), Some(dparams)])
    }
}

/// The block's output as one graph node over its input `x` and `params`, given its stages
/// already run on detached copies of them and the projection stage's output `branch`. CPU, f32 /
/// f64 (`ops::fusable`).
pub fn mbconv(x: &Tensor, params: &MbConvParams, stages: MbConvStages, branch: Tensor) -> Result<Tensor> {
    let flat = params.flat()?;
    let op = MbConv { params: flat.elem_count(), branch: Mutex::new(Some(branch)), stages };
    x.contiguous()?.apply_op2(&flat, Op(op))
}
