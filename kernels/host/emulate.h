// Compiles align's CUDA kernels (kernels/*.cu) as C++ and runs them on the host, so that tests
// check the kernel sources themselves on machines without a GPU. A launch runs its blocks one
// after another; the threads of a block are real threads that meet at __syncthreads, so a missing
// barrier shows up as a wrong result (or a race) here as it would on a GPU. Dynamic shared memory
// is one static buffer, which is sound because only one block runs at a time. Warp-level
// intrinsics are not emulated: the kernels do not use them.
#pragma once

#include <barrier>
#include <cmath>
#include <cstddef>
#include <functional>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __shared__

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

constexpr std::size_t kSharedBytes = 1 << 17;
alignas(16) inline unsigned char smem[kSharedBytes];

namespace emulate {
inline std::unique_ptr<std::barrier<>> block_barrier;
}

inline void __syncthreads() { emulate::block_barrier->arrive_and_wait(); }

namespace emulate {

// Runs `kernel` over a one-dimensional grid of `grid` blocks of `block` threads.
inline void launch(unsigned grid, unsigned block, std::size_t shared_bytes, const std::function<void()>& kernel) {
    if (shared_bytes > kSharedBytes) throw std::runtime_error("launch asks for more shared memory than the emulation has");
    if (block == 0 || block > 1024) throw std::runtime_error("block size out of range");
    blockDim = dim3{block, 1, 1};
    gridDim = dim3{grid, 1, 1};
    block_barrier = std::make_unique<std::barrier<>>(block);
    // After every thread of a block has finished, the next block gets a fresh barrier. Threads
    // that finish early leave the block's barrier (arrive_and_drop) so that the others can still
    // meet at theirs, as exited threads do on a GPU.
    auto next_block = [block]() noexcept { block_barrier = std::make_unique<std::barrier<>>(block); };
    std::barrier<decltype(next_block)> between_blocks(block, next_block);
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block; ++t) {
        threads.emplace_back([&, t] {
            threadIdx = dim3{t, 0, 0};
            for (unsigned b = 0; b < grid; ++b) {
                blockIdx = dim3{b, 0, 0};
                kernel();
                block_barrier->arrive_and_drop();
                between_blocks.arrive_and_wait();
            }
        });
    }
    for (auto& t : threads) t.join();
}

}  // namespace emulate
