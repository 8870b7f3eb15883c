#!/usr/bin/env bash
# align's whole GPU check in one command of at most 10 minutes, built here and run on a machine
# with one H100 or H200, the NVIDIA driver, the CUDA 13 libraries and Python with torch, timm and
# transformers, but no network and no Rust toolchain.
#
#   scripts/gpu-proof.sh --build-only [--out DIR] [--align BIN]
#       Here: builds the `--features cuda` release binary for compute capability 9.0, stripped,
#       with CUDA 13.0 from scripts/cuda-toolchain.sh and a target folder outside the clone
#       (ALIGN_GPU_TARGET, default ~/.cache/align-gpu-target), and packs DIR (default gpu-bundle/,
#       git-ignored): align.gz, this script, gpu_proof.py, bench_torch.py, demo.toml, BUILD-INFO.
#       Prints the bundle's size. --align BIN packs that binary instead of building one.
#
#   bash gpu-bundle/gpu-proof.sh --out DIR [--copy-to DIR2]
#       There: unpacks the binary to a scratch folder, finds cuBLAS, cuRAND and the CUDA runtime
#       (ldd; the Python nvidia-* wheel folders and torch's are searched and put on
#       LD_LIBRARY_PATH) and the driver's libcuda.so.1, naming any that is missing, then:
#         1. align bench ops: every CUDA kernel against the CPU in f64, forward and backward
#            (each op passes within 1e-4)
#         2. 100 training steps of the demo model from one seed, one tokenizer and the same
#            batches on the CPU in f32 and on the GPU in f32 and bf16, with ALIGN_KERNELS=align
#            and =candle: each GPU run's per-step loss against the CPU's (f32: within 1e-3
#            relative at every step, ~1e-4 expected; bf16: mean within 5%, every step within 15%);
#            then in f32, each against its own CPU run, the sigmoid loss with patch dropout and a
#            moving average, distillation from the CPU run's checkpoint with a locked tower, two
#            ranks with sharded state, and fine-tunes of the tests' CLIP, SigLIP 2 NaFlex and
#            timm-trunk SigLIP checkpoints (tests/fixtures, beside the bundle in the clone)
#         3. align bench model for ViT-B/16 (224 px), EfficientNet-B7 (289), ViT-B/32 and
#            EfficientNet-B3 (300), each with BERT-base, bf16 and f32, at the largest
#            power-of-two batch that fits: samples/s, peak GPU memory, MFU; and the same models
#            in PyTorch (timm + transformers, bf16 autocast, AdamW) at the same batch, with
#            align's ratio to it; with ALIGN_KERNELS=align when every row of 1 and every
#            align-kernel row of 2 passed, candle otherwise (steps 4 and 5 keep 80 s)
#         4. align bench loader with 16 workers: images/s and per core
#         5. align bench embed: forward-only images/s and peak memory of a trained checkpoint
#       and prints a table with the targets, written to DIR/gpu-proof.table, and
#       DIR/gpu-proof.json; every step's raw output is under DIR/raw/. --copy-to DIR2 copies the
#       table, the JSON, the log and raw/ as one .tar.gz to DIR2 (for the lent machine's $OUT,
#       which brings back 8 files), after each step as well as at the end.
#
#   scripts/gpu-proof.sh --device cpu --align target/debug/align --out DIR
#       The dry run: the same steps on the CPU with tiny towers, batches and step counts (about
#       a minute on two cores; PyTorch rows are skipped when torch is not installed, and the
#       bf16 rows, with align's refusal, on a CPU without AVX-512 BF16).
#
# Options: --device cuda | cuda:N | cpu (default cuda); --align BIN (default: align.gz beside
# this script, or gpu-bundle/align.gz); --out DIR (required to run).
# Knobs: GPU_PROOF_STEPS (the steps to run, e.g. "1 2"; default all; 5 needs 4's shards and 2's
# checkpoint; steps not asked for are not counted as failures),
# GPU_PROOF_BUDGET (seconds for the whole run; 570 on a GPU), PEAK_BF16 / PEAK_F32 (dense
# TFLOP/s for MFU; known for H100, H200, A100), GPU_PROOF_F32_RTOL, GPU_PROOF_BF16_MEAN,
# GPU_PROOF_BF16_MAX (step 2's tolerances), GPU_PROOF_WORK (scratch folder, kept; default a new
# one under /tmp, removed at the end unless GPU_PROOF_KEEP=1).
# Exit status: 0 when every pass/fail row passed and every step ran; 1 otherwise; 2 on bad usage;
# 3 when the binary cannot start (missing libraries are named) or Python is missing.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SELF=$HERE/$(basename "${BASH_SOURCE[0]}")

