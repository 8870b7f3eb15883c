//! A linear layer's bias add, optionally followed by GELU (exact, or OpenAI CLIP's sigmoid form),
//! as one op over `[.., cols]` with its own backward.
//!
//! Composed, `broadcast_add(bias)` sends the bias gradient through candle's strided reduce, which
//! runs on one thread (14% of a ViT-Ti + BERT-mini step, profiled), and
//! `gelu_erf`'s backward builds about ten full-size temporaries. Here the forward is one pass, the
//! backward one pass for the input gradient plus a blocked, multithreaded column sum.

use candle_core::{Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::column_sums::ColumnSums;
use crate::ops::gpu::{Limits, Program};
use crate::ops::op::{GpuPlan, Kernel, Op};
use crate::ops::{last_dim, output_buffer, simd, Float};

/// What follows the bias add.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Identity,
    /// GELU with the exact `erf`, as BERT and ViT have it (`gelu_erf` in candle).
    GeluErf,
    /// `z·σ(1.702·z)`, OpenAI CLIP's `quick_gelu` (its ViT and text towers). Composed from
    /// candle ops it was three full-size passes and two temporaries per MLP.
    QuickGelu,
    /// GELU's tanh approximation, `z/2·(1 + tanh(√(2/π)·(z + 0.044715·z³)))`: SigLIP's
    /// `gelu_pytorch_tanh` (`gelu` in candle).
    GeluTanh,
}

impl Activation {
    /// Whether `kernels/rows.cu` has it (the others are composed from candle ops on GPUs).
    fn has_cuda_kernel(self) -> bool {
        matches!(self, Activation::Identity | Activation::GeluErf)
    }

    /// The activation of `z`.
    #[inline(always)]
    pub(crate) fn of<T: Float>(self, z: T) -> T {
        match self {
            Activation::Identity => z,
            Activation::GeluErf => gelu(z),
            Activation::QuickGelu => z / (T::from(1.0) + (T::from(-QUICK) * z).exp()),
            Activation::GeluTanh => T::from(0.5) * z * (T::from(1.0) + tanh(T::from(TANH_C) * (z + T::from(TANH_A) * z * z * z))),
        }
    }

    /// `y = act(y)` element by element, in parallel chunks.
    pub(crate) fn apply_in_place<T: Float>(self, y: &mut [T]) {
        if self == Activation::Identity {
            return;
        }
        y.par_chunks_mut(TASK_ELEMS).for_each(|y| simd(|| self.apply_to(y)));
    }

    /// `y = act(y)` on the calling thread, for callers inside a [`simd`] region (one loop per
    /// activation, each vectorised on its own).
    #[inline(always)]
    pub(crate) fn apply_to<T: Float>(self, y: &mut [T]) {
        macro_rules! each {
            ($act:expr) => {
                for v in y.iter_mut() {
                    *v = $act.of(*v);
                }
            };
        }
        match self {
            Activation::Identity => {}
            Activation::GeluErf => each!(Activation::GeluErf),
            Activation::QuickGelu => each!(Activation::QuickGelu),
            Activation::GeluTanh => each!(Activation::GeluTanh),
        }
    }

    /// d act(z) / dz.
    #[inline(always)]
    fn slope<T: Float>(self, z: T) -> T {
        match self {
            Activation::Identity => T::from(1.0),
            Activation::GeluErf => gelu_slope(z),
            // With s = σ(az): d(z·s)/dz = s + a·z·s·(1 − s).
            Activation::QuickGelu => {
                let s = T::from(1.0) / (T::from(1.0) + (T::from(-QUICK) * z).exp());
                s + T::from(QUICK) * z * s * (T::from(1.0) - s)
            }
            // With u = c·(z + a·z³) and t = tanh u: (1 + t)/2 + z/2·(1 − t²)·c·(1 + 3a·z²).
            Activation::GeluTanh => {
                let t = tanh(T::from(TANH_C) * (z + T::from(TANH_A) * z * z * z));
                let du = T::from(TANH_C) * (T::from(1.0) + T::from(3.0 * TANH_A) * z * z);
                T::from(0.5) * (T::from(1.0) + t) + T::from(0.5) * z * (T::from(1.0) - t * t) * du
            }
        }
    }
}

/// √(2/π) and the cubic's weight in GELU's tanh approximation.
const TANH_C: f64 = 0.797_884_560_802_865_4;
const TANH_A: f64 = 0.044_715;

/// tanh u = 1 − 2/(e^(2u) + 1): exact at both ends (e^(2u) saturating or vanishing), and only the
/// vectorising `exp` of `Float`.
#[inline(always)]
fn tanh<T: Float>(u: T) -> T {
    T::from(1.0) - T::from(2.0) / ((T::from(2.0) * u).exp() + T::from(1.0))
}

