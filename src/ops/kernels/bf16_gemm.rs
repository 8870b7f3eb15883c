//! Matrix products with bfloat16 operands and f32 sums (AVX-512 BF16's `vdpbf16ps`), for the
//! forward-only commands asked for `--precision bf16` (embedding, scoring, evaluation) and for
//! CPU training with `train.precision = "bf16"`, whose kernels' forward and backward products
//! (dX = dY·Wᵀ, dW = dYᵀ·X) both come here while everything else stays f32. Two cores do about twice the f32
//! products' multiply-adds per cycle this way; the price is each operand rounded to 8
//! significant bits before the product (sums stay f32), as PyTorch's CPU autocast to bfloat16
//! rounds them.
//!
//! Operands are packed first: the left one row by row into pairs of neighbouring k (one 32-bit
//! broadcast each), the right one into panels of [`NR`] columns, each k pair of a column two
//! neighbouring bf16. A [`MR`]×[`NR`] tile of the product is then [`MR`]·2 accumulators over the
//! k pairs; tiles run as parallel tasks.
//!
//! Not every CPU with the instruction runs it fast: an Intel Emerald Rapids Xeon (its AMX
//! aside) issues one `vdpbf16ps` every second cycle, half the f32 multiply-adds of its two
//! 512-bit FMA units, where Zen 4 and Zen 5 issue about as many as f32 FMAs, each doing twice
//! the multiply-adds. On such a CPU the tiles take the same packed
//! operands and multiply them with f32 FMAs instead ([`TileKernel::Fma`]): a bf16 number is
//! the top half of an f32, and the product of two is exact in f32, so the sums are those of
//! the same rounded operands, in another order.

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use super::operands::{for_each_row_group, for_each_tile, row_groups_allowed, Dims, Epilogue, Mat, TileAdds, TileDst};

/// Rows of a tile: 24 accumulators, two right-hand loads and a broadcast fit the 32 registers.
pub(crate) const MR: usize = 12;
/// Columns of a tile: two registers of 16 f32.
pub(crate) const NR: usize = 32;

/// Rows of the left operand whose tiles run together, each right-hand panel in turn: 16 tiles.
const BLOCK_ROWS: usize = 16 * MR;

/// Rows of the left operand packed at once: 16 blocks (at most 12 MB packed for k = 3,072).
const PACK_ROWS: usize = 16 * BLOCK_ROWS;

/// Right operands up to this size packed (in bytes) run by row groups ([`for_each_row_group`]):
/// the panels stay in a core's own cache (1 MB or more on the CPUs with AVX-512 BF16) beside a
/// row group's packed rows and the tiles' output. A narrow product gains the most: ViT-Ti's
/// projections at batch 32, 6,304 × 192 × 192, had run at about 40% of the instruction's rate
/// with a pass over the whole left operand first (reading and writing every number of an
/// operand larger than the cache for few multiply-adds a number).
const GROUP_PANEL_BYTES: usize = 512 * 1024;

/// Products smaller than this many multiply-adds stay f32: packing would cost what bf16 saves
/// (a ViT-B/32 attention head's 50×50×64 products, for example).
const MIN_MACS: usize = 1 << 21;

static FORWARD_BF16: AtomicBool = AtomicBool::new(false);

/// How a tile multiplies its bf16 operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileKernel {
    /// `vdpbf16ps`: two products a lane per instruction, summed into f32.
    Dot,
    /// The operands widened to f32 in registers (a shift or a mask), then f32 FMAs.
    Fma,
}

#[cfg(test)]
thread_local! {
    static FORCED_KERNEL: std::cell::Cell<Option<TileKernel>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the products it starts on this thread on `kernel`, whatever this CPU's own
/// choice: the tests check both on every CPU with the instruction.
#[cfg(test)]
pub(crate) fn with_tile_kernel<R>(kernel: TileKernel, f: impl FnOnce() -> R) -> R {
    let before = FORCED_KERNEL.with(|k| k.replace(Some(kernel)));
    let out = f();
    FORCED_KERNEL.with(|k| k.set(before));
    out
}

/// The tile kernel of this process: `ALIGN_BF16_KERNEL=dot` or `=fma` where set, otherwise the
/// faster on this CPU, from the two instructions' rates measured once on the calling thread
/// (a few ms). The dot product wins a tie: it has no widening to do.
pub fn tile_kernel() -> TileKernel {
    #[cfg(test)]
    if let Some(k) = FORCED_KERNEL.with(|k| k.get()) {
        return k;
    }
    chosen().0
}

/// The kernel, and the multiply-adds per second a thread of `vdpbf16ps` and of f32 FMAs ran at
/// where they were measured to choose it.
fn chosen() -> (TileKernel, Option<(f64, f64)>) {
    static KERNEL: std::sync::OnceLock<(TileKernel, Option<(f64, f64)>)> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| match std::env::var("ALIGN_BF16_KERNEL").as_deref() {
        Ok("dot") => (TileKernel::Dot, None),
        Ok("fma") => (TileKernel::Fma, None),
        other => {
            if let Ok(v) = other {
                eprintln!("ALIGN_BF16_KERNEL={v:?} is neither \"dot\" nor \"fma\"; choosing by this CPU's rates");
            }
            if !available() {
                return (TileKernel::Dot, None);
            }
            use super::issue_rate::{thread_rate, Precision};
            // Each the fastest of ten single bursts (0.05-0.2 ms), taken in alternation: on a
            // busy machine a thread switched out during a burst only makes that one look slow,
            // and one turn of 1-2 ms each had chosen wrongly beside a build on both cores.
            let (mut dot, mut fma) = (0f64, 0f64);
            for _ in 0..10 {
                // SAFETY: AVX-512 BF16 is there (`available`), and AVX-512 F with it.
                unsafe {
                    dot = dot.max(thread_rate(Precision::Bf16, 0.0));
                    fma = fma.max(thread_rate(Precision::F32, 0.0));
                }
            }
            (if dot < fma { TileKernel::Fma } else { TileKernel::Dot }, Some((dot, fma)))
        }
    })
}

