//! Depthwise 2-D convolution (one k×k filter per channel) as a single candle op with its own
//! backward pass.
//!
//! candle runs a grouped convolution as one small convolution per group and concatenates the
//! results, in the forward pass and again in the backward pass: for EfficientNet's depthwise
//! layers (up to thousands of channels) that is hundreds of tiny kernels per layer. Here each
//! (image, channel) plane is one task on the thread pool, and the inner loops run over contiguous
//! rows so the compiler vectorises them. Padding is explicit per side, so TF / EfficientNet
//! "same" padding at stride 2 (more on the bottom/right) needs no separate pad op.
//!
//! Results are deterministic: every output element is accumulated by one thread in a fixed order.

use candle_core::{DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::ops::gpu::depthwise::Pass;
use crate::ops::gpu::program::DepthwiseParams;
use crate::ops::gpu::{Limits, Program};
use crate::ops::kernels::batch_norm::sigmoid;
use crate::ops::op::{GpuPlan, Kernel, Op};
use crate::ops::{lane_sum, output_buffer, simd, Float, LANES};

/// Padding in pixels: top, bottom, left, right.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Padding {
    pub top: usize,
    pub bottom: usize,
    pub left: usize,
    pub right: usize,
}

impl Padding {
    pub fn same(k: usize) -> Self {
        Padding { top: k / 2, bottom: k / 2, left: k / 2, right: k / 2 }
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    k: usize,
    stride: usize,
    pad: Padding,
    ho: usize,
    wo: usize,
}

impl Geometry {
    fn new(x: &[usize], kernel: &[usize], stride: usize, pad: Padding) -> Result<Self> {
        let [n, c, h, w] = x else { candle_core::bail!("depthwise conv: input must be NCHW, got {x:?}") };
        let [kc, one, k, k2] = kernel else { candle_core::bail!("depthwise conv: kernel must be [C, 1, k, k], got {kernel:?}") };
        if kc != c || *one != 1 || k != k2 {
            candle_core::bail!("depthwise conv: kernel {kernel:?} does not fit input {x:?}");
        }
        let (hp, wp) = (h + pad.top + pad.bottom, w + pad.left + pad.right);
        if stride == 0 || hp < *k || wp < *k {
            candle_core::bail!("depthwise conv: {k}x{k} kernel, stride {stride} does not fit a padded {hp}x{wp} input");
        }
        Ok(Geometry { n: *n, c: *c, h: *h, w: *w, k: *k, stride, pad, ho: (hp - k) / stride + 1, wo: (wp - k) / stride + 1 })
    }

    /// Output columns `ox` whose input column `ox·s + kx − left` lies inside the image.
    fn cols(&self, kx: usize) -> (usize, usize) {
        let (s, l) = (self.stride as isize, self.pad.left as isize);
        let lo = (l - kx as isize).max(0);
        let lo = ((lo + s - 1) / s) as usize;
        let hi = ((self.w as isize - 1 + l - kx as isize).div_euclid(s) + 1).clamp(0, self.wo as isize) as usize;
        (lo.min(hi), hi)
    }

    /// Input row for output row `oy` and kernel row `ky`, if inside the image.
    fn row(&self, oy: usize, ky: usize) -> Option<usize> {
        let iy = (oy * self.stride + ky) as isize - self.pad.top as isize;
        (0..self.h as isize).contains(&iy).then_some(iy as usize)
    }

    fn in_col(&self, ox: usize, kx: usize) -> usize {
        ox * self.stride + kx - self.pad.left
    }
}

impl Geometry {
    /// Where input columns `≡ phase (mod stride)` start in a row split by [`split_row`].
    fn phase_start(&self, phase: usize) -> usize {
        (0..phase).map(|q| (self.w.saturating_sub(q)).div_ceil(self.stride)).sum()
    }