usage() { sed -n '2,/^set -euo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "gpu-proof: error: $*" >&2; exit "${EXIT:-2}"; }

MODE=run DEVICE=cuda ALIGN_BIN='' OUT='' COPY_TO=''
while [ $# -gt 0 ]; do
    case "$1" in
        --build-only) MODE=build; shift ;;
        --device) [ $# -ge 2 ] || die "--device needs a value"; DEVICE=$2; shift 2 ;;
        --align) [ $# -ge 2 ] || die "--align needs a path"; ALIGN_BIN=$2; shift 2 ;;
        --out) [ $# -ge 2 ] || die "--out needs a folder"; OUT=$2; shift 2 ;;
        --copy-to) [ $# -ge 2 ] || die "--copy-to needs a folder"; COPY_TO=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done
case "$DEVICE" in
    cpu) KIND=cpu ;;
    cuda|cuda:[0-9]*) KIND=cuda ;;
    *) die "--device is cuda, cuda:N or cpu, not $DEVICE" ;;
esac

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

# ---------------------------------------------------------------------------------------------
# --build-only

build_bundle() {
    local repo out bin target commit
    repo=$(cd "$HERE/.." && pwd)
    [ -f "$repo/Cargo.toml" ] || die "--build-only runs from the repository's scripts/ folder (no Cargo.toml in $repo)"
    out=${OUT:-$repo/gpu-bundle}
    bin=$ALIGN_BIN
    if [ -z "$bin" ]; then
        command -v cargo >/dev/null || die "cargo not found: --build-only needs the Rust toolchain (or --align BIN to pack a binary)"
        target=${ALIGN_GPU_TARGET:-${XDG_CACHE_HOME:-$HOME/.cache}/align-gpu-target}
        case "$target/" in "$repo"/*) die "ALIGN_GPU_TARGET must be outside the clone ($target)" ;; esac
        export CUDA_COMPUTE_CAP=90
        eval "$("$repo/scripts/cuda-toolchain.sh" --env)"
        echo "gpu-proof: building the cuda release binary for sm_90 in $target (a cold build takes 12-23 minutes on two cores)" >&2
        (cd "$repo" && CUDA_COMPUTE_CAP=90 CARGO_TARGET_DIR="$target" CARGO_PROFILE_RELEASE_DEBUG=false \
            CARGO_PROFILE_RELEASE_STRIP=true cargo build --release --locked --features cuda) >&2
        bin=$target/release/align
    fi
    if [ ! -f "$bin" ] || [ ! -x "$bin" ]; then die "no executable binary at $bin"; fi
    if ! ldd "$bin" 2>/dev/null | grep 'libcublas' >/dev/null; then
        echo "gpu-proof: warning: $bin does not link cuBLAS: not a --features cuda build, so its GPU steps will fail" >&2
    fi
    if [ -e "$out" ]; then
        # Replace only what is recognisably a bundle (or an empty folder).
        if [ -f "$out/BUILD-INFO" ] || [ -z "$(ls -A "$out")" ]; then
            rm -rf "$out"
        else
            die "$out exists and is not a bundle (no BUILD-INFO): not replacing it"
        fi
    fi
    mkdir -p "$out"
    echo "gpu-proof: packing $bin into $out" >&2
    gzip -9 -c "$bin" >"$out/align.gz"
    cp "$SELF" "$out/gpu-proof.sh"
    cp "$HERE/gpu_proof.py" "$HERE/bench_torch.py" "$out/"
    cp "$repo/configs/demo.toml" "$out/demo.toml"
    commit=$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
    if [ -n "$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null)" ]; then commit="$commit+changes"; fi
    {
        echo "commit	$commit"
        echo "built	$(date -u +%Y-%m-%dT%H:%M:%SZ)"
        if [ -z "$ALIGN_BIN" ]; then echo "build	--release --locked --features cuda, CUDA_COMPUTE_CAP=90, stripped"; else echo "build	packed from $ALIGN_BIN"; fi
        echo "binary_bytes	$(stat -c %s "$bin")"
        echo "binary_sha256	$(sha256sum "$bin" | cut -d' ' -f1)"
    } >"$out/BUILD-INFO"
    local bytes gz total
    bytes=$(stat -c %s "$bin")
    gz=$(stat -c %s "$out/align.gz")
    total=$(du -sb "$out" | cut -f1)
    echo "gpu-proof: bundle $out: $(mib "$total") MiB ($total bytes): binary $(mib "$bytes") MiB, gzip'd $(mib "$gz") MiB"
    if [ "$total" -gt $((64 * 1048576)) ]; then
        echo "gpu-proof: warning: over the 64 MiB that travel with a device command" >&2
    fi
    echo "gpu-proof: on the GPU machine: bash $(basename "$out")/gpu-proof.sh --out /tmp/proof --copy-to \"\$OUT\""
}

if [ "$MODE" = build ]; then
    build_bundle
    exit 0
fi

# ---------------------------------------------------------------------------------------------
# The run

[ -n "$OUT" ] || { usage >&2; die "--out DIR is required"; }
command -v python3 >/dev/null || EXIT=3 die "python3 is needed (the comparisons and the report are gpu_proof.py)"
HELPER=$HERE/gpu_proof.py
BENCH_TORCH=$HERE/bench_torch.py
DEMO=
for f in "$HERE/demo.toml" "$HERE/../configs/demo.toml"; do
    if [ -f "$f" ]; then DEMO=$(cd "$(dirname "$f")" && pwd)/$(basename "$f"); break; fi
done
[ -f "$HELPER" ] || EXIT=3 die "gpu_proof.py is missing beside $SELF"
[ -n "$DEMO" ] || EXIT=3 die "demo.toml is missing (looked beside the script and in ../configs)"

STEPS=" ${GPU_PROOF_STEPS:-1 2 3 4 5} "
want() { case "$STEPS" in *" $1 "*) return 0 ;; esac; return 1; }

T0=$(date +%s)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RAW=$OUT/raw
rm -rf "$RAW" "$OUT/gpu-proof.table" "$OUT/gpu-proof.json" "$OUT/gpu-proof.log"
mkdir -p "$RAW"
LOG=$OUT/gpu-proof.log
note() { echo "gpu-proof: $*" | tee -a "$LOG" >&2; }

if [ -n "${GPU_PROOF_WORK:-}" ]; then
    WORK=$GPU_PROOF_WORK
    mkdir -p "$WORK"
    KEEP_WORK=1
else
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-proof.XXXXXX")
    KEEP_WORK=${GPU_PROOF_KEEP:-0}
fi
WORK=$(cd "$WORK" && pwd)
# shellcheck disable=SC2317 # called by the trap
cleanup() { if [ "$KEEP_WORK" != 1 ]; then rm -rf "$WORK"; fi; }
trap cleanup EXIT

# Sizes and time limits (seconds). The budget is split by deadlines: each step's commands are
# stopped at the step's deadline, and step 3 (the longest) runs last with whatever is left.
if [ "$KIND" = cpu ]; then
    BUDGET=${GPU_PROOF_BUDGET:-600}
    OPS_REPS=2
    TRAIN_STEPS=20 TRAIN_BATCH=32 TRAIN_SAMPLES=128
    LOADER_PROCS=2 LOADER_SAMPLES=48 LOADER_SIZE=128 LOADER_WORKERS=2 LOADER_BATCH=16 LOADER_BATCHES=6
else
    BUDGET=${GPU_PROOF_BUDGET:-570}
    OPS_REPS=10
    TRAIN_STEPS=100 TRAIN_BATCH=128 TRAIN_SAMPLES=512
    # 2400 synthetic 512 px images, written by one process per core.
    LOADER_PROCS=$(nproc); [ "$LOADER_PROCS" -gt 16 ] && LOADER_PROCS=16
    LOADER_SAMPLES=$((2400 / LOADER_PROCS)) LOADER_SIZE=512 LOADER_WORKERS=16 LOADER_BATCH=64 LOADER_BATCHES=200
fi
END=$((T0 + BUDGET))

# The binary: --align, else the bundle's compressed one.
BIN=
if [ -n "$ALIGN_BIN" ]; then
    [ -x "$ALIGN_BIN" ] || EXIT=3 die "--align $ALIGN_BIN is not an executable file"
    BIN=$(cd "$(dirname "$ALIGN_BIN")" && pwd)/$(basename "$ALIGN_BIN")
else
    for gz in "$HERE/align.gz" "$HERE/../gpu-bundle/align.gz"; do
        if [ -f "$gz" ]; then
            note "unpacking $gz"
            gunzip -c "$gz" >"$WORK/align"
            chmod +x "$WORK/align"
            BIN=$WORK/align
            break
        fi
    done
    [ -n "$BIN" ] || EXIT=3 die "no binary: pass --align BIN, or build the bundle with scripts/gpu-proof.sh --build-only"
fi
BUILD_INFO=
for f in "$HERE/BUILD-INFO" "$(dirname "$BIN")/BUILD-INFO"; do
    if [ -f "$f" ]; then BUILD_INFO=$(awk -F'\t' '$1=="commit"{c=$2} $1=="built"{b=$2} END{print "commit " c ", built " b}' "$f"); break; fi
done

# --- Libraries ---------------------------------------------------------------------------------

# Folders that may hold the CUDA libraries: the Python nvidia-* wheels (as torch uses them),
# torch's own lib/, the usual toolkit and system folders.
candidate_lib_dirs() {
    {
        python3 - <<'PY' 2>/dev/null || true
import importlib.util, os
roots = []
try:
    import nvidia
    roots += list(nvidia.__path__)
except Exception:
    pass
spec = importlib.util.find_spec("torch")
if spec is not None and spec.origin:
    roots.append(os.path.join(os.path.dirname(spec.origin), "lib"))
for root in roots:
    for dirpath, _, files in os.walk(root):
        if any(".so" in f for f in files):
            print(dirpath)
PY
        for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64 \
            /usr/local/cuda-13*/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu /usr/lib64; do
            if [ -d "$d" ]; then echo "$d"; fi
        done
    } | awk '!seen[$0]++'
}

