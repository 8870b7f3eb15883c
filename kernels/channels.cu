// Per-channel ops of the convolutional towers on NCHW tensors, for align's candle ops
// (src/ops/kernels/, planned by src/ops/gpu/channels.rs): batch moments, BatchNorm (+ SiLU) and
// its backward, channel scaling (squeeze-and-excitation), per-plane dot products and means, and
// the per-sample scaled residual of stochastic depth. One signature for all, as in rows.cu:
//
//   kernel(a, b, c, aux, out, params)
//
// `aux` holds f64 values computed on the host (BatchNorm's mean and 1/std, the per-sample
// factors). Reductions run in one block per channel or plane, in double, in a fixed tree order.

#include "reduce.cuh"

struct ChannelParams {
    int n;
    int c;
    long long hw;     // H * W
    int silu;         // BatchNorm: SiLU after the affine map
    int batch_stats;  // BatchNorm backward: the statistics are the batch's own
};

template <typename T>
__device__ T sigmoid(T z) {
    return (T)1 / ((T)1 + exp(-z));
}

// Element i of channel ch over every image: planes (img * c + ch), hw elements each.
__device__ long long channel_index(long long j, int ch, ChannelParams p) {
    long long img = j / p.hw;
    return (img * p.c + ch) * p.hw + j % p.hw;
}

// out = [means (c) | biased variances (c)] over N, H, W. Sums of x - k with k the channel's first
// value, so the variance E[(x-k)^2] - E[x-k]^2 keeps its digits when the mean is large.
template <typename T>
__device__ void channel_moments(const T* x, T* out, ChannelParams p, double* scratch) {
    long long per_channel = (long long)p.n * p.hw;
    double m = per_channel > 0 ? (double)per_channel : 1.0;
    for (int ch = blockIdx.x; ch < p.c; ch += gridDim.x) {
        double k = per_channel > 0 ? (double)x[(long long)ch * p.hw] : 0.0;
        double s1 = 0, s2 = 0;
        for (long long j = threadIdx.x; j < per_channel; j += blockDim.x) {
            double d = (double)x[channel_index(j, ch, p)] - k;
            s1 += d;
            s2 += d * d;
        }
        s1 = block_sum<double>(s1, scratch);
        s2 = block_sum<double>(s2, scratch);
        if (threadIdx.x == 0) {
            double d = s1 / m;
            double var = s2 / m - d * d;
            out[ch] = (T)(k + d);
            out[p.c + ch] = (T)(var > 0 ? var : 0);
        }
    }
}

// out = act(a * x + b) with a = gamma * inv_std, b = beta - a * mean per channel;
// aux = [mean (c) | inv_std (c)].
template <typename T>
__device__ void batch_norm_act(const T* x, const T* gamma, const T* beta, const double* aux, T* out, ChannelParams p) {
    long long total = (long long)p.n * p.c * p.hw;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        int ch = (i / p.hw) % p.c;
        double a = (double)gamma[ch] * aux[p.c + ch];
        T z = (T)a * x[i] + (T)((double)beta[ch] - a * aux[ch]);
        out[i] = p.silu ? z * sigmoid(z) : z;
    }
}

// The backward pass, one block per channel: out = [dx (n*c*hw) | sum dz * xhat (c) | sum dz (c)].
// The first pass writes dz = dy * act'(z) into dx's place and sums; the second turns it into dx
// (each thread rereads only the elements it wrote). gb = [gamma (c) | beta (c)],
// aux = [mean (c) | inv_std (c)].
template <typename T>
__device__ void batch_norm_act_grad(const T* x, const T* dy, const T* gb, const double* aux, T* out, ChannelParams p,
                                    double* scratch) {
    long long per_channel = (long long)p.n * p.hw;
    long long len = per_channel * p.c;
    double m = (double)per_channel;
    for (int ch = blockIdx.x; ch < p.c; ch += gridDim.x) {
        double g = (double)gb[ch], mean = aux[ch], r = aux[p.c + ch];
        T a = (T)(g * r), b = (T)((double)gb[p.c + ch] - g * r * mean);
        T mt = (T)mean, rt = (T)r;
        double s_dzx = 0, s_dz = 0;
        for (long long j = threadIdx.x; j < per_channel; j += blockDim.x) {
            long long i = channel_index(j, ch, p);
            T dz = dy[i];
            if (p.silu) {
                T z = a * x[i] + b;
                T s = sigmoid(z);
                dz = dz * s * ((T)1 + z * ((T)1 - s));
            }
            out[i] = dz;
            s_dzx += (double)(dz * ((x[i] - mt) * rt));
            s_dz += (double)dz;
        }
        s_dzx = block_sum<double>(s_dzx, scratch);
        s_dz = block_sum<double>(s_dz, scratch);
        if (p.batch_stats) {
            T k = (T)(g * r / m), sdz = (T)s_dz, sdzx = (T)s_dzx, mm = (T)m;
            for (long long j = threadIdx.x; j < per_channel; j += blockDim.x) {
                long long i = channel_index(j, ch, p);
                out[i] = k * (mm * out[i] - sdz - (x[i] - mt) * rt * sdzx);
            }
        } else {
            T k = (T)(g * r);
            for (long long j = threadIdx.x; j < per_channel; j += blockDim.x) {
                long long i = channel_index(j, ch, p);
                out[i] = k * out[i];
            }
        }
        if (threadIdx.x == 0) {
            out[len + ch] = (T)s_dzx;
            out[len + p.c + ch] = (T)s_dz;
        }
    }
}

