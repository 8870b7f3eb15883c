//! Launch plans of `kernels/channels.cu`: the convolutional towers' per-channel ops (batch
//! moments, BatchNorm + SiLU, channel scaling, plane sums, the scaled residual).

use super::program::{grid, ChannelParams, Dst, Launch, Limits, Params, Program, Src, THREADS};
use super::rows::row_threads;

impl Program {
    /// A per-channel kernel over NCHW `(n, c, hw)` operands: one block per channel (`Channel`),
    /// per plane (`Plane`), or a thread per element (`Element`); the reductions' scratch is one
    /// f64 per thread.
    fn channel(
        kernel: &'static str,
        inputs: [Src; 3],
        side: bool,
        p: ChannelParams,
        shape: Spread,
        out_len: usize,
        limits: &Limits,
    ) -> Program {
        let (n, c, hw) = (p.n as usize, p.c as usize, p.hw as usize);
        let (units, block, shared_bytes) = match shape {
            Spread::Channel => (c, THREADS, THREADS * 8),
            Spread::Plane => (n * c, row_threads(hw), row_threads(hw) * 8),
            Spread::Element => ((n * c * hw).div_ceil(THREADS as usize), THREADS, 0),
        };
        let out = Dst::Out { offset: 0, len: out_len };
        let launch = Launch { kernel, inputs, side, out, params: Params::Channel(p), grid: grid(units, limits), block, shared_bytes };
        Program::one(launch, out_len)
    }

    /// Per-channel mean and biased variance of operand `[x]`: `[2, c]`.
    pub(crate) fn channel_moments((n, c, hw): (usize, usize, usize), limits: &Limits) -> Program {
        let ops = [Src::Operand(0), Src::Null, Src::Null];
        Program::channel("channel_moments", ops, false, channel_params(n, c, hw), Spread::Channel, 2 * c, limits)
    }

    /// `act(γ·(x − μ)·r + β)` on operands `[x, γ, β]`; the side buffer is `[μ (c) | r (c)]`.
    pub(crate) fn batch_norm_act((n, c, hw): (usize, usize, usize), silu: bool, limits: &Limits) -> Program {
        let p = ChannelParams { silu: i32::from(silu), ..channel_params(n, c, hw) };
        let ops = [Src::Operand(0), Src::Operand(1), Src::Operand(2)];
        Program::channel("batch_norm_act", ops, true, p, Spread::Element, n * c * hw, limits)
    }

    /// BatchNorm's backward on operands `[x, dy, γ|β]` with the side buffer `[μ (c) | r (c)]`:
    /// `[dx | Σdz·x̂ (c) | Σdz (c)]`.
    pub(crate) fn batch_norm_act_grad((n, c, hw): (usize, usize, usize), silu: bool, batch_stats: bool, limits: &Limits) -> Program {
        let p = ChannelParams { silu: i32::from(silu), batch_stats: i32::from(batch_stats), ..channel_params(n, c, hw) };
        let ops = [Src::Operand(0), Src::Operand(1), Src::Operand(2)];
        Program::channel("batch_norm_act_grad", ops, true, p, Spread::Channel, n * c * hw + 2 * c, limits)
    }

    /// `h · s[plane]` on operands `[h, s]`.
    pub(crate) fn channel_scale((n, c, hw): (usize, usize, usize), limits: &Limits) -> Program {
        let ops = [Src::Operand(0), Src::Operand(1), Src::Null];
        Program::channel("channel_scale", ops, false, channel_params(n, c, hw), Spread::Element, n * c * hw, limits)
    }

    /// `Σ_hw a·b` per plane on operands `[a, b]`: `[n, c]`.
    pub(crate) fn dot_per_plane((n, c, hw): (usize, usize, usize), limits: &Limits) -> Program {
        let ops = [Src::Operand(0), Src::Operand(1), Src::Null];
        Program::channel("dot_per_plane", ops, false, channel_params(n, c, hw), Spread::Plane, n * c, limits)
    }

    /// The mean of each plane of operand `[x]`: `[n, c]`.
    pub(crate) fn spatial_mean((n, c, hw): (usize, usize, usize), limits: &Limits) -> Program {
        let ops = [Src::Operand(0), Src::Null, Src::Null];
        Program::channel("spatial_mean", ops, false, channel_params(n, c, hw), Spread::Plane, n * c, limits)
    }

    /// `h·keep[image] + x` on operands `[h, x]`, the side buffer `keep` (n).
    pub(crate) fn scaled_residual((n, c, hw): (usize, usize, usize), limits: &Limits) -> Program {
        let ops = [Src::Operand(0), Src::Operand(1), Src::Null];
        Program::channel("scaled_residual", ops, true, channel_params(n, c, hw), Spread::Element, n * c * hw, limits)
    }
}