/// A line for the log where bf16 products run on f32 FMAs because this CPU issues `vdpbf16ps`
/// slower: bf16 then saves no time over f32, which someone asking for it should know.
pub fn kernel_note() -> Option<String> {
    if !available() {
        return None;
    }
    match chosen() {
        (TileKernel::Fma, Some((dot, fma))) => Some(format!(
            "bf16 products run as f32 FMAs on bf16-rounded operands: this CPU's vdpbf16ps ran {:.1} GMAC/s a thread \
             against {:.1} for f32 FMAs, so bf16 is about as fast as f32 here, not faster",
            dot / 1e9,
            fma / 1e9
        )),
        (TileKernel::Fma, None) => Some("bf16 products run as f32 FMAs on bf16-rounded operands (ALIGN_BF16_KERNEL=fma)".into()),
        _ => None,
    }
}

/// Whether this CPU has the instructions (AVX-512 F and BF16).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *YES.get_or_init(|| {
            use std::arch::is_x86_feature_detected as has;
            !crate::ops::simd::avx512_disabled() && has!("avx512f") && has!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Routes the process's large f32 products through bf16 from now on (or back to f32). A
/// process-wide switch because only forward-only commands set it, before any work starts.
/// Returns whether bf16 products will run, which they do only where [`available`].
pub fn set_forward_bf16(on: bool) -> bool {
    let on = on && available();
    FORWARD_BF16.store(on, Ordering::Relaxed);
    on
}

/// A smallest product set by [`set_min_macs`] (0: none set).
static MIN_SET: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The smallest product that goes through bf16: [`MIN_MACS`], or `ALIGN_BF16_MIN_MACS`, or what
/// [`set_min_macs`] set (for tests, whose small models have no product that large, and for
/// measuring the threshold).
pub(crate) fn min_macs() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    match MIN_SET.load(Ordering::Relaxed) {
        0 => *MIN.get_or_init(|| std::env::var("ALIGN_BF16_MIN_MACS").ok().and_then(|v| v.parse().ok()).unwrap_or(MIN_MACS)),
        set => set,
    }
}

/// Sends products of at least `macs` multiply-adds through bf16 wherever bf16 products are on,
/// for the rest of the process (never reset). f32 work beside it is unaffected; other bf16 work
/// in the process gets the same threshold.
pub fn set_min_macs(macs: usize) {
    MIN_SET.store(macs.max(1), Ordering::Relaxed);
}

thread_local! {
    static SCOPED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the large f32 products it starts in bf16 (where [`available`]), the rest of the
/// process unchanged: a training run's bf16 products beside f32 tests and ranks, a forward-only
/// teacher beside its f32 student. Ops that hand products to other threads carry the setting
/// into them ([`Scope`]).
pub fn with_bf16_products<R>(f: impl FnOnce() -> R) -> R {
    Scope(available()).run(f)
}

/// Runs `f` with its products in f32 whatever the caller's scope: an f32 teacher inside a bf16
/// student's step. (The process-wide switch of the forward-only commands still holds; those
/// never train.)
pub fn with_f32_products<R>(f: impl FnOnce() -> R) -> R {
    Scope(false).run(f)
}

/// Whether the calling thread's large products run in bf16, to carry into the tasks an op hands
/// to rayon's threads: `let scope = Scope::current();` before the parallel loop, `scope.run(||
/// …)` in each task.
#[derive(Clone, Copy)]
pub(crate) struct Scope(bool);

impl Scope {
    pub(crate) fn current() -> Scope {
        Scope(SCOPED.with(|s| s.get()))
    }

    /// Whether the products run in bf16 in this scope.
    #[cfg(test)]
    pub(crate) fn is_on(self) -> bool {
        self.0
    }

    pub(crate) fn run<R>(self, f: impl FnOnce() -> R) -> R {
        // Restored on the way out however `f` ends, a panic included.
        struct Restore(bool);
        impl Drop for Restore {
            fn drop(&mut self) {
                SCOPED.with(|s| s.set(self.0));
            }
        }
        let _restore = Restore(SCOPED.with(|s| s.replace(self.0)));
        f()
    }
}

pub(crate) fn wanted(d: Dims) -> bool {
    (FORWARD_BF16.load(Ordering::Relaxed) || SCOPED.with(|s| s.get())) && d.m.saturating_mul(d.n).saturating_mul(d.k) >= min_macs()
}

/// `x` rounded to the nearest bfloat16 (ties to even), as its 16 bits; NaN stays NaN.
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The left operand's rows as k pairs: `out[i·kp + q]` holds (lhs[i, 2q], lhs[i, 2q+1]), the
/// first in the low half; rows up to a multiple of [`MR`] and a k past the end are zero.
fn pack_lhs(lhs: Mat<f32>, m: usize, k: usize) -> (Vec<u32>, usize) {
    let kp = k.div_ceil(2);
    let mut out = packed_rows(m, kp);
    // Groups of 16 rows: the transposed packing's unit, and enough work for a task.
    out.par_chunks_mut(16 * kp).enumerate().for_each(|(g, rows)| {
        let first = 16 * g;
        if first < m {
            pack_rows(lhs, first, (m - first).min(16), k, kp, rows);
        }
    });
    (out, kp)
}

/// A buffer for `m` packed rows of `kp` pairs, up to a multiple of [`MR`] rows: only the rows
/// after `m` are zeroed, as every row below it is written in full by [`pack_rows`] before a
/// tile reads it (zero-filling all of it had been 2% of a bf16 training step, on one thread).
fn packed_rows(m: usize, kp: usize) -> Vec<u32> {
    let rows = m.div_ceil(MR) * MR;
    let mut out: Vec<u32> = Vec::with_capacity(rows * kp);
    // SAFETY: as said above, every element is written before the tiles read it.
    #[allow(clippy::uninit_vec)]
    unsafe {
        out.set_len(rows * kp)
    };
    out[m * kp..].fill(0);
    out
}

/// Rows `first..first + rows` of the left operand into k pairs, row r of them at `out[r·kp..]`.
fn pack_rows(lhs: Mat<f32>, first: usize, rows: usize, k: usize, kp: usize, out: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if lhs.row_stride == 1 && available() {
        // A transposed operand (a gradient dYᵀ): a row's k are `col_stride` apart, so 16 rows
        // are packed at once from the 16 neighbouring numbers each k holds for them.
        for g in (0..rows).step_by(16) {
            // SAFETY: the CPU has AVX-512 F and BF16 (`available`); reads stay within the
            // operand's rows first + g.. (at most 16, masked to `rows`) and columns < k.
            unsafe { pack_columns_avx512(lhs, first + g, (rows - g).min(16), k, kp, &mut out[g * kp..]) }
        }
        return;
    }
    let at = |i: usize, j: usize| if j < k { bf16_bits(lhs.data[lhs.offset + i * lhs.row_stride + j * lhs.col_stride]) as u32 } else { 0 };
    for (r, row) in out.chunks_mut(kp).take(rows).enumerate() {
        let i = first + r;
        if lhs.col_stride == 1 {
            let start = lhs.offset + i * lhs.row_stride;
            pack_row(&lhs.data[start..start + k], row);
        } else {
            for (q, o) in row.iter_mut().enumerate() {
                *o = at(i, 2 * q) | (at(i, 2 * q + 1) << 16);
            }
        }
    }
}

/// 16 k pairs from the 16 neighbouring numbers at `lo` (an even k) and at `hi` (the next k; None
/// past the end), only the `lanes` read: u32 pairs with the even k's bf16 in the low half.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pairs16(lo: *const f32, hi: Option<*const f32>, lanes: u16) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let to32 = |x: __m512| _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x)));
    let lo = to32(_mm512_maskz_loadu_ps(lanes, lo));
    match hi {
        Some(hi) => _mm512_or_si512(lo, _mm512_slli_epi32::<16>(to32(_mm512_maskz_loadu_ps(lanes, hi)))),
        None => lo,
    }
}

