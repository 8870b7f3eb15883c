//! Shapes shared by the per-channel ops on NCHW tensors (BatchNorm, moments, channel scaling,
//! spatial means, stochastic depth).
//!
//! Composed from candle primitives these ops take several full-size temporaries each, and their
//! backward passes reduce broadcast gradients through candle's strided slow path; on
//! EfficientNet-B0 that made the backward pass 14× the forward (`align bench model --profile`). Each
//! op is one pass over the data, with its composition beside it as the fallback (bf16 on a GPU,
//! devices without kernels) and the tests' reference.

use candle_core::{Layout, Result, Tensor};

pub(crate) fn nchw(l: &Layout) -> Result<(usize, usize, usize)> {
    match l.dims() {
        [n, c, h, w] => Ok((*n, *c, h * w)),
        d => candle_core::bail!("expected an NCHW tensor, got {d:?}"),
    }
}

/// `(n, c, h·w)` of NCHW `l1` and a second operand `l2` of the same shape.
pub(crate) fn nchw_pair(l1: &Layout, l2: &Layout, what: &str) -> Result<(usize, usize, usize)> {
    let dims = nchw(l1)?;
    if l2.dims() != l1.dims() {
        candle_core::bail!("{what}: operands of shapes {:?} and {:?}", l1.dims(), l2.dims());
    }
    Ok(dims)
}

/// `(n, c, h·w)` of NCHW `l1` and a second operand `l2` with one value per plane (`[N, C]`).
pub(crate) fn nchw_planes(l1: &Layout, l2: &Layout, what: &str) -> Result<(usize, usize, usize)> {
    let dims = nchw(l1)?;
    if l2.shape().elem_count() != dims.0 * dims.1 {
        candle_core::bail!("{what}: {:?} is not one value per plane of {:?}", l2.dims(), l1.dims());
    }
    Ok(dims)
}

/// Checks that each of `dims` is one value per channel.
pub(crate) fn per_channel(c: usize, dims: &[&[usize]], what: &str) -> Result<()> {
    if let Some(d) = dims.iter().find(|d| **d != [c]) {
        candle_core::bail!("{what}: {d:?} for {c} channels");
    }
    Ok(())
}

/// Per-plane pairs of sums (planes in NCHW order) added up per channel.
pub(crate) fn channel_totals(plane_sums: Vec<[f64; 2]>, c: usize) -> Vec<[f64; 2]> {
    let mut sums = vec![[0.0f64; 2]; c];
    for (p, [a, b]) in plane_sums.into_iter().enumerate() {
        sums[p % c][0] += a;
        sums[p % c][1] += b;
    }
    sums
}

/// Mean over N, H and W, keeping `[1, C, 1, 1]`.
pub(crate) fn per_channel_mean(x: &Tensor) -> Result<Tensor> {
    x.mean_keepdim(3)?.mean_keepdim(2)?.mean_keepdim(0)
}
