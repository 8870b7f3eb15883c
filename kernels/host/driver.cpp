// Runs one launch of a kernel of kernels/rows.cu on the host (emulate.h), for the tests of
// src/model/ops/row_kernels.rs. Reads a request file (argv[1]) and writes the output buffer to
// argv[2]. Request, native byte order: name (u32 length + bytes), grid, block and shared bytes
// (u32 each), the RowParams struct as laid out in memory, the element size (u32: 4 or 8), the
// three operands and the output's initial contents (each u64 element count + elements; count 0
// passes a null pointer), then the key bias (u64 count + f32 elements).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

#include "emulate.h"
#include "../rows.cu"

namespace {

using Kernel32 = void (*)(const float*, const float*, const float*, const float*, float*, RowParams);
using Kernel64 = void (*)(const double*, const double*, const double*, const float*, double*, RowParams);

#define REGISTER(NAME, T, SUFFIX, CALL) {#NAME "_" #SUFFIX, reinterpret_cast<void*>(&NAME##_##SUFFIX)},
const std::map<std::string, void*> kKernels = {ROW_KERNELS(REGISTER, float, f32) ROW_KERNELS(REGISTER, double, f64)};

struct Reader {
    std::vector<char> bytes;
    std::size_t at = 0;
    void take(void* dst, std::size_t n) {
        if (at + n > bytes.size()) throw std::runtime_error("request file is truncated");
        std::memcpy(dst, bytes.data() + at, n);
        at += n;
    }
    template <typename V>
    V get() {
        V v;
        take(&v, sizeof v);
        return v;
    }
    template <typename T>
    std::vector<T> array() {
        std::vector<T> v(get<std::uint64_t>());
        take(v.data(), v.size() * sizeof(T));
        return v;
    }
};

template <typename T>
const T* data_or_null(const std::vector<T>& v) {
    return v.empty() ? nullptr : v.data();
}

template <typename T, typename K>
void run(Reader& r, K kernel, unsigned grid, unsigned block, unsigned shared, RowParams p, const char* out_path) {
    auto a = r.array<T>(), b = r.array<T>(), c = r.array<T>(), out = r.array<T>();
    auto key_bias = r.array<float>();
    emulate::launch(grid, block, shared, [&] {
        kernel(data_or_null(a), data_or_null(b), data_or_null(c), data_or_null(key_bias), out.data(), p);
    });
    std::ofstream f(out_path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(T));
    if (!f) throw std::runtime_error("cannot write the output file");
}

}  // namespace

int main(int argc, char** argv) {
    try {
        if (argc != 3) throw std::runtime_error("usage: driver REQUEST OUTPUT");
        std::ifstream in(argv[1], std::ios::binary);
        Reader r{std::vector<char>(std::istreambuf_iterator<char>(in), {})};
        std::string name(r.get<std::uint32_t>(), '\0');
        r.take(name.data(), name.size());
        auto grid = r.get<std::uint32_t>(), block = r.get<std::uint32_t>(), shared = r.get<std::uint32_t>();
        auto p = r.get<RowParams>();
        auto elem = r.get<std::uint32_t>();
        auto found = kKernels.find(name);
        if (found == kKernels.end()) throw std::runtime_error("no kernel named " + name);
        if (elem == 4) {
            run<float>(r, reinterpret_cast<Kernel32>(found->second), grid, block, shared, p, argv[2]);
        } else if (elem == 8) {
            run<double>(r, reinterpret_cast<Kernel64>(found->second), grid, block, shared, p, argv[2]);
        } else {
            throw std::runtime_error("element size must be 4 or 8");
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kernel driver: %s\n", e.what());
        return 1;
    }
    return 0;
}