    /// Per kernel column: the valid output columns `lo..hi` and where, in a (split) input row,
    /// the run of inputs they read starts. Consecutive output columns read consecutive entries of
    /// a split row, so every tap is a contiguous run at any stride.
    fn taps(&self) -> Vec<Tap> {
        (0..self.k)
            .map(|kx| {
                let (lo, hi) = self.cols(kx);
                let start = if lo >= hi {
                    0
                } else {
                    let ic = self.in_col(lo, kx);
                    if self.stride == 1 {
                        ic
                    } else {
                        self.phase_start(ic % self.stride) + ic / self.stride
                    }
                };
                Tap { lo, hi, start }
            })
            .collect()
    }
}

#[derive(Clone, Copy)]
struct Tap {
    lo: usize,
    hi: usize,
    start: usize,
}

/// Reorders each row's columns by phase (column mod stride: all of phase 0, then phase 1, …).
/// Strided reads and scatters do not vectorise; on split rows each tap is a contiguous run.
#[inline(always)]
fn split_rows<T: Copy>(g: &Geometry, src: &[T], dst: &mut [T]) {
    for (s, d) in src.chunks_exact(g.w).zip(dst.chunks_exact_mut(g.w)) {
        if g.stride == 2 {
            // The common case, as pairs the compiler turns into shuffles.
            let (even, odd) = d.split_at_mut(g.w.div_ceil(2));
            for ((e, o), pair) in even.iter_mut().zip(odd.iter_mut()).zip(s.chunks_exact(2)) {
                (*e, *o) = (pair[0], pair[1]);
            }
            if g.w % 2 == 1 {
                even[even.len() - 1] = s[g.w - 1];
            }
            continue;
        }
        let mut o = 0;
        for phase in 0..g.stride {
            for &v in s.iter().skip(phase).step_by(g.stride) {
                d[o] = v;
                o += 1;
            }
        }
    }
}

/// The inverse of [`split_rows`].
#[inline(always)]
fn merge_rows<T: Copy>(g: &Geometry, src: &[T], dst: &mut [T]) {
    for (s, d) in src.chunks_exact(g.w).zip(dst.chunks_exact_mut(g.w)) {
        if g.stride == 2 {
            let (even, odd) = s.split_at(g.w.div_ceil(2));
            for ((e, o), pair) in even.iter().zip(odd).zip(d.chunks_exact_mut(2)) {
                (pair[0], pair[1]) = (*e, *o);
            }
            if g.w % 2 == 1 {
                d[g.w - 1] = even[even.len() - 1];
            }
            continue;
        }
        let mut o = 0;
        for phase in 0..g.stride {
            for v in d.iter_mut().skip(phase).step_by(g.stride) {
                *v = s[o];
                o += 1;
            }
        }
    }
}

fn forward<T: Float>(g: &Geometry, x: &[T], kernel: &[T]) -> Vec<T> {
    forward_then(g, x, kernel, |_, _| 0.0).0
}

/// The convolution with a BatchNorm that normalises with running statistics folded in (`kernel`
/// scaled per channel, `shift` `[C]` what the BatchNorm adds), then SiLU: each output plane is
/// finished while it is still in cache. Also returns each plane's mean after SiLU (what
/// squeeze-excitation pools) and the output's height and width.
pub(crate) fn forward_folded<T: Float>(
    x: &[T],
    dims: [usize; 4],
    kernel: &[T],
    (k, stride, pad): (usize, usize, Padding),
    shift: &[T],
) -> Result<(Vec<T>, Vec<f64>, [usize; 2])> {
    let g = Geometry::new(&dims, &[dims[1], 1, k, k], stride, pad)?;
    if x.len() != dims.iter().product::<usize>() || kernel.len() != g.c * k * k || shift.len() != g.c {
        candle_core::bail!(
            "depthwise conv: {} inputs, {} kernel values and {} shifts for {dims:?} and a {k}x{k} kernel",
            x.len(),
            kernel.len(),
            shift.len()
        );
    }
    let (out, sums) = forward_then(
        &g,
        x,
        kernel,
        #[inline(always)]
        |p, o: &mut [T]| {
            let b = shift[p % g.c];
            for v in o.iter_mut() {
                let z = *v + b;
                *v = z * sigmoid(z);
            }
            lane_sum(o).f()
        },
    );
    let plane = (g.ho * g.wo) as f64;
    Ok((out, sums.into_iter().map(|s| s / plane).collect(), [g.ho, g.wo]))
}

/// The convolution, each output plane then handed to `finish` (with its index, image-major) on
/// the thread that wrote it; `finish`'s results in plane order.
///
/// Loop order: output row outermost, so the row being accumulated stays in L1 while the k×k
/// taps stream over at most k input rows.
fn forward_then<T: Float>(g: &Geometry, x: &[T], kernel: &[T], finish: impl Fn(usize, &mut [T]) -> f64 + Sync) -> (Vec<T>, Vec<f64>) {
    let (plane_in, plane_out, kk) = (g.h * g.w, g.ho * g.wo, g.k * g.k);
    let taps = g.taps();
    // SAFETY: each task zeroes its own plane before accumulating into it (zeroing there, on
    // the task's thread and just before use, rather than all up front on one), or, for a small
    // plane, copies every row of it out of its padded accumulator.
    let mut out = unsafe { output_buffer::<T>(g.n * g.c * plane_out) };
    let finished = out
        .par_chunks_mut(plane_out)
        .enumerate()
        .map_init(
            || if g.stride > 1 { vec![T::default(); plane_in] } else { Vec::new() },
            |scratch, (p, o)| {
                let xp = &x[p * plane_in..(p + 1) * plane_in];
                let kp = &kernel[(p % g.c) * kk..(p % g.c + 1) * kk];
                simd(
                    #[inline(always)]
                    || {
                        if g.stride > 1 {
                            o.fill(T::default());
                            split_rows(g, xp, scratch);
                            forward_plane(g, &taps, scratch, kp, o);
                        } else if g.padded_len() <= SMALL_PLANE {
                            forward_plane_padded(g, xp, kp, o, scratch);
                        } else {
                            o.fill(T::default());
                            forward_plane(g, &taps, xp, kp, o);
                        }
                        finish(p, o)
                    },
                )
            },
        )
        .collect();
    (out, finished)
}

/// Padded input planes of at most this many values (with the run they accumulate into, within
/// an L1 cache) take [`forward_plane_padded`] at stride 1.
const SMALL_PLANE: usize = 2048;

impl Geometry {
    /// At stride 1, the convolution whose forward pass is this one's input gradient: the
    /// output gradient convolved with the flipped kernel, padded by k − 1 − p on each side
    /// where this one pads by p (an input pixel gathers every output its taps reached). None
    /// at a larger stride, or where a side pads by k or more.
    fn transposed(&self) -> Option<Geometry> {
        let Padding { top, bottom, left, right } = self.pad;
        if self.stride != 1 || [top, bottom, left, right].iter().any(|&p| p >= self.k) {
            return None;
        }
        let flip = |p: usize| self.k - 1 - p;
        let pad = Padding { top: flip(top), bottom: flip(bottom), left: flip(left), right: flip(right) };
        Some(Geometry { h: self.ho, w: self.wo, ho: self.h, wo: self.w, pad, ..*self })
    }