not_found() { ldd "$BIN" 2>/dev/null | awk '/=> not found/ { print $1 }' | sort -u; }

ADDED_LIBS=
check_libraries() {
    local missing lib d found dirs
    missing=$(not_found)
    if [ -n "$missing" ]; then
        dirs=$(candidate_lib_dirs)
        for lib in $missing; do
            # The driver's library is never taken from a toolkit: a stub there would shadow nothing.
            [ "$lib" = libcuda.so.1 ] && continue
            found=
            while IFS= read -r d; do
                if [ -n "$d" ] && [ -e "$d/$lib" ]; then found=$d; break; fi
            done <<<"$dirs"
            if [ -z "$found" ]; then
                found=$(timeout 60 find / -xdev \( -path /proc -o -path /sys -o -path "$WORK" \) -prune -o -name "$lib" -print 2>/dev/null \
                    | grep -v '/stubs/' | head -1 || true)
                found=${found:+$(dirname "$found")}
            fi
            if [ -n "$found" ]; then
                case ":${LD_LIBRARY_PATH:-}:" in *":$found:"*) ;; *)
                    export LD_LIBRARY_PATH="$found${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
                    ADDED_LIBS="$ADDED_LIBS $found" ;;
                esac
            fi
        done
        missing=$(not_found)
    fi
    : >"$RAW/libs.txt"
    local wanted="libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libcudart.so.13 libnvrtc.so.13"
    for lib in $wanted; do
        local line
        line=$(ldd "$BIN" 2>/dev/null | awk -v l="$lib" '$1 == l { print $3; exit }')
        if [ -z "$line" ]; then
            [ "$KIND" = cuda ] && case "$lib" in libcuda.so.1|libcublas.so.13|libcurand.so.10|libcudart.so.13)
                printf '%s\tnot linked (is this a --features cuda build?)\n' "$lib" >>"$RAW/libs.txt" ;; esac
            continue
        fi
        if [ "$line" = not ]; then line=MISSING; fi
        printf '%s\t%s\n' "$lib" "$line" >>"$RAW/libs.txt"
    done
    if [ -n "$missing" ]; then
        note "libraries the binary cannot find:"
        for lib in $missing; do
            case "$lib" in
                libcuda.so.1) note "  $lib: the NVIDIA driver's library: is the driver installed (nvidia-smi)?" ;;
                libcublas*) note "  $lib: cuBLAS 13 (pip: nvidia-cublas for CUDA 13, or the CUDA 13 toolkit)" ;;
                libcurand*) note "  $lib: cuRAND 10 (pip: nvidia-curand for CUDA 13, or the CUDA 13 toolkit)" ;;
                libcudart*) note "  $lib: the CUDA 13 runtime (pip: nvidia-cuda-runtime for CUDA 13, or the toolkit)" ;;
                libnvrtc*) note "  $lib: NVRTC 13 (pip: nvidia-cuda-nvrtc for CUDA 13, or the toolkit)" ;;
                *) note "  $lib" ;;
            esac
        done
        note "searched: LD_LIBRARY_PATH, the Python nvidia-* and torch library folders, /usr/local/cuda*, and find /"
        return 1
    fi
    return 0
}