/// How a per-channel kernel spreads over the GPU.
#[derive(Clone, Copy, Debug)]
enum Spread {
    Channel,
    Plane,
    Element,
}

fn channel_params(n: usize, c: usize, hw: usize) -> ChannelParams {
    ChannelParams { n: n as i32, c: c as i32, hw: hw as i64, ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::super::host::{assert_close, to_f32, values, Pod};
    use super::super::{run_on_host, Program, SideBuf, SMALL_GRID};
    use crate::ops::kernels::batch_norm::{BatchNormAct, Statistics};
    use crate::ops::kernels::channel_scale::scale_planes;
    use crate::ops::kernels::moments::moments;
    use crate::ops::kernels::stochastic_depth::scaled_sum;
    use crate::ops::{lane_dot, lane_sum, Float};

    /// Every per-channel program in the host emulation against the CPU kernels, in one dtype.
    fn check<T: Float + Pod>(dims: (usize, usize, usize), x: &[T], dy: &[T], gamma: &[T], beta: &[T], tol: f64) {
        let (n, c, hw) = dims;
        let limits = &SMALL_GRID;
        let what = format!("{n}x{c}x{hw} {}", std::mem::size_of::<T>() * 8);
        assert_close(&run_on_host(&Program::channel_moments(dims, limits), &[x], None), &moments(x, n, c, hw), tol, &what);
        let stats = moments(x, n, c, hw).iter().map(|v| v.f()).collect::<Vec<_>>();
        let (mean, var) = stats.split_at(c);
        for (from_batch, silu) in [(true, true), (true, false), (false, true)] {
            let op = BatchNormAct::new(&Statistics { mean, var, eps: 1e-3, from_batch }, silu);
            let side = op.side();
            let side = Some(&side);
            let what = format!("{what} batch statistics {from_batch}, SiLU {silu}");
            let forward = run_on_host(&Program::batch_norm_act(dims, silu, limits), &[x, gamma, beta], side);
            assert_close(&forward, &op.apply(x, gamma, beta, c, hw), tol, &what);
            let gb: Vec<T> = gamma.iter().chain(beta).copied().collect();
            let backward = run_on_host(&Program::batch_norm_act_grad(dims, silu, from_batch, limits), &[x, dy, &gb], side);
            assert_close(&backward, &op.gradients(x, dy, gamma, beta, dims), tol, &what);
        }
        let s: Vec<T> = dy[..n * c].to_vec();
        let factors: Vec<f64> = s.iter().map(|v| v.f()).collect();
        assert_close(&run_on_host(&Program::channel_scale(dims, limits), &[x, &s], None), &scale_planes(x, &factors, None, hw), tol, &what);
        let dots: Vec<T> = x.chunks(hw).zip(dy.chunks(hw)).map(|(a, b)| lane_dot(a, b)).collect();
        assert_close(&run_on_host(&Program::dot_per_plane(dims, limits), &[x, dy], None), &dots, tol, &what);
        let means: Vec<T> = x.chunks(hw).map(|p| T::from(lane_sum(p).f() / hw as f64)).collect();
        assert_close(&run_on_host(&Program::spatial_mean(dims, limits), &[x], None), &means, tol, &what);
        let keep: Vec<f64> = (0..n).map(|i| if i % 2 == 0 { 1.25 } else { 0.0 }).collect();
        let residual = run_on_host(&Program::scaled_residual(dims, limits), &[x, dy], Some(&SideBuf::F64(keep.clone())));
        assert_close(&residual, &scaled_sum(x, &keep, dy), tol, &what);
    }

    #[test]
    fn the_gpu_kernels_match_the_cpu_ops_in_the_host_emulation() {
        // Planes larger than a block (300 > 256 threads) and smaller (7 of 32); more channels and
        // planes than the small grid's blocks; a mean far from zero for the shifted moments.
        for dims in [(3, 5, 300), (4, 9, 7)] {
            let len = dims.0 * dims.1 * dims.2;
            let x = values(220, 3.0, 2.0, len);
            let dy = values(221, 0.0, 1.0, len);
            let gamma = values(222, 1.0, 0.3, dims.1);
            let beta = values(223, 0.0, 0.3, dims.1);
            check(dims, &x, &dy, &gamma, &beta, 1e-12);
            check(dims, &to_f32(&x), &to_f32(&dy), &to_f32(&gamma), &to_f32(&beta), 2e-5);
        }
    }
}
