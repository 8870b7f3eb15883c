//! Launch plans of `kernels/rows.cu`: the transformer towers' row-wise ops (LayerNorm, the
//! scaled and masked softmax, bias + GELU, column sums).

use super::program::{grid, Dst, Launch, Limits, Params, Program, RowParams, Src, THREADS};

/// Partial sums over rows: at most this many chunks, so the second pass is short.
const MAX_CHUNKS: usize = 512;

/// Threads per block for a row of `cols`: a power of two (the tree reduction halves it), at
/// least a warp, at most [`THREADS`].
pub(super) fn row_threads(cols: usize) -> u32 {
    (cols.next_power_of_two() as u32).clamp(32, THREADS)
}

/// Shared memory of the LayerNorm parameter gradients' kernel: the reduction scratch and the
/// block's sums of two rows' worth of values.
fn layer_norm_grad_shared(cols: usize, elem: usize) -> usize {
    (row_threads(cols) as usize + 2 * cols) * elem
}

/// Whether the LayerNorm backward kernels take rows of `cols` values of `elem` bytes; wider ones
/// (above about 6000 in f32) compose candle ops on the GPU.
pub(crate) fn layer_norm_fits(cols: usize, elem: usize) -> bool {
    layer_norm_grad_shared(cols, elem) <= super::program::GPU.max_shared
}

fn params(rows: usize, cols: usize) -> RowParams {
    RowParams { rows: rows as i64, cols: cols as i32, ..Default::default() }
}

impl Program {
    /// A kernel with one block per row and a reduction scratch of one element per thread.
    fn per_row(kernel: &'static str, inputs: [Src; 3], side: bool, p: RowParams, elem: usize, limits: &Limits) -> Launch {
        let block = row_threads(p.cols as usize);
        let out = Dst::Out { offset: 0, len: p.rows as usize * p.cols as usize };
        let grid = grid(p.rows as usize, limits);
        Launch { kernel, inputs, side, out, params: Params::Row(p), grid, block, shared_bytes: block * elem as u32 }
    }

    /// An elementwise kernel over `rows × cols`.
    fn elementwise(kernel: &'static str, inputs: [Src; 3], p: RowParams, limits: &Limits) -> Launch {
        let len = p.rows as usize * p.cols as usize;
        let out = Dst::Out { offset: 0, len };
        let grid = grid(len.div_ceil(THREADS as usize), limits);
        Launch { kernel, inputs, side: false, out, params: Params::Row(p), grid, block: THREADS, shared_bytes: 0 }
    }

    /// `column_sums` of `src` as `[rows, cols]` in chunks of `chunk` rows, to `out`.
    fn column_sums_launch(src: Src, rows: usize, cols: usize, chunk: usize, out: Dst, limits: &Limits) -> Launch {
        let p = RowParams { chunk: chunk as i32, ..params(rows, cols) };
        let units = rows.div_ceil(chunk) * cols;
        let grid = grid(units.div_ceil(THREADS as usize), limits);
        Launch {
            kernel: "column_sums",
            inputs: [src, Src::Null, Src::Null],
            side: false,
            out,
            params: Params::Row(p),
            grid,
            block: THREADS,
            shared_bytes: 0,
        }
    }

    /// Rows per chunk of a two-pass sum over `rows`.
    fn chunk(rows: usize) -> usize {
        rows.div_ceil(MAX_CHUNKS).max(1)
    }

    /// `LayerNormOp` on operands `[x, weight, bias]`, rows of `cols`.
    pub(crate) fn layer_norm(rows: usize, cols: usize, eps: f64, elem: usize, limits: &Limits) -> Program {
        let p = RowParams { value: eps, ..params(rows, cols) };
        let ops = [Src::Operand(0), Src::Operand(1), Src::Operand(2)];
        Program::one(Program::per_row("layer_norm_fwd", ops, false, p, elem, limits), rows * cols)
    }