if ! check_libraries; then
    EXIT=3 die "the binary cannot start: libraries missing (above; also $RAW/libs.txt)"
fi
[ -n "$ADDED_LIBS" ] && note "LD_LIBRARY_PATH +=$ADDED_LIBS"
if ! "$BIN" --version >"$RAW/version.txt" 2>&1; then
    cat "$RAW/version.txt" >&2
    EXIT=3 die "$BIN does not start"
fi

# --- The device ----------------------------------------------------------------------------------

GPU='' DRIVER='' GPU_MEM='' CAP=''
if [ "$KIND" = cuda ]; then
    idx=0
    case "$DEVICE" in cuda:*) idx=${DEVICE#cuda:} ;; esac
    if smi=$(nvidia-smi -i "$idx" --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1); then
        IFS=, read -r GPU DRIVER GPU_MEM CAP <<<"$smi"
        GPU=$(echo "$GPU" | sed 's/^ *//; s/ *$//'); DRIVER=${DRIVER# }; GPU_MEM=${GPU_MEM# }; CAP=${CAP# }
    else
        note "nvidia-smi failed: $smi"
    fi
    # Dense peak TFLOP/s: bf16 on tensor cores; f32 without them (neither side uses TF32).
    case "$GPU" in
        *H200*|*H100*SXM*|*"H100 80GB HBM3"*) : "${PEAK_BF16:=989}" "${PEAK_F32:=67}" ;;
        *H100*NVL*) : "${PEAK_BF16:=835}" "${PEAK_F32:=60}" ;;
        *H100*) : "${PEAK_BF16:=756}" "${PEAK_F32:=51}" ;;
        *A100*) : "${PEAK_BF16:=312}" "${PEAK_F32:=19.5}" ;;
    esac
    [ -n "${PEAK_BF16:-}" ] || note "no peak TFLOP/s known for '${GPU:-this GPU}': set PEAK_BF16 / PEAK_F32 for MFU"
    note "${GPU:-unknown GPU}, driver ${DRIVER:-?}, ${GPU_MEM:-?}, compute capability ${CAP:-?}"