    /// Values in an input plane with its padding.
    fn padded_len(&self) -> usize {
        (self.h + self.pad.top + self.pad.bottom) * (self.w + self.pad.left + self.pad.right)
    }
}

/// A stride-1 plane through a zero-padded copy of its input: the output is accumulated in rows
/// as wide as the padded input (the columns past the output's width are dropped at the end), so
/// each tap is one multiply-add over a single contiguous run of the whole plane. Row by row, the
/// late stages' 7-19 pixel rows were runs too short to vectorise. Each output value takes the
/// same taps in the same order as in [`forward_plane`], the padding's zeros included.
#[inline(always)]
fn forward_plane_padded<T: Float>(g: &Geometry, xp: &[T], kp: &[T], o: &mut [T], scratch: &mut Vec<T>) {
    let wp = g.w + g.pad.left + g.pad.right;
    let padded = g.padded_len();
    let run = (g.ho - 1) * wp + g.wo;
    scratch.clear();
    scratch.resize(padded + run, T::default());
    let (input, acc) = scratch.split_at_mut(padded);
    for (y, row) in xp.chunks_exact(g.w).enumerate() {
        let at = (y + g.pad.top) * wp + g.pad.left;
        input[at..at + g.w].copy_from_slice(row);
    }
    for ky in 0..g.k {
        for kx in 0..g.k {
            let wv = kp[ky * g.k + kx];
            let at = ky * wp + kx;
            for (a, &xv) in acc.iter_mut().zip(&input[at..at + run]) {
                *a += wv * xv;
            }
        }
    }
    for (oy, orow) in o.chunks_exact_mut(g.wo).enumerate() {
        orow.copy_from_slice(&acc[oy * wp..oy * wp + g.wo]);
    }
}

/// `xp` is the input plane, its rows split by phase when the stride is over 1.
#[inline(always)]
fn forward_plane<T: Float>(g: &Geometry, taps: &[Tap], xp: &[T], kp: &[T], o: &mut [T]) {
    for (oy, orow) in o.chunks_exact_mut(g.wo).enumerate() {
        for ky in 0..g.k {
            let Some(iy) = g.row(oy, ky) else { continue };
            let xrow = &xp[iy * g.w..(iy + 1) * g.w];
            for (kx, t) in taps.iter().enumerate() {
                let wv = kp[ky * g.k + kx];
                for (ov, xv) in orow[t.lo..t.hi].iter_mut().zip(&xrow[t.start..t.start + (t.hi - t.lo)]) {
                    *ov += wv * *xv;
                }
            }
        }
    }
}

fn grad_input<T: Float>(g: &Geometry, grad: &[T], kernel: &[T]) -> Vec<T> {
    let (plane_in, plane_out, kk) = (g.h * g.w, g.ho * g.wo, g.k * g.k);
    let taps = g.taps();
    let transposed = g.transposed().filter(|t| t.padded_len() <= SMALL_PLANE);
    // Each channel's kernel turned by 180°, as the transposed convolution reads it.
    let flipped: Vec<T> = match transposed {
        Some(_) => kernel.chunks_exact(kk).flat_map(|c| c.iter().rev().copied()).collect(),
        None => Vec::new(),
    };
    // SAFETY: each task zeroes its plane (or, at stride > 1, its split scratch plane, which it
    // then merges over all of its plane) before accumulating.
    let mut gx = unsafe { output_buffer::<T>(g.n * g.c * plane_in) };
    gx.par_chunks_mut(plane_in).enumerate().for_each_init(
        || if g.stride > 1 { vec![T::default(); plane_in] } else { Vec::new() },
        |split, (p, gxp)| {
            let gp = &grad[p * plane_out..(p + 1) * plane_out];
            let kp = &kernel[(p % g.c) * kk..(p % g.c + 1) * kk];
            simd(
                #[inline(always)]
                || {
                    if g.stride > 1 {
                        split.fill(T::default());
                        grad_input_plane(g, &taps, gp, kp, split);
                        merge_rows(g, split, gxp);
                    } else if let Some(t) = transposed {
                        let c = p % g.c;
                        forward_plane_padded(&t, gp, &flipped[c * kk..(c + 1) * kk], gxp, split);
                    } else {
                        gxp.fill(T::default());
                        grad_input_plane(g, &taps, gp, kp, gxp)
                    }
                },
            )
        },
    );
    gx
}

/// Accumulates into `gxp`, whose rows are split by phase when the stride is over 1.
#[inline(always)]
fn grad_input_plane<T: Float>(g: &Geometry, taps: &[Tap], gp: &[T], kp: &[T], gxp: &mut [T]) {
    for (oy, grow) in gp.chunks_exact(g.wo).enumerate() {
        for ky in 0..g.k {
            let Some(iy) = g.row(oy, ky) else { continue };
            let xrow = &mut gxp[iy * g.w..(iy + 1) * g.w];
            for (kx, t) in taps.iter().enumerate() {
                let wv = kp[ky * g.k + kx];
                for (xv, gv) in xrow[t.start..t.start + (t.hi - t.lo)].iter_mut().zip(&grow[t.lo..t.hi]) {
                    *xv += wv * *gv;
                }
            }
        }
    }
}

fn grad_kernel<T: Float>(g: &Geometry, x: &[T], grad: &[T]) -> Vec<T> {
    let kk = g.k * g.k;
    let mut gw = vec![T::default(); g.c * kk];
    let padded = g.stride == 1 && g.padded_len() <= SMALL_PLANE;
    gw.par_chunks_mut(kk).enumerate().for_each(|(c, gwc)| {
        simd(
            #[inline(always)]
            || {
                if padded {
                    grad_kernel_channel_padded(g, x, grad, c, gwc)
                } else {
                    grad_kernel_channel(g, x, grad, c, gwc)
                }
            },
        )
    });
    gw
}

/// One channel's kernel gradient at stride 1 on a small plane (the forward pass's
/// [`forward_plane_padded`] sizes): with the input zero-padded and the output gradient's rows
/// laid out as wide as the padded input (zeros past its width), each tap's sum over a plane is
/// one dot product of two contiguous runs, in lane-wise partial sums kept across the batch. Row
/// by row, the late stages' 7-14 pixel rows were runs too short to vectorise: this gradient took
/// 2.6 times the forward pass's time.
#[inline(always)]
fn grad_kernel_channel_padded<T: Float>(g: &Geometry, x: &[T], grad: &[T], c: usize, gwc: &mut [T]) {
    let (plane_in, plane_out) = (g.h * g.w, g.ho * g.wo);
    let wp = g.w + g.pad.left + g.pad.right;
    let padded = g.padded_len();
    let run = (g.ho - 1) * wp + g.wo;
    let mut input = vec![T::default(); padded];
    let mut dy = vec![T::default(); run];
    let mut partial = vec![[T::default(); LANES]; g.k * g.k];
    for n in 0..g.n {
        let p = n * g.c + c;
        for (y, row) in x[p * plane_in..(p + 1) * plane_in].chunks_exact(g.w).enumerate() {
            let at = (y + g.pad.top) * wp + g.pad.left;
            input[at..at + g.w].copy_from_slice(row);
        }
        for (oy, row) in grad[p * plane_out..(p + 1) * plane_out].chunks_exact(g.wo).enumerate() {
            dy[oy * wp..oy * wp + g.wo].copy_from_slice(row);
        }
        for (tap, acc) in partial.iter_mut().enumerate() {
            let at = (tap / g.k) * wp + tap % g.k;
            let xs = &input[at..at + run];
            for (dc, xc) in dy.chunks_exact(LANES).zip(xs.chunks_exact(LANES)) {
                for l in 0..LANES {
                    acc[l] += dc[l] * xc[l];
                }
            }
            let whole = run / LANES * LANES;
            for (l, (&d, &xv)) in dy[whole..].iter().zip(&xs[whole..]).enumerate() {
                acc[l] += d * xv;
            }
        }
    }
    for (gv, acc) in gwc.iter_mut().zip(&partial) {
        *gv += lane_sum(acc);
    }
}

/// One channel's k×k kernel gradient, summed over the batch. Each tap's products accumulate
/// elementwise into a row of partial sums (all k² rows stay in L1), summed once at the end: no
/// horizontal reduction per image row, and the loops vectorise like the forward pass's.
#[inline(always)]
fn grad_kernel_channel<T: Float>(g: &Geometry, x: &[T], grad: &[T], c: usize, gwc: &mut [T]) {
    let (plane_in, plane_out) = (g.h * g.w, g.ho * g.wo);
    let taps = g.taps();
    let mut partial = vec![T::default(); g.k * g.k * g.wo];
    let mut split = if g.stride > 1 { vec![T::default(); plane_in] } else { Vec::new() };
    for n in 0..g.n {
        let p = n * g.c + c;
        let mut xp = &x[p * plane_in..(p + 1) * plane_in];
        if g.stride > 1 {
            split_rows(g, xp, &mut split);
            xp = &split;
        }
        let gp = &grad[p * plane_out..(p + 1) * plane_out];
        for (oy, grow) in gp.chunks_exact(g.wo).enumerate() {
            for ky in 0..g.k {
                let Some(iy) = g.row(oy, ky) else { continue };
                let xrow = &xp[iy * g.w..(iy + 1) * g.w];
                for (kx, t) in taps.iter().enumerate() {
                    let acc = &mut partial[(ky * g.k + kx) * g.wo..(ky * g.k + kx + 1) * g.wo];
                    for ((a, gv), xv) in acc[t.lo..t.hi].iter_mut().zip(&grow[t.lo..t.hi]).zip(&xrow[t.start..t.start + (t.hi - t.lo)]) {
                        *a += *gv * *xv;
                    }
                }
            }
        }
    }
    for (gv, row) in gwc.iter_mut().zip(partial.chunks_exact(g.wo)) {
        *gv += lane_sum(row);
    }
}

impl Geometry {
    /// The kernels' `struct Geometry`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn device(&self) -> DepthwiseParams {
        DepthwiseParams {
            n: self.n as i32,
            c: self.c as i32,
            h: self.h as i32,
            w: self.w as i32,
            k: self.k as i32,
            stride: self.stride as i32,
            top: self.pad.top as i32,
            left: self.pad.left as i32,
            ho: self.ho as i32,
            wo: self.wo as i32,
        }
    }
}

