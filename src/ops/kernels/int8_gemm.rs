//! Linear layers' products with 8-bit integer operands and 32-bit integer sums (AVX-512 VNNI's
//! `vpdpbusd`), for the forward-only commands asked for `--precision int8` (embedding, scoring,
//! evaluation), quantized as ONNX Runtime's and PyTorch's dynamic int8 quantize: the weight `W`
//! `[n, k]` symmetric with one scale per output channel, the input `x` `[m, k]` asymmetric
//! (unsigned, with a zero point) with one scale per row (token), taken from each row as it
//! arrives:
//!
//! `y[i, j] = sx[i]·sw[j]·Σ_k (ux[i, k] − zx[i])·qw[j, k]`, where
//! `qw = round(w / sw)` in −127..=127 with `sw = max|w| / 127` over the channel, and
//! `ux = round(x / sx) + zx` in 0..=255 with `sx = (max − min) / 255` over the row (the range
//! stretched to hold 0, so that 0 stays exact) and `zx = round(−min / sx)`.
//!
//! An asymmetric input spends all 256 steps on the row's range: after GELU, whose outputs lie
//! above −0.17, that is twice as fine as a symmetric step. The integer sums are exact, so the only
//! error is each operand's rounding, at most half a step. `vpdpbusd` multiplies unsigned bytes by
//! signed ones, four neighbouring k at a time, which is the operands' form here; `zx·Σ_k qw` is
//! taken off each sum afterwards. As in the bf16 kernel, the input is packed row by row (one
//! 32-bit broadcast per four k) and the weight into panels of [`NR`] output channels; a
//! [`MR`]×[`NR`] tile of the product is [`MR`]·2 accumulators of 16 sums, and tiles run as
//! parallel tasks.

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use super::operands::{for_each_row_group, for_each_tile, row_groups_allowed, Dims, Epilogue, Mat, TileAdds, TileDst};

/// Rows of a tile: 24 accumulators, two weight loads and a broadcast fit the 32 registers.
const MR: usize = 12;
/// Output channels of a tile: two registers of 16 sums.
const NR: usize = 32;

/// Rows of the input whose tiles run together, each weight panel in turn: 16 tiles.
const BLOCK_ROWS: usize = 16 * MR;

/// Weights up to this size quantized (in bytes) run by row groups ([`for_each_row_group`]): the
/// panels stay in a core's own cache (1 MB or more on the CPUs with VNNI) beside a row group's
/// quantized rows; a ViT-B's 768 × 768 projections (576 KiB) among them.
const GROUP_PANEL_BYTES: usize = 640 * 1024;

/// The longest sum whose 32-bit total cannot overflow: each term is at most 255·127.
pub(crate) const MAX_K: usize = (i32::MAX as usize) / (255 * 127);

static FORWARD_INT8: AtomicBool = AtomicBool::new(false);

/// Whether this CPU has the instructions (AVX-512 F, BW, VL and VNNI).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *YES.get_or_init(|| {
            use std::arch::is_x86_feature_detected as has;
            !crate::ops::simd::avx512_disabled() && has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Routes the process's linear layers through int8 products from now on (or back). A
/// process-wide switch because only forward-only commands set it, before any work starts.
/// Returns whether int8 products will run, which they do only where [`available`].
pub fn set_forward_int8(on: bool) -> bool {
    let on = on && available();
    FORWARD_INT8.store(on, Ordering::Relaxed);
    on
}

/// Whether a linear layer's product of this shape runs in int8: the switch is on, and the
/// product is as large as the bf16 kernel's smallest (`bf16_gemm::set_min_macs`), below which
/// quantizing the weight would cost about what the product does.
pub(crate) fn wanted(d: Dims) -> bool {
    #[cfg(test)]
    let on = FORWARD_INT8.load(Ordering::Relaxed) || TEST_SCOPE.with(|s| s.get());
    #[cfg(not(test))]
    let on = FORWARD_INT8.load(Ordering::Relaxed);
    on && d.k <= MAX_K && d.m.saturating_mul(d.n).saturating_mul(d.k) >= super::bf16_gemm::min_macs()
}