/// The sigmoid's slope in `quick_gelu`.
const QUICK: f64 = 1.702;

/// Elements per parallel task of the elementwise passes.
const TASK_ELEMS: usize = 16 * 1024;

#[inline(always)]
fn gelu<T: Float>(z: T) -> T {
    T::from(0.5) * z * (T::from(1.0) + (z * T::from(std::f64::consts::FRAC_1_SQRT_2)).erf())
}

/// d gelu(z) / dz = Φ(z) + z·φ(z).
#[inline(always)]
fn gelu_slope<T: Float>(z: T) -> T {
    // With a = z/√2: Φ(z) = (1 + erf a)/2 and φ(z) = e^(−a²)/√(2π).
    let (erf, gauss) = (z * T::from(std::f64::consts::FRAC_1_SQRT_2)).erf_and_gauss();
    let cdf = T::from(0.5) * (T::from(1.0) + erf);
    let pdf = T::from(1.0 / (2.0 * std::f64::consts::PI).sqrt()) * gauss;
    cdf + z * pdf
}

/// `act(y + b)` over `[.., cols]` with `b` of `[cols]`.
pub(crate) struct BiasAct(pub Activation);

/// Rows, and values per row.
type Rows = (usize, usize);

fn rows(l: &Layout) -> Rows {
    let cols = last_dim(l);
    (l.shape().elem_count() / cols, cols)
}

impl BiasAct {
    pub(crate) fn run<T: Float>(&self, y: &[T], b: &[T], cols: usize) -> Vec<T> {
        // SAFETY: the loop below writes every element.
        let mut out = unsafe { output_buffer::<T>(y.len()) };
        let task = (TASK_ELEMS / cols).max(1) * cols;
        out.par_chunks_mut(task).zip(y.par_chunks(task)).for_each(|(o, y)| {
            simd(
                #[inline(always)]
                || {
                    for (orow, yrow) in o.chunks_mut(cols).zip(y.chunks(cols)) {
                        // One loop per activation, each vectorised on its own.
                        macro_rules! each {
                            ($act:expr) => {
                                for ((o, &y), &b) in orow.iter_mut().zip(yrow).zip(b) {
                                    *o = $act.of(y + b);
                                }
                            };
                        }
                        match self.0 {
                            Activation::Identity => each!(Activation::Identity),
                            Activation::GeluErf => each!(Activation::GeluErf),
                            Activation::QuickGelu => each!(Activation::QuickGelu),
                            Activation::GeluTanh => each!(Activation::GeluTanh),
                        }
                    }
                },
            )
        });
        out
    }
}

impl Kernel<2> for BiasAct {
    const NAME: &'static str = "bias-act";
    const PROFILE: &'static str = "op/bias-act";
    type Geometry = Rows;

    fn geometry(&self, [y, b]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        let g = rows(y);
        if b.dims() != [g.1] {
            candle_core::bail!("bias of shape {:?} does not fit an input of shape {:?}", b.dims(), y.dims());
        }
        Ok((g, y.shape().clone()))
    }

    fn cpu<T: Float>(&self, &(_, cols): &Self::Geometry, [y, b]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(self.run(y, b, cols))
    }

    fn gpu(&self, &(rows, cols): &Self::Geometry, _elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        if !self.0.has_cuda_kernel() {
            // `bias_act` composes candle ops for it on GPUs.
            return Ok(None);
        }
        Ok(Some(GpuPlan::new(Program::bias_act(rows, cols, self.0 == Activation::GeluErf, limits))))
    }

    fn backward(&self, [y, b]: [&Tensor; 2], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let grad = grad.contiguous()?;
        let dz = match self.0 {
            Activation::Identity => grad,
            act => y.apply_op3_no_bwd(b, &grad, &Op(ActGrad(act)))?,
        };
        let db = dz.apply_op1_no_bwd(&Op(ColumnSums))?;
        Ok([Some(dz), Some(db)])
    }
}

/// `dz = dy · act'(y + b)`, recomputing the pre-activation.
pub(crate) struct ActGrad(pub Activation);

impl ActGrad {
    pub(crate) fn run<T: Float>(&self, y: &[T], b: &[T], dy: &[T], cols: usize) -> Vec<T> {
        // SAFETY: the loop below writes every element.
        let mut out = unsafe { output_buffer::<T>(y.len()) };
        let task = (TASK_ELEMS / cols).max(1) * cols;
        out.par_chunks_mut(task).zip(y.par_chunks(task)).zip(dy.par_chunks(task)).for_each(|((o, y), g)| {
            simd(
                #[inline(always)]
                || {
                    for ((orow, yrow), grow) in o.chunks_mut(cols).zip(y.chunks(cols)).zip(g.chunks(cols)) {
                        macro_rules! each {
                            ($act:expr) => {
                                for (((o, &y), &b), &g) in orow.iter_mut().zip(yrow).zip(b).zip(grow) {
                                    *o = g * $act.slope(y + b);
                                }
                            };
                        }
                        match self.0 {
                            Activation::Identity => each!(Activation::Identity),
                            Activation::GeluErf => each!(Activation::GeluErf),
                            Activation::QuickGelu => each!(Activation::QuickGelu),
                            Activation::GeluTanh => each!(Activation::GeluTanh),
                        }
                    }
                },
            )
        });
        out
    }
}

