//! The operands of a matrix product as the product kernels (`matmul`'s gemm calls and
//! `bf16_gemm`'s packed bfloat16 products) read them: a strided view into a slice, and the
//! product's shape.

use super::bias_act::Activation;
use crate::ops::simd;

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

/// Rows of the left operand that a row-group task packs and runs ([`for_each_row_group`]):
/// whole tiles of both kernels (12 rows) and whole groups of a transposed operand's packing (16).
const GROUP_ROWS: usize = 48;

/// One tile of a row group: row tile `t` of the group against panel `panel`, its first row
/// `row0` in the product, `rows` × `cols` of it kept.
#[derive(Clone, Copy)]
pub(crate) struct GroupTile {
    pub t: usize,
    pub panel: usize,
    pub row0: usize,
    pub rows: usize,
    pub cols: usize,
}

/// Runs a product `m` × `n` as tasks of [`GROUP_ROWS`] rows over `threads` (or on the calling
/// thread): each task makes its rows' packed form with `pack(first, rows)` and runs `tile` on
/// each of their `mr` × `nr` tiles against every panel in turn. For products whose right-hand
/// panels all fit a core's cache: the packed rows never leave the core that made them, and no
/// pass over the whole left operand (nor a wait for one) comes before the tiles.
pub(crate) fn for_each_row_group<A>(
    (m, n): (usize, usize),
    (mr, nr): (usize, usize),
    threads: usize,
    pack: impl Fn(usize, usize) -> A + Sync,
    tile: impl Fn(&A, GroupTile) + Sync,
) {
    use rayon::prelude::*;
    let group = |g: usize| {
        let first = g * GROUP_ROWS;
        let rows = GROUP_ROWS.min(m - first);
        let packed = pack(first, rows);
        for panel in 0..n.div_ceil(nr) {
            for t in 0..rows.div_ceil(mr) {
                let row0 = first + t * mr;
                tile(&packed, GroupTile { t, panel, row0, rows: mr.min(first + rows - row0), cols: nr.min(n - panel * nr) });
            }
        }
    };
    let groups = m.div_ceil(GROUP_ROWS);
    if threads > 1 {
        (0..groups).into_par_iter().for_each(group);
    } else {
        (0..groups).for_each(group);
    }
}

#[cfg(test)]
thread_local! {
    static WHOLE_OPERAND_PACKING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether products on this thread may run by row groups: always, except inside
/// [`with_whole_operand_packing`].
pub(crate) fn row_groups_allowed() -> bool {
    #[cfg(test)]
    return !WHOLE_OPERAND_PACKING.with(|w| w.get());
    #[cfg(not(test))]
    true
}

/// `f` with this thread's products packing their whole left operand first even where row
/// groups would run, so that a test can hold the two ways against each other.
#[cfg(test)]
pub(crate) fn with_whole_operand_packing<R>(f: impl FnOnce() -> R) -> R {
    WHOLE_OPERAND_PACKING.with(|w| w.set(true));
    let r = f();
    WHOLE_OPERAND_PACKING.with(|w| w.set(false));
    r
}

/// What a product does to each of its values as its tiles are stored, in place of passes over
/// the whole output afterwards: `act(value + bias[j] + residual[i, j])`. A linear layer's
/// output is written once while its tile is in cache, instead of written by the product, then
/// read and written again for the bias and residual and once more for the activation (each pass
/// as long as a ViT-B/32 MLP's 39 MB hidden layer).
#[derive(Clone, Copy)]
pub(crate) struct Epilogue<'a> {
    /// One value per column.
    pub bias: Option<&'a [f32]>,
    /// The product's shape, rows `n` apart.
    pub residual: Option<&'a [f32]>,
    pub act: Activation,
}

impl Epilogue<'_> {
    /// What the tile at row `row0` and column `col0` of a product `n` columns wide adds to its
    /// sums as it stores them: the residual's and the bias's elements at its place.
    pub fn adds(&self, row0: usize, col0: usize, n: usize) -> TileAdds {
        TileAdds {
            residual: self.residual.map_or(std::ptr::null(), |r| r[row0 * n + col0..].as_ptr()),
            residual_rs: n,
            bias: self.bias.map_or(std::ptr::null(), |b| b[col0..].as_ptr()),
        }
    }

    /// The activation on the stored `rows` × `cols` block at `dst` (rows `dst_rs` apart), once
    /// the tile has added the residual and bias ([`Epilogue::adds`]).
    ///
    /// # Safety
    /// The block must be valid and the calling task's alone.
    pub unsafe fn activate(&self, dst: *mut f32, dst_rs: usize, rows: usize, cols: usize) {
        let act = self.act;
        if act == Activation::Identity {
            return;
        }
        simd(
            #[inline(always)]
            || {
                for r in 0..rows {
                    // SAFETY: the caller's contract.
                    act.apply_to(unsafe { std::slice::from_raw_parts_mut(dst.add(r * dst_rs), cols) });
                }
            },
        )
    }
}

