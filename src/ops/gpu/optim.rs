//! Launch plans of `kernels/optim.cu`: the AdamW / LAMB update of f32 parameters, rewriting the
//! moments, LAMB's partial sums and the parameter in place (`train::optim::kernels` holds the
//! ops that run them).

use super::program::{Dst, Launch, OptimParams, Params, Program, Src, MAX_GRID, THREADS};

/// Blocks summing LAMB's norms: at most this many partial pairs for the ratio's one block.
const NORM_BLOCKS: usize = 256;

/// The update's three steps, each rewriting one buffer in place:
/// - `Moments`: `[m | v]` from the gradient (operand `[g]`);
/// - `TrustRatio`: LAMB's partial sums and trust ratio (operands `[w, m|v]`);
/// - `Apply`: the parameter from the moments and the ratio buffer (operands `[m|v, ratio]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    Moments,
    TrustRatio,
    Apply,
}

pub(crate) fn norm_blocks(n: usize) -> usize {
    n.div_ceil(THREADS as usize).clamp(1, NORM_BLOCKS)
}

/// Length of a parameter's partial-sum buffer: `[(|w|², |u|²) per norm block | ratio]`.
pub(crate) fn partials_len(n: usize) -> usize {
    2 * norm_blocks(n) + 1
}

/// Checks the lengths of a step's updated buffer and operands against the parameter's `n`: the
/// kernels index them by `n` alone.
pub(crate) fn check_lengths(step: Step, n: usize, out: usize, operands: &[usize]) -> candle_core::Result<()> {
    let (want_out, want): (usize, &[usize]) = match step {
        Step::Moments => (2 * n, &[n]),
        Step::TrustRatio => (partials_len(n), &[n, 2 * n]),
        Step::Apply => (n, &[2 * n, partials_len(n)]),
    };
    if out != want_out || operands != want {
        candle_core::bail!("{step:?} for {n} parameters: buffers of {out} and {operands:?} values, expected {want_out} and {want:?}");
    }
    Ok(())
}

fn launch(kernel: &'static str, step: Step, grid: u32, shared_bytes: u32, out_len: usize, p: OptimParams) -> Launch {
    let second = if step == Step::Moments { Src::Null } else { Src::Operand(1) };
    Launch {
        kernel,
        inputs: [Src::Operand(0), second, Src::Null],
        side: false,
        out: Dst::Out { offset: 0, len: out_len },
        params: Params::Optim(p),
        grid,
        block: THREADS,
        shared_bytes,
    }
}

impl Program {
    /// One step of the update, run in place on its buffer (`gpu::cuda::run_in_place`).
    pub(crate) fn optim(step: Step, p: &OptimParams) -> Program {
        let n = p.n as usize;
        let elementwise = n.div_ceil(THREADS as usize).clamp(1, MAX_GRID as usize) as u32;
        let reduce_shared = THREADS * 8;
        let launches = match step {
            Step::Moments => vec![launch("adam_moments", step, elementwise, 0, 2 * n, *p)],
            Step::TrustRatio => {
                let blocks = norm_blocks(n);
                let len = partials_len(n);
                vec![
                    launch("adam_norms", step, blocks as u32, reduce_shared, len, *p),
                    launch("adam_ratio", step, 1, reduce_shared, len, OptimParams { n: blocks as i64, ..*p }),
                ]
            }
            Step::Apply => vec![launch("adam_apply", step, elementwise, 0, n, *p)],
        };
        let out_len = match step {
            Step::Moments => 2 * n,
            Step::TrustRatio => partials_len(n),
            Step::Apply => n,
        };
        Program { launches, scratch: vec![], out_len }
    }
}