/// Rows `first..first + rows` (at most 16) of a left operand whose rows are neighbours in
/// memory (`row_stride` 1) into k pairs: `out[r·kp + q]` for the group's row r. Sixteen k pairs
/// are read for the 16 rows at once (one contiguous load per k each), transposed in registers
/// and stored a row at a time: scattering each k pair's 16 numbers to their rows instead cost
/// 7% of a ViT-Ti bf16 training step (Zen 4's scatter moves about one number a cycle).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pack_columns_avx512(lhs: Mat<f32>, first: usize, rows: usize, k: usize, kp: usize, out: &mut [u32]) {
    use std::arch::x86_64::*;
    let lanes = mask(rows);
    let base = lhs.data.as_ptr().add(lhs.offset + first);
    for q0 in (0..kp).step_by(16) {
        let pairs_here = (kp - q0).min(16);
        // The rows of k two blocks ahead into the cache. A block reads one 64-byte piece of
        // each of 32 rows of the operand's memory (rows of dY for dYᵀ, 3 KiB apart for a
        // 768-wide layer): nearly every read is on another page, where the hardware's
        // prefetchers stop following the stride. Waiting for those reads had made this packing
        // about 10% of a ViT-Ti/16 bf16 training step, as long as the products it feeds.
        for j in (2 * (q0 + 32)..2 * (q0 + 48)).take_while(|&j| j < k) {
            let p = base.add(j * lhs.col_stride);
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(p.add(rows - 1) as *const i8);
        }
        let mut v = [_mm512_setzero_si512(); 16];
        for (t, v) in v.iter_mut().enumerate().take(pairs_here) {
            let (j0, j1) = (2 * (q0 + t), 2 * (q0 + t) + 1);
            *v = pairs16(base.add(j0 * lhs.col_stride), (j1 < k).then(|| base.add(j1 * lhs.col_stride)), lanes);
        }
        // v[t] holds k pair q0 + t of the 16 rows; after the transpose cols[r] holds row r's
        // 16 k pairs.
        let cols = transpose16(v);
        for (r, col) in cols.iter().enumerate().take(rows) {
            _mm512_mask_storeu_epi32(out.as_mut_ptr().add(r * kp + q0) as *mut _, mask(pairs_here), *col);
        }
    }
}

/// The transpose of a 16×16 matrix of 32-bit numbers held as 16 rows: two rounds of unpacks
/// transpose each 4×4 block within the 128-bit lanes, two rounds of lane shuffles move the
/// blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(v: [std::arch::x86_64::__m512i; 16]) -> [std::arch::x86_64::__m512i; 16] {
    use std::arch::x86_64::*;
    let mut t = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    // u[4i + e], 128-bit lane L: rows 4i..4i+4 of column 4L + e.
    let mut u = [_mm512_setzero_si512(); 16];
    for i in 0..4 {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    let mut out = [_mm512_setzero_si512(); 16];
    for e in 0..4 {
        // Lanes (0, 1) or (2, 3) of rows 0..8, then of rows 8..16.
        let low_ab = _mm512_shuffle_i32x4::<0x44>(u[e], u[4 + e]);
        let high_ab = _mm512_shuffle_i32x4::<0xee>(u[e], u[4 + e]);
        let low_cd = _mm512_shuffle_i32x4::<0x44>(u[8 + e], u[12 + e]);
        let high_cd = _mm512_shuffle_i32x4::<0xee>(u[8 + e], u[12 + e]);
        // Column 4L + e gathers lane L of each group of four rows.
        out[e] = _mm512_shuffle_i32x4::<0x88>(low_ab, low_cd);
        out[4 + e] = _mm512_shuffle_i32x4::<0xdd>(low_ab, low_cd);
        out[8 + e] = _mm512_shuffle_i32x4::<0x88>(high_ab, high_cd);
        out[12 + e] = _mm512_shuffle_i32x4::<0xdd>(high_ab, high_cd);
    }
    out
}