pub(crate) struct Forward {
    stride: usize,
    pad: Padding,
}

impl Kernel<2> for Forward {
    const NAME: &'static str = "depthwise-conv2d";
    const PROFILE: &'static str = "op/depthwise";
    type Geometry = Geometry;

    fn geometry(&self, [x, k]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        let g = Geometry::new(x.dims(), k.dims(), self.stride, self.pad)?;
        Ok((g, Shape::from((g.n, g.c, g.ho, g.wo))))
    }

    fn cpu<T: Float>(&self, g: &Self::Geometry, [x, k]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(forward(g, x, k))
    }

    fn gpu(&self, g: &Self::Geometry, elem: usize, _limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(Some(GpuPlan::new(Program::depthwise(Pass::Forward, g.device(), elem))))
    }

    fn backward(&self, [x, kernel]: [&Tensor; 2], _out: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let (gx, gk) = backward(x, kernel, self.stride, self.pad, grad)?;
        Ok([Some(gx), Some(gk)])
    }
}

/// The forward pass as a graph leaf (no backward recorded): for ops that differentiate through
/// it themselves. `x` and `kernel` are contiguous f32 or f64 of one dtype.
pub(crate) fn forward_detached(x: &Tensor, kernel: &Tensor, stride: usize, pad: Padding) -> Result<Tensor> {
    x.apply_op2_no_bwd(kernel, &Op(Forward { stride, pad }))
}

