// Depthwise 2-D convolution on NCHW tensors, forward and both gradients, for align's
// `depthwise-conv2d` candle op (src/ops/kernels/depthwise.rs). Explicit per-side padding, any
// square kernel, any stride. Every output element is computed by one thread in a fixed order,
// so results are deterministic (no atomics).

struct Geometry {
    int n, c, h, w, k, stride, top, left, ho, wo;
};

// out[n,c,oy,ox] = sum_{ky,kx} x[n,c,oy*s+ky-top, ox*s+kx-left] * k[c,ky,kx]
template <typename T>
__device__ void forward(const T* x, const T* kernel, T* out, Geometry g) {
    long total = (long)g.n * g.c * g.ho * g.wo;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        int ox = i % g.wo;
        int oy = (i / g.wo) % g.ho;
        long plane = i / ((long)g.wo * g.ho);
        int ch = plane % g.c;
        const T* xp = x + plane * g.h * g.w;
        const T* kp = kernel + (long)ch * g.k * g.k;
        T acc = 0;
        for (int ky = 0; ky < g.k; ++ky) {
            int iy = oy * g.stride + ky - g.top;
            if (iy < 0 || iy >= g.h) continue;
            for (int kx = 0; kx < g.k; ++kx) {
                int ix = ox * g.stride + kx - g.left;
                if (ix < 0 || ix >= g.w) continue;
                acc += xp[(long)iy * g.w + ix] * kp[ky * g.k + kx];
            }
        }
        out[i] = acc;
    }
}

// dx[n,c,iy,ix] = sum over (ky,kx) with iy = oy*s+ky-top, ix = ox*s+kx-left of g[n,c,oy,ox]*k[c,ky,kx]
template <typename T>
__device__ void grad_input(const T* grad, const T* kernel, T* dx, Geometry g) {
    long total = (long)g.n * g.c * g.h * g.w;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        int ix = i % g.w;
        int iy = (i / g.w) % g.h;
        long plane = i / ((long)g.w * g.h);
        int ch = plane % g.c;
        const T* gp = grad + plane * g.ho * g.wo;
        const T* kp = kernel + (long)ch * g.k * g.k;
        T acc = 0;
        for (int ky = 0; ky < g.k; ++ky) {
            int ty = iy + g.top - ky;
            if (ty < 0 || ty % g.stride != 0) continue;
            int oy = ty / g.stride;
            if (oy >= g.ho) continue;
            for (int kx = 0; kx < g.k; ++kx) {
                int tx = ix + g.left - kx;
                if (tx < 0 || tx % g.stride != 0) continue;
                int ox = tx / g.stride;
                if (ox >= g.wo) continue;
                acc += gp[(long)oy * g.wo + ox] * kp[ky * g.k + kx];
            }
        }
        dx[i] = acc;
    }
}

// dk[c,ky,kx] = sum_{n,oy,ox} x[n,c,oy*s+ky-top, ox*s+kx-left] * g[n,c,oy,ox]: one block per
// kernel weight, a strided sum per thread, then a tree reduction in shared memory.
template <typename T>
__device__ void grad_kernel(const T* x, const T* grad, T* dk, Geometry g) {
    extern __shared__ unsigned char smem[];
    T* partial = reinterpret_cast<T*>(smem);
    int weight = blockIdx.x;  // c * k * k + ky * k + kx
    int kx = weight % g.k;
    int ky = (weight / g.k) % g.k;
    int ch = weight / (g.k * g.k);
    long per_image = (long)g.ho * g.wo;
    long total = g.n * per_image;
    T acc = 0;
    for (long j = threadIdx.x; j < total; j += blockDim.x) {
        int img = j / per_image;
        int ox = j % g.wo;
        int oy = (j / g.wo) % g.ho;
        int iy = oy * g.stride + ky - g.top;
        int ix = ox * g.stride + kx - g.left;
        if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
        long plane = (long)img * g.c + ch;
        acc += x[plane * g.h * g.w + (long)iy * g.w + ix] * grad[plane * per_image + (long)oy * g.wo + ox];
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) dk[weight] = partial[0];
}

// Every kernel file's kernels take (a, b, c, side, out, params); depthwise reads two operands
// and no side buffer.
#define DEPTHWISE_KERNEL(NAME, T, SUFFIX, CALL)                                                            \
    extern "C" __global__ void NAME##_##SUFFIX(const T* a, const T* b, const T* c, const double* aux, T* out,  \
                                               Geometry g) {                                                  \
        (void)c, (void)aux;                                                                                    \
        CALL;                                                                                                  \
    }

// The kernels by name, for instantiation here and for the host emulation's table.
#define DEPTHWISE_KERNELS(X, T, SUFFIX)                                   \
    X(depthwise_fwd, T, SUFFIX, forward<T>(a, b, out, g))                 \
    X(depthwise_grad_input, T, SUFFIX, grad_input<T>(a, b, out, g))       \
    X(depthwise_grad_kernel, T, SUFFIX, grad_kernel<T>(a, b, out, g))

DEPTHWISE_KERNELS(DEPTHWISE_KERNEL, float, f32)
DEPTHWISE_KERNELS(DEPTHWISE_KERNEL, double, f64)