/// Columns `first..first + cols` (at most [`NR`]) of a right operand whose columns are
/// neighbours in memory (`col_stride` 1, a row-major matrix) into the panel's k pairs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pack_panel_avx512(rhs: Mat<f32>, first: usize, cols: usize, k: usize, kp: usize, panel: &mut [u16]) {
    use std::arch::x86_64::*;
    let base = rhs.data.as_ptr().add(rhs.offset + first);
    for q in 0..kp {
        let (j0, j1) = (2 * q, 2 * q + 1);
        for h in 0..cols.div_ceil(16) {
            let lanes = mask(cols - 16 * h);
            let (lo, hi) = (base.add(j0 * rhs.row_stride + 16 * h), (j1 < k).then(|| base.add(j1 * rhs.row_stride + 16 * h)));
            let pairs = pairs16(lo, hi, lanes);
            _mm512_mask_storeu_epi32(panel.as_mut_ptr().add((q * NR + 16 * h) * 2) as *mut _, lanes, pairs);
        }
    }
}

/// One contiguous row into k pairs.
fn pack_row(src: &[f32], out: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU has AVX-512 F and BF16 (`available`).
        return unsafe { pack_row_avx512(src, out) };
    }
    for (q, o) in out.iter_mut().enumerate() {
        let lo = bf16_bits(src[2 * q]) as u32;
        let hi = src.get(2 * q + 1).map_or(0, |&x| bf16_bits(x) as u32);
        *o = lo | (hi << 16);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pack_row_avx512(src: &[f32], out: &mut [u32]) {
    use std::arch::x86_64::*;
    let whole = src.len() / 32 * 32;
    let mut j = 0;
    while j < whole {
        let lo = _mm512_loadu_ps(src.as_ptr().add(j));
        let hi = _mm512_loadu_ps(src.as_ptr().add(j + 16));
        // The second argument fills the low half: element j first, as the pairs want.
        let packed = _mm512_cvtne2ps_pbh(hi, lo);
        _mm512_storeu_si512(out.as_mut_ptr().add(j / 2) as *mut _, std::mem::transmute::<__m512bh, __m512i>(packed));
        j += 32;
    }
    for q in whole / 2..out.len() {
        let lo = bf16_bits(src[2 * q]) as u32;
        let hi = src.get(2 * q + 1).map_or(0, |&x| bf16_bits(x) as u32);
        out[q] = lo | (hi << 16);
    }
}

/// The right operand in panels of [`NR`] columns: `out[((b·kp + q)·NR + c)·2 + h]` is
/// rhs[2q + h, b·NR + c]; columns past `n` and a k past the end are zero.
fn pack_rhs(rhs: Mat<f32>, k: usize, n: usize) -> Vec<u16> {
    let kp = k.div_ceil(2);
    let panels = n.div_ceil(NR);
    let mut out: Vec<u16> = Vec::with_capacity(panels * kp * NR * 2);
    // SAFETY: every panel is written in full below before a tile reads it: the vector paths
    // write all of a whole panel, and a partial panel or the scalar path's is zeroed first.
    // (Zeroing the whole operand first had been a serial pass over every weight at every bf16
    // product, 4% of a ViT-B/32 embedding.)
    #[allow(clippy::uninit_vec)]
    unsafe {
        out.set_len(panels * kp * NR * 2)
    };
    let whole_panels_written = rhs.row_stride == 1 || (rhs.col_stride == 1 && available());
    out.par_chunks_mut(kp * NR * 2).enumerate().for_each(|(b, panel)| {
        let cols = NR.min(n - b * NR);
        if cols < NR || !whole_panels_written {
            panel.fill(0);
        }
        if rhs.row_stride == 1 {
            // A transposed row-major matrix (a linear layer's weight): each column is a
            // contiguous row, packed into pairs first and then spread over the panel.
            let mut pairs = vec![0u32; kp];
            let aligned = (panel.as_ptr() as usize).is_multiple_of(std::mem::align_of::<u32>());
            for c in 0..cols {
                let start = rhs.offset + (b * NR + c) * rhs.col_stride;
                pack_row(&rhs.data[start..start + k], &mut pairs);
                if aligned {
                    // A pair is one little-endian word, the even k in its low half: one store
                    // instead of two (this loop had been 3% of a ViT-B/32 bf16 embedding).
                    // SAFETY: the panel is aligned for u32 (checked above) and holds an even
                    // number of u16; any bits make a u32.
                    let words = unsafe { std::slice::from_raw_parts_mut(panel.as_mut_ptr() as *mut u32, panel.len() / 2) };
                    for (q, &p) in pairs.iter().enumerate() {
                        words[q * NR + c] = p;
                    }
                } else {
                    for (q, &p) in pairs.iter().enumerate() {
                        let at = (q * NR + c) * 2;
                        panel[at] = p as u16;
                        panel[at + 1] = (p >> 16) as u16;
                    }
                }
            }
        } else if rhs.col_stride == 1 && available() {
            // A row-major matrix (activations in dW = dYᵀ·X): each k's columns are neighbours.
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX-512 F and BF16 (`available`); reads stay within the
            // operand's columns b·NR.. (masked to n) and rows < k.
            unsafe {
                pack_panel_avx512(rhs, b * NR, cols, k, kp, panel)
            }
        } else {
            for q in 0..kp {
                for h in 0..2 {
                    let row = 2 * q + h;
                    if row >= k {
                        continue;
                    }
                    for c in 0..cols {
                        panel[(q * NR + c) * 2 + h] =
                            bf16_bits(rhs.data[rhs.offset + row * rhs.row_stride + (b * NR + c) * rhs.col_stride]);
                    }
                }
            }
        }
    });
    out
}

/// `dst[offset + i·dst_rs + j] = (lhs·rhs)[i, j]` (or `+=`), in bf16 products summed in f32,
/// split over `threads` tasks; then the `epilogue`, if any, on each tile as it is stored.
///
/// # Safety
/// [`available`] must hold, and `dst` must be valid for every element written (the caller,
/// `matmul::gemm_raw`, has checked the bounds) with no other thread touching them.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product(
    dst: *mut f32,
    offset: usize,
    dst_rs: usize,
    d: Dims,
    lhs: Mat<f32>,
    rhs: Mat<f32>,
    accumulate: bool,
    threads: usize,
    epilogue: Option<Epilogue>,
) {
    let kernel = tile_kernel();
    // A frozen weight's panels are packed once and kept.
    let b = super::frozen::packed(rhs, d.k, d.n, || pack_rhs(rhs, d.k, d.n));
    if b.len() * std::mem::size_of::<u16>() <= GROUP_PANEL_BYTES && row_groups_allowed() {
        let (dst, kp) = (TileDst(dst.add(offset)), d.k.div_ceil(2));
        let pack = |first, rows| {
            let mut a = packed_rows(rows, kp);
            pack_rows(lhs, first, rows, d.k, kp, &mut a);
            a
        };
        for_each_row_group((d.m, d.n), (MR, NR), threads, pack, |a, t| {
            let (out, operands) =
                (dst.at(t.row0 * dst_rs + t.panel * NR), (a.as_ptr().add(t.t * MR * kp), kp, b.as_ptr().add(t.panel * kp * NR * 2)));
            tile_with(kernel, operands, out, dst_rs, (t.row0, t.panel * NR, d.n), (t.rows, t.cols), accumulate, epilogue);
        });
        return;
    }
    // The left operand is packed PACK_ROWS rows at a time, so the packed copy stays small (a
    // ViT-B/16 batch's 12,608 rows × 3,072 would be 77 MB at once), each part's tiles one loop.
    for start in (0..d.m).step_by(PACK_ROWS) {
        let m = PACK_ROWS.min(d.m - start);
        let (a, _) = pack_lhs(Mat { offset: lhs.offset + start * lhs.row_stride, ..lhs }, m, d.k);
        let dst = TileDst(dst.add(offset + start * dst_rs));
        every_tile(kernel, (&a, d.k, &b), (start, m, d.n), dst, dst_rs, accumulate, threads, epilogue);
    }
}

