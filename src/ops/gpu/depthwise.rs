//! Launch plans of `kernels/depthwise.cu`: EfficientNet's depthwise convolution, forward and both
//! gradients. One thread per output element for the forward pass and the input gradient, one
//! block per weight for the kernel gradient.

use super::program::{DepthwiseParams, Dst, Launch, Params, Program, Src, THREADS};

/// The three passes, each on two operands: `[x, kernel]`, `[dy, kernel]` and `[x, dy]`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Pass {
    Forward,
    GradInput,
    GradKernel,
}

impl Program {
    pub(crate) fn depthwise(pass: Pass, g: DepthwiseParams, elem: usize) -> Program {
        let (n, c, k) = (g.n as usize, g.c as usize, g.k as usize);
        let (kernel, out_len, grid, shared) = match pass {
            Pass::Forward | Pass::GradInput => {
                let (kernel, out_len) = match pass {
                    Pass::Forward => ("depthwise_fwd", n * c * g.ho as usize * g.wo as usize),
                    _ => ("depthwise_grad_input", n * c * g.h as usize * g.w as usize),
                };
                (kernel, out_len, out_len.div_ceil(THREADS as usize).clamp(1, 1 << 20) as u32, 0)
            }
            Pass::GradKernel => ("depthwise_grad_kernel", c * k * k, (c * k * k) as u32, THREADS * elem as u32),
        };
        let launch = Launch {
            kernel,
            inputs: [Src::Operand(0), Src::Operand(1), Src::Null],
            side: false,
            out: Dst::Out { offset: 0, len: out_len },
            params: Params::Depthwise(g),
            grid,
            block: THREADS,
            shared_bytes: shared,
        };
        Program::one(launch, out_len)
    }
}
