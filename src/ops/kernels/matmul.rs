//! Strided matrix products through gemm (candle's own CPU matmul kernel), for ops that read
//! operands transposed or as column slices in place, accumulate into an existing buffer, or run
//! many small products as parallel tasks.

use super::bias_act::Activation;
use super::operands::{Dims, Epilogue, Mat};
use crate::ops::Float;

/// A destination for products that several tasks write at once, each into its own rows or
/// columns (attention heads write their column slices of one `[batch, len, width]` buffer).
pub(crate) struct SharedDst<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: tasks write disjoint elements (the callers' contract, see `gemm_shared`).
unsafe impl<T: Send> Send for SharedDst<T> {}
unsafe impl<T: Send> Sync for SharedDst<T> {}

impl<T> SharedDst<T> {
    pub fn new(buf: &mut [T]) -> Self {
        SharedDst { ptr: buf.as_mut_ptr(), len: buf.len() }
    }

    /// `len` elements from `offset`, for a task to finish what its product wrote.
    ///
    /// # Safety
    /// No other task may touch these elements while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: usize, len: usize) -> &mut [T] {
        assert!(offset + len <= self.len, "slice outside the shared destination");
        std::slice::from_raw_parts_mut(self.ptr.add(offset), len)
    }
}

/// `dst[offset + i·dst_rs + j] = (lhs·rhs)[i, j]`, or `+=` with `accumulate`, on `threads`.
///
/// # Safety
/// `dst` must be valid for every element the strides reach (checked against its length here)
/// and no other thread may touch those elements during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_raw<T: Float>(
    dst: (*mut T, usize),
    offset: usize,
    dst_rs: usize,
    d: Dims,
    lhs: Mat<T>,
    rhs: Mat<T>,
    accumulate: bool,
    threads: usize,
) {
    assert!(lhs.fits(d.m, d.k) && rhs.fits(d.k, d.n), "matrix operand outside its buffer");
    if d.m == 0 || d.n == 0 {
        return;
    }
    assert!(offset + (d.m - 1) * dst_rs + d.n <= dst.1, "matrix product outside its destination");
    if d.k == 0 {
        // An empty sum: the product is zero. Written here because callers' destinations may be
        // unfilled buffers (`output_buffer`) and gemm need not touch them when k = 0.
        if !accumulate {
            for i in 0..d.m {
                std::slice::from_raw_parts_mut(dst.0.add(offset + i * dst_rs), d.n).fill(T::default());
            }
        }
        return;
    }
    if super::bf16_gemm::wanted(d) {
        if let (Some(dst32), Some(lhs32), Some(rhs32)) = (as_f32_ptr(dst.0), as_f32(lhs), as_f32(rhs)) {
            // `wanted` holds only where the instructions are (`set_forward_bf16`,
            // `with_bf16_products`).
            return super::bf16_gemm::product(dst32, offset, dst_rs, d, lhs32, rhs32, accumulate, threads, None);
        }
    }
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // gemm computes dst := α·dst + β·lhs·rhs, reading dst only when asked to.
    gemm::gemm(
        d.m,
        d.n,
        d.k,
        dst.0.add(offset),
        1,
        dst_rs as isize,
        accumulate,
        lhs.data.as_ptr().add(lhs.offset),
        lhs.col_stride as isize,
        lhs.row_stride as isize,
        rhs.data.as_ptr().add(rhs.offset),
        rhs.col_stride as isize,
        rhs.row_stride as isize,
        T::from(1.0),
        T::from(1.0),
        false,
        false,
        false,
        parallelism,
    )
}

/// `mat` as f32, when that is its type.
fn as_f32<T: 'static>(mat: Mat<T>) -> Option<Mat<f32>> {
    if std::any::TypeId::of::<T>() != std::any::TypeId::of::<f32>() {
        return None;
    }
    // SAFETY: T is f32.
    let data = unsafe { std::slice::from_raw_parts(mat.data.as_ptr() as *const f32, mat.data.len()) };
    Some(Mat { data, offset: mat.offset, row_stride: mat.row_stride, col_stride: mat.col_stride })
}

fn as_f32_ptr<T: 'static>(p: *mut T) -> Option<*mut f32> {
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>()).then_some(p as *mut f32)
}

/// `dst (row-major, rows dst_rs apart) = lhs·rhs`, or `+=` with `accumulate`, split across the
/// thread pool by gemm.
pub(crate) fn gemm_into<T: Float>(dst: &mut [T], dst_rs: usize, d: Dims, lhs: Mat<T>, rhs: Mat<T>, accumulate: bool) {
    // SAFETY: `dst` is borrowed exclusively; gemm_raw checks the bounds.
    unsafe { gemm_raw((dst.as_mut_ptr(), dst.len()), 0, dst_rs, d, lhs, rhs, accumulate, rayon::current_num_threads()) }
}