/// Every tile of rows `first..first + m` of a product `n` wide, whose left operand's rows are
/// packed in `a` (k numbers each) and right operand in `b`, as one parallel loop
/// ([`for_each_tile`]); `dst` is the first row's place.
///
/// # Safety
/// As [`product`]'s.
#[allow(clippy::too_many_arguments)]
unsafe fn every_tile(
    kernel: TileKernel,
    (a, k, b): (&[u32], usize, &[u16]),
    (first, m, n): (usize, usize, usize),
    dst: TileDst,
    dst_rs: usize,
    accumulate: bool,
    threads: usize,
    epilogue: Option<Epilogue>,
) {
    let kp = k.div_ceil(2);
    for_each_tile(m.div_ceil(MR), n.div_ceil(NR), BLOCK_ROWS / MR, threads, |p, r| {
        let operands = (a.as_ptr().add(r * MR * kp), kp, b.as_ptr().add(p * kp * NR * 2));
        let place = (first + r * MR, p * NR, n);
        tile_with(
            kernel,
            operands,
            dst.at(r * MR * dst_rs + p * NR),
            dst_rs,
            place,
            (MR.min(m - r * MR), NR.min(n - p * NR)),
            accumulate,
            epilogue,
        );
    });
}

/// One tile of a product `n` wide: packed rows `a` against panel `b`, stored at `out` (rows
/// `dst_rs` apart) with the `epilogue` of the product's elements from (`row`, `col`); only
/// `rows` × `cols` of it kept.
///
/// # Safety
/// As [`tile_avx512`]'s, and the epilogue's operands must cover the tile.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile_with(
    kernel: TileKernel,
    (a, kp, b): (*const u32, usize, *const u16),
    out: *mut f32,
    dst_rs: usize,
    (row, col, n): (usize, usize, usize),
    (rows, cols): (usize, usize),
    accumulate: bool,
    epilogue: Option<Epilogue>,
) {
    let adds = epilogue.map_or(TileAdds::NONE, |e| e.adds(row, col, n));
    match kernel {
        TileKernel::Dot => tile_avx512(a, kp, b, out, dst_rs, rows, cols, accumulate, adds),
        TileKernel::Fma => tile_fma_avx512(a, kp, b, out, dst_rs, rows, cols, accumulate, adds),
    }
    if let Some(e) = epilogue {
        e.activate(out, dst_rs, rows, cols);
    }
}

/// A left operand in the kernel's packed form (rows of k pairs, up to a multiple of [`MR`] rows),
/// made once by the op that produces it: a LayerNorm's output read by three projections, or a
/// product's output read by the next. No f32 copy of it is written, read back and packed for
/// each product that reads it.
pub(crate) struct PackedRows {
    words: Vec<u32>,
    m: usize,
    k: usize,
}

