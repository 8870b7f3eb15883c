// Block-wide reductions shared by the kernel files: a tree over shared memory in a fixed order
// (results are the same on every run), for blocks of a power-of-two number of threads. `scratch`
// holds one value per thread.
#pragma once

template <typename T>
__device__ T block_sum(T v, T* scratch) {
    scratch[threadIdx.x] = v;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) scratch[threadIdx.x] += scratch[threadIdx.x + half];
        __syncthreads();
    }
    T total = scratch[0];
    // Nobody may overwrite scratch[0] for the next reduction before every thread has read it.
    __syncthreads();
    return total;
}

template <typename T>
__device__ T block_max(T v, T* scratch) {
    scratch[threadIdx.x] = v;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half && scratch[threadIdx.x + half] > scratch[threadIdx.x]) {
            scratch[threadIdx.x] = scratch[threadIdx.x + half];
        }
        __syncthreads();
    }
    T best = scratch[0];
    __syncthreads();
    return best;
}
