//! The operands of a matrix product as the product kernels (`matmul`'s gemm calls and
//! `bf16_gemm`'s packed bfloat16 products) read them: a strided view into a slice, and the
//! product's shape.

/// A matrix operand inside a slice: element (i, j) at `offset + i·row_stride + j·col_stride`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub offset: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a, T> Mat<'a, T> {
    /// A row-major matrix starting at `offset`, rows `row_stride` apart.
    pub fn rows(data: &'a [T], offset: usize, row_stride: usize) -> Self {
        Mat { data, offset, row_stride, col_stride: 1 }
    }

    /// The transpose of [`Mat::rows`]`(data, offset, row_stride)`, read in place.
    pub fn transposed(data: &'a [T], offset: usize, row_stride: usize) -> Self {
        Mat { data, offset, row_stride: 1, col_stride: row_stride }
    }

    pub(super) fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || self.offset + (rows - 1) * self.row_stride + (cols - 1) * self.col_stride < self.data.len()
    }
}

/// Product shape: `m×k` times `k×n`.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}
