//! EfficientNet's squeeze-and-excitation, `h · σ(W2·silu(W1·mean_hw(h) + b1) + b2)` per image and
//! channel, as one op.
//!
//! Composed (spatial mean, two small linear layers, the activations, the channel scaling), `h`
//! (the block's widest tensor) feeds two graph nodes, so the backward pass gives it a zero-filled
//! gradient buffer and two full-size adds, one of them of a broadcast. Here its gradient is one
//! pass, `dh = dy·s + dmean/HW`. The per-image vectors (`[N, C]` and `[N, R]`, R the reduced
//! width) are computed in f64 and kept in the op.

use std::sync::Mutex;

use candle_core::{Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::stage::Stage;
use crate::ops::kernels::batch_norm::sigmoid;
use crate::ops::kernels::channel_scale::scale_planes;
use crate::ops::op::{Kernel, Op};
use crate::ops::{lane_dot, lane_sum, simd, with_cpu_slice, Float};

/// Shapes: images, channels, plane size, reduced width.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    n: usize,
    c: usize,
    hw: usize,
    r: usize,
}

impl Dims {
    fn new(h: &[usize], w1: &[usize], rest: usize) -> Result<Self> {
        let (&[n, c, hh, ww], &[r, wc]) = (h, w1) else {
            candle_core::bail!("squeeze-excitation: input {h:?} and reduce weight {w1:?} are not [N, C, H, W] and [R, C]")
        };
        if wc != c || rest != r + c * r + c {
            candle_core::bail!("squeeze-excitation: weights {w1:?} and {rest} more values do not fit {c} channels");
        }
        Ok(Dims { n, c, hw: hh * ww, r })
    }
}

/// The per-image vectors the backward pass needs.
#[derive(Clone)]
struct Saved {
    /// Spatial means `[N, C]`.
    pool: Vec<f64>,
    /// Reduce layer's pre-activation `[N, R]`.
    z1: Vec<f64>,
    /// Channel factors `[N, C]`.
    s: Vec<f64>,
}

/// The channel factors `[N, C]` of `n` images from their spatial means `pool` `[N, C]`, with the
/// reduce weight `w1` `[R, C]` and bias, and the expand weight `w2` `[C, R]` and bias.
pub(crate) fn factors<T: Float>(n: usize, pool: &[f64], (w1, b1): (&[T], &[T]), (w2, b2): (&[T], &[T])) -> Result<Vec<f64>> {
    let (c, r) = (pool.len() / n.max(1), b1.len());
    if pool.len() != n * c || w1.len() != r * c || w2.len() != c * r || b2.len() != c {
        candle_core::bail!(
            "squeeze-excitation: weights of {}, {r}, {} and {} values do not fit {c} channels",
            w1.len(),
            w2.len(),
            b2.len()
        );
    }
    Ok(excite(Dims { n, c, hw: 1, r }, pool, w1, b1, w2, b2).2)
}

/// `(a1 = silu(z1), z1, s)` from the spatial means: `z1 = pool·W1ᵀ + b1`, `s = σ(a1·W2ᵀ + b2)`.
fn excite<T: Float>(d: Dims, pool: &[f64], w1: &[T], b1: &[T], w2: &[T], b2: &[T]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut a1, mut z1, mut s) = (vec![0.0; d.n * d.r], vec![0.0; d.n * d.r], vec![0.0; d.n * d.c]);
    for i in 0..d.n {
        let p = &pool[i * d.c..(i + 1) * d.c];
        for j in 0..d.r {
            let z = b1[j].f() + w1[j * d.c..(j + 1) * d.c].iter().zip(p).map(|(w, x)| w.f() * x).sum::<f64>();
            z1[i * d.r + j] = z;
            a1[i * d.r + j] = z * sigmoid(z);
        }
        let a = &a1[i * d.r..(i + 1) * d.r];
        for k in 0..d.c {
            let z = b2[k].f() + w2[k * d.r..(k + 1) * d.r].iter().zip(a).map(|(w, x)| w.f() * x).sum::<f64>();
            s[i * d.c + k] = sigmoid(z);
        }
    }
    (a1, z1, s)
}

pub struct SqueezeExcite {
    saved: Mutex<Option<Saved>>,
}

impl SqueezeExcite {
    fn run<T: Float>(&self, d: Dims, h: &[T], w1: &[T], rest: &[T]) -> Vec<T> {
        let (b1, rest) = rest.split_at(d.r);
        let (w2, b2) = rest.split_at(d.c * d.r);
        let pool: Vec<f64> = h.par_chunks(d.hw).map(|p| simd(|| lane_sum(p)).f() / d.hw as f64).collect();
        let (_, z1, s) = excite(d, &pool, w1, b1, w2, b2);
        let out = scale_planes(h, &s, None, d.hw);
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(Saved { pool, z1, s });
        out
    }
}

impl Kernel<3> for SqueezeExcite {
    const NAME: &'static str = "squeeze-excite";
    const PROFILE: &'static str = "op/channel";
    type Geometry = Dims;

