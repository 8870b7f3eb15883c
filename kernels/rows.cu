// Row-wise ops of the transformer towers for align's candle ops (src/ops/kernels/, planned by
// src/ops/gpu/rows.rs):
// LayerNorm and its gradients, the scaled and masked softmax and its gradient, bias + GELU and
// its gradient, and column sums. Every kernel has the same signature, so that one launcher (and
// the host emulation the tests run, kernels/host/) serves them all:
//
//   kernel(a, b, c, key_bias, out, params)
//
// Row kernels run one block per row (grid-stride over rows) and reduce within the block through
// shared memory in a fixed tree order; sums over rows go through per-chunk partials that a
// second launch adds in chunk order. No atomics: results are the same on every run.

#include "reduce.cuh"

struct RowParams {
    long long rows;     // rows of the [rows, cols] operand
    int cols;
    int rows_per_bias;  // softmax: rows (heads x queries) per batch element of key_bias
    int chunk;          // column sums: rows per partial sum
    int act;            // bias_act: 0 identity, 1 GELU (erf)
    double value;       // LayerNorm: epsilon; softmax: scale
};

// Mean and 1/sqrt(var + eps) of one row, the variance from centred values as the CPU op has it.
template <typename T>
__device__ void row_stats(const T* row, int cols, double eps, T* scratch, T* mean, T* rstd) {
    T s = 0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += row[c];
    T m = block_sum(s, scratch) / (T)cols;
    T q = 0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) q += (row[c] - m) * (row[c] - m);
    T var = block_sum(q, scratch) / (T)cols;
    *mean = m;
    *rstd = (T)1 / sqrt(var + (T)eps);
}

// out = (x - mean) * rstd * w + b per row. a = x, b = w, c = b.
template <typename T>
__device__ void layer_norm_fwd(const T* x, const T* w, const T* bias, T* out, RowParams p, T* scratch) {
    for (long long r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const T* row = x + r * p.cols;
        T mean, rstd;
        row_stats(row, p.cols, p.value, scratch, &mean, &rstd);
        for (int c = threadIdx.x; c < p.cols; c += blockDim.x) out[r * p.cols + c] = (row[c] - mean) * rstd * w[c] + bias[c];
    }
}

// With xh = (x - mean) * rstd and gh = dy * w: dx = rstd * (gh - mean(gh) - xh * mean(gh * xh)).
// a = x, b = w, c = dy.
template <typename T>
__device__ void layer_norm_grad_input(const T* x, const T* w, const T* dy, T* dx, RowParams p, T* scratch) {
    for (long long r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const T* row = x + r * p.cols;
        const T* g = dy + r * p.cols;
        T mean, rstd;
        row_stats(row, p.cols, p.value, scratch, &mean, &rstd);
        T sg = 0, sgx = 0;
        for (int c = threadIdx.x; c < p.cols; c += blockDim.x) {
            T gh = g[c] * w[c];
            sg += gh;
            sgx += gh * (row[c] - mean) * rstd;
        }
        T mg = block_sum(sg, scratch) / (T)p.cols;
        T mgx = block_sum(sgx, scratch) / (T)p.cols;
        for (int c = threadIdx.x; c < p.cols; c += blockDim.x) {
            T xh = (row[c] - mean) * rstd;
            dx[r * p.cols + c] = rstd * (g[c] * w[c] - mg - xh * mgx);
        }
    }
}

// Per chunk of p.chunk rows (one block each): partial[chunk] = [sum dy * xh | sum dy], 2 * cols
// values, accumulated in shared memory after the reduction scratch. a = x, c = dy.
template <typename T>
__device__ void layer_norm_grad_params(const T* x, const T* dy, T* partial, RowParams p, T* scratch) {
    T* acc = scratch + blockDim.x;
    long long chunks = (p.rows + p.chunk - 1) / p.chunk;
    for (long long k = blockIdx.x; k < chunks; k += gridDim.x) {
        for (int c = threadIdx.x; c < 2 * p.cols; c += blockDim.x) acc[c] = 0;
        long long end = (k + 1) * p.chunk < p.rows ? (k + 1) * p.chunk : p.rows;
        for (long long r = k * p.chunk; r < end; ++r) {
            const T* row = x + r * p.cols;
            T mean, rstd;
            row_stats(row, p.cols, p.value, scratch, &mean, &rstd);
            // Each thread owns the columns it touches, here and in the write below.
            for (int c = threadIdx.x; c < p.cols; c += blockDim.x) {
                T g = dy[r * p.cols + c];
                acc[c] += g * (row[c] - mean) * rstd;
                acc[p.cols + c] += g;
            }
        }
        // The write reads columns other threads accumulated, and the next chunk clears them.
        __syncthreads();
        for (int c = threadIdx.x; c < 2 * p.cols; c += blockDim.x) partial[k * 2 * p.cols + c] = acc[c];
        __syncthreads();
    }
}

