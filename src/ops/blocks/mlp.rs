//! Fused linear layers with an activation: `act(x·Wᵀ + b)` and a transformer's whole MLP, each
//! one op that keeps its widest activations itself instead of as graph nodes.

use std::sync::Mutex;

use candle_core::{Layout, Result, Shape, Tensor};

use crate::ops::kernels::bias_act::{bias_act, ActGrad, Activation, BiasAct};
use crate::ops::kernels::linear::{fusable, linear_bias, shapes, LinearBias, LinearBiasGrad};
use crate::ops::kernels::matmul::weight_product_into;
use crate::ops::kernels::operands::{Dims, Mat};
use crate::ops::op::{Kernel, Op};
use crate::ops::{output_buffer, Float};

/// `act(x·Wᵀ + b)`. The product before the bias is kept in the op for the backward pass: as a
/// graph node of its own (the input of a bias + activation op) it got a zero-filled gradient
/// buffer and an add in every backward pass, an MLP's widest tensor each time.
pub(crate) struct LinearBiasAct {
    act: Activation,
    product: Mutex<Option<Tensor>>,
}

impl LinearBiasAct {
    fn run<T: Float>(&self, x: &[T], w: &[T], b: &[T], (rows, inp, out): (usize, usize, usize)) -> Result<Vec<T>> {
        // SAFETY: the product overwrites every element.
        let mut y = unsafe { output_buffer::<T>(rows * out) };
        weight_product_into(&mut y, out, Dims { m: rows, n: out, k: inp }, Mat::rows(x, 0, inp), Mat::transposed(w, 0, inp), false);
        let activated = BiasAct(self.act).run(&y, b, out);
        let product = Tensor::from_vec(y, (rows, out), &candle_core::Device::Cpu)?;
        *self.product.lock().unwrap_or_else(|e| e.into_inner()) = Some(product);
        Ok(activated)
    }
}

impl Kernel<3> for LinearBiasAct {
    const NAME: &'static str = "linear-bias-act";
    const PROFILE: &'static str = "op/linear";
    /// Rows, inputs and outputs.
    type Geometry = (usize, usize, usize);

    fn geometry(&self, layouts: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        crate::ops::kernels::linear::geometry(layouts)
    }

    fn cpu<T: Float>(&self, &dims: &Self::Geometry, [x, w, b]: [&[T]; 3]) -> Result<Vec<T>> {
        self.run(x, w, b, dims)
    }

    fn backward(&self, [x, w, b]: [&Tensor; 3], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let Some(product) = self.product.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            candle_core::bail!("linear + activation backward before its forward pass")
        };
        let dz = product.apply_op3_no_bwd(b, &grad.contiguous()?, &Op(ActGrad(self.act)))?;
        LinearBias.backward([x, w, b], &product, &dz)
    }
}

/// `act(x·Wᵀ + b)` for `x` `[rows, in]`, `w` `[out, in]`, `b` `[out]`: one op on the CPU in
/// f32 / f64, candle's matmul and the bias (+ activation) op elsewhere.
pub fn linear_bias_act(x: &Tensor, w: &Tensor, b: &Tensor, act: Activation) -> Result<Tensor> {
    if act == Activation::Identity || !fusable(x, w, b) {
        return match act {
            Activation::Identity => linear_bias(x, w, b),
            _ => bias_act(&x.matmul(&w.t()?)?, b, act),
        };
    }
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, Op(LinearBiasAct { act, product: Mutex::new(None) }))
}

/// A transformer's MLP, `act(x·W1ᵀ + b1)·W2ᵀ + b2`, as one op. Its hidden activation (4× the
/// model width) is kept in the op with the product before it, instead of being a graph node that
/// the backward pass gives a zero-filled gradient buffer and an add. Arguments: x, W1, and
/// `[b1 | W2 | b2]` flattened into one tensor (an op has three inputs), so that the gradient of
/// W2 and b2, written side by side by one backward kernel, is already that tensor's tail.
pub(crate) struct Mlp {
    act: Activation,
    saved: Mutex<Option<(Tensor, Tensor)>>,
}

