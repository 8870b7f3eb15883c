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

    /// `act(x·Wᵀ + b (+ residual))` for this input `x` and `w` `[n, k]`, `b` `[n]`, `residual`
    /// `[m, n]`, each row-major.
    pub(crate) fn linear(&self, w: &[f32], b: &[f32], residual: Option<&[f32]>, act: Activation, n: usize) -> Vec<f32> {
        let m = self.rows();
        let k = w.len() / n.max(1);
        assert!(w.len() == n * k && b.len() == n && residual.is_none_or(|r| r.len() == m * n), "linear layer operands of the wrong sizes");
        // SAFETY: the product writes every element.
        let mut y = unsafe { output_buffer::<f32>(m * n) };
        let epilogue = Some(Epilogue { bias: Some(b), residual, act });
        let (w, threads) = (Mat::transposed(w, 0, k), rayon::current_num_threads());
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
        match self {
            Prepared::Bf16(p) => {
                let k = w.len() / n.max(1);
                assert!(w.len() == n * k && b.len() == n, "linear layer operands of the wrong sizes");
                let epilogue = Some(Epilogue { bias: Some(b), residual: None, act });
                // SAFETY: packed rows exist only where the bf16 instructions are.
                Prepared::Bf16(unsafe { p.product_packed(Mat::transposed(w, 0, k), n, rayon::current_num_threads(), epilogue) })
            }
            Prepared::Int8(q) => {
                let k = w.len() / n.max(1);
                assert!(w.len() == n * k && b.len() == n, "linear layer operands of the wrong sizes");
                let epilogue = Some(Epilogue { bias: Some(b), residual: None, act });
                // SAFETY: quantized rows exist only where the int8 instructions are.
                Prepared::Int8(unsafe { q.product_quantized(Mat::transposed(w, 0, k), n, rayon::current_num_threads(), epilogue) })
            }
        }
    }
}