fi

{
    printf 'mode\t%s\n' "$KIND"
    printf 'device\t%s\n' "$DEVICE"
    printf 'gpu\t%s\n' "$GPU"
    printf 'driver\t%s\n' "$DRIVER"
    printf 'gpu_memory\t%s\n' "$GPU_MEM"
    printf 'compute_cap\t%s\n' "$CAP"
    printf 'cpu_cores\t%s\n' "$(nproc)"
    printf 'binary\t%s\n' "$(head -1 "$RAW/version.txt")"
    printf 'build\t%s\n' "$BUILD_INFO"
    printf 'peak_bf16_tflops\t%s\n' "${PEAK_BF16:-}"
    printf 'peak_f32_tflops\t%s\n' "${PEAK_F32:-}"
    printf 'train_steps\t%s\n' "$TRAIN_STEPS"
    printf 'train_batch\t%s\n' "$TRAIN_BATCH"
    printf 'budget_s\t%s\n' "$BUDGET"
    printf 'loader_source_px\t%s\n' "$LOADER_SIZE"
    printf 'ld_library_path_added\t%s\n' "${ADDED_LIBS# }"
    printf 'started\t%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    printf 'steps\t%s\n' "${GPU_PROOF_STEPS:-1 2 3 4 5}"
} >"$RAW/env.txt"

# The error a command's stderr ends with: its `Error:` line or panic (a backtrace may follow).
error_line() {
    { grep -m 1 -E '^(Error|error):|panicked at' "$1" || grep -v '^[[:space:]]*$' "$1" | tail -n 1; } 2>/dev/null | cut -c 1-300 || true
}

# run_cmd NAME DEADLINE CAP COMMAND...: stdout to RAW/NAME.out, stderr to RAW/NAME.err, at most
# CAP seconds and never past DEADLINE; its status, time and whether it was stopped go to
# RAW/commands.jsonl. Returns the command's status (124 when stopped or not started).
run_cmd() {
    local name=$1 deadline=$2 cap=$3 left t rc start secs timed_out
    shift 3
    mkdir -p "$RAW/$(dirname "$name")"
    left=$((deadline - $(date +%s)))
    t=$cap
    if [ "$left" -lt "$t" ]; then t=$left; fi
    if [ "$t" -lt 3 ]; then
        note "$name: not started, out of time"
        printf '{"name":"%s","rc":124,"seconds":0,"timed_out":true,"skipped":true}\n' "$name" >>"$RAW/commands.jsonl"
        return 124
    fi
    start=$(date +%s.%N)
    if timeout --kill-after=10 "$t" "$@" >"$RAW/$name.out" 2>"$RAW/$name.err"; then rc=0; else rc=$?; fi
    secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
    timed_out=false
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then timed_out=true; fi
    printf '{"name":"%s","rc":%d,"seconds":%s,"timed_out":%s,"limit_s":%d}\n' "$name" "$rc" "$secs" "$timed_out" "$t" >>"$RAW/commands.jsonl"
    if [ "$rc" -ne 0 ]; then
        note "$name: exit status $rc after ${secs}s$([ "$timed_out" = true ] && echo " (stopped at its ${t}s limit)"): $(error_line "$RAW/$name.err")"
    fi
    return "$rc"
}

