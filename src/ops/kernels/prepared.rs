//! A linear layer's input made once, in the form its products' kernel reads (bf16 packed rows
//! or int8 quantized rows), by the op that produces it. In a forward-only transformer block the
//! LayerNorm's output feeds three projections (or the MLP's first layer) and the first MLP
//! layer's output feeds the second; made as f32, each would be written, read back and packed or
//! quantized by every product that reads it. Here it is made packed (bf16: the LayerNorm's rows
//! and the first MLP layer's tiles as they are stored) or quantized once (int8: the LayerNorm's
//! rows), into the numbers the products would have made from the f32 copy, so the sums are the
//! same bit for bit.

use super::bf16_gemm::{self, PackedRows};
use super::bias_act::Activation;
use super::int8_gemm::{self, QuantizedRows};
use super::operands::{Dims, Epilogue, Mat};
use crate::ops::output_buffer;

/// The kernel that runs a set of products.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Route {
    Bf16,
    Int8,
}

/// The kernel that every product of these shapes goes through, where it is one of the two that
/// read prepared inputs; None where any would be an f32 product or they would not agree.
pub(crate) fn route(products: &[Dims]) -> Option<Route> {
    if products.iter().all(|&d| int8_gemm::wanted(d) && d.k <= int8_gemm::MAX_K) {
        Some(Route::Int8)
    } else if products.iter().all(|&d| !int8_gemm::wanted(d) && bf16_gemm::wanted(d)) {
        Some(Route::Bf16)
    } else {
        None
    }
}

/// A prepared input: `m` rows of `k` numbers.
pub(crate) enum Prepared {
    Bf16(PackedRows),
    Int8(QuantizedRows),
}

impl Prepared {
    /// Rows `0..m` made by `row(i, r)` into an f32 row `r` of `k` numbers, prepared for `route`
    /// as each arrives.
    pub(crate) fn from_rows(route: Route, m: usize, k: usize, row: impl Fn(usize, &mut [f32]) + Sync) -> Prepared {
        match route {
            Route::Bf16 => Prepared::Bf16(PackedRows::from_rows(m, k, row)),
            // SAFETY: `route` says Int8 only where the products are wanted, so the CPU has them.
            Route::Int8 => Prepared::Int8(unsafe { QuantizedRows::from_rows(m, k, row) }),
        }
    }

    fn rows(&self) -> usize {
        match self {
            Prepared::Bf16(p) => p.rows(),
            Prepared::Int8(q) => q.rows(),
        }
    }

    /// A linear layer's weight `w` `[n, k]` (row-major, k this input's width) as its products
    /// read it, and the epilogue adding its bias `b` `[n]` and `residual` `[m, n]`.
    fn layer<'a>(
        &self,
        w: &'a [f32],
        b: &'a [f32],
        residual: Option<&'a [f32]>,
        act: Activation,
        n: usize,
    ) -> (Mat<'a, f32>, Option<Epilogue<'a>>) {
        let k = match self {
            Prepared::Bf16(p) => p.cols(),
            Prepared::Int8(q) => q.cols(),
        };
        let fits = w.len() == n * k && b.len() == n && residual.is_none_or(|r| r.len() == self.rows() * n);
        assert!(fits, "linear layer operands of the wrong sizes for an input {k} wide");
        (Mat::transposed(w, 0, k), Some(Epilogue { bias: Some(b), residual, act }))
    }

    /// `act(x·Wᵀ + b (+ residual))` for this input `x` and `w` `[n, k]`, `b` `[n]`, `residual`
    /// `[m, n]`, each row-major.
    pub(crate) fn linear(&self, w: &[f32], b: &[f32], residual: Option<&[f32]>, act: Activation, n: usize) -> Vec<f32> {
        let (w, epilogue) = self.layer(w, b, residual, act, n);
        // SAFETY: the product writes every element.
        let mut y = unsafe { output_buffer::<f32>(self.rows() * n) };
        let threads = rayon::current_num_threads();
        // SAFETY: each form exists only where its kernel's instructions are; `y` holds the m × n
        // output and is this call's alone.
        unsafe {
            match self {
                Prepared::Bf16(p) => p.product(y.as_mut_ptr(), n, w, n, threads, epilogue),
                Prepared::Int8(q) => q.product(y.as_mut_ptr(), n, w, n, threads, epilogue),
            }
        }
        y
    }

    /// [`Prepared::linear`]'s output (no residual), prepared as the next product's input.
    pub(crate) fn linear_prepared(&self, w: &[f32], b: &[f32], act: Activation, n: usize) -> Prepared {
        let (w, epilogue) = self.layer(w, b, None, act, n);
        let threads = rayon::current_num_threads();
        // SAFETY: each form exists only where its kernel's instructions are.
        unsafe {
            match self {
                Prepared::Bf16(p) => Prepared::Bf16(p.product_packed(w, n, threads, epilogue)),
                // A row's quantization needs its whole range: see `product_quantized`.
                Prepared::Int8(q) => Prepared::Int8(q.product_quantized(w, n, threads, epilogue)),
            }
        }
    }
}
