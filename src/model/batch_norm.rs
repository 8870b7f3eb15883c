//! BatchNorm over the channels of NCHW tensors, with the three behaviours training needs:
//! - training: normalise with the batch's statistics and update the running averages,
//! - evaluation: normalise with the running averages,
//! - frozen (ALIGN fine-tunes this way): running averages while training, never updated.
//!
//! The running averages are variables of the model (`running_mean`, `running_var`, Hugging Face's
//! names) so they are saved in checkpoints; the optimiser leaves them alone. `momentum` follows
//! PyTorch: `running ← (1 − momentum)·running + momentum·batch` (TensorFlow's decay 0.99 is
//! momentum 0.01), and the running variance takes the unbiased batch variance.

use candle_core::{DType, Result, Tensor, Var};

use super::Ctx;
use crate::ops::blocks::conv_norm::{conv_norm, Conv, ConvNormStage, Norm};
use crate::ops::blocks::mbconv_eval::Affine;
use crate::ops::kernels::batch_norm::{batch_norm_act, Statistics};
use crate::ops::kernels::moments::channel_moments;
use candle_nn::{Init, VarBuilder};

pub struct BatchNorm2d {
    weight: Tensor,
    bias: Tensor,
    running_mean: Var,
    running_var: Var,
    eps: f64,
    momentum: f64,
    frozen: bool,
}

/// Names of the statistics variables: excluded from optimisation.
pub fn is_running_stat(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var")
}

/// The variables an optimizer trains: every one but the BatchNorm running statistics (model
/// state, updated by the forward pass).
pub fn trainable_vars(vm: &candle_nn::VarMap) -> Vec<(String, candle_core::Var)> {
    let data = vm.data().lock().unwrap_or_else(|e| e.into_inner());
    data.iter().filter(|(k, _)| !is_running_stat(k)).map(|(k, v)| (k.clone(), v.clone())).collect()
}

