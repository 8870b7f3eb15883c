#!/usr/bin/env bash
# Install a CUDA toolchain from PyPI wheels, on a machine without a GPU or
# driver, so that `cargo check --features cuda` and `cargo build --features
# cuda` (compile and link) work.
#
#   scripts/cuda-toolchain.sh            install (idempotent), print the env
#   eval "$(scripts/cuda-toolchain.sh --env)"
#   source <(scripts/cuda-toolchain.sh --env)
#                                        install if needed, export the env
#
# Knobs: ALIGN_CUDA_HOME (cache dir, outside the clone so it survives fresh
# clones), CUDA_COMPUTE_CAP (default 80; 90 for kernels native to H100/H200
# only), PYTHON (default python3).
#
# Why these versions:
# - candle-core 0.11.1 uses cudarc 0.19.10 with `cuda-version-from-build-system`
#   and `dynamic-linking`. cudarc's build script runs `nvcc --version` and
#   panics unless the release is one it has bindings for: 11.4-12.9 and
#   13.0-13.4. PyPI's newest toolkit (13.5) is therefore unusable; the version
#   must be pinned, not floated.
# - Of the supported CUDA 13 releases, 13.0 asks the least of the driver. At
#   run time this toolchain needs an NVIDIA driver of the R580 branch or newer
#   (>= 580.65.06 on Linux): candle loads its kernels as PTX, which the driver
#   must JIT, and a driver cannot JIT PTX from a newer toolkit than itself.
#   13.0.3.0 is the last 13.0 wheel set (nvcc 13.0.88, cudart 13.0.96,
#   cuBLAS 13.1.1).
# - NCCL 2.30 matches the bindings behind cudarc's `nccl` feature
#   (`nccl` = `nccl-02030`), which candle-core's `nccl` feature turns on.
set -euo pipefail

CUDA_TOOLKIT_VERSION=13.0.3.0
CUDA_RELEASE=13.0
NCCL_VERSION=2.30.7

# `cargo check` already needs nvcc, cccl, crt, nvvm and cudart: build scripts
# run under check, and candle-kernels' compiles its kernels (PTX and a static
# lib). Linking adds what cudarc's `dynamic-linking` asks for (-lnvrtc
# -lcurand -lcublas -lcublasLt; -lcuda is the stub below).
CUDA_WHEELS="cuda-toolkit[nvcc,cccl,crt,nvvm,cudart,nvrtc,curand,cublas]==${CUDA_TOOLKIT_VERSION}"
NCCL_WHEEL="nvidia-nccl-cu13==${NCCL_VERSION}"

PREFIX=${ALIGN_CUDA_HOME:-$HOME/.cache/align-cuda/$CUDA_TOOLKIT_VERSION}
SITE=$PREFIX/site        # what pip installs, left as pip laid it out
ROOT=$PREFIX/cuda        # the CUDA_HOME we assemble from it
MARKER=$PREFIX/.installed
PYTHON=${PYTHON:-python3}

log() { printf 'cuda-toolchain: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
}

# pip from the running Python if it has one, else a throwaway venv's: Debian's
# system Python ships neither pip nor ensurepip unless asked, pyenv's has both.
pip_cmd() {
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        echo "$PYTHON -m pip"
    else
        "$PYTHON" -m venv "$PREFIX/venv" >&2 \
            || die "need pip or venv for $PYTHON (Debian: apt-get install python3-venv)"
        echo "$PREFIX/venv/bin/python -m pip"
    fi
}

install_wheels() {
    local pip
    pip=$(pip_cmd)
    rm -rf "$SITE"
    log "downloading CUDA $CUDA_TOOLKIT_VERSION wheels into $SITE"
    # --target keeps the toolkit out of any Python environment; --only-binary
    # because there are no sdists for these and a build attempt would only
    # obscure the error.
    PIP_ROOT_USER_ACTION=ignore $pip install --quiet --disable-pip-version-check \
        --no-warn-script-location --only-binary=:all: --target "$SITE" \
        "$CUDA_WHEELS" "$NCCL_WHEEL" >&2
}

# The wheels put the toolkit under nvidia/cu13/ (bin, include, lib, nvvm) and
# NCCL under nvidia/nccl/. Tools expect the classic layout, so build one from
# symlinks and leave the wheel tree exactly as pip laid it out.
#
# bin/ must be a real directory: nvcc finds its include/, lib64/ and nvvm/ as
# "$(dirname argv[0])/..", and through a symlinked bin/ that `..` would land
# back in the wheel tree, which has no lib64/.
assemble_root() {
    local wheel=$SITE/nvidia/cu13 nccl=$SITE/nvidia/nccl f name
    [[ -x $wheel/bin/nvcc ]] || die "no nvcc in $wheel/bin: wheel layout changed?"

    rm -rf "$ROOT"
    mkdir -p "$ROOT/bin" "$ROOT/include" "$ROOT/lib64/stubs"
    for f in "$wheel"/*; do
        name=${f##*/}
        case $name in
        bin | include | lib) ;;
        *) ln -s "$f" "$ROOT/$name" ;;
        esac
    done
    link_all "$ROOT/bin" "$wheel"/bin/*
    # NCCL's header beside CUDA's, where cudarc's header probe looks.
    link_all "$ROOT/include" "$wheel"/include/* "$nccl"/include/*
    link_all "$ROOT/lib64" "$wheel"/lib/* "$nccl"/lib/*
    # The wheels ship only sonames (libcudart.so.13); the linker asks for
    # libcudart.so.
    for f in "$ROOT"/lib64/*.so.*; do
        name=${f##*/}
        ln -sfn "$name" "$ROOT/lib64/${name%%.so.*}.so"
    done
    ln -s lib64 "$ROOT/lib"
    build_driver_stub
}

