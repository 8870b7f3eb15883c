//! `align bench ops`: every per-op kernel run on a device in f32 against the same op on the CPU
//! in f64, forward and backward, with its time per call; and the optimizer's update on the device
//! against the CPU's. On a GPU this is the first thing to run: the CUDA kernels are tested in CI
//! only through the host emulation of their source. On the CPU it checks the f32 kernels against
//! the f64 ones (whose own tests hold them to compositions of candle ops and to finite
//! differences).

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};

use align::ops::kernels::batch_norm::{batch_norm_act, Statistics};
use align::ops::kernels::bias_act::{bias_act, Activation};
use align::ops::kernels::channel_scale::channel_scale;
use align::ops::kernels::depthwise::{depthwise_conv2d, Padding};
use align::ops::kernels::layer_norm::layer_norm;
use align::ops::kernels::moments::channel_moments;
use align::ops::kernels::softmax::scaled_masked_softmax;
use align::ops::kernels::spatial_mean::spatial_mean;
use align::ops::kernels::stochastic_depth::scaled_residual;

/// Largest error relative to the reference's largest magnitude that an f32 op may show.
pub const TOLERANCE: f64 = 1e-4;

#[derive(Debug, Clone, serde::Serialize)]
pub struct OpCheck {
    pub op: String,
    pub shape: String,
    /// Largest |device − reference| over the output, relative to the reference's largest value.
    pub forward_error: f64,
    /// The same over every input's gradient (the worst input).
    pub backward_error: f64,
    /// Forward and backward on the device, averaged over the timed repetitions.
    pub ms_per_call: f64,
}

impl OpCheck {
    pub fn passed(&self) -> bool {
        self.forward_error <= TOLERANCE && self.backward_error <= TOLERANCE
    }
}

type OpFn = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;

/// An op, its inputs (shape, mean, spread) and the function of them to check.
struct Case {
    op: &'static str,
    inputs: Vec<(Vec<usize>, f64, f64)>,
    f: OpFn,
}

fn case(op: &'static str, inputs: &[(&[usize], f64, f64)], f: impl Fn(&[Tensor]) -> Result<Tensor> + 'static) -> Case {
    Case { op, inputs: inputs.iter().map(|(s, m, sd)| (s.to_vec(), *m, *sd)).collect(), f: Box::new(f) }
}

/// 0 for every key but the last ten of every other batch element, which are padding.
fn key_mask(batch: usize, keys: usize, device: &Device, dtype: DType) -> Result<Tensor> {
    let m: Vec<f64> = (0..batch * keys).map(|i| if (i / keys) % 2 == 1 && i % keys >= keys - 10 { -1e9 } else { 0.0 }).collect();
    Tensor::from_vec(m, (batch, keys), device)?.to_dtype(dtype)
}

fn cases() -> Vec<Case> {
    let nchw: &[usize] = &[8, 32, 28, 28];
    let c: &[usize] = &[32];
    vec![
        case("layer-norm", &[(&[16, 50, 192], 1.0, 2.0), (&[192], 1.0, 0.3), (&[192], 0.0, 0.3)], |t| {
            layer_norm(&t[0], &t[1], &t[2], 1e-5)
        }),
        // A view starting one row in: the kernels' operands at an offset into their buffer.
        case("layer-norm, offset view", &[(&[17, 50, 192], 1.0, 2.0), (&[192], 1.0, 0.3), (&[192], 0.0, 0.3)], |t| {
            layer_norm(&t[0].narrow(0, 1, 16)?, &t[1], &t[2], 1e-5)
        }),
        case("attention softmax (scaled, masked)", &[(&[8, 3, 50, 50], 0.0, 3.0)], |t| {
            scaled_masked_softmax(&t[0], 0.125, Some(&key_mask(8, 50, t[0].device(), t[0].dtype())?))
        }),
        case("bias + GELU", &[(&[512, 768], 0.0, 2.0), (&[768], 0.0, 1.0)], |t| bias_act(&t[0], &t[1], Activation::GeluErf)),
        case("bias", &[(&[512, 768], 0.0, 2.0), (&[768], 0.0, 1.0)], |t| bias_act(&t[0], &t[1], Activation::Identity)),
        case("batch norm + SiLU, batch statistics", &[(nchw, 0.5, 2.0), (c, 1.0, 0.3), (c, 0.0, 0.3)], |t| {
            let m = channel_moments(&t[0])?.to_dtype(DType::F64)?.to_vec2::<f64>()?;
            let stats = Statistics { mean: &m[0], var: &m[1], eps: 1e-3, from_batch: true };
            batch_norm_act(&t[0], &stats, &t[1], &t[2], true)
        }),
        case("batch norm, running statistics", &[(nchw, 0.5, 2.0), (c, 1.0, 0.3), (c, 0.0, 0.3)], |t| {
            let mean: Vec<f64> = (0..32).map(|k| 0.05 * k as f64).collect();
            let var: Vec<f64> = (0..32).map(|k| 1.0 + 0.1 * k as f64).collect();
            batch_norm_act(&t[0], &Statistics { mean: &mean, var: &var, eps: 1e-3, from_batch: false }, &t[1], &t[2], false)
        }),
        case("channel scale", &[(nchw, 0.0, 1.0), (&[8, 32], 0.5, 0.3)], |t| channel_scale(&t[0], &t[1])),
        case("spatial mean", &[(nchw, 0.3, 1.0)], |t| spatial_mean(&t[0])),
        case("stochastic-depth residual", &[(nchw, 0.0, 1.0), (nchw, 0.0, 1.0)], |t| {
            scaled_residual(&t[0], &[1.25, 0.0, 1.25, 1.25, 0.0, 1.25, 1.25, 1.25], &t[1])
        }),
        case("depthwise 3x3, stride 1", &[(nchw, 0.0, 1.0), (&[32, 1, 3, 3], 0.0, 0.3)], |t| {
            depthwise_conv2d(&t[0], &t[1], 1, Padding::same(3))
        }),
        case("depthwise 5x5, stride 2", &[(nchw, 0.0, 1.0), (&[32, 1, 5, 5], 0.0, 0.3)], |t| {
            depthwise_conv2d(&t[0], &t[1], 2, Padding { top: 1, bottom: 2, left: 1, right: 2 })
        }),
    ]
}