impl BatchNorm2d {
    pub fn new(channels: usize, eps: f64, momentum: f64, frozen: bool, vb: VarBuilder) -> Result<Self> {
        Ok(BatchNorm2d {
            weight: vb.get_with_hints(channels, "weight", Init::Const(1.0))?,
            bias: vb.get_with_hints(channels, "bias", Init::Const(0.0))?,
            running_mean: Var::from_tensor(&vb.get_with_hints(channels, "running_mean", Init::Const(0.0))?)?,
            running_var: Var::from_tensor(&vb.get_with_hints(channels, "running_var", Init::Const(1.0))?)?,
            eps,
            momentum,
            frozen,
        })
    }

    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        self.forward_act(x, ctx, false)
    }

    /// BatchNorm followed by SiLU when `silu`, as one fused op.
    pub fn forward_act(&self, x: &Tensor, ctx: &Ctx, silu: bool) -> Result<Tensor> {
        let (mean, var, batch_stats) = self.statistics(x, ctx)?;
        batch_norm_act(x, &Statistics { mean: &mean, var: &var, eps: self.eps, from_batch: batch_stats }, &self.weight, &self.bias, silu)
    }

    /// `conv` of `x` and `w`, then this BatchNorm (+ SiLU), as one graph node where the operands
    /// allow it (see `ops::conv_norm`), else as the two ops.
    pub fn conv_forward_act(&self, conv: Conv, x: &Tensor, w: &Tensor, ctx: &Ctx, silu: bool) -> Result<Tensor> {
        if !Conv::fusable(x, w, &self.weight) {
            return self.forward_act(&conv.apply(x, w)?, ctx, silu);
        }
        self.after_conv(conv, x, w, ctx, silu, |z, norm| conv_norm(conv, x, w, z, norm))
    }

    /// [`BatchNorm2d::conv_forward_act`] outside candle's graph, for `ops::mbconv`: the output
    /// and the stage that differentiates it. Operands as [`Conv::fusable`] requires.
    pub(crate) fn conv_stage(&self, conv: Conv, x: &Tensor, w: &Tensor, ctx: &Ctx, silu: bool) -> Result<(Tensor, ConvNormStage)> {
        self.after_conv(conv, x, w, ctx, silu, |z, norm| ConvNormStage::conv_norm(conv, x, w, z, norm))
    }

    /// `f` of the convolution's output (a graph leaf) and this BatchNorm with the statistics to
    /// normalise it with (the running averages take in the batch's when they are used).
    fn after_conv<R>(
        &self,
        conv: Conv,
        x: &Tensor,
        w: &Tensor,
        ctx: &Ctx,
        silu: bool,
        f: impl FnOnce(Tensor, &Norm) -> Result<R>,
    ) -> Result<R> {
        let z = conv.forward_detached(x, w)?;
        let (mean, var, batch_stats) = self.statistics(&z, ctx)?;
        let stats = Statistics { mean: &mean, var: &var, eps: self.eps, from_batch: batch_stats };
        f(z, &Norm { stats: &stats, gamma: &self.weight, beta: &self.bias, silu })
    }

    /// What this BatchNorm computes with its running statistics: `scale·z + shift` per channel.
    pub(crate) fn running_affine(&self) -> Result<Affine> {
        let host = |t: &Tensor| t.to_dtype(DType::F64)?.to_vec1::<f64>();
        let (gamma, beta) = (host(&self.weight)?, host(&self.bias)?);
        let (mean, var) = (host(self.running_mean.as_tensor())?, host(self.running_var.as_tensor())?);
        let scale: Vec<f64> = gamma.iter().zip(&var).map(|(g, v)| g / (v + self.eps).sqrt()).collect();
        let shift = beta.iter().zip(&mean).zip(&scale).map(|((b, m), s)| b - m * s).collect();
        Ok(Affine { scale, shift })
    }

    /// γ and β.
    pub fn affine(&self) -> (&Tensor, &Tensor) {
        (&self.weight, &self.bias)
    }

    /// The mean and variance to normalise `x` with, and whether they are the batch's own. With
    /// the batch's, the running averages take them in (when the context says to).
    fn statistics(&self, x: &Tensor, ctx: &Ctx) -> Result<(Vec<f64>, Vec<f64>, bool)> {
        let batch_stats = ctx.train && !self.frozen;
        if !batch_stats {
            let host = |v: &Var| v.as_tensor().to_dtype(DType::F64)?.to_vec1::<f64>();
            return Ok((host(&self.running_mean)?, host(&self.running_var)?, false));
        }
        let (n, _, h, w) = x.dims4()?;
        let count = (n * h * w) as f64;
        let m: Vec<Vec<f64>> = channel_moments(x)?.to_dtype(DType::F64)?.to_vec2()?;
        let mo = self.momentum;
        let blend = |running: &Var, batch: Vec<f64>| -> Result<()> {
            let old: Vec<f64> = running.as_tensor().to_dtype(DType::F64)?.to_vec1()?;
            let new: Vec<f64> = old.iter().zip(&batch).map(|(o, b)| (1.0 - mo) * o + mo * b).collect();
            running.set(&Tensor::from_vec(new, old.len(), running.device())?.to_dtype(running.dtype())?)
        };
        if ctx.update_stats {
            blend(&self.running_mean, m[0].clone())?;
            blend(&self.running_var, m[1].iter().map(|v| v * count / (count - 1.0).max(1.0)).collect())?;
        }
        Ok((m[0].clone(), m[1].clone(), true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_nn::VarMap;

    fn bn(vm: &VarMap, frozen: bool) -> BatchNorm2d {
        BatchNorm2d::new(2, 1e-3, 0.1, frozen, crate::model::init::SeededVars::builder(vm, 0, &Device::Cpu)).unwrap()
    }

    #[test]
    fn running_statistics_after_k_steps_match_hand_computation() {
        let dev = Device::Cpu;
        let vm = VarMap::new();
        let layer = bn(&vm, false);
        // Channel 0 holds 1,2,3,4 and channel 1 holds 10,10,10,30, over a batch of 2 × (1×2).
        let x = Tensor::new(&[[[[1.0f32, 2.0]], [[10.0, 10.0]]], [[[3.0, 4.0]], [[10.0, 30.0]]]], &dev).unwrap();
        let (mut rm, mut rv) = ([0.0f64, 0.0], [1.0f64, 1.0]);
        let stats = [(2.5f64, 5.0 / 3.0), (15.0, 100.0)]; // mean, unbiased variance
        for _ in 0..3 {
            let y = layer.forward(&x, &Ctx::train(0)).unwrap();
            for c in 0..2 {
                rm[c] = 0.9 * rm[c] + 0.1 * stats[c].0;
                rv[c] = 0.9 * rv[c] + 0.1 * stats[c].1;
            }
            // Training output uses the biased batch variance.
            let y00 = y.flatten_all().unwrap().to_vec1::<f32>().unwrap()[0] as f64;
            assert!((y00 - (1.0 - 2.5) / (1.25f64 + 1e-3).sqrt()).abs() < 1e-5);
        }
        let got_m = layer.running_mean.as_tensor().to_vec1::<f32>().unwrap();
        let got_v = layer.running_var.as_tensor().to_vec1::<f32>().unwrap();
        for c in 0..2 {
            assert!(
                (got_m[c] as f64 - rm[c]).abs() < 1e-4 && (got_v[c] as f64 - rv[c]).abs() < 1e-3,
                "{got_m:?} {got_v:?} vs {rm:?} {rv:?}"
            );
        }
        // Evaluation normalises with the running statistics and leaves them alone.
        let y = layer.forward(&x, &Ctx::EVAL).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!((y[0] as f64 - (1.0 - rm[0]) / (rv[0] + 1e-3).sqrt()).abs() < 1e-4);
        assert_eq!(layer.running_mean.as_tensor().to_vec1::<f32>().unwrap(), got_m);
    }

    #[test]
    fn frozen_layers_use_and_keep_the_running_statistics_in_training() {
        let dev = Device::Cpu;
        let vm = VarMap::new();
        let layer = bn(&vm, true);
        let x = Tensor::new(&[[[[1.0f32, 3.0]], [[2.0, 4.0]]]], &dev).unwrap();
        let y = layer.forward(&x, &Ctx::train(0)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let s = (1.0f32 + 1e-3).sqrt();
        assert!((y[0] - 1.0 / s).abs() < 1e-5 && (y[3] - 4.0 / s).abs() < 1e-5);
        assert_eq!(layer.running_mean.as_tensor().to_vec1::<f32>().unwrap(), vec![0.0, 0.0]);
    }
    /// The fused convolution + BatchNorm path against the convolution op and the BatchNorm op:
    /// output, input and weight gradients, and the running statistics it updates.
    #[test]
    fn fused_conv_path_matches_the_separate_ops() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&crate::util::rng::randn(51, 0.2, 1.0, (2, 3, 5, 4), DType::F32, &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&crate::util::rng::randn(52, 0.0, 0.5, (2, 3, 1, 1), DType::F32, &dev).unwrap()).unwrap();
        let (vm1, vm2) = (VarMap::new(), VarMap::new());
        let (a, b) = (bn(&vm1, false), bn(&vm2, false));
        for ctx in [Ctx::train(0), Ctx::EVAL] {
            let ya = a.conv_forward_act(Conv::Pointwise, x.as_tensor(), w.as_tensor(), &ctx, true).unwrap();
            let yb = b.forward_act(&Conv::Pointwise.apply(x.as_tensor(), w.as_tensor()).unwrap(), &ctx, true).unwrap();
            let diff =
                |p: &Tensor, q: &Tensor| (p - q).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
            assert!(diff(&ya, &yb) < 1e-5);
            let (ga, gb) =
                (ya.sqr().unwrap().sum_all().unwrap().backward().unwrap(), yb.sqr().unwrap().sum_all().unwrap().backward().unwrap());
            for v in [&x, &w] {
                assert!(diff(ga.get(v.as_tensor()).unwrap(), gb.get(v.as_tensor()).unwrap()) < 1e-4);
            }
            for (p, q) in [(&a.running_mean, &b.running_mean), (&a.running_var, &b.running_var)] {
                assert!(diff(p.as_tensor(), q.as_tensor()) < 1e-6);
            }
        }
        assert!(a.running_mean.as_tensor().abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0, "statistics were updated");
    }
}