    fn geometry(&self, [h, w1, rest]: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        Ok((Dims::new(h.dims(), w1.dims(), rest.shape().elem_count())?, h.shape().clone()))
    }

    fn cpu<T: Float>(&self, &d: &Self::Geometry, [h, w1, rest]: [&[T]; 3]) -> Result<Vec<T>> {
        Ok(self.run(d, h, w1, rest))
    }

    fn backward(&self, [h, w1, rest]: [&Tensor; 3], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let Some(saved) = self.saved.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            candle_core::bail!("squeeze-excitation backward before its forward pass")
        };
        let d = Dims::new(h.dims(), w1.dims(), rest.elem_count())?;
        let op = SqueezeExciteGrad { d, saved, w1: w1.clone(), rest: rest.clone() };
        let all = h.apply_op2_no_bwd(&grad.contiguous()?, &Op(op))?;
        let nh = h.elem_count();
        let dh = all.narrow(0, 0, nh)?.reshape(h.shape())?;
        let dw1 = all.narrow(0, nh, d.r * d.c)?.reshape(w1.shape())?;
        Ok([Some(dh), Some(dw1), Some(all.narrow(0, nh + d.r * d.c, rest.elem_count())?)])
    }
}

/// Arguments h and dy; result `[dh | dW1 | b1, W2, b2 gradients]`.
struct SqueezeExciteGrad {
    d: Dims,
    saved: Saved,
    w1: Tensor,
    rest: Tensor,
}

impl SqueezeExciteGrad {
    fn run<T: Float>(&self, h: &[T], dy: &[T], w1: &[T], rest: &[T]) -> Vec<T> {
        let (d, sv) = (self.d, &self.saved);
        let w2 = &rest[d.r..d.r + d.c * d.r];
        let ds: Vec<f64> = h.par_chunks(d.hw).zip(dy.par_chunks(d.hw)).map(|(a, b)| simd(|| lane_dot(a, b)).f()).collect();
        let (mut dw1, mut db1, mut dw2, mut db2) = (vec![0.0; d.r * d.c], vec![0.0; d.r], vec![0.0; d.c * d.r], vec![0.0; d.c]);
        let mut dpool = vec![0.0; d.n * d.c];
        for i in 0..d.n {
            let z1 = &sv.z1[i * d.r..(i + 1) * d.r];
            let a1: Vec<f64> = z1.iter().map(|&z| z * sigmoid(z)).collect();
            let mut da1 = vec![0.0; d.r];
            for k in 0..d.c {
                let s = sv.s[i * d.c + k];
                let dz2 = ds[i * d.c + k] * s * (1.0 - s);
                db2[k] += dz2;
                for j in 0..d.r {
                    dw2[k * d.r + j] += dz2 * a1[j];
                    da1[j] += dz2 * w2[k * d.r + j].f();
                }
            }
            let pool = &sv.pool[i * d.c..(i + 1) * d.c];
            for j in 0..d.r {
                let sg = sigmoid(z1[j]);
                let dz1 = da1[j] * sg * (1.0 + z1[j] * (1.0 - sg));
                db1[j] += dz1;
                for k in 0..d.c {
                    dw1[j * d.c + k] += dz1 * pool[k];
                    dpool[i * d.c + k] += dz1 * w1[j * d.c + k].f();
                }
            }
        }
        let per_pixel: Vec<f64> = dpool.iter().map(|g| g / d.hw as f64).collect();
        let mut out = scale_planes(dy, &sv.s, Some(&per_pixel), d.hw);
        out.extend(dw1.iter().chain(&db1).chain(&dw2).chain(&db2).map(|&v| T::from(v)));
        out
    }
}

impl Kernel<2> for SqueezeExciteGrad {
    const NAME: &'static str = "squeeze-excite-grad";
    const PROFILE: &'static str = "op/channel-grad";
    type Geometry = ();

    fn geometry(&self, [h, dy]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        if dy.dims() != h.dims() {
            candle_core::bail!("squeeze-excitation backward: gradient {:?} for output {:?}", dy.dims(), h.dims());
        }
        Ok(((), Shape::from(h.shape().elem_count() + self.rest.elem_count() + self.w1.elem_count())))
    }

    fn cpu<T: Float>(&self, _: &Self::Geometry, [h, dy]: [&[T]; 2]) -> Result<Vec<T>> {
        with_cpu_slice(&self.w1, "squeeze-excitation weight", |w1| {
            with_cpu_slice(&self.rest, "squeeze-excitation weights", |rest| Ok(self.run(h, dy, w1, rest)))
        })
    }
}

/// `h · σ(W2·silu(W1·mean_hw(h) + b1) + b2)` for `h` `[N, C, H, W]`, `w1` `[R, C]`, `b1` `[R]`,
/// `w2` `[C, R]`, `b2` `[C]`. Needs operands `ops::fusable` accepts.
pub fn squeeze_excite(h: &Tensor, (w1, b1): (&Tensor, &Tensor), (w2, b2): (&Tensor, &Tensor)) -> Result<Tensor> {
    h.contiguous()?.apply_op3(&w1.contiguous()?, &biases_and_expand(b1, w2, b2)?, Op(SqueezeExcite { saved: Mutex::new(None) }))
}