    /// `LayerNormGrad` on operands `[x, weight, dy]`: the output is `[dx | dweight | dbias]`.
    /// dx is one block per row; the parameter gradients are summed per chunk of rows into a
    /// scratch `[chunks, 2·cols]` and the chunks then added in order.
    pub(crate) fn layer_norm_grad(rows: usize, cols: usize, eps: f64, elem: usize, limits: &Limits) -> candle_core::Result<Program> {
        let p = RowParams { value: eps, ..params(rows, cols) };
        let dx = Program::per_row("layer_norm_grad_input", [Src::Operand(0), Src::Operand(1), Src::Operand(2)], false, p, elem, limits);
        let chunk = Program::chunk(rows);
        let chunks = rows.div_ceil(chunk);
        let block = row_threads(cols);
        let shared = layer_norm_grad_shared(cols, elem);
        if shared > limits.max_shared {
            candle_core::bail!(
                "layer norm backward on the GPU: rows of {cols} need {shared} bytes of shared memory, more than {}",
                limits.max_shared
            );
        }
        let partial = Launch {
            kernel: "layer_norm_grad_params",
            inputs: [Src::Operand(0), Src::Null, Src::Operand(2)],
            side: false,
            out: Dst::Scratch(0),
            params: Params::Row(RowParams { chunk: chunk as i32, ..p }),
            grid: grid(chunks, limits),
            block,
            shared_bytes: shared as u32,
        };
        let total = Program::column_sums_launch(
            Src::Scratch(0),
            chunks,
            2 * cols,
            chunks.max(1),
            Dst::Out { offset: rows * cols, len: 2 * cols },
            limits,
        );
        Ok(Program { launches: vec![dx, partial, total], scratch: vec![chunks * 2 * cols], out_len: rows * cols + 2 * cols })
    }

    /// `softmax(scale·x + key_bias)` per row on operand `[x]`; the key bias (`[batch, cols]`)
    /// serves `rows_per_bias` consecutive rows per batch element.
    pub(crate) fn softmax(rows: usize, cols: usize, scale: f64, key_bias: Option<usize>, elem: usize, limits: &Limits) -> Program {
        let p = RowParams { value: scale, rows_per_bias: key_bias.unwrap_or(1).max(1) as i32, ..params(rows, cols) };
        let ops = [Src::Operand(0), Src::Null, Src::Null];
        Program::one(Program::per_row("softmax_fwd", ops, key_bias.is_some(), p, elem, limits), rows * cols)
    }

    /// The softmax's input gradient on operands `[y, dy]`.
    pub(crate) fn softmax_grad(rows: usize, cols: usize, scale: f64, elem: usize, limits: &Limits) -> Program {
        let p = RowParams { value: scale, ..params(rows, cols) };
        let ops = [Src::Operand(0), Src::Operand(1), Src::Null];
        Program::one(Program::per_row("softmax_grad", ops, false, p, elem, limits), rows * cols)
    }

    /// `act(y + b)` on operands `[y, b]`; `gelu` picks GELU over the identity.
    pub(crate) fn bias_act(rows: usize, cols: usize, gelu: bool, limits: &Limits) -> Program {
        let p = RowParams { act: i32::from(gelu), ..params(rows, cols) };
        Program::one(Program::elementwise("bias_act", [Src::Operand(0), Src::Operand(1), Src::Null], p, limits), rows * cols)
    }

    /// `dy · gelu'(y + b)` on operands `[y, b, dy]`.
    pub(crate) fn bias_gelu_grad(rows: usize, cols: usize, limits: &Limits) -> Program {
        let ops = [Src::Operand(0), Src::Operand(1), Src::Operand(2)];
        Program::one(Program::elementwise("bias_gelu_grad", ops, params(rows, cols), limits), rows * cols)
    }

    /// Sums over rows of operand `[x]` (`[rows, cols]` → `[cols]`), in two passes.
    pub(crate) fn column_sums(rows: usize, cols: usize, limits: &Limits) -> Program {
        let chunk = Program::chunk(rows);
        let chunks = rows.div_ceil(chunk);
        let partial = Program::column_sums_launch(Src::Operand(0), rows, cols, chunk, Dst::Scratch(0), limits);
        let total = Program::column_sums_launch(Src::Scratch(0), chunks, cols, chunks.max(1), Dst::Out { offset: 0, len: cols }, limits);
        Program { launches: vec![partial, total], scratch: vec![chunks * cols], out_len: cols }
    }
}
