//! Softmax over the last dimension as one op with its own backward, for attention. candle's
//! composed softmax (max, subtract, exp, sum, divide, each a full-size temporary, and as many
//! backward nodes) is the largest part of the ViT's attention; its fused `softmax_last_dim` has no
//! backward at all (see CANDLE-NOTES). Forward: one pass per row; backward: one pass per row,
//! `dx = y·(dy − Σ y·dy)`.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

fn rows<'a, T>(data: &'a [T], l: &Layout) -> Result<(&'a [T], usize)> {
    let d = *l.dims().last().unwrap_or(&1);
    match l.contiguous_offsets() {
        Some((a, b)) => Ok((&data[a..b], d.max(1))),
        None => candle_core::bail!("softmax input must be contiguous"),
    }
}

macro_rules! softmax_rows {
    ($x:expr, $d:expr, $t:ty) => {{
        let mut out = vec![0 as $t; $x.len()];
        out.par_chunks_mut($d).zip($x.par_chunks($d)).for_each(|(o, r)| {
            let m = r.iter().copied().fold(<$t>::NEG_INFINITY, <$t>::max);
            let mut sum = 0.0 as $t;
            for (ov, &v) in o.iter_mut().zip(r) {
                *ov = (v - m).exp();
                sum += *ov;
            }
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|v| *v *= inv);
        });
        out
    }};
}

macro_rules! softmax_grad_rows {
    ($y:expr, $dy:expr, $d:expr, $t:ty) => {{
        let mut out = vec![0 as $t; $y.len()];
        out.par_chunks_mut($d).zip($y.par_chunks($d)).zip($dy.par_chunks($d)).for_each(|((o, y), g)| {
            let dot: $t = y.iter().zip(g).map(|(a, b)| a * b).sum();
            for ((ov, &yv), &gv) in o.iter_mut().zip(y).zip(g) {
                *ov = yv * (gv - dot);
            }
        });
        out
    }};
}

struct Softmax;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "softmax-last-dim"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(x) => {
                let (x, d) = rows(x, l)?;
                CpuStorage::F32(softmax_rows!(x, d, f32))
            }
            CpuStorage::F64(x) => {
                let (x, d) = rows(x, l)?;
                CpuStorage::F64(softmax_rows!(x, d, f64))
            }
            _ => candle_core::bail!("softmax supports f32 and f64"),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(y.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxGrad)?))
    }
}

struct SoftmaxGrad;

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "softmax-last-dim-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(g)) => {
                let ((y, d), (g, _)) = (rows(y, l1)?, rows(g, l2)?);
                CpuStorage::F32(softmax_grad_rows!(y, g, d, f32))
            }
            (CpuStorage::F64(y), CpuStorage::F64(g)) => {
                let ((y, d), (g, _)) = (rows(y, l1)?, rows(g, l2)?);
                CpuStorage::F64(softmax_grad_rows!(y, g, d, f64))
            }
            _ => candle_core::bail!("softmax backward supports f32 and f64 with matching dtypes"),
        };
        Ok((out, l1.shape().clone()))
    }
}

/// Softmax over the last dimension, differentiable. Fused on the CPU for f32 / f64; candle's
/// composed softmax elsewhere.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() || !matches!(x.dtype(), DType::F32 | DType::F64) {
        return candle_nn::ops::softmax(x, D::Minus1);
    }
    x.contiguous()?.apply_op1(Softmax)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
    }

    #[test]
    fn matches_candles_composed_softmax_forward_and_backward() {
        let dev = Device::Cpu;
        for dtype in [DType::F64, DType::F32] {
            let x = Var::from_tensor(&crate::util::rng::randn(150, 0.0, 3.0, (2, 3, 5, 17), dtype, &dev).unwrap()).unwrap();
            // A padding mask's -1e9 must give exact zeros, not NaNs.
            let mask = Tensor::from_vec((0..17).map(|j| if j > 12 { -1e9 } else { 0.0 }).collect::<Vec<f64>>(), 17, &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let xm = x.as_tensor().broadcast_add(&mask).unwrap();
            let ours = softmax_last_dim(&xm).unwrap();
            let reference = candle_nn::ops::softmax(&xm, D::Minus1).unwrap();
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-6 };
            assert!(max_diff(&ours, &reference) < tol);
            assert_eq!(
                ours.narrow(3, 13, 4).unwrap().abs().unwrap().sum_all().unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(),
                0.0
            );
            let up = crate::util::rng::randn(151, 0.0, 1.0, ours.dims(), dtype, &dev).unwrap();
            let g1 = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(max_diff(g1.get(x.as_tensor()).unwrap(), g2.get(x.as_tensor()).unwrap()) < tol * 10.0);
        }
    }
}