impl PackedRows {
    /// `m` rows of `k` numbers, row i made by `row(i, r)` into an f32 row `r` and packed from
    /// there as the products pack an f32 operand, so that the products' sums are the same.
    pub(crate) fn from_rows(m: usize, k: usize, row: impl Fn(usize, &mut [f32]) + Sync) -> PackedRows {
        let kp = k.div_ceil(2);
        let mut words = packed_rows(m, kp);
        words[..m * kp].par_chunks_mut(16 * kp).enumerate().for_each(|(g, rows)| {
            let mut scratch = vec![0f32; k];
            for (r, out) in rows.chunks_mut(kp).enumerate() {
                row(16 * g + r, &mut scratch);
                pack_row(&scratch, out);
            }
        });
        PackedRows { words, m, k }
    }

    pub(crate) fn rows(&self) -> usize {
        self.m
    }

    /// Numbers per row.
    pub(crate) fn cols(&self) -> usize {
        self.k
    }

    /// `dst[i·dst_rs + j] = (x·W)[i, j]` for this operand `x` and `w` (`k` × `n`), then the
    /// `epilogue`, in the same sums as [`product`] makes from x in f32.
    ///
    /// # Safety
    /// [`available`] must hold, and `dst` must be valid for every element written with no other
    /// thread touching them.
    pub(crate) unsafe fn product(&self, dst: *mut f32, dst_rs: usize, w: Mat<f32>, n: usize, threads: usize, epilogue: Option<Epilogue>) {
        let b = super::frozen::packed(w, self.k, n, || pack_rhs(w, self.k, n));
        every_tile(tile_kernel(), (&self.words, self.k, &b), (0, self.m, n), TileDst(dst), dst_rs, false, threads, epilogue);
    }

    /// [`PackedRows::product`]'s output (`n` wide) packed as the next product's left operand,
    /// each tile as it is made: the numbers [`PackedRows::from_rows`] would pack from it.
    ///
    /// # Safety
    /// [`available`] must hold.
    pub(crate) unsafe fn product_packed(&self, w: Mat<f32>, n: usize, threads: usize, epilogue: Option<Epilogue>) -> PackedRows {
        let (m, k, kp) = (self.m, self.k, self.k.div_ceil(2));
        let b = super::frozen::packed(w, k, n, || pack_rhs(w, k, n));
        let np = n.div_ceil(2);
        let mut words = packed_rows(m, np);
        let out = TileWords(words.as_mut_ptr());
        let kernel = tile_kernel();
        for_each_tile(m.div_ceil(MR), n.div_ceil(NR), BLOCK_ROWS / MR, threads, |p, r| {
            let (rows, cols) = (MR.min(m - r * MR), NR.min(n - p * NR));
            // Only the `rows` × `cols` the tile stores are read back; not zeroed first, as this
            // runs once per tile.
            let mut tile = std::mem::MaybeUninit::<[f32; MR * NR]>::uninit();
            let t = tile.as_mut_ptr() as *mut f32;
            let operands = (self.words.as_ptr().add(r * MR * kp), kp, b.as_ptr().add(p * kp * NR * 2));
            tile_with(kernel, operands, t, NR, (r * MR, p * NR, n), (rows, cols), false, epilogue);
            for i in 0..rows {
                let values = std::slice::from_raw_parts(t.add(i * NR), cols);
                // A tile's columns are one of the 32-number runs `pack_row` packs a row in
                // (NR = 32 and tiles start at multiples of it), so the words are its words.
                let words = std::slice::from_raw_parts_mut(out.at((r * MR + i) * np + p * NR / 2), cols.div_ceil(2));
                pack_row(values, words);
            }
        });
        PackedRows { words, m, k: n }
    }
}

/// Packed words that a product's tiles write at once, each its own.
#[derive(Clone, Copy)]
struct TileWords(*mut u32);
// SAFETY: tiles write disjoint words.
unsafe impl Send for TileWords {}
unsafe impl Sync for TileWords {}

impl TileWords {
    fn at(self, offset: usize) -> *mut u32 {
        self.0.wrapping_add(offset)
    }
}

/// A tile's sums stored (added to what `dst` holds if `accumulate`), with the `adds`; only its
/// first `rows` × `cols` are written. A macro, so that each row's accumulators are named by a
/// constant index where the tile kernel ends: handed to a function as an array, they were
/// written to the stack after a memset of the whole array at every tile (3% of a ViT-B/32
/// embedding), the function not being inlined into a kernel with other target features.
macro_rules! store_tile {
    ($acc:ident, $dst:expr, $dst_rs:expr, $rows:expr, $cols:expr, $accumulate:expr, $adds:expr) => {{
        const _: () = assert!(MR == 12, "store_tile! names every row of a tile");
        let (dst, dst_rs, rows, cols, accumulate, adds) = ($dst, $dst_rs, $rows, $cols, $accumulate, $adds);
        let masks = [mask(cols), mask(cols.saturating_sub(16))];
        store_tile!(@rows $acc dst dst_rs rows masks accumulate adds; 0 1 2 3 4 5 6 7 8 9 10 11);
    }};
    (@rows $acc:ident $dst:ident $dst_rs:ident $rows:ident $masks:ident $accumulate:ident $adds:ident; $($r:literal)*) => {
        $(if $r < $rows {
            store_row($acc[$r], $r, $dst.add($r * $dst_rs), $masks, $accumulate, $adds);
        })*
    };
}

/// One [`MR`]×[`NR`] tile over all k pairs; only its first `rows` × `cols` are stored.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx512(
    a: *const u32,
    kp: usize,
    b: *const u16,
    dst: *mut f32,
    dst_rs: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
    adds: TileAdds,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for q in 0..kp {
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * NR * 2) as *const _));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * NR * 2 + 32) as *const _));
        for (r, acc) in acc.iter_mut().enumerate() {
            let pair: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(r * kp + q) as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], pair, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], pair, b1);
        }
    }
    store_tile!(acc, dst, dst_rs, rows, cols, accumulate, adds);
}