impl Mlp {
    fn run<T: Float>(&self, x: &[T], w1: &[T], rest: &[T], (rows, inp, hidden, out): (usize, usize, usize, usize)) -> Result<Vec<T>> {
        let (b1, rest) = rest.split_at(hidden);
        let (w2, b2) = rest.split_at(out * hidden);
        // SAFETY: the product overwrites every element.
        let mut y = unsafe { output_buffer::<T>(rows * hidden) };
        weight_product_into(&mut y, hidden, Dims { m: rows, n: hidden, k: inp }, Mat::rows(x, 0, inp), Mat::transposed(w1, 0, inp), false);
        let h = BiasAct(self.act).run(&y, b1, hidden);
        let z = LinearBias::run(&h, w2, b2, (rows, hidden, out));
        let cpu = candle_core::Device::Cpu;
        let saved = (Tensor::from_vec(y, (rows, hidden), &cpu)?, Tensor::from_vec(h, (rows, hidden), &cpu)?);
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(saved);
        Ok(z)
    }
}

impl Kernel<3> for Mlp {
    const NAME: &'static str = "mlp";
    const PROFILE: &'static str = "op/linear";
    /// Rows, inputs, hidden units and outputs.
    type Geometry = (usize, usize, usize, usize);

    fn geometry(&self, [x, w1, rest]: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        let (rows, inp, hidden) = shapes(x.dims(), w1.dims())?;
        let rest = rest.shape().elem_count();
        // rest = hidden + out·hidden + out
        if rest <= hidden || !(rest - hidden).is_multiple_of(hidden + 1) {
            candle_core::bail!("MLP: {rest} values do not hold b1 [{hidden}], W2 [out, {hidden}] and b2 [out]");
        }
        let out = (rest - hidden) / (hidden + 1);
        Ok(((rows, inp, hidden, out), Shape::from((rows, out))))
    }

    fn cpu<T: Float>(&self, &dims: &Self::Geometry, [x, w1, rest]: [&[T]; 3]) -> Result<Vec<T>> {
        self.run(x, w1, rest, dims)
    }

    fn backward(&self, [x, w1, rest]: [&Tensor; 3], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let Some((y, h)) = self.saved.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            candle_core::bail!("MLP backward before its forward pass")
        };
        let (rows, hidden) = h.dims2()?;
        let out = grad.dim(1)?;
        let b1 = rest.narrow(0, 0, hidden)?;
        let w2 = rest.narrow(0, hidden, out * hidden)?.reshape((out, hidden))?;
        // [dh | dW2 | db2], then [dx | dW1 | db1] as `LinearBias` computes them.
        let second = h.apply_op3_no_bwd(&w2, &grad.contiguous()?, &Op(LinearBiasGrad { input_grad: true }))?;
        let dh = second.narrow(0, 0, rows * hidden)?.reshape((rows, hidden))?;
        let dz = y.apply_op3_no_bwd(&b1, &dh, &Op(ActGrad(self.act)))?;
        let [dx, dw1, db1] = LinearBias.backward([x, w1, &b1], &y, &dz)?;
        let drest = Tensor::cat(&[&db1.expect("bias gradient"), &second.narrow(0, rows * hidden, out * hidden + out)?], 0)?;
        Ok([dx, dw1, Some(drest)])
    }
}