/// The gradients of the input and of the kernel, given the output's.
pub(crate) fn backward(x: &Tensor, kernel: &Tensor, stride: usize, pad: Padding, grad: &Tensor) -> Result<(Tensor, Tensor)> {
    let grad = grad.contiguous()?;
    let gx = grad.apply_op2_no_bwd(kernel, &Op(GradInput { stride, pad, input: x.dims().to_vec() }))?;
    let gk = x.apply_op2_no_bwd(&grad, &Op(GradKernel { stride, pad, kernel: kernel.dims().to_vec() }))?;
    Ok((gx, gk))
}

/// The forward geometry, checking that the incoming gradient has the forward output's shape.
fn backward_geometry(x: &[usize], kernel: &[usize], grad: &[usize], stride: usize, pad: Padding) -> Result<Geometry> {
    let g = Geometry::new(x, kernel, stride, pad)?;
    if grad != [g.n, g.c, g.ho, g.wo] {
        candle_core::bail!("depthwise conv backward: gradient {grad:?} does not match output {:?}", [g.n, g.c, g.ho, g.wo]);
    }
    Ok(g)
}

/// The input's gradient, from operands `[dy, kernel]`.
struct GradInput {
    stride: usize,
    pad: Padding,
    input: Vec<usize>,
}

impl Kernel<2> for GradInput {
    const NAME: &'static str = "depthwise-conv2d-grad-input";
    const PROFILE: &'static str = "op/depthwise-grad";
    type Geometry = Geometry;