/// [`tile_avx512`]'s tile with f32 FMAs: each word of a panel or of a packed row holds the even
/// k's bf16 in its low half and the odd k's in its high half, so a shift left by 16 gives the
/// even k's f32 and clearing the low half the odd k's. The panel's two words per k pair are
/// widened as they are loaded (four instructions for 48 FMAs); the rows', which each FMA
/// broadcasts, [`SPAN`] pairs at a time into a block on the stack, from where the FMAs read
/// them as memory operands (rather than two instructions per row and pair: 24 for 48 FMAs).
///
/// # Safety
/// As [`tile_avx512`]'s; the CPU needs AVX-512 F only.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_fma_avx512(
    a: *const u32,
    kp: usize,
    b: *const u16,
    dst: *mut f32,
    dst_rs: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
    adds: TileAdds,
) {
    use std::arch::x86_64::*;
    let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
    let even = |w: __m512i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
    let odd = |w: __m512i| _mm512_castsi512_ps(_mm512_and_si512(w, high));
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    // widened[0][r] holds row r's even-k numbers of the span's pairs, widened[1][r] its odd.
    let mut widened = [[_mm512_setzero_ps(); MR]; 2];
    for q0 in (0..kp).step_by(SPAN) {
        let pairs = SPAN.min(kp - q0);
        let [evens, odds] = &mut widened;
        for (r, (e, o)) in evens.iter_mut().zip(odds.iter_mut()).enumerate() {
            let w = _mm512_maskz_loadu_epi32(mask(pairs), a.add(r * kp + q0) as *const i32);
            (*e, *o) = (even(w), odd(w));
        }
        let lanes = widened.as_ptr() as *const f32;
        for q in 0..pairs {
            let w0 = _mm512_loadu_si512(b.add((q0 + q) * NR * 2) as *const _);
            let w1 = _mm512_loadu_si512(b.add((q0 + q) * NR * 2 + 32) as *const _);
            let (e0, o0, e1, o1) = (even(w0), odd(w0), even(w1), odd(w1));
            for (r, acc) in acc.iter_mut().enumerate() {
                let ae = _mm512_set1_ps(*lanes.add(r * SPAN + q));
                let ao = _mm512_set1_ps(*lanes.add((MR + r) * SPAN + q));
                acc[0] = _mm512_fmadd_ps(ao, o0, _mm512_fmadd_ps(ae, e0, acc[0]));
                acc[1] = _mm512_fmadd_ps(ao, o1, _mm512_fmadd_ps(ae, e1, acc[1]));
            }
        }
    }
    store_tile!(acc, dst, dst_rs, rows, cols, accumulate, adds);
}

/// k pairs of a tile's rows widened at a time by [`tile_fma_avx512`]: one register's worth.
const SPAN: usize = 16;

/// Row `r` of a tile's sums stored at `p` (added to what it holds if `accumulate`), with the
/// `adds`, in the lanes `masks` keep.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_row(acc: [std::arch::x86_64::__m512; 2], r: usize, p: *mut f32, masks: [u16; 2], accumulate: bool, adds: TileAdds) {
    use std::arch::x86_64::*;
    for h in 0..2 {
        let p = p.add(16 * h);
        let v = if accumulate { _mm512_add_ps(acc[h], _mm512_maskz_loadu_ps(masks[h], p)) } else { acc[h] };
        _mm512_mask_storeu_ps(p, masks[h], adds.add(v, r, 16 * h, masks[h]));
    }
}