deadline_in() { local d=$(($(date +%s) + $1)); [ "$d" -gt "$END" ] && d=$END; echo "$d"; }

# --- After each step: the report so far --------------------------------------------------------

# The table and JSON of what has run, copied out with the raw output, so that a run stopped from
# outside (the lent machine's own time limit) still brings back every finished row.
copy_out() {
    mkdir -p "$COPY_TO"
    cp "$OUT/gpu-proof.table" "$OUT/gpu-proof.json" "$LOG" "$COPY_TO/" 2>/dev/null || true
    tar -czf "$COPY_TO/gpu-proof-raw.tar.gz" -C "$OUT" raw || note "copying raw/ to $COPY_TO failed"
}
snapshot() {
    python3 "$HELPER" report --raw "$RAW" --out "$OUT" >/dev/null 2>&1 || true
    if [ -n "$COPY_TO" ]; then copy_out; fi
}

# --- 1. Kernels ----------------------------------------------------------------------------------
if want 1; then
    note "1. align bench ops on $DEVICE"
    STEP_END=$(deadline_in 90)
    run_cmd 1-ops/ops "$STEP_END" 90 "$BIN" --device "$DEVICE" bench ops --reps "$OPS_REPS" --json || true
    snapshot
fi

# --- 2. Training: the device against the CPU -----------------------------------------------------
if want 2; then
    note "2. $TRAIN_STEPS training steps of the demo model, batch $TRAIN_BATCH: cpu f32, then $DEVICE f32 / bf16 x ALIGN_KERNELS align / candle"
    STEP_END=$(deadline_in 200)
    DATA=$WORK/train-data
    TOK=$RAW/2-train/tokenizer.json
    run_cmd 2-train/synth "$STEP_END" 60 "$BIN" data synth --out "$DATA" --train-shards 2 --samples-per-shard "$TRAIN_SAMPLES" \
        --test-samples 8 --image-size 64 --json || true
    # One vocabulary for every run: training one is not reproducible from run to run.
    run_cmd 2-train/tokenizer "$STEP_END" 60 "$BIN" tokenizer train --data "$DATA/train-{00000..00001}.tar" --vocab-size 1000 \
        --out "$TOK" || true
    # At the demo's learning rate (2e-3) the run passes through loss spikes (steps 30-50) that
    # amplify any last-bit difference: the same binary on 2 and on 16 CPU cores differs there by
    # 2.8e-2 in loss, as much as any GPU run. At 5e-4, 1 and 2 threads stay within 2.1e-7 over
    # 100 steps, so a difference above the tolerance is the device's, not the recipe's.
    TRAIN=(train --config "$DEMO" --set "data.train=\"$DATA/train-{00000..00001}.tar\"" --set "text.tokenizer=\"$TOK\""
        --set "run.out_dir=\"$WORK/runs\"" --set "train.steps=$TRAIN_STEPS" --set "train.batch_size=$TRAIN_BATCH" --set train.lr=5e-4
        --set train.log_every=1 --set train.checkpoint_every=0 --set train.eval_every=0 --quiet --json)
    keep_metrics() { if [ -f "$WORK/runs/$1/metrics.jsonl" ]; then cp "$WORK/runs/$1/metrics.jsonl" "$RAW/2-train/$1.metrics.jsonl"; fi; }
    : >"$RAW/2-train/runs.txt"
    for precision in f32 bf16; do
        for kernels in align candle; do
            printf '%s-%s-%s\t%s\t%s\tcpu-f32\n' "$KIND" "$precision" "$kernels" "$precision" "$kernels" >>"$RAW/2-train/runs.txt"
        done
    done
    # The other paths a run takes on the device, each against its own CPU run: SigLIP's sigmoid loss
    # around the ring with patch dropout and a moving average; distillation from step 2's CPU
    # checkpoint with a locked image tower; two ranks (threads sharing the device) with sharded
    # optimizer state and gradients over two accumulated micro-batches; and fine-tunes of the
    # tests' small checkpoints, each with its own towers, tokenizer and recipe: open_clip's CLIP,
    # SigLIP 2 NaFlex (patch grids of each image's shape, masked) and open_clip's timm-trunk SigLIP.
    VARIANTS=(sigmoid-flip-ema distill-lock shard-ranks)
    FIXTURES=$(cd "$HERE/../tests/fixtures" 2>/dev/null && pwd || true)
    if [ -n "$FIXTURES" ] && [ -d "$FIXTURES/siglip2/naflex" ]; then
        VARIANTS+=(clip-start naflex-start timm-siglip-start)
    else
        note "2. tests/fixtures not found beside the script: the fine-tunes of the CLIP and SigLIP checkpoints are skipped"
    fi
    # A fine-tune takes its architecture from its checkpoint: no demo settings (a learning rate
    # a twentieth of the demo's, which these runs follow as closely as 1 against 2 CPU threads do).
    : >"$WORK/start.toml"
    START=(train --config "$WORK/start.toml" --set "data.train=\"$DATA/train-{00000..00001}.tar\"" --set "run.out_dir=\"$WORK/runs\""
        --set "train.steps=$TRAIN_STEPS" --set "train.batch_size=$TRAIN_BATCH" --set train.lr=1e-4 --set train.log_every=1
        --set train.checkpoint_every=0 --set train.eval_every=0 --quiet --json)
    # The command line of a run: BASE (the demo's settings or a fine-tune's) and VSETS after it.
    variant_sets() {
        BASE=("${TRAIN[@]}")
        case "$1" in
            sigmoid-flip-ema) VSETS=(--set 'model.temperature="align"' --set model.temperature_init=1.0 --set 'loss.kind="sigmoid"'
                --set model.vit.patch_dropout=0.5 --set train.ema_decay=0.99) ;;
            distill-lock) VSETS=(--set "distill.teacher=\"$WORK/runs/cpu-f32\"" --set model.lock_image=true
                --set model.lock_image_unlocked_groups=1) ;;
            shard-ranks) VSETS=(--nproc 2 --set 'train.shard="gradients"' --set train.accum_steps=2) ;;
            clip-start) BASE=("${START[@]}") VSETS=(--set "model.init=\"$FIXTURES/open_clip/clip-native\"") ;;
            naflex-start) BASE=("${START[@]}") VSETS=(--set "model.init=\"$FIXTURES/siglip2/naflex\"") ;;
            timm-siglip-start) BASE=("${START[@]}") VSETS=(--set "model.init=\"$FIXTURES/open_clip/timm-siglip\"") ;;
            *) BASE=("${TRAIN[@]}") VSETS=() ;;
        esac
    }
    for v in "${VARIANTS[@]}"; do
        printf '%s-f32-align-%s\tf32\talign\tcpu-f32-%s\n' "$KIND" "$v" "$v" >>"$RAW/2-train/runs.txt"
    done
    if [ -f "$TOK" ]; then
        run_cmd 2-train/cpu-f32 "$STEP_END" 120 "$BIN" --device cpu "${TRAIN[@]}" --set 'run.name="cpu-f32"' || true
        keep_metrics cpu-f32
        while IFS=$'\t' read -r name precision kernels ref; do
            variant_sets "${ref#cpu-f32-}"
            if [ "$ref" != cpu-f32 ]; then
                run_cmd "2-train/$ref" "$STEP_END" 120 "$BIN" --device cpu "${BASE[@]}" --set "run.name=\"$ref\"" "${VSETS[@]}" || true
                keep_metrics "$ref"
            fi
            run_cmd "2-train/$name" "$STEP_END" 90 env ALIGN_KERNELS="$kernels" "$BIN" --device "$DEVICE" "${BASE[@]}" \
                --set "run.name=\"$name\"" --set "train.precision=\"$precision\"" "${VSETS[@]}" || true
            keep_metrics "$name"
        done <"$RAW/2-train/runs.txt"
    else
        note "2. no tokenizer: training runs skipped"
    fi
