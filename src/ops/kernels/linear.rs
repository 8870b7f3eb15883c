//! `x·Wᵀ + b` over `[rows, in]` as one op: the bias is written first and the product accumulated
//! onto it inside the matmul kernel; and the gradient helpers the fused blocks share.
//!
//! Composed (a matmul, then a bias add), the graph holds the product before the bias as well as
//! after it: one more activation-sized tensor per layer kept until the backward pass ends (five
//! per transformer block), and one more pass over it each way.

use candle_core::{Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::bf16_gemm::Scope;
use super::bias_act::{bias_act, Activation};
use super::column_sums::column_sums;
use super::matmul::{fused_linear, gemm_into, gemm_serial, weight_product_into};
use super::operands::{Dims, Mat};
use crate::ops::op::{Kernel, Op};
use crate::ops::{output_buffer, simd, Float};

pub(crate) fn shapes(x: &[usize], w: &[usize]) -> Result<(usize, usize, usize)> {
    match (x, w) {
        ([rows, i], [o, wi]) if i == wi => Ok((*rows, *i, *o)),
        _ => candle_core::bail!("linear layer: input {x:?} does not fit weight {w:?} ([rows, in] and [out, in])"),
    }
}

pub(crate) struct LinearBias;

/// `(rows, in, out)` and the output's shape of a layer on operands `[x, W, b]`.
pub(crate) fn geometry([x, w, b]: [&Layout; 3]) -> Result<((usize, usize, usize), Shape)> {
    let g = product_geometry(x, w)?;
    if b.dims() != [g.0 .2] {
        candle_core::bail!("linear layer: bias {:?} for {} outputs", b.dims(), g.0 .2);
    }
    Ok(g)
}

/// `(rows, in, out)` and the output's shape of `x·Wᵀ`.
fn product_geometry(x: &Layout, w: &Layout) -> Result<((usize, usize, usize), Shape)> {
    let (rows, inp, out) = shapes(x.dims(), w.dims())?;
    Ok(((rows, inp, out), Shape::from((rows, out))))
}

impl LinearBias {
    pub(crate) fn run<T: Float>(x: &[T], w: &[T], b: &[T], dims: (usize, usize, usize)) -> Vec<T> {
        linear_onto(None, x, w, b, dims)
    }
}

impl Kernel<3> for LinearBias {
    const NAME: &'static str = "linear-bias";
    const PROFILE: &'static str = "op/linear";
    /// Rows, inputs and outputs.
    type Geometry = (usize, usize, usize);

    fn geometry(&self, layouts: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        geometry(layouts)
    }

    fn cpu<T: Float>(&self, &dims: &Self::Geometry, [x, w, b]: [&[T]; 3]) -> Result<Vec<T>> {
        Ok(Self::run(x, w, b, dims))
    }

    fn backward(&self, [x, w, _b]: [&Tensor; 3], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let (dx, dw, db) = grads(x, w, grad)?;
        Ok([dx, Some(dw), Some(db)])
    }
}

/// The gradients `(dx, dW, db)` of `x·Wᵀ (+ b)` from the output's.
fn grads(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Tensor, Tensor)> {
    let (rows, inp, out) = shapes(x.dims(), w.dims())?;
    // An input outside the graph (a ViT's image patches) needs no gradient: its product, as
    // large as the layer's weight gradient, is skipped.
    let input_grad = x.track_op();
    let dx_len = if input_grad { rows * inp } else { 0 };
    // One storage holding [dx (rows·in) | dW (out·in) | db (out)]; the gradients are views.
    let all = x.apply_op3_no_bwd(w, &grad.contiguous()?, &Op(LinearBiasGrad { input_grad }))?;
    let dx = if input_grad { Some(all.narrow(0, 0, dx_len)?.reshape((rows, inp))?) } else { None };
    let dw = all.narrow(0, dx_len, out * inp)?.reshape((out, inp))?;
    Ok((dx, dw, all.narrow(0, dx_len + out * inp, out)?))
}

/// `x·Wᵀ`, a linear layer without a bias (CLIP's patch embedding and projections).
pub(crate) struct LinearNoBias;

impl Kernel<2> for LinearNoBias {
    const NAME: &'static str = "linear-no-bias";
    const PROFILE: &'static str = "op/linear";
    /// Rows, inputs and outputs.
    type Geometry = (usize, usize, usize);

    fn geometry(&self, [x, w]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        product_geometry(x, w)
    }

    fn cpu<T: Float>(&self, &dims: &Self::Geometry, [x, w]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(product(x, w, dims))
    }

    fn backward(&self, [x, w]: [&Tensor; 2], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 2]> {
        // The bias gradient the shared kernel also sums is a row of `out` numbers, dropped.
        let (dx, dw, _) = grads(x, w, grad)?;
        Ok([dx, Some(dw)])
    }
}

/// dx = dy·W (unless `input_grad` is off), dW = dyᵀ·x, db = column sums of dy.
pub(crate) struct LinearBiasGrad {
    pub input_grad: bool,
}

impl LinearBiasGrad {
    fn dx_len(&self, rows: usize, inp: usize) -> usize {
        if self.input_grad {
            rows * inp
        } else {
            0
        }
    }

    fn run<T: Float>(&self, x: &[T], w: &[T], dy: &[T], dims: (usize, usize, usize)) -> Vec<T> {
        let (rows, inp, out) = dims;
        let dx_len = self.dx_len(rows, inp);
        // SAFETY: linear_grads fills dx (not accumulating), dW and db.
        let mut all = unsafe { output_buffer::<T>(dx_len + out * inp + out) };
        let (dx, rest) = all.split_at_mut(dx_len);
        let (dw, db) = rest.split_at_mut(out * inp);
        linear_grads(x, w, dy, dims, self.input_grad.then_some((dx, false)), dw, db);
        all
    }
}

impl Kernel<3> for LinearBiasGrad {
    const NAME: &'static str = "linear-bias-grad";
    const PROFILE: &'static str = "op/linear-grad";
    type Geometry = (usize, usize, usize);

    fn geometry(&self, [x, w, dy]: [&Layout; 3]) -> Result<(Self::Geometry, Shape)> {
        let (rows, inp, out) = shapes(x.dims(), w.dims())?;
        if dy.dims() != [rows, out] {
            candle_core::bail!("linear layer backward: gradient {:?} for output [{rows}, {out}]", dy.dims());
        }
        Ok(((rows, inp, out), Shape::from(self.dx_len(rows, inp) + out * inp + out)))
    }

    fn cpu<T: Float>(&self, &dims: &Self::Geometry, [x, w, dy]: [&[T]; 3]) -> Result<Vec<T>> {
        Ok(self.run(x, w, dy, dims))
    }
}

/// The gradients of `y = x·Wᵀ + b` from dy, for `x` `[rows, in]`, `w` `[out, in]`: `dx = dy·W`
/// (added to what `dx` holds when its flag says so; skipped without `dx`), `dW = dyᵀ·x`,
/// `db` = column sums of dy.
pub(crate) fn linear_grads<T: Float>(
    x: &[T],
    w: &[T],
    dy: &[T],
    (rows, inp, out): (usize, usize, usize),
    dx: Option<(&mut [T], bool)>,
    dw: &mut [T],
    db: &mut [T],
) {
    if let Some((dx, accumulate)) = dx {
        gemm_into(dx, inp, Dims { m: rows, n: inp, k: out }, Mat::rows(dy, 0, out), Mat::rows(w, 0, inp), accumulate);
    }
    weight_grad(x, dy, (rows, inp, out), dw);
    db.copy_from_slice(&column_sums(dy, out));
}

/// `dW = dyᵀ·x`: a short, wide product summed over all rows (k = rows). gemm splits only the
/// output (`out × in` blocks, few of them) across threads; splitting the rows instead, one
/// partial product per thread added up at the end, made ViT-Ti's weight gradients 20% faster on
/// two threads (205–228 → 252–275 GFLOP/s).
fn weight_grad<T: Float>(x: &[T], dy: &[T], (rows, inp, out): (usize, usize, usize), dw: &mut [T]) {
    // At least 1024 rows a part, and the partial sums ((parts − 1)·out·in values) no larger than
    // the input x (rows·in).
    let parts = rayon::current_num_threads().min(rows / 1024).min(rows / out.max(1) + 1).max(1);
    let dims = |k| Dims { m: out, n: inp, k };
    if parts == 1 {
        gemm_into(dw, inp, dims(rows), Mat::transposed(dy, 0, out), Mat::rows(x, 0, inp), false);
        return;
    }
    let per = rows.div_ceil(parts);
    // SAFETY: each part's product overwrites its buffer (k ≥ 1 rows each, as per ≤ rows).
    let mut partial: Vec<Vec<T>> = (1..parts).map(|_| unsafe { output_buffer::<T>(out * inp) }).collect();
    let mut dsts: Vec<&mut [T]> = std::iter::once(&mut *dw).chain(partial.iter_mut().map(|p| &mut p[..])).collect();
    let scope = Scope::current();
    dsts.par_iter_mut().enumerate().for_each(|(i, dst)| {
        let (start, end) = (i * per, ((i + 1) * per).min(rows));
        let d = dims(end.saturating_sub(start));
        scope.run(|| gemm_serial(dst, inp, d, Mat::transposed(dy, start * out, out), Mat::rows(x, start * inp, inp), false));
    });
    for p in &partial {
        add_assign(dw, p);
    }
}

/// `dst = a + b` element by element, in parallel chunks.
pub(crate) fn sum_into<T: Float>(dst: &mut [T], a: &[T], b: &[T]) {
    dst.par_chunks_mut(16 * 1024).zip(a.par_chunks(16 * 1024)).zip(b.par_chunks(16 * 1024)).for_each(|((d, a), b)| {
        simd(
            #[inline(always)]
            || {
                for ((d, &x), &y) in d.iter_mut().zip(a).zip(b) {
                    *d = x + y;
                }
            },
        )
    });
}

/// `Σ_img` of one `len`-element product per image, for weight gradients whose product per image
/// is small (`out × c`) with a long sum (`h·w`): gemm would split only the small output across
/// threads and synchronise them for every image. Here the `n` images are split into one run per
/// thread, each run accumulating its own partial on its thread, and the partials are added at the
/// end. `each(dst, scratch, img, accumulate)` writes (or with `accumulate`, adds) image `img`'s
/// product into `dst`; `scratch()` makes a run's own work buffer.
pub(crate) fn sum_over_image_runs<T: Float, S>(
    n: usize,
    len: usize,
    scratch: impl Fn() -> S + Sync,
    each: impl Fn(&mut [T], &mut S, usize, bool) + Sync,
) -> Vec<T> {
    if n == 0 {
        return vec![T::default(); len];
    }
    let per = n.div_ceil(rayon::current_num_threads().clamp(1, n));
    let parts = n.div_ceil(per);
    // SAFETY: every part has at least one image (parts = ⌈n / per⌉), whose product overwrites
    // its buffer before the others accumulate.
    let mut partial: Vec<Vec<T>> = (0..parts).map(|_| unsafe { output_buffer::<T>(len) }).collect();
    let scope = Scope::current();
    partial.par_iter_mut().enumerate().for_each(|(i, dst)| {
        let mut work = scratch();
        for (j, img) in (i * per..((i + 1) * per).min(n)).enumerate() {
            scope.run(|| each(dst, &mut work, img, j > 0));
        }
    });
    let mut sum = partial.swap_remove(0);
    for p in &partial {
        add_assign(&mut sum, p);
    }
    sum
}

/// `a += b` element by element, in parallel chunks.
pub(crate) fn add_assign<T: Float>(a: &mut [T], b: &[T]) {
    a.par_chunks_mut(16 * 1024).zip(b.par_chunks(16 * 1024)).for_each(|(a, b)| {
        simd(
            #[inline(always)]
            || {
                for (x, &y) in a.iter_mut().zip(b) {
                    *x += y;
                }
            },
        )
    });
}

/// `x·Wᵀ` for `x` `[rows, in]`, `w` `[out, in]`.
pub(crate) fn product<T: Float>(x: &[T], w: &[T], (rows, inp, out): (usize, usize, usize)) -> Vec<T> {
    // SAFETY: the product overwrites every element.
    let mut y = unsafe { output_buffer::<T>(rows * out) };
    weight_product_into(&mut y, out, Dims { m: rows, n: out, k: inp }, Mat::rows(x, 0, inp), Mat::transposed(w, 0, inp), false);
    y
}

/// `(residual +) x·Wᵀ + b`: the residual (if any) and the bias are written first and the product
/// accumulated onto them inside the matmul kernel.
pub(crate) fn linear_onto<T: Float>(residual: Option<&[T]>, x: &[T], w: &[T], b: &[T], dims: (usize, usize, usize)) -> Vec<T> {
    // SAFETY: `linear_into` writes every element.
    let mut y = unsafe { output_buffer::<T>(dims.0 * dims.2) };
    linear_into(&mut y, residual, x, w, b, dims);
    y
}

/// [`linear_onto`] into `y` (`[rows, out]`).
fn linear_into<T: Float>(y: &mut [T], residual: Option<&[T]>, x: &[T], w: &[T], b: &[T], (rows, inp, out): (usize, usize, usize)) {
    let task = out * (16 * 1024 / out.max(1)).max(1);
    y.par_chunks_mut(task).enumerate().for_each(|(t, y)| {
        let r = residual.map(|r| &r[t * task..t * task + y.len()]);
        simd(
            #[inline(always)]
            || {
                for (i, yrow) in y.chunks_mut(out).enumerate() {
                    match r {
                        Some(r) => {
                            for ((o, &r), &b) in yrow.iter_mut().zip(&r[i * out..(i + 1) * out]).zip(b) {
                                *o = r + b;
                            }
                        }
                        None => yrow.copy_from_slice(b),
                    }
                }
            },
        )
    });
    weight_product_into(y, out, Dims { m: rows, n: out, k: inp }, Mat::rows(x, 0, inp), Mat::transposed(w, 0, inp), true);
}

/// `act((residual +) x·Wᵀ + b)`, for forward passes that keep nothing for a backward pass: where
/// the product runs in int8 or bf16 its tiles add, activate and store at once
/// ([`fused_linear`]); elsewhere [`linear_onto`], then the activation in place.
pub(crate) fn linear_act<T: Float>(
    residual: Option<&[T]>,
    x: &[T],
    w: &[T],
    b: &[T],
    act: Activation,
    (rows, inp, out): (usize, usize, usize),
) -> Vec<T> {
    // SAFETY: either path writes every element.
    let mut y = unsafe { output_buffer::<T>(rows * out) };
    if !fused_linear(&mut y, Dims { m: rows, n: out, k: inp }, x, w, b, residual, act) {
        linear_into(&mut y, residual, x, w, b, (rows, inp, out));
        act.apply_in_place(&mut y);
    }
    y
}

pub(crate) fn fusable(x: &Tensor, w: &Tensor, b: &Tensor) -> bool {
    crate::ops::fusable(x, &[w, b])
}

/// `x·Wᵀ` for `x` `[rows, in]`, `w` `[out, in]`: on the CPU in f32 / f64 the kernels' product
/// (bf16 or int8 where the precision asks for it, as every linear layer with a bias has), elsewhere
/// candle's matmul.
pub fn linear_no_bias(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !crate::ops::fusable(x, &[w]) {
        return x.matmul(&w.t()?);
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, Op(LinearNoBias))
}

/// `x·Wᵀ + b` for `x` `[rows, in]`, `w` `[out, in]`, `b` `[out]`: one op on the CPU in f32 / f64,
/// elsewhere candle's matmul and the bias op (whose bias gradient is the column-sum kernel on a
/// GPU, not candle's reduce).
pub fn linear_bias(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    if !fusable(x, w, b) {
        return bias_act(&x.matmul(&w.t()?)?, b, Activation::Identity);
    }
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, Op(LinearBias))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ops::testing::{check_fd, max_abs, max_diff};
    use candle_core::{DType, Device, Var};

    pub(crate) fn inputs(dtype: DType, (rows, inp, out): (usize, usize, usize)) -> [Var; 3] {
        let dev = Device::Cpu;
        let v =
            |seed, shape: &[usize], std| Var::from_tensor(&crate::util::rng::randn(seed, 0.1, std, shape, dtype, &dev).unwrap()).unwrap();
        [v(170, &[rows, inp], 1.0), v(171, &[out, inp], 0.5), v(172, &[out], 0.5)]
    }

    pub(crate) type Op3 = fn(&Tensor, &Tensor, &Tensor) -> Tensor;

    /// `ours` against `reference` on (x, W, b): forward and every gradient in f64 (1e-12) and
    /// f32 (`f32_tol`), relative to the largest reference value, the gradients twice over one
    /// graph (state an op keeps must outlive a backward pass); then `ours` against finite
    /// differences in f64.
    pub(crate) fn check_against(ours: Op3, reference: Op3, f32_tol: f64) {
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, f32_tol)] {
            for shape in [(7, 5, 3), (1, 9, 4), (33, 16, 20)] {
                let [x, w, b] = inputs(dtype, shape);
                let (y, r) = (ours(&x, &w, &b), reference(&x, &w, &b));
                assert!(max_diff(&y, &r) <= tol * max_abs(&r), "{dtype:?} {shape:?}");
                let up = crate::util::rng::randn(173, 0.0, 1.0, y.dims(), dtype, &Device::Cpu).unwrap();
                let loss = (y * &up).unwrap().sum_all().unwrap();
                let (g1, again) = (loss.backward().unwrap(), loss.backward().unwrap());
                let g2 = (r * &up).unwrap().sum_all().unwrap().backward().unwrap();
                for v in [&x, &w, &b] {
                    let (a, r) = (g1.get(v).unwrap(), g2.get(v).unwrap());
                    assert_eq!(a.dims(), v.dims());
                    assert!(max_diff(a, r) <= tol * max_abs(r), "{dtype:?} {shape:?} gradient");
                    assert_eq!(max_diff(a, again.get(v).unwrap()), 0.0);
                }
            }
        }
        let [x, w, b] = inputs(DType::F64, (4, 3, 5));
        let up = crate::util::rng::randn(174, 0.0, 1.0, (4, 5), DType::F64, &Device::Cpu).unwrap();
        let loss = |x: &Tensor, w: &Tensor, b: &Tensor| (ours(x, w, b) * &up).unwrap().sum_all().unwrap();
        let g = loss(&x, &w, &b).backward().unwrap();
        let scalar = |t: Tensor| t.to_scalar::<f64>().unwrap();
        let errs = [
            check_fd(|t| scalar(loss(t, &w, &b)), &x, g.get(&x).unwrap(), &[0, 5, 11]),
            check_fd(|t| scalar(loss(&x, t, &b)), &w, g.get(&w).unwrap(), &[0, 7, 14]),
            check_fd(|t| scalar(loss(&x, &w, t)), &b, g.get(&b).unwrap(), &[0, 4]),
        ];
        assert!(errs.iter().all(|e| *e < 1e-7), "{errs:?}");
    }

    #[test]
    fn matches_matmul_plus_bias_and_finite_differences() {
        check_against(
            |x, w, b| linear_bias(x, w, b).unwrap(),
            |x, w, b| x.matmul(&w.t().unwrap()).unwrap().broadcast_add(b).unwrap(),
            1e-5,
        );
    }

    #[test]
    fn without_a_bias_matches_matmul_and_finite_differences() {
        check_against(
            |x, w, b| linear_no_bias(x, w).unwrap().broadcast_add(b).unwrap(),
            |x, w, b| x.matmul(&w.t().unwrap()).unwrap().broadcast_add(b).unwrap(),
            1e-5,
        );
        let [x, w, _] = inputs(DType::F64, (6, 4, 3));
        let plain = x.as_tensor().detach();
        let g = linear_no_bias(&plain, &w).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(g.get(&plain).is_none() && g.get(&w).is_some(), "an untracked input gets no gradient");
    }

    /// Tall inputs take the weight gradient in per-thread row blocks: the same gradients as one
    /// product, with three threads (three blocks, the last one shorter) and with one.
    #[test]
    fn weight_gradient_in_row_blocks_matches_one_product() {
        let [x, w, b] = inputs(DType::F64, (3500, 6, 5));
        let up = crate::util::rng::randn(176, 0.0, 1.0, (3500, 5), DType::F64, &Device::Cpu).unwrap();
        let grad = |threads| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| (linear_bias(&x, &w, &b).unwrap() * &up).unwrap().sum_all().unwrap().backward().unwrap())
        };
        let (one, three) = (grad(1), grad(3));
        let reference = x.t().unwrap().matmul(&up).unwrap().t().unwrap();
        for g in [&one, &three] {
            let dw = g.get(&w).unwrap();
            assert!(max_diff(dw, &reference) <= 1e-12 * max_abs(&reference));
        }
    }

    /// An input outside the graph gets no gradient; the weight's and bias's are as before.
    #[test]
    fn an_untracked_input_gets_no_gradient() {
        let [x, w, b] = inputs(DType::F64, (6, 4, 3));
        let plain = x.as_tensor().detach();
        let up = crate::util::rng::randn(175, 0.0, 1.0, (6, 3), DType::F64, &Device::Cpu).unwrap();
        let g1 = (linear_bias(&plain, &w, &b).unwrap() * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (linear_bias(&x, &w, &b).unwrap() * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(g1.get(&plain).is_none() && g2.get(&x).is_some());
        for v in [&w, &b] {
            assert!(max_diff(g1.get(v).unwrap(), g2.get(v).unwrap()) < 1e-12);
        }
    }
}