// out[k, c] = sum of src[r, c] over the rows r of chunk k (p.chunk rows each); one thread per
// (chunk, column), rows in order.
template <typename T>
__device__ void column_sums(const T* src, T* out, RowParams p) {
    long long chunks = (p.rows + p.chunk - 1) / p.chunk;
    long long total = chunks * p.cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long k = i / p.cols;
        int c = i % p.cols;
        long long end = (k + 1) * p.chunk < p.rows ? (k + 1) * p.chunk : p.rows;
        T s = 0;
        for (long long r = k * p.chunk; r < end; ++r) s += src[r * p.cols + c];
        out[i] = s;
    }
}

// out = softmax(scale * x + key_bias[batch of the row]) per row; key_bias may be null.
template <typename T>
__device__ void softmax_fwd(const T* x, const float* key_bias, T* out, RowParams p, T* scratch) {
    T scale = (T)p.value;
    for (long long r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const T* row = x + r * p.cols;
        const float* kb = key_bias ? key_bias + (r / p.rows_per_bias) * p.cols : nullptr;
        T* o = out + r * p.cols;
        T m = -INFINITY;
        for (int c = threadIdx.x; c < p.cols; c += blockDim.x) {
            T z = scale * row[c] + (kb ? (T)kb[c] : (T)0);
            o[c] = z;
            if (z > m) m = z;
        }
        m = block_max(m, scratch);
        T s = 0;
        for (int c = threadIdx.x; c < p.cols; c += blockDim.x) {
            T e = exp(o[c] - m);
            o[c] = e;
            s += e;
        }
        T inv = (T)1 / block_sum(s, scratch);
        for (int c = threadIdx.x; c < p.cols; c += blockDim.x) o[c] *= inv;
    }
}

// dx = scale * y * (dy - sum(y * dy)) per row. a = y, b = dy.
template <typename T>
__device__ void softmax_grad(const T* y, const T* dy, T* dx, RowParams p, T* scratch) {
    T scale = (T)p.value;
    for (long long r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const T* yr = y + r * p.cols;
        const T* gr = dy + r * p.cols;
        T s = 0;
        for (int c = threadIdx.x; c < p.cols; c += blockDim.x) s += yr[c] * gr[c];
        T dot = block_sum(s, scratch);
        for (int c = threadIdx.x; c < p.cols; c += blockDim.x) dx[r * p.cols + c] = scale * yr[c] * (gr[c] - dot);
    }
}

template <typename T>
__device__ T gelu(T z) {
    return (T)0.5 * z * ((T)1 + erf(z * (T)0.70710678118654752440));
}

// d gelu / dz = Phi(z) + z * phi(z).
template <typename T>
__device__ T gelu_slope(T z) {
    T a = z * (T)0.70710678118654752440;
    return (T)0.5 * ((T)1 + erf(a)) + z * (T)0.39894228040143267794 * exp(-a * a);
}

// out = act(y + b[column]). a = y, b = b.
template <typename T>
__device__ void bias_act(const T* y, const T* b, T* out, RowParams p) {
    long long total = p.rows * p.cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        T z = y[i] + b[i % p.cols];
        out[i] = p.act == 1 ? gelu(z) : z;
    }
}

// dz = dy * gelu'(y + b[column]). a = y, b = b, c = dy.
template <typename T>
__device__ void bias_gelu_grad(const T* y, const T* b, const T* dy, T* out, RowParams p) {
    long long total = p.rows * p.cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        out[i] = dy[i] * gelu_slope(y[i] + b[i % p.cols]);
    }
}

#define ROW_KERNEL(NAME, T, SUFFIX, CALL)                                                                             \
    extern "C" __global__ void NAME##_##SUFFIX(const T* a, const T* b, const T* c, const float* key_bias, T* out,  \
                                               RowParams p) {                                                      \
        extern __shared__ unsigned char smem[];                                                                    \
        (void)a, (void)b, (void)c, (void)key_bias, (void)smem;                                                     \
        CALL;                                                                                                      \
    }

// The kernels by name, for instantiation here and for the host emulation's table.
#define ROW_KERNELS(X, T, SUFFIX)                                                                      \
    X(layer_norm_fwd, T, SUFFIX, layer_norm_fwd<T>(a, b, c, out, p, reinterpret_cast<T*>(smem)))                       \
    X(layer_norm_grad_input, T, SUFFIX, layer_norm_grad_input<T>(a, b, c, out, p, reinterpret_cast<T*>(smem)))         \
    X(layer_norm_grad_params, T, SUFFIX, layer_norm_grad_params<T>(a, c, out, p, reinterpret_cast<T*>(smem)))          \
    X(column_sums, T, SUFFIX, column_sums<T>(a, out, p))                                            \
    X(softmax_fwd, T, SUFFIX, softmax_fwd<T>(a, key_bias, out, p, reinterpret_cast<T*>(smem)))                         \
    X(softmax_grad, T, SUFFIX, softmax_grad<T>(a, b, out, p, reinterpret_cast<T*>(smem)))                              \
    X(bias_act, T, SUFFIX, bias_act<T>(a, b, out, p))                                               \
    X(bias_gelu_grad, T, SUFFIX, bias_gelu_grad<T>(a, b, c, out, p))

ROW_KERNELS(ROW_KERNEL, float, f32)
ROW_KERNELS(ROW_KERNEL, double, f64)