    fn geometry(&self, [grad, kernel]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        let g = backward_geometry(&self.input, kernel.dims(), grad.dims(), self.stride, self.pad)?;
        Ok((g, Shape::from(self.input.clone())))
    }

    fn cpu<T: Float>(&self, g: &Self::Geometry, [gr, k]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(grad_input(g, gr, k))
    }

    fn gpu(&self, g: &Self::Geometry, elem: usize, _limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(Some(GpuPlan::new(Program::depthwise(Pass::GradInput, g.device(), elem))))
    }
}

/// The kernel's gradient, from operands `[x, dy]`.
struct GradKernel {
    stride: usize,
    pad: Padding,
    kernel: Vec<usize>,
}

impl Kernel<2> for GradKernel {
    const NAME: &'static str = "depthwise-conv2d-grad-kernel";
    const PROFILE: &'static str = "op/depthwise-grad";
    type Geometry = Geometry;

    fn geometry(&self, [x, grad]: [&Layout; 2]) -> Result<(Self::Geometry, Shape)> {
        let g = backward_geometry(x.dims(), &self.kernel, grad.dims(), self.stride, self.pad)?;
        Ok((g, Shape::from(self.kernel.clone())))
    }

    fn cpu<T: Float>(&self, g: &Self::Geometry, [x, gr]: [&[T]; 2]) -> Result<Vec<T>> {
        Ok(grad_kernel(g, x, gr))
    }

    fn gpu(&self, g: &Self::Geometry, elem: usize, _limits: &Limits) -> Result<Option<GpuPlan>> {
        Ok(Some(GpuPlan::new(Program::depthwise(Pass::GradKernel, g.device(), elem))))
    }
}

/// Depthwise convolution of `x` (`[N, C, H, W]`) with `kernel` (`[C, 1, k, k]`, PyTorch's grouped
/// layout), explicit zero padding per side and a stride. Differentiable in both arguments.
pub fn depthwise_conv2d(x: &Tensor, kernel: &Tensor, stride: usize, pad: Padding) -> Result<Tensor> {
    let dtype = x.dtype();
    if dtype != DType::F32 && dtype != DType::F64 {
        // Lower precisions compute in f32.
        let y = depthwise_conv2d(&x.to_dtype(DType::F32)?, &kernel.to_dtype(DType::F32)?, stride, pad)?;
        return y.to_dtype(dtype);
    }
    if x.device().is_cuda() && crate::ops::gpu_kernels() == crate::ops::GpuKernels::Candle {
        return composed(x, kernel, stride, pad);
    }
    x.contiguous()?.apply_op2(&kernel.contiguous()?, Op(Forward { stride, pad }))
}