/// A tile's share of an [`Epilogue`]'s additions, added to the sums in registers as they are
/// stored (a pass of its own over each stored tile had cost as much as the activation): `(sum +
/// residual) + bias`, the order in which the separate steps would add them. Null where absent.
#[derive(Clone, Copy)]
pub(crate) struct TileAdds {
    /// The residual's element at the tile's first row and column; its rows `residual_rs` apart.
    pub residual: *const f32,
    pub residual_rs: usize,
    /// The bias's element at the tile's first column.
    pub bias: *const f32,
}

impl TileAdds {
    pub const NONE: TileAdds = TileAdds { residual: std::ptr::null(), residual_rs: 0, bias: std::ptr::null() };

    /// `v`, the sums of 16 columns from `col` of the tile's row `r`, with the residual and the
    /// bias added in the lanes `mask` keeps.
    ///
    /// # Safety
    /// AVX-512 F must be available; the pointers must cover the tile's kept lanes.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub unsafe fn add(&self, v: std::arch::x86_64::__m512, r: usize, col: usize, mask: u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let mut v = v;
        if !self.residual.is_null() {
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, self.residual.add(r * self.residual_rs + col)));
        }
        if !self.bias.is_null() {
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, self.bias.add(col)));
        }
        v
    }
}

// SAFETY: the pointers are read only, from slices that outlive the product.
unsafe impl Send for TileAdds {}
unsafe impl Sync for TileAdds {}

#[cfg(test)]
mod tests {
    use super::*;

    fn randn(seed: u64, len: usize) -> Vec<f32> {
        crate::util::rng::randn(seed, 0.0, 1.0, &[len], candle_core::DType::F32, &candle_core::Device::Cpu).unwrap().to_vec1().unwrap()
    }

    type Product = unsafe fn(*mut f32, usize, usize, Dims, Mat<f32>, Mat<f32>, bool, usize, Option<Epilogue>);

    /// Each kernel's tiles with an epilogue against its plain product followed by the epilogue's
    /// arithmetic, element by element: the same sums, so the two agree to f32 rounding. 400 rows
    /// and 50 columns leave partial tiles at both edges.
    #[test]
    fn the_epilogue_in_the_tiles_equals_the_same_steps_afterwards() {
        let kernels: [(&str, bool, Product); 2] = [
            ("bf16", super::super::bf16_gemm::available(), super::super::bf16_gemm::product),
            ("int8", super::super::int8_gemm::available(), super::super::int8_gemm::product),
        ];
        let (m, n, k) = (400, 50, 70);
        let (x, w, bias, residual) = (randn(1, m * k), randn(2, n * k), randn(3, n), randn(4, m * n));
        for (name, available, product) in kernels {
            if !available {
                eprintln!("skipped {name}: this CPU lacks its instructions");
                continue;
            }
            let (xm, wm) = (Mat::rows(&x, 0, k), Mat::transposed(&w, 0, k));
            let d = Dims { m, n, k };
            let mut plain = vec![0f32; m * n];
            unsafe { product(plain.as_mut_ptr(), 0, n, d, xm, wm, false, 2, None) };
            for act in [Activation::Identity, Activation::GeluErf, Activation::QuickGelu, Activation::GeluTanh] {
                for with_residual in [false, true] {
                    let residual = with_residual.then_some(&residual[..]);
                    let e = Epilogue { bias: Some(&bias), residual, act };
                    let mut fused = vec![0f32; m * n];
                    unsafe { product(fused.as_mut_ptr(), 0, n, d, xm, wm, false, 2, Some(e)) };
                    for (i, (&f, &p)) in fused.iter().zip(&plain).enumerate() {
                        let z = p + residual.map_or(0.0, |r| r[i]) + bias[i % n];
                        let want = act.of(z);
                        assert!(
                            (f - want).abs() <= 1e-6 * want.abs().max(1.0),
                            "{name} {act:?} residual {with_residual} at {i}: {f} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
