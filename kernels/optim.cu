// AdamW and LAMB updating one f32 parameter and its moments in place, for align's optimizer
// (src/train/optim/kernels.rs, planned by src/ops/gpu/optim.rs), with the formulas of its CPU
// update:
//   m <- b1 m + (1 - b1) g,  v <- b2 v + (1 - b2) g^2   (g already scaled by the clip factor)
//   u = m / bc1 / (sqrt(v / bc2) + eps) + wd w,  w <- w - lr * ratio * u
// with ratio = |w| / |u| for LAMB (1 when either norm is 0) and 1 for AdamW. The moments live in
// one buffer [m (n) | v (n)]. LAMB's norms are summed per block and the block sums added by one
// block, on the device: no copy to the host between the launches. Same signature as the other
// kernel files: kernel(a, b, c, aux, out, params); out is the buffer updated in place.

#include "reduce.cuh"

struct OptimParams {
    long long n;         // elements of the parameter (adam_ratio: pairs of partial sums)
    long long ratio_at;  // adam_apply: where the trust ratio sits in its buffer
    float lr, clip, b1, b2, inv_bc1, inv_bc2, eps, wd;
    int lamb;
    int unused;
};

__device__ float direction(float m, float v, float w, OptimParams p) {
    return m * p.inv_bc1 / (sqrt(v * p.inv_bc2) + p.eps) + p.wd * w;
}

// a = g, out = [m | v].
__device__ void adam_moments(const float* g, float* mv, OptimParams p) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x) {
        float gi = g[i] * p.clip;
        mv[i] = p.b1 * mv[i] + (1.0f - p.b1) * gi;
        mv[p.n + i] = p.b2 * mv[p.n + i] + (1.0f - p.b2) * gi * gi;
    }
}

// a = w, b = [m | v], out = partial sums [|w|^2, |u|^2] per block (2 * gridDim.x values).
__device__ void adam_norms(const float* w, const float* mv, float* partial, OptimParams p, double* scratch) {
    double ww = 0, uu = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x) {
        float u = direction(mv[i], mv[p.n + i], w[i], p);
        ww += (double)w[i] * w[i];
        uu += (double)u * u;
    }
    ww = block_sum(ww, scratch);
    uu = block_sum(uu, scratch);
    if (threadIdx.x == 0) {
        partial[2 * blockIdx.x] = (float)ww;
        partial[2 * blockIdx.x + 1] = (float)uu;
    }
}

// One block: out = the partial sums (p.n pairs) followed by the trust ratio, written after them.
__device__ void adam_ratio(float* partial, OptimParams p, double* scratch) {
    double ww = 0, uu = 0;
    for (long long k = threadIdx.x; k < p.n; k += blockDim.x) {
        ww += partial[2 * k];
        uu += partial[2 * k + 1];
    }
    ww = block_sum(ww, scratch);
    uu = block_sum(uu, scratch);
    if (threadIdx.x == 0) {
        double wn = sqrt(ww), un = sqrt(uu);
        partial[2 * p.n] = (float)(wn > 0 && un > 0 ? wn / un : 1.0);
    }
}

// a = [m | v], b = the ratio buffer (read at p.ratio_at when LAMB), out = w.
__device__ void adam_apply(const float* mv, const float* ratio, float* w, OptimParams p) {
    float scale = p.lr * (p.lamb ? ratio[p.ratio_at] : 1.0f);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x) {
        w[i] -= scale * direction(mv[i], mv[p.n + i], w[i], p);
    }
}

#define OPTIM_KERNEL(NAME, T, SUFFIX, CALL)                                                                       \
    extern "C" __global__ void NAME##_##SUFFIX(const T* a, const T* b, const T* c, const double* aux, T* out,      \
                                               OptimParams p) {                                                    \
        extern __shared__ unsigned char smem[];                                                                    \
        (void)a, (void)b, (void)c, (void)aux, (void)smem;                                                          \
        CALL;                                                                                                      \
    }

// The kernels by name, for instantiation here and for the host emulation's table. f32 only:
// the optimizer keeps f32 master weights.
#define OPTIM_KERNELS(X, T, SUFFIX)                                                                          \
    X(adam_moments, T, SUFFIX, adam_moments(a, out, p))                                                       \
    X(adam_norms, T, SUFFIX, adam_norms(a, b, out, p, reinterpret_cast<double*>(smem)))                      \
    X(adam_ratio, T, SUFFIX, adam_ratio(out, p, reinterpret_cast<double*>(smem)))                            \
    X(adam_apply, T, SUFFIX, adam_apply(a, b, out, p))

OPTIM_KERNELS(OPTIM_KERNEL, float, f32)