impl Kernel<3> for ActGrad {
    const NAME: &'static str = "bias-act-grad";
    const PROFILE: &'static str = "op/bias-act-grad";
    type Geometry = Rows;

    fn geometry(&self, [y, b, dy]: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        let g = rows(y);
        if b.dims() != [g.1] || dy.dims() != y.dims() {
            candle_core::bail!("bias + activation backward: input {:?}, bias {:?}, gradient {:?}", y.dims(), b.dims(), dy.dims());
        }
        Ok((g, y.shape().clone()))
    }

    fn cpu<T: Float>(&self, &(_, cols): &Self::Geometry, [y, b, dy]: [&[T]; 3]) -> Result<Vec<T>> {
        Ok(self.run(y, b, dy, cols))
    }

    fn gpu(&self, &(rows, cols): &Self::Geometry, _elem: usize, limits: &Limits) -> Result<Option<GpuPlan>> {
        // The exact GELU's has a CUDA kernel; the others are composed on GPUs (`bias_act`).
        Ok((self.0 == Activation::GeluErf).then(|| GpuPlan::new(Program::bias_gelu_grad(rows, cols, limits))))
    }
}

/// `act(y + bias)` with `bias` broadcast over every dimension but the last. One op in f32 / f64
/// where `ops::has_kernels` says so (the CPU, CUDA GPUs); candle's composition elsewhere
/// (bf16).
pub fn bias_act(y: &Tensor, bias: &Tensor, act: Activation) -> Result<Tensor> {
    if !crate::ops::has_kernels(y, &[bias]) || (!act.has_cuda_kernel() && !y.device().is_cpu()) {
        return composed(y, bias, act);
    }
    y.contiguous()?.apply_op2(&bias.contiguous()?, Op(BiasAct(act)))
}