fi

# --- 3. Model throughput, align and PyTorch ------------------------------------------------------

# Steps 3 and 5 run align's kernels (the binary's default) unless step 1 or 2 showed one wrong on
# this device: a kernel over its tolerance, or a training run on them that ran and failed (one
# stopped for time, or whose CPU reference failed, says nothing about the kernels). An
# ALIGN_KERNELS given to this script wins.
snapshot
if [ -n "${ALIGN_KERNELS:-}" ]; then
    MODEL_KERNELS=$ALIGN_KERNELS
    why="as ALIGN_KERNELS was given"
else
    MODEL_KERNELS=align
    why="no kernel and no training run on them failed"
    if ! python3 - "$OUT/gpu-proof.json" <<'PY'
import json, sys
steps = json.load(open(sys.argv[1]))["steps"]
def failed(r):
    error = r.get("error") or ""
    return r["pass"] is False and not any(s in error for s in ("time limit", "did not run", "CPU reference"))
wrong = steps["ops"].get("failed_ops") or [r["run"] for r in steps["training"]["rows"] if r["kernels"] == "align" and failed(r)]
sys.exit(1 if wrong else 0)
PY
    then
        MODEL_KERNELS=candle
        why="align's failed in step 1 or 2"
    fi
fi
printf 'model_kernels\t%s\n' "$MODEL_KERNELS" >>"$RAW/env.txt"
if want 3; then
    note "steps 3 and 5 run with ALIGN_KERNELS=$MODEL_KERNELS ($why)"
    # Before the loader and embedding: the throughput targets matter more, and the loader and
    # embedding need little time, kept for them here.
    STEP3_END=$END
    if want 4 || want 5; then STEP3_END=$((END - 80)); fi
    note "3. align bench model (and PyTorch) until $((STEP3_END - T0)) s into the run"
    BENCH=(python3 "$HELPER" bench --align "$BIN" --device "$DEVICE" --out "$RAW/3-model" --deadline "$STEP3_END"
        --bench-torch "$BENCH_TORCH")
    [ -n "${PEAK_F32:-}" ] && BENCH+=(--peak-f32 "$PEAK_F32")
    [ -n "${PEAK_BF16:-}" ] && BENCH+=(--peak-bf16 "$PEAK_BF16")
    # The helper stops starting runs near the deadline; the margin covers one that is under way.
    run_cmd 3-model "$((STEP3_END + 10))" "$((STEP3_END + 10 - $(date +%s)))" env ALIGN_KERNELS="$MODEL_KERNELS" "${BENCH[@]}" || true
    snapshot