#[cfg(test)]
thread_local! {
    static TEST_SCOPE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `f` with the int8 route on for the products this thread starts (where [`available`]),
/// leaving the process-wide switch alone: tests run beside others that expect f32 products.
#[cfg(test)]
pub(crate) fn with_int8_products<R>(f: impl FnOnce() -> R) -> R {
    TEST_SCOPE.with(|s| s.set(available()));
    let r = f();
    TEST_SCOPE.with(|s| s.set(false));
    r
}

/// A weight channel `src` quantized into `out` as signed bytes (as many as `src` has numbers;
/// the rest left alone): q = round(w·(127 / max|w|)) (ties to even). Returns the scale
/// max|w| / 127 (0 for zeros, NaN where the channel holds one) and Σ q.
///
/// # Safety
/// [`available`] must hold.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn quantize_weight(src: &[f32], out: &mut [u8]) -> (f32, i32) {
    use std::arch::x86_64::*;
    assert!(out.len() >= src.len());
    let (lo, hi, nan) = range(src);
    if nan {
        return (f32::NAN, 0);
    }
    let amax = hi.max(-lo);
    let inv = _mm512_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
    let mut sum = _mm512_setzero_si512();
    each_16(src, out, |v| {
        // Rounds to nearest, ties to even (the default rounding mode); |w·inv| ≤ 127.
        let q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
        sum = _mm512_add_epi32(sum, q);
        q
    });
    (amax / 127.0, _mm512_reduce_add_epi32(sum))
}

/// An input row `src` quantized into `out` as unsigned bytes (as many as `src` has numbers; the
/// rest left alone): u = round(x·(255 / (hi − lo))) + z clamped to 0..=255, with lo = min(0,
/// min x), hi = max(0, max x) and z = round(−lo·(255 / (hi − lo))). Returns the scale
/// (hi − lo) / 255 (0 for zeros, NaN where the row holds one) and z.
///
/// # Safety
/// [`available`] must hold.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn quantize_input(src: &[f32], out: &mut [u8]) -> (f32, i32) {
    use std::arch::x86_64::*;
    assert!(out.len() >= src.len());
    let (lo, hi, nan) = range(src);
    if nan {
        return (f32::NAN, 0);
    }
    let width = hi - lo;
    let inv = if width > 0.0 { 255.0 / width } else { 0.0 };
    let zero = (-lo * inv).round_ties_even().clamp(0.0, 255.0) as i32;
    let (inv, z, top) = (_mm512_set1_ps(inv), _mm512_set1_epi32(zero), _mm512_set1_epi32(255));
    each_16(src, out, |v| {
        _mm512_min_epi32(top, _mm512_max_epi32(_mm512_setzero_si512(), _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)), z)))
    });
    (width / 255.0, zero)
}

/// `(min(0, min src), max(0, max src), whether src holds a NaN)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn range(src: &[f32]) -> (f32, f32, bool) {
    use std::arch::x86_64::*;
    let (mut lo, mut hi, mut nan) = (_mm512_setzero_ps(), _mm512_setzero_ps(), 0u16);
    for j in (0..src.len()).step_by(16) {
        let v = _mm512_maskz_loadu_ps(lanes(src.len() - j), src.as_ptr().add(j));
        nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
    }
    (_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi), nan != 0)
}