/// `act(x·W1ᵀ + b1)·W2ᵀ + b2` for `x` `[rows, in]`: one op on the CPU in f32 / f64, two linear
/// layers elsewhere.
pub fn mlp(x: &Tensor, (w1, b1): (&Tensor, &Tensor), (w2, b2): (&Tensor, &Tensor), act: Activation) -> Result<Tensor> {
    if !fusable(x, w1, b1) || !fusable(x, w2, b2) {
        return linear_bias(&linear_bias_act(x, w1, b1, act)?, w2, b2);
    }
    let rest = Tensor::cat(&[b1, &w2.flatten_all()?, b2], 0)?;
    x.contiguous()?.apply_op3(&w1.contiguous()?, &rest, Op(Mlp { act, saved: Mutex::new(None) }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::kernels::linear::tests::check_against;
    use crate::ops::testing::{check_fd, max_abs, max_diff};
    use candle_core::{DType, Device, Var};

    /// Against candle's matmul and the bias + GELU op (itself checked against candle's
    /// `gelu_erf`, whose derivative is good to 7e-7 only).
    #[test]
    fn linear_bias_gelu_matches_the_composition_and_finite_differences() {
        check_against(
            |x, w, b| linear_bias_act(x, w, b, Activation::GeluErf).unwrap(),
            |x, w, b| bias_act(&x.matmul(&w.t().unwrap()).unwrap(), b, Activation::GeluErf).unwrap(),
            2e-5,
        );
        check_against(
            |x, w, b| linear_bias_act(x, w, b, Activation::QuickGelu).unwrap(),
            |x, w, b| bias_act(&x.matmul(&w.t().unwrap()).unwrap(), b, Activation::QuickGelu).unwrap(),
            2e-5,
        );
    }

    /// The fused MLP against its two layers as separate ops: forward and every gradient (twice
    /// over one graph), and against finite differences for each of its five operands.
    #[test]
    fn mlp_matches_its_two_layers_and_finite_differences() {
        let dev = Device::Cpu;
        let v =
            |seed, shape: &[usize], dtype| Var::from_tensor(&crate::util::rng::randn(seed, 0.1, 0.7, shape, dtype, &dev).unwrap()).unwrap();
        for (act, (dtype, tol)) in
            [Activation::GeluErf, Activation::QuickGelu].into_iter().flat_map(|a| [(a, (DType::F64, 1e-12)), (a, (DType::F32, 2e-5))])
        {
            for (rows, inp, hidden, out) in [(7, 5, 12, 5), (1, 3, 4, 2), (33, 16, 40, 16)] {
                let [x, w1, b1, w2, b2] = [
                    v(178, &[rows, inp], dtype),
                    v(179, &[hidden, inp], dtype),
                    v(180, &[hidden], dtype),
                    v(181, &[out, hidden], dtype),
                    v(182, &[out], dtype),
                ];
                let ours = mlp(&x, (&w1, &b1), (&w2, &b2), act).unwrap();
                let reference = linear_bias(&linear_bias_act(&x, &w1, &b1, act).unwrap(), &w2, &b2).unwrap();
                let what = format!("{act:?} {dtype:?} {rows}x{inp} -> {hidden} -> {out}");
                assert!(max_diff(&ours, &reference) <= tol * max_abs(&reference), "{what}");
                let up = crate::util::rng::randn(183, 0.0, 1.0, ours.dims(), dtype, &dev).unwrap();
                let loss = (ours * &up).unwrap().sum_all().unwrap();
                let (g1, again) = (loss.backward().unwrap(), loss.backward().unwrap());
                let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
                for t in [&x, &w1, &b1, &w2, &b2] {
                    let (a, r) = (g1.get(t).unwrap(), g2.get(t).unwrap());
                    assert_eq!(a.dims(), t.dims());
                    assert!(max_diff(a, r) <= tol * max_abs(r), "{what}: gradient");
                    assert_eq!(max_diff(a, again.get(t).unwrap()), 0.0);
                }
            }
        }
        let [x, w1, b1, w2, b2] = [
            v(184, &[4, 3], DType::F64),
            v(185, &[6, 3], DType::F64),
            v(186, &[6], DType::F64),
            v(187, &[2, 6], DType::F64),
            v(188, &[2], DType::F64),
        ];
        let up = crate::util::rng::randn(189, 0.0, 1.0, (4, 2), DType::F64, &dev).unwrap();
        let loss = |t: [&Tensor; 5]| {
            let y = mlp(t[0], (t[1], t[2]), (t[3], t[4]), Activation::QuickGelu).unwrap();
            (y * &up).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
        };
        let all: [&Tensor; 5] = [&x, &w1, &b1, &w2, &b2];
        let y = mlp(&x, (&w1, &b1), (&w2, &b2), Activation::QuickGelu).unwrap();
        let g = (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        for (i, t) in all.iter().enumerate() {
            let err = check_fd(
                |p| {
                    let mut args = all;
                    args[i] = p;
                    loss(args)
                },
                t,
                g.get(t).unwrap(),
                &[0, 1, t.elem_count() - 1],
            );
            assert!(err < 1e-7, "operand {i}: {err}");
        }
    }
}