fi

# --- 4. Loader ----------------------------------------------------------------------------------
if want 4; then
    note "4. align bench loader, $LOADER_WORKERS workers"
    STEP_END=$(deadline_in 45)
    for ((i = 0; i < LOADER_PROCS; i++)); do
        run_cmd "4-loader/synth-$i" "$STEP_END" 60 "$BIN" data synth --out "$WORK/loader/$i" --train-shards 1 \
            --samples-per-shard "$LOADER_SAMPLES" --test-samples 1 --image-size "$LOADER_SIZE" --seed "$i" --json &
    done
    wait
    run_cmd 4-loader/loader "$STEP_END" 40 "$BIN" bench loader --data "$WORK/loader/*/train-*.tar" --workers "$LOADER_WORKERS" \
        --batch "$LOADER_BATCH" --batches "$LOADER_BATCHES" --json || true
    snapshot
fi

# --- 5. Forward-only embedding: the path evaluation, embed, search and scoring share --------------
if want 5; then
    note "5. align bench embed with a device f32 run's checkpoint on the loader's shards"
    STEP_END=$(deadline_in 25)
    # The demo model as the device trained it, else as the CPU did.
    EMBED_CKPT="$WORK/runs/$KIND-f32-align"
    [ -d "$EMBED_CKPT" ] || EMBED_CKPT="$WORK/runs/cpu-f32"
    run_cmd 5-embed/embed "$STEP_END" 25 env ALIGN_KERNELS="$MODEL_KERNELS" "$BIN" --device "$DEVICE" bench embed --checkpoint "$EMBED_CKPT" \
        --data "$WORK/loader/0/train-*.tar" --json || true
fi

# --- The report ----------------------------------------------------------------------------------

printf 'seconds\t%s\n' "$(($(date +%s) - T0))" >>"$RAW/env.txt"
if python3 "$HELPER" report --raw "$RAW" --out "$OUT"; then status=0; else status=$?; fi
cat "$OUT/gpu-proof.table" >>"$LOG" 2>/dev/null || true
note "finished in $(($(date +%s) - T0)) s; report in $OUT/gpu-proof.table and $OUT/gpu-proof.json, raw output in $RAW"
if [ -n "$COPY_TO" ]; then
    copy_out
    note "copied the table, the JSON, the log and raw/ (gpu-proof-raw.tar.gz) to $COPY_TO"
fi
exit "$status"