/// Largest |a − b| relative to b's largest magnitude, in f64 on the CPU.
fn relative_error(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    if a.dims() != b.dims() {
        candle_core::bail!("shapes differ: {:?} and {:?}", a.dims(), b.dims());
    }
    let diff = (&a - &b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?.max(1e-12);
    // NaN compares false everywhere: report it as an infinite error.
    Ok(if diff.is_nan() { f64::INFINITY } else { diff / scale })
}

/// `f` of `inputs` as variables: the variables and the output.
fn forward(f: &OpFn, inputs: &[Tensor]) -> Result<(Vec<Var>, Tensor)> {
    let vars = inputs.iter().map(Var::from_tensor).collect::<Result<Vec<_>>>()?;
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&tensors)?;
    Ok((vars, y))
}

/// The gradients of `Σ y·up` with respect to each variable.
fn gradients(vars: &[Var], y: &Tensor, up: &Tensor) -> Result<Vec<Tensor>> {
    let grads = (y * up)?.sum_all()?.backward()?;
    vars.iter()
        .map(|v| grads.get(v.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("an input got no gradient".into())))
        .collect()
}

fn check_case(case: &Case, device: &Device, reps: usize, seed: u64) -> Result<OpCheck> {
    let cpu = Device::Cpu;
    let reference: Vec<Tensor> = case
        .inputs
        .iter()
        .enumerate()
        .map(|(i, (shape, mean, sd))| align::util::rng::randn(seed + i as u64, *mean, *sd, shape.as_slice(), DType::F64, &cpu))
        .collect::<Result<_>>()?;
    let (vars, y_ref) = forward(&case.f, &reference)?;
    let up_ref = align::util::rng::randn(seed + 100, 0.0, 1.0, y_ref.dims(), DType::F64, &cpu)?;
    let g_ref = gradients(&vars, &y_ref, &up_ref)?;
    let on_device = |t: &Tensor| t.to_dtype(DType::F32)?.to_device(device);
    let inputs = reference.iter().map(on_device).collect::<Result<Vec<_>>>()?;
    let up = on_device(&up_ref)?;
    let (vars, y) = forward(&case.f, &inputs)?;
    let g = gradients(&vars, &y, &up)?;
    let forward_error = relative_error(&y, &y_ref)?;
    let mut backward_error = 0.0f64;
    for (a, b) in g.iter().zip(&g_ref) {
        backward_error = backward_error.max(relative_error(a, b)?);
    }
    device.synchronize()?;
    let start = Instant::now();
    for _ in 0..reps {
        let (vars, y) = forward(&case.f, &inputs)?;
        gradients(&vars, &y, &up)?;
    }
    device.synchronize()?;
    let ms_per_call = start.elapsed().as_secs_f64() * 1e3 / reps.max(1) as f64;
    let shape = case.inputs[0].0.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x");
    Ok(OpCheck { op: case.op.into(), shape, forward_error, backward_error, ms_per_call })
}