link_all() {
    local dir=$1 f
    shift
    for f in "$@"; do
        [[ -e $f ]] || continue
        ln -sfn "$f" "$dir/${f##*/}"
    done
}

# No wheel ships libcuda.so: it belongs to the driver. `dynamic-linking` makes
# cudarc link -lcuda, so the link needs a library exporting every driver entry
# point it uses, and the binary then records libcuda.so.1, which the real
# driver provides at run time. Generate it from the toolkit's own headers.
# Each entry point returns CUDA_ERROR_STUB_LIBRARY (34), as NVIDIA's own stub
# does, so a binary run against it gets an error it can fall back on instead
# of a crash. It lives in lib64/stubs, where cudarc searches, not in lib64:
# LD_LIBRARY_PATH=lib64 must never shadow a real driver.
build_driver_stub() {
    local dir=$ROOT/lib64/stubs src=$PREFIX/libcuda-stub.c
    local -a names
    # Preprocessing resolves cuda.h's `#define cuFoo cuFoo_v2` aliases, so
    # these are the names the linker will actually be asked for. The profiler
    # calls live in cudaProfiler.h, which no wheel ships; cudarc binds them.
    mapfile -t names < <({
        gcc -E -P -x c -I "$ROOT/include" - <<<'#include <cuda.h>' \
            | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d ' \t('
        printf '%s\n' cuProfilerInitialize cuProfilerStart cuProfilerStop
    } | sort -u | grep -vxE 'cuGetErrorName|cuGetErrorString')
    ((${#names[@]} > 100)) || die "found too few driver entry points in cuda.h"
    {
        echo '/* Generated by scripts/cuda-toolchain.sh: link-time stand-in for the driver. */'
        echo 'static const char msg[] = "CUDA driver stub: no NVIDIA driver is installed";'
        echo 'int cuGetErrorName(int e, const char **s) { (void)e; *s = "CUDA_ERROR_STUB_LIBRARY"; return 0; }'
        echo 'int cuGetErrorString(int e, const char **s) { (void)e; *s = msg; return 0; }'
        printf 'int %s(void) { return 34; }\n' "${names[@]}"
    } >"$src"
    gcc -shared -fPIC -O1 -w -Wl,-soname,libcuda.so.1 -o "$dir/libcuda.so.1" "$src"
    ln -sfn libcuda.so.1 "$dir/libcuda.so"
}

installed() {
    [[ -f $MARKER && $(<"$MARKER") == "$CUDA_TOOLKIT_VERSION $NCCL_VERSION" ]] \
        && [[ -x $ROOT/bin/nvcc && -e $ROOT/lib64/stubs/libcuda.so ]]
}

install() {
    installed && return
    command -v gcc >/dev/null || die "gcc is needed (nvcc's host compiler, driver stub)"
    mkdir -p "$PREFIX"
    # Parallel CI jobs sharing one cache must not install over each other.
    if command -v flock >/dev/null; then
        exec 9>"$PREFIX/.lock"
        flock 9
        installed && return
    fi
    rm -f "$MARKER"
    local start=$SECONDS release
    install_wheels
    assemble_root
    release=$("$ROOT/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
    [[ $release == "$CUDA_RELEASE" ]] \
        || die "nvcc reports release '$release', expected $CUDA_RELEASE"
    echo "$CUDA_TOOLKIT_VERSION $NCCL_VERSION" >"$MARKER"
    log "installed CUDA $release in $ROOT ($(du -sh "$SITE" | cut -f1), $((SECONDS - start))s)"
}

# A binary linked with `dynamic-linking` needs libcuda.so.1 just to start,
# even to run its CPU tests. Only offer the stub when no real driver exists:
# LD_LIBRARY_PATH beats the system's library cache, so it would shadow one.
have_driver() {
    # No `grep -q`: under pipefail, ldconfig dying of SIGPIPE would read as
    # "no driver".
    { ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep 'libcuda\.so\.1 ' >/dev/null
}

print_env() {
    local ld=$ROOT/lib64
    have_driver || ld=$ld:$ROOT/lib64/stubs
    printf 'export CUDA_HOME=%q\n' "$ROOT"
    printf 'export CUDA_ROOT=%q\n' "$ROOT"
    printf 'export CUDA_PATH=%q\n' "$ROOT"
    # candle-kernels builds for this arch; nvidia-smi, its fallback, needs a
    # GPU. 80 is the oldest with bf16 kernels, and its PTX JITs on any newer
    # GPU (the quantized-MoE static lib is sm_80 machine code only). 90 becomes
    # sm_90a, which runs on H100/H200 and nothing else.
    printf 'export CUDA_COMPUTE_CAP=%q\n' "${CUDA_COMPUTE_CAP:-80}"
    # Ties cudarc's bindings to these libraries whatever nvcc PATH finds first.
    printf 'export CUDARC_CUDA_VERSION=%q\n' "${CUDA_RELEASE/./0}0"
    # shellcheck disable=SC2016 # $PATH is for the shell that evals this
    printf 'export PATH=%q:"$PATH"\n' "$ROOT/bin"
    # shellcheck disable=SC2016
    printf 'export LD_LIBRARY_PATH=%q"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"\n' "$ld"
}

case ${1:-} in
"")
    install
    print_env
    log "to use: eval \"\$($0 --env)\""
    ;;
--env)
    install
    print_env
    ;;
-h | --help) usage ;;
*)
    usage >&2
    exit 2
    ;;
esac