/// `dst = x·Wᵀ` (or `+=` with `accumulate`) for a linear layer's input `x` and weight `W`
/// (`w` its transposed view): [`gemm_into`], except that under `--precision int8` the product
/// takes int8 operands (`int8_gemm`).
pub(crate) fn weight_product_into<T: Float>(dst: &mut [T], dst_rs: usize, d: Dims, x: Mat<T>, w: Mat<T>, accumulate: bool) {
    if super::int8_gemm::wanted(d) && x.col_stride == 1 && w.row_stride == 1 && d.m > 0 && d.n > 0 {
        if let (Some(dst32), Some(x32), Some(w32)) = (as_f32_ptr(dst.as_mut_ptr()), as_f32(x), as_f32(w)) {
            assert!(x.fits(d.m, d.k) && w.fits(d.k, d.n), "matrix operand outside its buffer");
            assert!((d.m - 1) * dst_rs + d.n <= dst.len(), "matrix product outside its destination");
            // SAFETY: `wanted` holds only where the instructions are (`set_forward_int8`); the
            // bounds are checked above and `dst` is borrowed exclusively.
            return unsafe { super::int8_gemm::product(dst32, 0, dst_rs, d, x32, w32, accumulate, rayon::current_num_threads(), None) };
        }
    }
    gemm_into(dst, dst_rs, d, x, w, accumulate)
}

/// `dst = act(x·Wᵀ + bias (+ residual))` for a linear layer's input `x` `[m, k]` and weight `W`
/// `[n, k]`, both row-major, when the product goes through int8 or bf16, whose tiles apply the
/// rest as they are stored (`operands::Epilogue`). Returns false, with `dst` untouched, where the
/// product would go through gemm: the caller composes the rest.
pub(crate) fn fused_linear<T: Float>(
    dst: &mut [T],
    d: Dims,
    x: &[T],
    w: &[T],
    bias: &[T],
    residual: Option<&[T]>,
    act: Activation,
) -> bool {
    if d.m == 0 || d.n == 0 || d.k == 0 {
        return false;
    }
    let (Some(x), Some(w), Some(bias)) = (slice_f32(x), slice_f32(w), slice_f32(bias)) else { return false };
    let residual = match residual.map(slice_f32) {
        Some(None) => return false,
        r => r.flatten(),
    };
    let Some(dst) = as_f32_ptr(dst.as_mut_ptr()).map(|p| (p, dst.len())) else { return false };
    assert!(x.len() >= d.m * d.k && w.len() >= d.n * d.k && bias.len() >= d.n, "linear layer operand too short");
    assert!(dst.1 >= d.m * d.n && residual.is_none_or(|r| r.len() >= d.m * d.n), "linear layer output too short");
    let (x, w) = (Mat::rows(x, 0, d.k), Mat::transposed(w, 0, d.k));
    let epilogue = Some(Epilogue { bias: Some(bias), residual, act });
    let threads = rayon::current_num_threads();
    // SAFETY: each path runs only where its instructions are (`wanted`); the bounds are checked
    // above and `dst` is borrowed exclusively.
    unsafe {
        if super::int8_gemm::wanted(d) {
            super::int8_gemm::product(dst.0, 0, d.n, d, x, w, false, threads, epilogue);
        } else if super::bf16_gemm::wanted(d) {
            super::bf16_gemm::product(dst.0, 0, d.n, d, x, w, false, threads, epilogue);
        } else {
            return false;
        }
    }
    true
}

/// `s` as f32, when that is its type.
pub(crate) fn slice_f32<T: 'static>(s: &[T]) -> Option<&[f32]> {
    // SAFETY: T is f32 where this returns Some.
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>())
        .then(|| unsafe { std::slice::from_raw_parts(s.as_ptr() as *const f32, s.len()) })
}

/// `dst = lhs·rhs` (or `+=` with `accumulate`) on the calling thread, for products that are
/// themselves parallel tasks.
pub(crate) fn gemm_serial<T: Float>(dst: &mut [T], dst_rs: usize, d: Dims, lhs: Mat<T>, rhs: Mat<T>, accumulate: bool) {
    // SAFETY: as in `gemm_into`.
    unsafe { gemm_raw((dst.as_mut_ptr(), dst.len()), 0, dst_rs, d, lhs, rhs, accumulate, 1) }
}

/// One task's product into a shared destination, on the calling thread (the tasks themselves
/// are the parallelism).
///
/// # Safety
/// No two concurrent calls may write the same element of `dst`.
pub(crate) unsafe fn gemm_shared<T: Float>(dst: &SharedDst<T>, offset: usize, dst_rs: usize, d: Dims, lhs: Mat<T>, rhs: Mat<T>) {
    gemm_raw((dst.ptr, dst.len), offset, dst_rs, d, lhs, rhs, false, 1)
}