// out = h * s[plane], s one factor per (image, channel).
template <typename T>
__device__ void channel_scale(const T* h, const T* s, T* out, ChannelParams p) {
    long long total = (long long)p.n * p.c * p.hw;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        out[i] = h[i] * s[i / p.hw];
    }
}

// out[plane] = sum over the plane of a * b (b null: of a), times `scale`; one block per plane.
template <typename T>
__device__ void plane_sums(const T* a, const T* b, T* out, ChannelParams p, double scale, double* scratch) {
    long long planes = (long long)p.n * p.c;
    for (long long q = blockIdx.x; q < planes; q += gridDim.x) {
        const T* ap = a + q * p.hw;
        const T* bp = b ? b + q * p.hw : nullptr;
        double s = 0;
        for (long long j = threadIdx.x; j < p.hw; j += blockDim.x) s += bp ? (double)(ap[j] * bp[j]) : (double)ap[j];
        s = block_sum<double>(s, scratch);
        if (threadIdx.x == 0) out[q] = (T)(s * scale);
    }
}

// out = h * keep[image] + x; aux = keep (n).
template <typename T>
__device__ void scaled_residual(const T* h, const T* x, const double* keep, T* out, ChannelParams p) {
    long long per_sample = (long long)p.c * p.hw;
    long long total = per_sample * p.n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        out[i] = h[i] * (T)keep[i / per_sample] + x[i];
    }
}

#define CHANNEL_KERNEL(NAME, T, SUFFIX, CALL)                                                                     \
    extern "C" __global__ void NAME##_##SUFFIX(const T* a, const T* b, const T* c, const double* aux, T* out,      \
                                               ChannelParams p) {                                                  \
        extern __shared__ unsigned char smem[];                                                                    \
        (void)a, (void)b, (void)c, (void)aux, (void)smem;                                                          \
        CALL;                                                                                                      \
    }

// The kernels by name, for instantiation here and for the host emulation's table.
#define CHANNEL_KERNELS(X, T, SUFFIX)                                                                        \
    X(channel_moments, T, SUFFIX, channel_moments<T>(a, out, p, reinterpret_cast<double*>(smem)))             \
    X(batch_norm_act, T, SUFFIX, batch_norm_act<T>(a, b, c, aux, out, p))                                     \
    X(batch_norm_act_grad, T, SUFFIX, batch_norm_act_grad<T>(a, b, c, aux, out, p, reinterpret_cast<double*>(smem))) \
    X(channel_scale, T, SUFFIX, channel_scale<T>(a, b, out, p))                                               \
    X(dot_per_plane, T, SUFFIX, plane_sums<T>(a, b, out, p, 1.0, reinterpret_cast<double*>(smem)))           \
    X(spatial_mean, T, SUFFIX, plane_sums<T>(a, nullptr, out, p, 1.0 / (double)p.hw, reinterpret_cast<double*>(smem))) \
    X(scaled_residual, T, SUFFIX, scaled_residual<T>(a, b, aux, out, p))

CHANNEL_KERNELS(CHANNEL_KERNEL, float, f32)
CHANNEL_KERNELS(CHANNEL_KERNEL, double, f64)