/// The bias add and activation composed from candle ops: the fallback, and the reference the
/// op's tests hold it to.
pub fn composed(y: &Tensor, bias: &Tensor, act: Activation) -> Result<Tensor> {
    let z = y.broadcast_add(bias)?;
    match act {
        Activation::Identity => Ok(z),
        Activation::GeluErf => z.gelu_erf(),
        Activation::QuickGelu => &z * candle_nn::ops::sigmoid(&(&z * QUICK)?)?,
        Activation::GeluTanh => z.gelu(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{check_fd, max_abs, max_diff};
    use candle_core::{DType, Device, Var};

    #[test]
    fn matches_the_composition_forward_and_backward() {
        let dev = Device::Cpu;
        for act in [Activation::Identity, Activation::GeluErf, Activation::QuickGelu, Activation::GeluTanh] {
            for dtype in [DType::F64, DType::F32] {
                // 3 × 700 rows: several row blocks and several elementwise tasks.
                let y = Var::from_tensor(&crate::util::rng::randn(160, 0.0, 2.0, (3, 700, 37), dtype, &dev).unwrap()).unwrap();
                let b = Var::from_tensor(&crate::util::rng::randn(161, 0.0, 1.0, 37, dtype, &dev).unwrap()).unwrap();
                let up = crate::util::rng::randn(162, 0.0, 1.0, (3, 700, 37), dtype, &dev).unwrap();
                let ours = bias_act(&y, &b, act).unwrap();
                let reference = composed(&y, &b, act).unwrap();
                let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
                assert!(max_diff(&ours, &reference) < tol * max_abs(&reference).max(1.0), "{act:?} {dtype:?}");
                let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
                let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
                for v in [&y, &b] {
                    let (a, r) = (g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap());
                    // candle's GELU derivatives round their constants (1/√(2π) to 0.398942 for
                    // the exact one): up to 1e-6 relative; ours meet finite differences below.
                    let approximate = matches!(act, Activation::GeluErf | Activation::GeluTanh);
                    let tol = if approximate && dtype == DType::F64 { 2e-6 } else { tol };
                    assert!(max_diff(a, r) < tol * max_abs(r).max(1.0), "{act:?} {dtype:?} {}", max_diff(a, r));
                }
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let dev = Device::Cpu;
        let y0 = crate::util::rng::randn(163, 0.0, 1.5, (4, 6), DType::F64, &dev).unwrap();
        let b0 = crate::util::rng::randn(164, 0.0, 1.0, 6, DType::F64, &dev).unwrap();
        let up = crate::util::rng::randn(165, 0.0, 1.0, (4, 6), DType::F64, &dev).unwrap();
        for act in [Activation::GeluErf, Activation::QuickGelu, Activation::GeluTanh] {
            let loss =
                |y: &Tensor, b: &Tensor| (bias_act(y, b, act).unwrap() * &up).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
            let (y, b) = (Var::from_tensor(&y0).unwrap(), Var::from_tensor(&b0).unwrap());
            let grads = (bias_act(&y, &b, act).unwrap() * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let all: Vec<usize> = (0..24).collect();
            assert!(check_fd(|t| loss(t, &b0), &y0, grads.get(y.as_tensor()).unwrap(), &all) < 1e-7, "{act:?}");
            assert!(check_fd(|t| loss(&y0, t), &b0, grads.get(b.as_tensor()).unwrap(), &[0, 1, 2, 3, 4, 5]) < 1e-7, "{act:?}");
        }
    }

    /// quick_gelu by hand: z·σ(1.702z) at a few points, and its far tails.
    #[test]
    fn quick_gelu_by_hand() {
        let q = |z: f64| z / (1.0 + (-1.702 * z).exp());
        for z in [-3.0f64, -0.5, 0.0, 0.25, 2.0] {
            assert!((Activation::QuickGelu.of(z) - q(z)).abs() < 1e-15);
            assert!((Activation::QuickGelu.of(z as f32) as f64 - q(z)).abs() < 1e-6);
        }
        // σ(1.702) = 0.845796…: quick_gelu(1), and its slope s + 1.702·s·(1 − s) = 1.067780…
        assert!((Activation::QuickGelu.of(1.0f64) - 0.845_795_8).abs() < 1e-6);
        assert!((Activation::QuickGelu.slope(1.0f64) - 1.067_779_6).abs() < 1e-6);
        assert!(Activation::QuickGelu.of(-200.0f32).abs() < 1e-30);
        assert_eq!(Activation::QuickGelu.of(200.0f32), 200.0);
    }

    /// GELU's tanh form by hand, with libm's tanh: a few points, and the far tails.
    #[test]
    fn gelu_tanh_by_hand() {
        let g = |z: f64| 0.5 * z * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (z + 0.044715 * z * z * z)).tanh());
        for z in [-4.0f64, -1.0, -0.3, 0.0, 0.5, 3.0] {
            assert!((Activation::GeluTanh.of(z) - g(z)).abs() < 1e-15, "{z}");
            assert!((Activation::GeluTanh.of(z as f32) as f64 - g(z)).abs() < 2e-6, "{z}");
        }
        assert_eq!(Activation::GeluTanh.of(-30.0f32), 0.0);
        assert_eq!(Activation::GeluTanh.of(30.0f32), 30.0);
        assert_eq!(Activation::GeluTanh.slope(0.0f64), 0.5);
    }
}

#[cfg(test)]
mod gpu_tests {
    use super::*;
    use crate::ops::gpu::host::{assert_close, to_f32, values};
    use crate::ops::gpu::{run_on_host, SMALL_GRID};

    #[test]
    fn the_gpu_kernels_match_the_cpu_op_in_the_host_emulation() {
        // 1500 rows: more than the small grid's blocks cover in one turn.
        let (rows, cols) = (1500, 37);
        let y = values(200, 0.0, 2.0, rows * cols);
        let b = values(201, 0.0, 1.0, cols);
        let dy = values(202, 0.0, 1.0, rows * cols);
        for act in [Activation::Identity, Activation::GeluErf] {
            let program = Program::bias_act(rows, cols, act == Activation::GeluErf, &SMALL_GRID);
            assert_close(&run_on_host(&program, &[&y, &b], None), &BiasAct(act).run(&y, &b, cols), 1e-12, &format!("{act:?}"));
            let (y, b) = (to_f32(&y), to_f32(&b));
            assert_close(&run_on_host(&program, &[&y, &b], None), &BiasAct(act).run(&y, &b, cols), 1e-5, &format!("{act:?}"));
        }
        let grad = Program::bias_gelu_grad(rows, cols, &SMALL_GRID);
        assert_close(&run_on_host(&grad, &[&y, &b, &dy], None), &ActGrad(Activation::GeluErf).run(&y, &b, &dy, cols), 1e-12, "GELU grad");
        let (y, b, dy) = (to_f32(&y), to_f32(&b), to_f32(&dy));
        assert_close(&run_on_host(&grad, &[&y, &b, &dy], None), &ActGrad(Activation::GeluErf).run(&y, &b, &dy, cols), 1e-5, "GELU grad");
    }
}
