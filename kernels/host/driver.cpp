// Runs one kernel launch of kernels/*.cu on the host (emulate.h), for the tests of the CUDA ops
// (src/ops/gpu/, through src/ops/gpu/host.rs). Reads a request file
// (argv[1]) and writes the output buffer to argv[2]. Request, native byte order:
//   name        u32 length + bytes (with the dtype suffix, as in the PTX)
//   launch      grid, block, shared bytes (u32 each)
//   elem        u32: 4 (f32) or 8 (f64)
//   params      u32 length + the kernel's parameter struct as laid out in memory
//   operands    u32 count, then each as u64 element count + elements (count 0: a null pointer)
//   side        u64 byte count + bytes (rows.cu: the f32 key bias; channels.cu: f64 values;
//               depthwise.cu and optim.cu: none)
//   output      u64 count + initial elements
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

#include "emulate.h"
#include "../channels.cu"
#include "../depthwise.cu"
#include "../optim.cu"
#include "../rows.cu"

namespace {

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

// One launch's arguments, typed.
template <typename T>
struct Args {
    std::vector<std::vector<T>> operands;
    std::vector<T> out;
    std::vector<char> params;

    const T* operand(std::size_t i) const {
        if (i >= operands.size()) throw std::runtime_error("missing operand");
        return operands[i].empty() ? nullptr : operands[i].data();
    }
    // The side buffer's bytes in storage aligned for f32 and f64 alike.
    std::vector<double> side_storage;
    std::size_t side_bytes = 0;

    template <typename V>
    const V* side_as() const {
        if (side_bytes % sizeof(V) != 0) throw std::runtime_error("side buffer of a partial element");
        return side_bytes == 0 ? nullptr : reinterpret_cast<const V*>(side_storage.data());
    }
    template <typename P>
    P param_struct() const {
        if (params.size() != sizeof(P)) throw std::runtime_error("parameter struct has the wrong size");
        P p;
        std::memcpy(&p, params.data(), sizeof p);
        return p;
    }
};

template <typename T>
using Call = std::function<void(Args<T>&)>;

template <typename T>
std::map<std::string, Call<T>>& table() {
    static std::map<std::string, Call<T>> t;
    return t;
}

#define REGISTER_ROW(NAME, T, SUFFIX, CALL)                                                                  \
    table<T>()[#NAME "_" #SUFFIX] = [](Args<T>& a) {                                                         \
        NAME##_##SUFFIX(a.operand(0), a.operand(1), a.operand(2), a.template side_as<float>(), a.out.data(),  \
                        a.template param_struct<RowParams>());                                               \
    };

#define REGISTER_CHANNEL(NAME, T, SUFFIX, CALL)                                                              \
    table<T>()[#NAME "_" #SUFFIX] = [](Args<T>& a) {                                                         \
        NAME##_##SUFFIX(a.operand(0), a.operand(1), a.operand(2), a.template side_as<double>(), a.out.data(), \
                        a.template param_struct<ChannelParams>());                                           \
    };

#define REGISTER_OPTIM(NAME, T, SUFFIX, CALL)                                                                \
    table<T>()[#NAME "_" #SUFFIX] = [](Args<T>& a) {                                                         \
        NAME##_##SUFFIX(a.operand(0), a.operand(1), a.operand(2), a.template side_as<double>(), a.out.data(), \
                        a.template param_struct<OptimParams>());                                             \
    };

#define REGISTER_DEPTHWISE(NAME, T, SUFFIX, CALL)                                                           \
    table<T>()[#NAME "_" #SUFFIX] = [](Args<T>& a) {                                                         \
        NAME##_##SUFFIX(a.operand(0), a.operand(1), a.operand(2), a.template side_as<double>(), a.out.data(), \
                        a.template param_struct<Geometry>());                                                \
    };

void register_kernels() {
    ROW_KERNELS(REGISTER_ROW, float, f32)
    ROW_KERNELS(REGISTER_ROW, double, f64)
    CHANNEL_KERNELS(REGISTER_CHANNEL, float, f32)
    CHANNEL_KERNELS(REGISTER_CHANNEL, double, f64)
    OPTIM_KERNELS(REGISTER_OPTIM, float, f32)
    DEPTHWISE_KERNELS(REGISTER_DEPTHWISE, float, f32)
    DEPTHWISE_KERNELS(REGISTER_DEPTHWISE, double, f64)
}

template <typename T>
void run(Reader& r, const std::string& name, unsigned grid, unsigned block, unsigned shared, std::vector<char> params,
         const char* out_path) {
    auto found = table<T>().find(name);
    if (found == table<T>().end()) throw std::runtime_error("no kernel named " + name);
    Args<T> args;
    args.params = std::move(params);
    auto count = r.get<std::uint32_t>();
    for (std::uint32_t i = 0; i < count; ++i) args.operands.push_back(r.array<T>());
    auto side = r.array<char>();
    args.side_bytes = side.size();
    args.side_storage.resize((side.size() + sizeof(double) - 1) / sizeof(double));
    if (!side.empty()) std::memcpy(args.side_storage.data(), side.data(), side.size());
    args.out = r.array<T>();
    emulate::launch(grid, block, shared, [&] { found->second(args); });
    std::ofstream f(out_path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(args.out.data()), args.out.size() * sizeof(T));
    if (!f) throw std::runtime_error("cannot write the output file");
}

}  // namespace

int main(int argc, char** argv) {
    try {
        if (argc != 3) throw std::runtime_error("usage: driver REQUEST OUTPUT");
        register_kernels();
        std::ifstream in(argv[1], std::ios::binary);
        Reader r{std::vector<char>(std::istreambuf_iterator<char>(in), {})};
        std::string name(r.get<std::uint32_t>(), '\0');
        r.take(name.data(), name.size());
        auto grid = r.get<std::uint32_t>(), block = r.get<std::uint32_t>(), shared = r.get<std::uint32_t>();
        auto elem = r.get<std::uint32_t>();
        std::vector<char> params(r.get<std::uint32_t>());
        r.take(params.data(), params.size());
        if (elem == 4) {
            run<float>(r, name, grid, block, shared, std::move(params), argv[2]);
        } else if (elem == 8) {
            run<double>(r, name, grid, block, shared, std::move(params), argv[2]);
        } else {
            throw std::runtime_error("element size must be 4 or 8");
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kernel driver: %s\n", e.what());
        return 1;
    }
    return 0;
}