/// Writes `byte(src[j..j + 16])`'s low bytes to `out[j..]` for each 16 numbers of `src` (the
/// last group masked; its lanes past the end read as 0).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn each_16(src: &[f32], out: &mut [u8], mut byte: impl FnMut(std::arch::x86_64::__m512) -> std::arch::x86_64::__m512i) {
    use std::arch::x86_64::*;
    for j in (0..src.len()).step_by(16) {
        let lanes = lanes(src.len() - j);
        let bytes = _mm512_cvtepi32_epi8(byte(_mm512_maskz_loadu_ps(lanes, src.as_ptr().add(j))));
        if lanes == u16::MAX {
            // A narrowing store straight to memory is microcoded on some CPUs (Zen 4): narrow in
            // a register, store the 16 bytes.
            _mm_storeu_si128(out.as_mut_ptr().add(j) as *mut _, bytes);
        } else {
            _mm_mask_storeu_epi8(out.as_mut_ptr().add(j) as *mut _, lanes, bytes);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn quantize_weight(_: &[f32], _: &mut [u8]) -> (f32, i32) {
    unreachable!("int8 products run only where `available`")
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn quantize_input(_: &[f32], _: &mut [u8]) -> (f32, i32) {
    unreachable!("int8 products run only where `available`")
}

/// The first `n` (at most 16) lanes.
fn lanes(n: usize) -> u16 {
    if n >= 16 {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}

/// Rows of the input quantized: each row's `kq` words (the bytes past k zero), scale and zero
/// point, rows up to a multiple of [`MR`] (the padding rows zero).
struct Input {
    words: Vec<u32>,
    scales: Vec<f32>,
    zeros: Vec<i32>,
}

impl Input {
    /// Room for `rows` rows of `k` numbers, up to a multiple of [`MR`] rows: what no row's
    /// quantization writes is zeroed (the padding rows, and the bytes past k in each row's last
    /// word), the rest left for the rows to fill. Zeroing all of it first had been a pass over
    /// every input as long as the quantization's own.
    fn unfilled(rows: usize, k: usize) -> Input {
        let (kq, padded) = (k.div_ceil(4), rows.div_ceil(MR) * MR);
        let mut words: Vec<u32> = Vec::with_capacity(padded * kq);
        // SAFETY: u32 has no invalid values; every word is written below or by a row's
        // quantization before a tile reads it.
        #[allow(clippy::uninit_vec)]
        unsafe {
            words.set_len(padded * kq)
        };
        words[rows * kq..].fill(0);
        if !k.is_multiple_of(4) {
            words[..rows * kq].chunks_mut(kq).for_each(|row| row[kq - 1] = 0);
        }
        Input { words, scales: vec![0.0; padded], zeros: vec![0; padded] }
    }

    /// Rows `first..first + rows` of `x` (k numbers each) quantized, on the thread pool where
    /// `parallel`.
    ///
    /// # Safety
    /// [`available`] must hold.
    unsafe fn of(x: Mat<f32>, first: usize, rows: usize, k: usize, parallel: bool) -> Input {
        let kq = k.div_ceil(4);
        let mut q = Input::unfilled(rows, k);
        let row = |(i, ((words, scale), zero)): (usize, ((&mut [u32], &mut f32), &mut i32))| {
            let start = x.offset + (first + i) * x.row_stride;
            // SAFETY: the caller's.
            (*scale, *zero) = unsafe { quantize_input(&x.data[start..start + k], bytemuck_bytes(words)) };
        };
        if parallel {
            q.words.par_chunks_mut(kq).zip(q.scales.par_iter_mut()).zip(q.zeros.par_iter_mut()).take(rows).enumerate().for_each(row);
        } else {
            q.words.chunks_mut(kq).zip(q.scales.iter_mut()).zip(q.zeros.iter_mut()).take(rows).enumerate().for_each(row);
        }
        q
    }

    /// The scales of the tile at this input's row `row` and the weight's channel `col`.
    fn scales(&self, w: &Weight, row: usize, col: usize) -> Scales {
        Scales {
            x: self.scales[row..].as_ptr(),
            zeros: self.zeros[row..].as_ptr(),
            w: w.scales[col..].as_ptr(),
            sums: w.sums[col..].as_ptr(),
        }
    }
}

/// The bytes of a run of 32-bit words.
fn bytemuck_bytes(words: &mut [u32]) -> &mut [u8] {
    // SAFETY: u8 has no alignment or validity requirements; the length covers the same memory.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, words.len() * 4) }
}

/// The weight, quantized per output channel, in panels of [`NR`] channels: in panel b, word
/// `q·NR + c` holds channel `b·NR + c`'s four signed bytes for k = 4q..4q + 4 (zero past k and
/// past n). With each channel's scale and Σ_k qw, which the input's zero point multiplies.
struct Weight {
    panels: Vec<u32>,
    scales: Vec<f32>,
    sums: Vec<i32>,
}

/// `w` is the product's right operand read as `Mat::transposed` of a row-major `[n, k]` weight
/// (`row_stride` 1): column j is the weight's row j, contiguous.
///
/// # Safety
/// [`available`] must hold.
unsafe fn pack_weight(w: Mat<f32>, k: usize, n: usize) -> Weight {
    let kq = k.div_ceil(4);
    let padded = n.div_ceil(NR) * NR;
    let mut panels = vec![0u32; padded * kq];
    let mut scales = vec![0f32; padded];
    let mut sums = vec![0i32; padded];
    panels.par_chunks_mut(kq * NR).zip(scales.par_chunks_mut(NR)).zip(sums.par_chunks_mut(NR)).enumerate().for_each(
        |(b, ((panel, scales), sums))| {
            let mut row = vec![0u32; kq];
            for c in 0..NR.min(n - b * NR) {
                let start = w.offset + (b * NR + c) * w.col_stride;
                // SAFETY: the caller's. The row's words past k stay zero from the start.
                (scales[c], sums[c]) = unsafe { quantize_weight(&w.data[start..start + k], bytemuck_bytes(&mut row)) };
                for (q, &word) in row.iter().enumerate() {
                    panel[q * NR + c] = word;
                }
            }
        },
    );
    Weight { panels, scales, sums }
}

/// `dst[offset + i·dst_rs + j] = (x·Wᵀ)[i, j]` (or `+=`) in int8 products, for `x` `[m, k]` with
/// contiguous rows (`col_stride` 1) and the weight read transposed (`row_stride` 1), split over
/// `threads` tasks; then the `epilogue`, if any, on each tile as it is stored. A row or channel
/// holding NaN gives NaN outputs.
///
/// # Safety
/// [`available`] must hold, and `dst` must be valid for every element written (the caller,
/// `matmul::weight_product_into`, has checked the bounds) with no other thread touching them.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product(
    dst: *mut f32,
    offset: usize,
    dst_rs: usize,
    d: Dims,
    x: Mat<f32>,
    w: Mat<f32>,
    accumulate: bool,
    threads: usize,
    epilogue: Option<Epilogue>,
) {
    assert!(available() && x.col_stride == 1 && w.row_stride == 1 && d.k <= MAX_K, "int8 product of unsupported operands");
    // A frozen weight's panels are quantized once and kept.
    let wq = super::frozen::packed(w, d.k, d.n, || pack_weight(w, d.k, d.n));
    let dst = TileDst(dst.add(offset));
    if wq.panels.len() * std::mem::size_of::<u32>() <= GROUP_PANEL_BYTES && row_groups_allowed() {
        // Each task quantizes its own rows (see `for_each_row_group`).
        // SAFETY: `available` holds (asserted above).
        let quantize = |first, rows| unsafe { Input::of(x, first, rows, d.k, false) };
        for_each_row_group((d.m, d.n), (MR, NR), threads, quantize, |q, t| {
            let (out, place) = (dst.at(t.row0 * dst_rs + t.panel * NR), (t.t * MR, t.row0, t.panel * NR, d.n));
            // SAFETY: the caller's contract; the tile lies inside the product, and no other
            // task writes it.
            unsafe { tile_with((q, &wq), place, (t.rows, t.cols), out, dst_rs, accumulate, epilogue) }
        });
        return;
    }
    // The whole input quantized first (a quarter of its f32 size), then every tile as one loop.
    every_tile((&Input::of(x, 0, d.m, d.k, true), &wq), (d.m, d.n), dst, dst_rs, accumulate, threads, epilogue);
}

/// The tile of `q`'s row `row` (the product's row `row0`) and the weight's channel `col`, of a
/// product `n` wide, stored at `out` (rows `dst_rs` apart) with the `epilogue`; only `rows` ×
/// `cols` of it kept.
///
/// # Safety
/// As [`tile_avx512`]'s, and the epilogue's operands must cover the tile.
#[inline(always)]
unsafe fn tile_with(
    (q, wq): (&Input, &Weight),
    (row, row0, col, n): (usize, usize, usize, usize),
    (rows, cols): (usize, usize),
    out: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    epilogue: Option<Epilogue>,
) {
    let kq = q.words.len() / q.scales.len().max(1);
    let adds = epilogue.map_or(TileAdds::NONE, |e| e.adds(row0, col, n));
    let (a, b) = (q.words[row * kq..].as_ptr(), wq.panels[col * kq..].as_ptr());
    tile_avx512(a, kq, b, q.scales(wq, row, col), out, dst_rs, rows, cols, accumulate, adds);
    if let Some(e) = epilogue {
        e.activate(out, dst_rs, rows, cols);
    }
}

/// Every tile of an `m` × `n` product whose input is quantized whole in `q`, as one parallel
/// loop ([`for_each_tile`]).
///
/// # Safety
/// As [`product`]'s.
unsafe fn every_tile(
    (q, wq): (&Input, &Weight),
    (m, n): (usize, usize),
    dst: TileDst,
    dst_rs: usize,
    accumulate: bool,
    threads: usize,
    epilogue: Option<Epilogue>,
) {
    for_each_tile(m.div_ceil(MR), n.div_ceil(NR), BLOCK_ROWS / MR, threads, |p, r| {
        let place = (r * MR, r * MR, p * NR, n);
        tile_with((q, wq), place, (MR.min(m - r * MR), NR.min(n - p * NR)), dst.at(r * MR * dst_rs + p * NR), dst_rs, accumulate, epilogue)
    });
}

/// A linear layer's input quantized once, by the op that produces it: a LayerNorm's output read
/// by three projections is quantized once rather than by each, and no f32 copy of it is written
/// and read back.
pub(crate) struct QuantizedRows {
    input: Input,
    m: usize,
    k: usize,
}

impl QuantizedRows {
    /// `m` rows of `k` numbers, row i made by `row(i, r)` into an f32 row `r` and quantized from
    /// there as the products quantize an f32 input, so that their sums are the same.
    ///
    /// # Safety
    /// [`available`] must hold.
    pub(crate) unsafe fn from_rows(m: usize, k: usize, row: impl Fn(usize, &mut [f32]) + Sync) -> QuantizedRows {
        let kq = k.div_ceil(4);
        let mut q = Input::unfilled(m, k);
        let rows = q.words.par_chunks_mut(16 * kq).zip(q.scales.par_chunks_mut(16)).zip(q.zeros.par_chunks_mut(16));
        rows.enumerate().take(m.div_ceil(16)).for_each(|(g, ((words, scales), zeros))| {
            let mut scratch = vec![0f32; k];
            for (r, ((words, scale), zero)) in words.chunks_mut(kq).zip(scales).zip(zeros).enumerate().take(m - 16 * g) {
                row(16 * g + r, &mut scratch);
                // SAFETY: the caller's.
                (*scale, *zero) = unsafe { quantize_input(&scratch, bytemuck_bytes(words)) };
            }
        });
        QuantizedRows { input: q, m, k }
    }

    /// `x` (`m` rows of `k`, contiguous) quantized as [`product`] quantizes it.
    ///
    /// # Safety
    /// [`available`] must hold.
    #[cfg(test)]
    unsafe fn of(x: &[f32], m: usize, k: usize) -> QuantizedRows {
        assert!(x.len() >= m * k, "int8 input shorter than its rows");
        QuantizedRows { input: Input::of(Mat::rows(x, 0, k), 0, m, k, true), m, k }
    }

    pub(crate) fn rows(&self) -> usize {
        self.m
    }

    /// Numbers per row.
    pub(crate) fn cols(&self) -> usize {
        self.k
    }

    /// `dst[i·dst_rs + j] = (x·Wᵀ)[i, j]` for this input `x` and the weight `w` read as in
    /// [`product`] (`n` channels), then the `epilogue`: the sums [`product`] makes from x in f32.
    ///
    /// # Safety
    /// [`available`] must hold, and `dst` must be valid for every element written with no other
    /// thread touching them.
    pub(crate) unsafe fn product(&self, dst: *mut f32, dst_rs: usize, w: Mat<f32>, n: usize, threads: usize, epilogue: Option<Epilogue>) {
        let k = self.k;
        assert!(available() && w.row_stride == 1 && k <= MAX_K, "int8 product of unsupported operands");
        let wq = super::frozen::packed(w, k, n, || pack_weight(w, k, n));
        every_tile((&self.input, &wq), (self.m, n), TileDst(dst), dst_rs, false, threads, epilogue);
    }

    /// [`QuantizedRows::product`]'s output (`n` wide) quantized as the next product's input,
    /// the rows [`QuantizedRows::of`] would make from it. A row's quantization needs the whole
    /// row's range, so each task makes [`OUTPUT_GROUP_ROWS`] whole rows in its own f32 buffer,
    /// every panel in turn, and quantizes them from there: the f32 output (an MLP's hidden
    /// layer, four times its input) is never written out and read back.
    ///
    /// # Safety
    /// [`available`] must hold.
    pub(crate) unsafe fn product_quantized(&self, w: Mat<f32>, n: usize, threads: usize, epilogue: Option<Epilogue>) -> QuantizedRows {
        let (m, k) = (self.m, self.k);
        assert!(available() && w.row_stride == 1 && k <= MAX_K && n <= MAX_K, "int8 product of unsupported operands");
        let wq = super::frozen::packed(w, k, n, || pack_weight(w, k, n));
        let mut out = Input::unfilled(m, n);
        let nq = n.div_ceil(4);
        let q = &self.input;
        let group = |(g, ((words, scales), zeros)): (usize, GroupRows)| {
            let first = g * OUTPUT_GROUP_ROWS;
            let rows = OUTPUT_GROUP_ROWS.min(m - first);
            let mut y = vec![0f32; rows * n];
            for col in (0..n).step_by(NR) {
                for row in (0..rows).step_by(MR) {
                    let (r0, tile_rows, cols) = (first + row, MR.min(rows - row), NR.min(n - col));
                    let dst = y[row * n + col..].as_mut_ptr();
                    // SAFETY: the caller's; the tile lies inside `y`, this task's own.
                    unsafe { tile_with((q, &wq), (r0, r0, col, n), (tile_rows, cols), dst, n, false, epilogue) }
                }
            }
            for (r, ((words, scale), zero)) in words.chunks_mut(nq).zip(scales).zip(zeros).take(rows).enumerate() {
                // SAFETY: the caller's.
                (*scale, *zero) = unsafe { quantize_input(&y[r * n..(r + 1) * n], bytemuck_bytes(words)) };
            }
        };
        let groups: Vec<GroupRows> = out
            .words
            .chunks_mut(OUTPUT_GROUP_ROWS * nq)
            .zip(out.scales.chunks_mut(OUTPUT_GROUP_ROWS))
            .zip(out.zeros.chunks_mut(OUTPUT_GROUP_ROWS))
            .take(m.div_ceil(OUTPUT_GROUP_ROWS))
            .collect();
        if threads > 1 {
            groups.into_par_iter().enumerate().for_each(group);
        } else {
            groups.into_iter().enumerate().for_each(group);
        }
        QuantizedRows { input: out, m, k: n }
    }
}

/// A run of a quantized input's rows: their words, scales and zero points.
type GroupRows<'a> = ((&'a mut [u32], &'a mut [f32]), &'a mut [i32]);

/// The rows a task of [`QuantizedRows::product_quantized`] makes whole: a multiple of [`MR`],
/// and few enough that their f32 values stay in a core's own cache for an MLP's hidden layer
/// (48 × 3,072 × 4 bytes: 576 KiB).
const OUTPUT_GROUP_ROWS: usize = 4 * MR;

/// A tile's rows' scales and zero points, and its columns' scales and sums.
#[derive(Clone, Copy)]
struct Scales {
    x: *const f32,
    zeros: *const i32,
    w: *const f32,
    sums: *const i32,
}

/// One [`MR`]×[`NR`] tile over all k; only its first `rows` × `cols` are stored.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx512(
    a: *const u32,
    kq: usize,
    b: *const u32,
    s: Scales,
    dst: *mut f32,
    dst_rs: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
    adds: TileAdds,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_si512(); 2]; MR];
    for q in 0..kq {
        let b0 = _mm512_loadu_si512(b.add(q * NR) as *const _);
        let b1 = _mm512_loadu_si512(b.add(q * NR + 16) as *const _);
        for (r, acc) in acc.iter_mut().enumerate() {
            let four = _mm512_set1_epi32(*a.add(r * kq + q) as i32);
            acc[0] = _mm512_dpbusd_epi32(acc[0], four, b0);
            acc[1] = _mm512_dpbusd_epi32(acc[1], four, b1);
        }
    }
    let masks = [lanes(cols), lanes(cols.saturating_sub(16))];
    let sw = [_mm512_maskz_loadu_ps(masks[0], s.w), _mm512_maskz_loadu_ps(masks[1], s.w.add(16))];
    let sums = [_mm512_maskz_loadu_epi32(masks[0], s.sums), _mm512_maskz_loadu_epi32(masks[1], s.sums.add(16))];
    let store = |r: usize, acc: [__m512i; 2]| {
        let (x_scale, zero) = (_mm512_set1_ps(*s.x.add(r)), _mm512_set1_epi32(*s.zeros.add(r)));
        for h in 0..2 {
            let p = dst.add(r * dst_rs + 16 * h);
            // Σ (u − z)·qw = Σ u·qw − z·Σ qw, exact in 32 bits (|u − z| ≤ 255).
            let exact = _mm512_sub_epi32(acc[h], _mm512_mullo_epi32(zero, sums[h]));
            let mut v = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(x_scale, sw[h]));
            if accumulate {
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(masks[h], p));
            }
            _mm512_mask_storeu_ps(p, masks[h], adds.add(v, r, 16 * h, masks[h]));
        }
    };
    // Row by row with constant indices, written out: as a loop (which the compiler keeps for a
    // body this long) the accumulators became an array on the stack, zeroed by a call to memset
    // at every tile.
    macro_rules! store_rows {
        ($($r:literal)*) => {
            $(if $r < rows {
                store($r, acc[$r]);
            })*
        };
    }
    const _: () = assert!(MR == 12, "store_rows! names every row of a tile");
    store_rows!(0 1 2 3 4 5 6 7 8 9 10 11);
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx512(_: *const u32, _: usize, _: *const u32, _: Scales, _: *mut f32, _: usize, _: usize, _: usize, _: bool, _: TileAdds) {
    unreachable!("int8 products run only where `available`")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::kernels::bias_act::Activation;
    use crate::ops::kernels::operands::with_whole_operand_packing;

    fn randn(seed: u64, len: usize) -> Vec<f32> {
        crate::util::rng::randn(seed, 0.0, 1.0, &[len], candle_core::DType::F32, &candle_core::Device::Cpu).unwrap().to_vec1().unwrap()
    }

    /// A weight channel quantized from the definition (the multiplier 127 / max|w| in f32, ties
    /// to even): the integers and the scale.
    fn reference_weight(w: &[f32]) -> (Vec<i64>, f64) {
        let amax = w.iter().fold(0f32, |m, &x| m.max(x.abs()));
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        (w.iter().map(|&x| (x * inv).round_ties_even() as i64).collect(), (amax / 127.0) as f64)
    }

    /// An input row quantized from the definition: the integers u − z (what each stands for, in
    /// steps), the unsigned bytes u, the scale and the zero point.
    fn reference_input(x: &[f32]) -> (Vec<i64>, Vec<u8>, f64, i64) {
        let lo = x.iter().fold(0f32, |m, &v| m.min(v));
        let hi = x.iter().fold(0f32, |m, &v| m.max(v));
        let inv = if hi > lo { 255.0 / (hi - lo) } else { 0.0 };
        let z = (-lo * inv).round_ties_even().clamp(0.0, 255.0) as i64;
        let u: Vec<u8> = x.iter().map(|&v| ((v * inv).round_ties_even() as i64 + z).clamp(0, 255) as u8).collect();
        (u.iter().map(|&u| u as i64 - z).collect(), u, ((hi - lo) / 255.0) as f64, z)
    }

    #[test]
    fn weights_quantize_symmetrically_and_inputs_over_their_range() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        // 16 + 7 numbers: a whole vector and a masked tail. The largest magnitude is negative;
        // 0.5 and 1.5 steps sit exactly on ties for the weight (amax 127: a step of 1).
        let mut row: Vec<f32> = (0..23).map(|i| (i as f32 - 9.0) * 0.37).collect();
        row[20] = -127.0;
        row[21] = 0.5;
        row[22] = 1.5;
        let mut out = vec![0u8; 24];
        let (scale, sum) = unsafe { quantize_weight(&row, &mut out) };
        let (q, s) = reference_weight(&row);
        assert_eq!((scale as f64, sum as i64), (s, q.iter().sum::<i64>()));
        let got: Vec<i64> = out[..23].iter().map(|&b| b as i8 as i64).collect();
        assert_eq!(got, q);
        assert_eq!((got[20], got[21], got[22]), (-127, 0, 2), "ties go to even");
        assert_eq!(out[23], 0, "past the row: untouched");

        let mut bytes = vec![0u8; 24];
        let (scale, zero) = unsafe { quantize_input(&row, &mut bytes) };
        let (_, u, s, z) = reference_input(&row);
        assert_eq!((scale as f64, zero as i64), (s, z));
        assert_eq!(&bytes[..23], &u[..]);
        assert_eq!((bytes[20], bytes[23]), (0, 0), "the minimum is step 0; past the row: untouched");
        // All positive: the range is stretched down to 0, which stays exact at zero point 0.
        let (scale, zero) = unsafe { quantize_input(&[0.5, 2.0, 1.0], &mut bytes) };
        assert_eq!((scale, zero, &bytes[..3]), (2.0 / 255.0, 0, &[64u8, 255, 128][..]));
        let (scale, zero) = unsafe { quantize_input(&[0.0; 5], &mut bytes) };
        assert_eq!((scale, zero, &bytes[..5]), (0.0, 0, &[0u8; 5][..]));
        assert!(unsafe { quantize_input(&[1.0, f32::NAN, 2.0], &mut bytes) }.0.is_nan());
        assert!(unsafe { quantize_weight(&[1.0, f32::NAN, 2.0], &mut bytes) }.0.is_nan());
    }

    /// The product against exact integer sums of the same quantized operands, scaled in f64:
    /// only the f32 epilogue differs. Shapes cover partial tiles and panels, k not a multiple of
    /// four, several row blocks, strided rows, inputs all of one sign, and accumulation; each
    /// both by row groups and with the input quantized whole first, which give the same numbers.
    #[test]
    fn products_equal_integer_sums_of_the_quantized_operands() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        for (s, &(m, n, k)) in [(1, 1, 1), (13, 33, 7), (12, 32, 64), (25, 70, 301), (400, 40, 50), (30, 50, 17)].iter().enumerate() {
            for accumulate in [false, true] {
                let mut x = randn(500 + s as u64, m * (k + 3) + 2);
                if s == 3 {
                    // Rows after GELU: nothing below −0.17.
                    x.iter_mut().for_each(|v| *v = v.max(-0.17));
                }
                let w = randn(600 + s as u64, n * k);
                let dst_rs = n + 5;
                let start: Vec<f32> = (0..m * dst_rs).map(|i| (i % 7) as f32 - 3.0).collect();
                let d = Dims { m, n, k };
                let run = || {
                    let mut dst = start.clone();
                    unsafe {
                        product(dst.as_mut_ptr(), 0, dst_rs, d, Mat::rows(&x, 2, k + 3), Mat::transposed(&w, 0, k), accumulate, 2, None)
                    };
                    dst
                };
                let dst = run();
                assert!(dst == with_whole_operand_packing(run), "({m}, {n}, {k}) a{accumulate}: row groups and whole quantization differ");
                let rows: Vec<_> = (0..m).map(|i| reference_input(&x[2 + i * (k + 3)..2 + i * (k + 3) + k])).collect();
                let cols: Vec<_> = (0..n).map(|j| reference_weight(&w[j * k..(j + 1) * k])).collect();
                for i in 0..m {
                    for j in 0..dst_rs {
                        let got = dst[i * dst_rs + j] as f64;
                        if j >= n {
                            assert_eq!(got, start[i * dst_rs + j] as f64, "wrote outside the product at ({i}, {j})");
                            continue;
                        }
                        let ((qx, _, sx, _), (qw, sw)) = (&rows[i], &cols[j]);
                        let dot: i64 = qx.iter().zip(qw).map(|(a, b)| a * b).sum();
                        let size: i64 = qx.iter().zip(qw).map(|(a, b)| (a * b).abs()).sum();
                        let base = if accumulate { start[i * dst_rs + j] as f64 } else { 0.0 };
                        let want = base + sx * sw * dot as f64;
                        let tol = 1e-6 * (base.abs() + sx * sw * size as f64);
                        assert!((got - want).abs() <= tol, "({m}, {n}, {k}) a{accumulate} at ({i}, {j}): {got} vs {want}");
                    }
                }
            }
        }
    }

    /// An input quantized once by the op that makes it ([`QuantizedRows`]) gives the products
    /// that the f32 input gives, bit for bit, epilogue included.
    #[test]
    fn prepared_inputs_give_the_products_of_the_f32_input() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        for (s, &(m, n, k)) in [(1, 1, 1), (13, 33, 7), (25, 70, 301), (400, 40, 50), (50, 64, 96)].iter().enumerate() {
            let s = s as u64;
            let (x, w, bias, residual) = (randn(700 + s, m * k), randn(710 + s, n * k), randn(720 + s, n), randn(730 + s, m * n));
            let d = Dims { m, n, k };
            for epilogue in [None, Some(Epilogue { bias: Some(&bias), residual: Some(&residual), act: Activation::QuickGelu })] {
                let mut want = vec![0f32; m * n];
                unsafe { product(want.as_mut_ptr(), 0, n, d, Mat::rows(&x, 0, k), Mat::transposed(&w, 0, k), false, 2, epilogue) };
                let made = unsafe { QuantizedRows::from_rows(m, k, |i, r| r.copy_from_slice(&x[i * k..(i + 1) * k])) };
                for (how, q) in [("from rows", &made), ("of a slice", &unsafe { QuantizedRows::of(&x, m, k) })] {
                    let mut got = vec![f32::NAN; m * n];
                    unsafe { q.product(got.as_mut_ptr(), n, Mat::transposed(&w, 0, k), n, 2, epilogue) };
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "({m}, {n}, {k}) {how}, epilogue {}: differs", epilogue.is_some());
                }
            }
            // The output quantized as its rows are made, against the f32 output quantized after.
            let epilogue = Some(Epilogue { bias: Some(&bias), residual: None, act: Activation::QuickGelu });
            let mut y = vec![0f32; m * n];
            unsafe { product(y.as_mut_ptr(), 0, n, d, Mat::rows(&x, 0, k), Mat::transposed(&w, 0, k), false, 2, epilogue) };
            let after = unsafe { QuantizedRows::of(&y, m, n) };
            let made = unsafe { QuantizedRows::from_rows(m, k, |i, r| r.copy_from_slice(&x[i * k..(i + 1) * k])) };
            for threads in [1, 2] {
                let next = unsafe { made.product_quantized(Mat::transposed(&w, 0, k), n, threads, epilogue) };
                let (a, b) = (&next.input, &after.input);
                let scales = a.scales.iter().zip(&b.scales).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(
                    (next.m, next.k) == (m, n) && a.words == b.words && a.zeros == b.zeros && scales,
                    "({m}, {n}, {k}) {threads} threads: quantized as made differs"
                );
            }
        }
    }

    /// Against the f32 product of the unquantized operands, the error stays within what half a
    /// step on each operand allows: |Δy| ≤ Σ_k (|x|·sw/2 + |w|·sx/2 + sx·sw/4).
    #[test]
    fn the_error_is_bounded_by_half_a_step_on_each_operand() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        let (m, n, k) = (37, 45, 384);
        let x = randn(700, m * k);
        let w = randn(701, n * k);
        let mut y = vec![0f32; m * n];
        unsafe { product(y.as_mut_ptr(), 0, n, Dims { m, n, k }, Mat::rows(&x, 0, k), Mat::transposed(&w, 0, k), false, 2, None) };
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            let sx = reference_input(xr).2;
            for j in 0..n {
                let wr = &w[j * k..(j + 1) * k];
                let sw = reference_weight(wr).1;
                let exact: f64 = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
                let bound: f64 =
                    xr.iter().zip(wr).map(|(&a, &b)| (a as f64).abs() * sw / 2.0 + (b as f64).abs() * sx / 2.0 + sx * sw / 4.0).sum();
                assert!((y[i * n + j] as f64 - exact).abs() <= bound * 1.001, "({i}, {j})");
            }
        }
    }
}