/// The first `n` (at most 16) lanes.
fn mask(n: usize) -> u16 {
    if n >= 16 {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx512(_: *const u32, _: usize, _: *const u16, _: *mut f32, _: usize, _: usize, _: usize, _: bool, _: TileAdds) {
    unreachable!("bf16 products run only where `available`")
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_fma_avx512(_: *const u32, _: usize, _: *const u16, _: *mut f32, _: usize, _: usize, _: usize, _: bool, _: TileAdds) {
    unreachable!("bf16 products run only where `available`")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::kernels::bias_act::Activation;
    use crate::ops::kernels::operands::with_whole_operand_packing;

    fn randn(seed: u64, len: usize) -> Vec<f32> {
        crate::util::rng::randn(seed, 0.0, 1.0, &[len], candle_core::DType::F32, &candle_core::Device::Cpu).unwrap().to_vec1().unwrap()
    }

    fn bf16_value(bits: u16) -> f64 {
        f32::from_bits((bits as u32) << 16) as f64
    }

    #[test]
    fn rounding_to_bf16_is_to_nearest_even() {
        // 1 + 2⁻⁸ lies halfway between 1 and 1 + 2⁻⁷: ties go to the even mantissa, 1.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), bf16_bits(1.0));
        // 1 + 3·2⁻⁸ lies halfway between 1 + 2⁻⁷ and 1 + 2⁻⁶: to the even one, 1 + 2⁻⁶.
        assert_eq!(bf16_value(bf16_bits(1.0 + 3.0 / 256.0)), 1.0 + 4.0 / 256.0);
        assert_eq!(bf16_value(bf16_bits(-2.5)), -2.5);
        assert!(f32::from_bits((bf16_bits(f32::NAN) as u32) << 16).is_nan());
        assert_eq!(bf16_value(bf16_bits(f32::INFINITY)), f64::INFINITY);
    }

    /// A left operand packed once by the op that makes it ([`PackedRows`]) gives the products
    /// that the f32 operand gives, bit for bit, epilogue included; a product's output packed as
    /// its tiles are stored is the output packed afterwards, word for word.
    #[test]
    fn packed_operands_give_the_products_of_the_f32_operand() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 BF16");
            return;
        }
        for kernel in [TileKernel::Dot, TileKernel::Fma] {
            with_tile_kernel(kernel, packed_operands_agree);
        }
    }

    fn packed_operands_agree() {
        for (s, &(m, n, k)) in [(1, 1, 1), (13, 33, 7), (25, 70, 301), (400, 40, 50), (50, 64, 96), (7, 95, 64)].iter().enumerate() {
            let s = s as u64;
            let (x, w, bias, residual) = (randn(740 + s, m * k), randn(750 + s, n * k), randn(760 + s, n), randn(770 + s, m * n));
            let d = Dims { m, n, k };
            let packed = PackedRows::from_rows(m, k, |i, r| r.copy_from_slice(&x[i * k..(i + 1) * k]));
            let w_t = Mat::transposed(&w, 0, k);
            for (residual, act) in
                [(None, Activation::Identity), (Some(&residual[..]), Activation::QuickGelu), (None, Activation::GeluTanh)]
            {
                let epilogue = Some(Epilogue { bias: Some(&bias), residual, act });
                let mut want = vec![0f32; m * n];
                unsafe { product(want.as_mut_ptr(), 0, n, d, Mat::rows(&x, 0, k), w_t, false, 2, epilogue) };
                let mut got = vec![f32::NAN; m * n];
                unsafe { packed.product(got.as_mut_ptr(), n, w_t, n, 2, epilogue) };
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "({m}, {n}, {k}) {act:?}, residual {}: differs", residual.is_some());
                if residual.is_none() {
                    let next = unsafe { packed.product_packed(w_t, n, 2, epilogue) };
                    let after = PackedRows::from_rows(m, n, |i, r| r.copy_from_slice(&want[i * n..(i + 1) * n]));
                    assert_eq!((next.m, next.k), (m, n));
                    assert!(next.words == after.words, "({m}, {n}, {k}) {act:?}: packed as stored differs from packed after");
                }
            }
        }
    }

    /// The product against f64 sums of the same bf16-rounded operands: only the order of the
    /// f32 sums differs, so the two agree to f32 rounding. Shapes cover partial tiles, odd k,
    /// transposed and strided operands, and accumulation.
    #[test]
    fn products_equal_f64_sums_of_the_rounded_operands() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 BF16");
            return;
        }
        for kernel in [TileKernel::Dot, TileKernel::Fma] {
            with_tile_kernel(kernel, || products_against_f64(kernel));
        }
    }

    fn products_against_f64(kernel: TileKernel) {
        // 400 rows span three blocks of tiles, the last one partial; 3,100 rows two packed parts.
        // k = 50 and 301: the FMA kernel widens a last span of pairs that is partial.
        // n = 50: a last panel of 18 columns, its second half partly masked.
        let shapes = [(1, 1, 1), (13, 33, 7), (12, 32, 64), (25, 70, 301), (40, 96, 768), (400, 40, 50), (30, 50, 17), (3100, 40, 9)];
        for (s, &(m, n, k)) in shapes.iter().enumerate() {
            // lhs: 0, rows k + 3 apart (a column slice); 1, a [k, m + 3] matrix read transposed
            // (a gradient dYᵀ); 2, every other number of rows 2k + 3 apart (neither stride 1).
            for (transposed_rhs, accumulate, lhs_kind) in [
                (false, false, 0),
                (true, false, 0),
                (true, true, 0),
                (false, true, 0),
                (false, false, 1),
                (true, true, 1),
                (true, false, 2),
            ] {
                let a: Vec<f32> = crate::util::rng::randn(
                    300 + s as u64,
                    0.0,
                    1.0,
                    &[(m + 3) * (2 * k + 3)],
                    candle_core::DType::F32,
                    &candle_core::Device::Cpu,
                )
                .unwrap()
                .to_vec1()
                .unwrap();
                let w: Vec<f32> =
                    crate::util::rng::randn(400 + s as u64, 0.0, 1.0, &[n * k], candle_core::DType::F32, &candle_core::Device::Cpu)
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                // rhs: a [n, k] weight read transposed, or the same numbers as a row-major [k, n].
                let lhs = match lhs_kind {
                    0 => Mat::rows(&a, 2, k + 3),
                    1 => Mat::transposed(&a, 2, m + 3),
                    _ => Mat { data: &a, offset: 2, row_stride: 2 * k + 3, col_stride: 2 },
                };
                let rhs = if transposed_rhs { Mat::transposed(&w, 0, k) } else { Mat::rows(&w, 0, n) };
                let at = |mat: &Mat<f32>, i: usize, j: usize| mat.data[mat.offset + i * mat.row_stride + j * mat.col_stride];
                let dst_rs = n + 5;
                let start: Vec<f32> = (0..m * dst_rs).map(|i| (i % 7) as f32 - 3.0).collect();
                // Both ways of running a product: the same sums in the same order.
                let run = || {
                    let mut dst = start.clone();
                    unsafe { product(dst.as_mut_ptr(), 0, dst_rs, Dims { m, n, k }, lhs, rhs, accumulate, 2, None) };
                    dst
                };
                let dst = run();
                assert!(
                    dst == with_whole_operand_packing(run),
                    "{kernel:?} ({m}, {n}, {k}) t{transposed_rhs} a{accumulate} l{lhs_kind}: row groups and whole packing differ"
                );
                for i in 0..m {
                    for j in 0..dst_rs {
                        let got = dst[i * dst_rs + j] as f64;
                        if j >= n {
                            assert_eq!(got, start[i * dst_rs + j] as f64, "wrote outside the product at ({i}, {j})");
                            continue;
                        }
                        let mut want = if accumulate { start[i * dst_rs + j] as f64 } else { 0.0 };
                        let mut scale = want.abs();
                        for p in 0..k {
                            let t = bf16_value(bf16_bits(at(&lhs, i, p))) * bf16_value(bf16_bits(at(&rhs, p, j)));
                            want += t;
                            scale += t.abs();
                        }
                        assert!(
                            (got - want).abs() <= 1e-6 * scale.max(1.0),
                            "{kernel:?} ({m}, {n}, {k}) t{transposed_rhs} a{accumulate} l{lhs_kind} at ({i}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