/// The same as candle's grouped convolution after explicit zero padding (cropped so the stride
/// tiles it: candle's backward needs that): what GPUs run with `ALIGN_KERNELS=candle`, and
/// `efficientnet`'s `DepthwiseImpl::Candle`.
pub fn composed(x: &Tensor, w: &Tensor, stride: usize, pad: Padding) -> Result<Tensor> {
    let (_, c, h, wd) = x.dims4()?;
    let k = w.dim(2)?;
    let x = x.pad_with_zeros(2, pad.top, pad.bottom)?.pad_with_zeros(3, pad.left, pad.right)?;
    let (hp, wp) = (h + pad.top + pad.bottom, wd + pad.left + pad.right);
    let x = x.narrow(2, 0, (hp - k) / stride * stride + k)?.narrow(3, 0, (wp - k) / stride * stride + k)?;
    x.conv2d(w, 0, stride, 1, c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::max_diff;
    use candle_core::{Device, Var};

    /// Stride 1 takes the padded-plane path below `SMALL_PLANE` values and the row path above
    /// (the 46×45 case).
    pub(crate) const CASES: [(usize, usize, usize, usize, usize, usize, Padding); 9] = [
        // n, c, h, w, k, stride, padding
        (2, 3, 7, 9, 3, 1, Padding { top: 1, bottom: 1, left: 1, right: 1 }),
        (1, 4, 8, 8, 3, 2, Padding { top: 0, bottom: 1, left: 0, right: 1 }),
        (2, 2, 9, 7, 5, 2, Padding { top: 1, bottom: 2, left: 1, right: 2 }),
        (1, 5, 6, 6, 5, 1, Padding { top: 2, bottom: 2, left: 2, right: 2 }),
        (3, 2, 11, 10, 3, 2, Padding { top: 1, bottom: 1, left: 1, right: 1 }),
        (1, 1, 4, 5, 3, 1, Padding { top: 0, bottom: 0, left: 0, right: 0 }),
        (2, 2, 10, 11, 3, 3, Padding { top: 1, bottom: 1, left: 1, right: 1 }),
        (1, 3, 5, 6, 3, 1, Padding { top: 0, bottom: 2, left: 2, right: 0 }),
        (1, 2, 46, 45, 3, 1, Padding { top: 1, bottom: 1, left: 1, right: 1 }),
    ];

    /// The convolution with the BatchNorm folded in against the plain convolution followed by the
    /// shift and SiLU, and the planes' means, on every case (both strides, uneven padding).
    #[test]
    fn the_folded_convolution_is_the_convolution_then_the_shift_and_silu() {
        let dev = Device::Cpu;
        for (i, &(n, c, h, w, k, stride, pad)) in CASES.iter().enumerate() {
            let seed = 190 + 3 * i as u64;
            let x = crate::util::rng::randn(seed, 0.0, 1.0, n * c * h * w, DType::F64, &dev).unwrap().to_vec1::<f64>().unwrap();
            let kernel = crate::util::rng::randn(seed + 1, 0.0, 0.5, c * k * k, DType::F64, &dev).unwrap().to_vec1::<f64>().unwrap();
            let shift = crate::util::rng::randn(seed + 2, 0.0, 1.0, c, DType::F64, &dev).unwrap().to_vec1::<f64>().unwrap();
            let g = Geometry::new(&[n, c, h, w], &[c, 1, k, k], stride, pad).unwrap();
            let plain = forward(&g, &x, &kernel);
            let (ours, means, [ho, wo]) = forward_folded(&x, [n, c, h, w], &kernel, (k, stride, pad), &shift).unwrap();
            assert_eq!((ho, wo), (g.ho, g.wo));
            let plane = ho * wo;
            for (p, (o, z)) in ours.chunks(plane).zip(plain.chunks(plane)).enumerate() {
                let want: Vec<f64> = z.iter().map(|&z| (z + shift[p % c]) / (1.0 + (-(z + shift[p % c])).exp())).collect();
                for (a, b) in o.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-12, "case {i} plane {p}: {a} vs {b}");
                }
                let mean = want.iter().sum::<f64>() / plane as f64;
                assert!((means[p] - mean).abs() < 1e-12, "case {i} plane {p}: mean {} vs {mean}", means[p]);
            }
        }
        let err = forward_folded(&[0.0f64; 12], [1, 3, 2, 2], &[0.0; 27], (3, 1, Padding::same(3)), &[0.0; 2]).unwrap_err();
        assert!(err.to_string().contains("2 shifts"), "{err}");
    }
    #[test]
    fn forward_and_backward_match_candles_grouped_convolution() {
        let dev = Device::Cpu;
        for (n, c, h, w, k, stride, pad) in CASES {
            let x =
                Var::from_tensor(&crate::util::rng::randn(112, 0.0, 1.0, (n, c, h, w), candle_core::DType::F32, &dev).unwrap()).unwrap();
            let kern =
                Var::from_tensor(&crate::util::rng::randn(113, 0.0, 1.0, (c, 1, k, k), candle_core::DType::F32, &dev).unwrap()).unwrap();
            let ours = depthwise_conv2d(x.as_tensor(), kern.as_tensor(), stride, pad).unwrap();
            let theirs = composed(x.as_tensor(), kern.as_tensor(), stride, pad).unwrap();
            assert_eq!(ours.dims(), theirs.dims());
            assert!(max_diff(&ours, &theirs) < 1e-5, "forward {:?}", (n, c, h, w, k, stride, pad));
            // A non-uniform upstream gradient.
            let up = crate::util::rng::randn(114, 0.0, 1.0, ours.dims(), candle_core::DType::F32, &dev).unwrap();
            let g1 = (&ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (&theirs * &up).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&x, &kern] {
                let (a, b) = (g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap());
                // Relative: a kernel's gradient is a sum over its whole plane (2,000 terms in f32).
                let d = max_diff(a, b) / crate::ops::testing::max_abs(b).max(1.0);
                assert!(d < 1e-5, "backward {:?}: {d}", (n, c, h, w, k, stride, pad));
            }
        }
    }

    #[test]
    fn gradients_match_central_finite_differences_in_f64() {
        let dev = Device::Cpu;
        let mut rng = crate::util::rng::Rng::new(2);
        for (n, c, h, w, k, stride, pad) in CASES {
            let xv: Vec<f64> = (0..n * c * h * w).map(|_| rng.normal()).collect();
            let kv: Vec<f64> = (0..c * k * k).map(|_| rng.normal()).collect();
            let x = Var::from_tensor(&Tensor::from_vec(xv.clone(), (n, c, h, w), &dev).unwrap()).unwrap();
            let kern = Var::from_tensor(&Tensor::from_vec(kv.clone(), (c, 1, k, k), &dev).unwrap()).unwrap();
            let y = depthwise_conv2d(x.as_tensor(), kern.as_tensor(), stride, pad).unwrap();
            let up = crate::util::rng::randn(115, 0.0, 1.0, y.dims(), candle_core::DType::F64, &dev).unwrap();
            let loss = |x: &Tensor, k: &Tensor| {
                (depthwise_conv2d(x, k, stride, pad).unwrap() * &up).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
            };
            let grads = (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let gx = grads.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            let gk = grads.get(kern.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            let h_ = 1e-6;
            let kt = Tensor::from_vec(kv.clone(), (c, 1, k, k), &dev).unwrap();
            let xt = Tensor::from_vec(xv.clone(), (n, c, h, w), &dev).unwrap();
            for _ in 0..5 {
                let i = rng.below(xv.len());
                let (mut p, mut m) = (xv.clone(), xv.clone());
                p[i] += h_;
                m[i] -= h_;
                let fd = (loss(&Tensor::from_vec(p, (n, c, h, w), &dev).unwrap(), &kt)
                    - loss(&Tensor::from_vec(m, (n, c, h, w), &dev).unwrap(), &kt))
                    / (2.0 * h_);
                assert!((fd - gx[i]).abs() < 1e-6, "d/dx[{i}] {fd} vs {}", gx[i]);
                let j = rng.below(kv.len());
                let (mut p, mut m) = (kv.clone(), kv.clone());
                p[j] += h_;
                m[j] -= h_;
                let fd = (loss(&xt, &Tensor::from_vec(p, (c, 1, k, k), &dev).unwrap())
                    - loss(&xt, &Tensor::from_vec(m, (c, 1, k, k), &dev).unwrap()))
                    / (2.0 * h_);
                assert!((fd - gk[j]).abs() < 1e-6, "d/dk[{j}] {fd} vs {}", gk[j]);
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_errors() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((1, 2, 4, 4), DType::F32, &dev).unwrap();
        assert!(depthwise_conv2d(&x, &Tensor::zeros((3, 1, 3, 3), DType::F32, &dev).unwrap(), 1, Padding::same(3)).is_err());
        assert!(depthwise_conv2d(&x, &Tensor::zeros((2, 1, 7, 7), DType::F32, &dev).unwrap(), 1, Padding::same(1)).is_err());
    }
}

#[cfg(test)]
mod gpu_tests {
    use super::*;
    use crate::ops::gpu::host::{assert_close, to_f32, values, Pod};
    use crate::ops::gpu::run_on_host;

    /// The three passes of `kernels/depthwise.cu` in the host emulation, each as the ops plan it,
    /// against the CPU kernels.
    fn check<T: Float + Pod>(g: &Geometry, x: &[T], k: &[T], dy: &[T], tol: f64, what: &str) {
        let elem = std::mem::size_of::<T>();
        let run = |pass, a: &[T], b: &[T]| run_on_host(&Program::depthwise(pass, g.device(), elem), &[a, b], None);
        assert_close(&run(Pass::Forward, x, k), &forward(g, x, k), tol, &format!("{what} forward"));
        assert_close(&run(Pass::GradInput, dy, k), &grad_input(g, dy, k), tol, &format!("{what} input gradient"));
        assert_close(&run(Pass::GradKernel, x, dy), &grad_kernel(g, x, dy), tol, &format!("{what} kernel gradient"));
    }

    #[test]
    fn the_gpu_kernels_match_the_cpu_kernels_in_the_host_emulation() {
        for (n, c, h, w, k, stride, pad) in super::tests::CASES {
            let g = Geometry::new(&[n, c, h, w], &[c, 1, k, k], stride, pad).unwrap();
            let x = values(210, 0.0, 1.0, n * c * h * w);
            let kernel = values(211, 0.0, 0.5, c * k * k);
            let dy = values(212, 0.0, 1.0, n * c * g.ho * g.wo);
            let what = format!("{k}x{k} stride {stride}");
            check(&g, &x, &kernel, &dy, 1e-12, &what);
            check(&g, &to_f32(&x), &to_f32(&kernel), &to_f32(&dy), 1e-5, &what);
        }
    }
}