/// Two steps of each optimizer on a `[600, 300]` f32 parameter on `device` against the same on
/// the CPU (the in-place host update): the parameters' relative difference as the forward
/// error, the moments' as the backward error.
fn check_optimizer(kind: align::train::optim::OptimizerKind, device: &Device, reps: usize) -> Result<OpCheck> {
    use align::train::optim::{Grads, Optimizer, OptimizerConfig};
    let cfg = OptimizerConfig { kind, weight_decay: 0.01, grad_clip: 1.0, ..Default::default() };
    let init = align::util::rng::randn(300, 0.0, 1.0, (600, 300), DType::F32, &Device::Cpu)?;
    let grads: Vec<Tensor> =
        (0..2).map(|s| align::util::rng::randn(301 + s, 0.0, 0.1, (600, 300), DType::F32, &Device::Cpu)).collect::<Result<_>>()?;
    let optimizer = |dev: &Device| -> Result<(Var, Optimizer)> {
        let var = Var::from_tensor(&init.to_device(dev)?)?;
        Ok((var.clone(), Optimizer::new(vec![("w.weight".into(), var)], cfg.clone())?))
    };
    let ((w_ref, mut reference), (w, mut subject)) = (optimizer(&Device::Cpu)?, optimizer(device)?);
    for g in &grads {
        reference.step(&Grads(vec![Some(g.clone())]), 1e-2)?;
        subject.step(&Grads(vec![Some(g.to_device(device)?)]), 1e-2)?;
    }
    let forward_error = relative_error(w.as_tensor(), w_ref.as_tensor())?;
    let (sr, ss) = (reference.state_tensors(), subject.state_tensors());
    let mut backward_error = 0.0f64;
    for (k, t) in &sr {
        let other = ss.get(k).ok_or_else(|| candle_core::Error::Msg(format!("optimizer state {k} missing")))?;
        backward_error = backward_error.max(relative_error(other, t)?);
    }
    let g = Grads(vec![Some(grads[0].to_device(device)?)]);
    device.synchronize()?;
    let start = Instant::now();
    for _ in 0..reps {
        subject.step(&g, 1e-2)?;
    }
    device.synchronize()?;
    let ms_per_call = start.elapsed().as_secs_f64() * 1e3 / reps.max(1) as f64;
    let op = format!("{kind:?} step").to_lowercase();
    Ok(OpCheck { op, shape: "600x300".into(), forward_error, backward_error, ms_per_call })
}

/// Every check on `device`, `reps` timed calls each; `progress` is told after each.
pub fn check_ops(device: &Device, reps: usize, mut progress: impl FnMut(&OpCheck)) -> Result<Vec<OpCheck>> {
    let mut out = Vec::new();
    for (i, case) in cases().iter().enumerate() {
        let r = check_case(case, device, reps, 500 + 10 * i as u64)?;
        progress(&r);
        out.push(r);
    }
    for kind in [align::train::optim::OptimizerKind::Adamw, align::train::optim::OptimizerKind::Lamb] {
        let r = check_optimizer(kind, device, reps)?;
        progress(&r);
        out.push(r);
    }
    Ok(out)
}

/// How many checks [`check_ops`] runs.
pub fn check_count() -> usize {
    cases().len() + 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_f32_kernels_pass_against_the_f64_ones_on_the_cpu() {
        let mut seen = 0;
        let checks = check_ops(&Device::Cpu, 1, |_| seen += 1).unwrap();
        assert_eq!((checks.len(), seen), (check_count(), check_count()));
        for c in &checks {
            assert!(c.passed(), "{c:?}");
            // f32 against f64: errors are rounding, never exactly zero for these sizes, except
            // the optimizer's, which compares two f32 updates.
            assert!(c.op.ends_with("step") || c.forward_error > 0.0, "{c:?}");
        }
    }

    #[test]
    fn errors_are_relative_to_the_reference_and_nan_fails() {
        let cpu = Device::Cpu;
        let b = Tensor::new(&[2.0f64, -4.0], &cpu).unwrap();
        let a = Tensor::new(&[2.0f32, -3.0], &cpu).unwrap();
        assert_eq!(relative_error(&a, &b).unwrap(), 0.25);
        let nan = Tensor::new(&[f32::NAN, -4.0], &cpu).unwrap();
        let check = OpCheck {
            op: "x".into(),
            shape: "2".into(),
            forward_error: relative_error(&nan, &b).unwrap(),
            backward_error: 0.0,
            ms_per_call: 0.0,
        };
        assert!(!check.passed());
    }
}