/// The op's third operand, `[b1 | W2 | b2]` flattened.
fn biases_and_expand(b1: &Tensor, w2: &Tensor, b2: &Tensor) -> Result<Tensor> {
    Tensor::cat(&[b1.flatten_all()?, w2.flatten_all()?, b2.flatten_all()?], 0)
}

/// [`squeeze_excite`] outside candle's graph, for an op that chains it with others
/// (`ops::mbconv`); its backward pass gives the gradients of `h`, `W1` and `[b1 | W2 | b2]`.
pub(crate) type SqueezeExciteStage = Stage<Op<SqueezeExcite>>;

impl SqueezeExciteStage {
    /// The output and the stage; operands as [`squeeze_excite`] takes them, detached from any
    /// graph.
    pub fn squeeze_excite(h: &Tensor, (w1, b1): (&Tensor, &Tensor), (w2, b2): (&Tensor, &Tensor)) -> Result<(Tensor, Self)> {
        Stage::run(Op(SqueezeExcite { saved: Mutex::new(None) }), [h, w1, &biases_and_expand(b1, w2, b2)?])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::kernels::channel_scale::channel_scale;
    use crate::ops::kernels::spatial_mean::spatial_mean;
    use crate::ops::testing::{check_fd, max_abs, max_diff};
    use crate::util::rng::randn;
    use candle_core::{DType, Device, Var};

    /// h, W1, b1, W2, b2 for 2 images of 6 channels, 3×5 pixels, reduced width 3.
    fn operands(dtype: DType) -> [Var; 5] {
        let v = |seed, shape: &[usize]| Var::from_tensor(&randn(seed, 0.1, 0.8, shape, dtype, &Device::Cpu).unwrap()).unwrap();
        [v(430, &[2, 6, 3, 5]), v(431, &[3, 6]), v(432, &[3]), v(433, &[6, 3]), v(434, &[6])]
    }

    fn composed(h: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> Tensor {
        let z1 = spatial_mean(h).unwrap().matmul(&w1.t().unwrap()).unwrap().broadcast_add(b1).unwrap();
        let z2 = z1.silu().unwrap().matmul(&w2.t().unwrap()).unwrap().broadcast_add(b2).unwrap();
        channel_scale(h, &candle_nn::ops::sigmoid(&z2).unwrap()).unwrap()
    }

    #[test]
    fn matches_the_composed_ops_and_finite_differences() {
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
            let [h, w1, b1, w2, b2] = operands(dtype);
            let ours = squeeze_excite(&h, (&w1, &b1), (&w2, &b2)).unwrap();
            let reference = composed(&h, &w1, &b1, &w2, &b2);
            assert!(max_diff(&ours, &reference) <= tol * max_abs(&reference), "{dtype:?}");
            let up = randn(435, 0.0, 1.0, ours.dims(), dtype, &Device::Cpu).unwrap();
            let loss = (ours * &up).unwrap().sum_all().unwrap();
            let (g1, again) = (loss.backward().unwrap(), loss.backward().unwrap());
            let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
            for (i, t) in [&h, &w1, &b1, &w2, &b2].into_iter().enumerate() {
                let (a, r) = (g1.get(t).unwrap(), g2.get(t).unwrap());
                assert_eq!(a.dims(), t.dims());
                assert!(max_diff(a, r) <= tol * max_abs(r), "{dtype:?} operand {i}: {} vs {}", max_diff(a, r), max_abs(r));
                assert_eq!(max_diff(a, again.get(t).unwrap()), 0.0);
            }
        }
        let all = operands(DType::F64);
        let up = randn(436, 0.0, 1.0, (2, 6, 3, 5), DType::F64, &Device::Cpu).unwrap();
        let loss = |t: [&Tensor; 5]| {
            let y = squeeze_excite(t[0], (t[1], t[2]), (t[3], t[4])).unwrap();
            (y * &up).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
        };
        let args: [&Tensor; 5] = [&all[0], &all[1], &all[2], &all[3], &all[4]];
        let g = (squeeze_excite(args[0], (args[1], args[2]), (args[3], args[4])).unwrap() * &up)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (i, t) in args.iter().enumerate() {
            let err = check_fd(
                |p| {
                    let mut a = args;
                    a[i] = p;
                    loss(a)
                },
                t,
                g.get(t).unwrap(),
                &[0, 1, t.elem_count() / 2, t.elem_count() - 1],
            );
            assert!(err < 1e-7, "operand {i}: {err}");
        }
    }

    #[test]
    fn weights_that_do_not_fit_are_errors() {
        let [h, w1, b1, _, b2] = operands(DType::F32);
        let w2 = Tensor::zeros((5, 3), DType::F32, &Device::Cpu).unwrap();
        let err = squeeze_excite(&h, (&w1, &b1), (&w2, &b2)).unwrap_err().to_string();
        assert!(err.contains("channels"), "{err}");
    }
}
