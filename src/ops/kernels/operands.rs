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

/// A destination that a product's tiles write at once, each its own elements.
#[derive(Clone, Copy)]
pub(crate) struct TileDst(pub *mut f32);
// SAFETY: tiles write disjoint elements (the products' contract).
unsafe impl Send for TileDst {}
unsafe impl Sync for TileDst {}

impl TileDst {
    /// The pointer, through the whole (Send) struct: a closure naming the field would capture
    /// the bare pointer.
    pub fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// Runs `tile(panel, row_tile)` for each of a product's `row_tiles` × `panels` tiles as one
/// parallel loop over `threads` (or on the calling thread): blocks of `per_block` row tiles in
/// order, panel-major within a block, so that consecutive tasks share a right-hand panel while it
/// is in cache and a block's rows stay in cache across panels. One loop, not one per block: a
/// barrier per block made a thread that the OS had paused (another process on its core) stall
/// the others once per block.
pub(crate) fn for_each_tile(row_tiles: usize, panels: usize, per_block: usize, threads: usize, tile: impl Fn(usize, usize) + Sync) {
    use rayon::prelude::*;
    let task = |t: usize| {
        let (block, local) = (t / (per_block * panels), t % (per_block * panels));
        let tiles = per_block.min(row_tiles - block * per_block);
        tile(local / tiles, block * per_block + local % tiles)
    };
    if threads > 1 {
        (0..row_tiles * panels).into_par_iter().with_min_len(4).for_each(task);
    } else {
        (0..row_tiles * panels).for_each(task);
    }
}
