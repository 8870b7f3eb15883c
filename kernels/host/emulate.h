// Compiles align's CUDA kernels (kernels/*.cu) as C++ and runs them on the host, so that tests
// check the kernel sources themselves on machines without a GPU. A launch runs its blocks one
// after another; the threads of a block are real threads that meet at __syncthreads, so a missing
// barrier shows up as a wrong result (or a race) here as it would on a GPU. Dynamic shared memory
// is one static buffer, which is sound because only one block runs at a time. Three checks a GPU
// would not make:
// - shared memory is filled with 0xFF bytes (NaN as f32 or f64) before every block, so a read
//   of a value no thread of the block wrote poisons the result;
// - a block that writes past the shared bytes its launch asked for fails the launch;
// - every thread meeting at a barrier must have come from the same __syncthreads (same line).
// Warp-level intrinsics are not emulated: the kernels do not use them.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

// The device's float overloads of the math functions, as CUDA has them unqualified.
using std::erf;
using std::exp;
using std::sqrt;

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

// A barrier that remembers the source line each thread arrived from.
struct Barrier {
    explicit Barrier(unsigned threads) : lines(threads, 0), phase(threads, Check{this}) {}
    struct Check {
        Barrier* self;
        void operator()() noexcept {
            int first = 0;
            for (int line : self->lines) {
                if (line <= 0) continue;  // finished threads
                if (first == 0) first = line;
                if (line != first) self->error = "threads met at barriers of different lines " + std::to_string(first) + " and " + std::to_string(line);
            }
        }
    };
    std::vector<int> lines;
    std::string error;
    std::barrier<Check> phase;
};

inline std::unique_ptr<Barrier> block_barrier;

inline void sync(int line) {
    block_barrier->lines[threadIdx.x] = line;
    block_barrier->phase.arrive_and_wait();
}

// Runs `kernel` over a one-dimensional grid of `grid` blocks of `block` threads.
inline void launch(unsigned grid, unsigned block, std::size_t shared_bytes, const std::function<void()>& kernel) {
    if (shared_bytes > kSharedBytes) throw std::runtime_error("launch asks for more shared memory than the emulation has");
    if (block == 0 || block > 1024) throw std::runtime_error("block size out of range");
    blockDim = dim3{block, 1, 1};
    gridDim = dim3{grid, 1, 1};
    std::string error;
    auto fresh_block = [&] {
        std::memset(smem, 0xFF, kSharedBytes);
        block_barrier = std::make_unique<Barrier>(block);
    };
    // After every thread of a block has finished: check the block, then a fresh barrier and
    // poisoned shared memory for the next. Threads that finish early leave the block's barrier
    // (arrive_and_drop) so that the others can still meet at theirs, as exited threads do on a
    // GPU.
    auto next_block = [&]() noexcept {
        if (error.empty()) error = block_barrier->error;
        for (std::size_t i = shared_bytes; i < kSharedBytes && error.empty(); ++i) {
            if (smem[i] != 0xFF) error = "a block wrote past the " + std::to_string(shared_bytes) + " bytes of shared memory it asked for";
        }
        fresh_block();
    };
    fresh_block();
    std::barrier<decltype(next_block)> between_blocks(block, next_block);
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block; ++t) {
        threads.emplace_back([&, t] {
            threadIdx = dim3{t, 0, 0};
            for (unsigned b = 0; b < grid; ++b) {
                blockIdx = dim3{b, 0, 0};
                kernel();
                block_barrier->lines[t] = -1;
                block_barrier->phase.arrive_and_drop();
                between_blocks.arrive_and_wait();
            }
        });
    }
    for (auto& t : threads) t.join();
    if (!error.empty()) throw std::runtime_error(error);
}

}  // namespace emulate

#define __syncthreads() emulate::sync(__LINE__)
