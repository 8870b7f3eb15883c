#!/usr/bin/env bash
# Measures align on a GPU machine: training-step throughput, peak GPU memory and model FLOPs
# utilisation for ViT-B/32, ViT-B/16, EfficientNet-B3 and EfficientNet-B7 image towers with
# BERT-base, in f32 and bf16, and the data loader's images/s. Prints one table.
#
#   scripts/gpu-bench.sh                    build with --features cuda, run on cuda:0
#   scripts/gpu-bench.sh --device cpu       the same runs on the CPU (a dry run: small batch,
#                                           small images, one step; checks the script and table)
#
# Knobs: BATCH (default 128 on a GPU), STEPS (default 10), PEAK_F32 / PEAK_BF16 (TFLOP/s for
# the MFU column; known GPUs are filled in from nvidia-smi), ALIGN_BIN (skip the build).
# FLOPs per sample are counted by align from the architecture (`align bench model` reports them);
# MFU = 3 × forward FLOPs × samples/s / peak.
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-bench: unknown argument $1" >&2; exit 2 ;;
    esac
done

if [ "$DEVICE" = cpu ]; then
    FEATURES=()
    BATCH=${BATCH:-2}; STEPS=${STEPS:-1}; SIZE_OVERRIDE=64; LOADER_BATCHES=5
else
    FEATURES=(--features cuda)
    BATCH=${BATCH:-128}; STEPS=${STEPS:-10}; SIZE_OVERRIDE=; LOADER_BATCHES=200
    if [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null; then
        eval "$(scripts/cuda-toolchain.sh --env)"
    fi
    # Peak dense TFLOP/s (f32 without tensor cores, bf16 with) for the GPUs we know.
    GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
    case "$GPU" in
        *H200*|*H100*SXM*|*"H100 80GB HBM3"*) : "${PEAK_F32:=67}" "${PEAK_BF16:=989}" ;;
        *H100*) : "${PEAK_F32:=51}" "${PEAK_BF16:=756}" ;;
        *A100*) : "${PEAK_F32:=19.5}" "${PEAK_BF16:=312}" ;;
        *L4*) : "${PEAK_F32:=30}" "${PEAK_BF16:=121}" ;;
    esac
    echo "gpu-bench: ${GPU:-unknown GPU}" >&2
fi

BIN=${ALIGN_BIN:-}
if [ -z "$BIN" ]; then
    cargo build --release --locked "${FEATURES[@]}" >&2
    BIN=target/release/align
fi

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# name image_tower image_size
CONFIGS=(
    "vit-b32+bert-base vit-b32 224"
    "vit-b16+bert-base vit-b16 224"
    "effnet-b3+bert-base efficientnet-b3 300"
    "effnet-b7+bert-base efficientnet-b7 289"
)
for cfg in "${CONFIGS[@]}"; do
    read -r name tower size <<<"$cfg"
    size=${SIZE_OVERRIDE:-$size}
    for precision in f32 bf16; do
        peak=$([ "$precision" = f32 ] && echo "${PEAK_F32:-}" || echo "${PEAK_BF16:-}")
        args=(bench model --device "$DEVICE" --image-tower "$tower" --text-tower bert-base --batch "$BATCH"
              --image-size "$size" --text-len 64 --steps "$STEPS" --warmup 1 --precision "$precision" --json)
        [ -n "$peak" ] && args+=(--peak-tflops "$peak")
        echo "gpu-bench: $name $precision" >&2
        if ! "$BIN" "${args[@]}" >"$OUT/$name-$precision.json" 2>"$OUT/$name-$precision.err"; then
            echo "{\"error\": \"$(tail -1 "$OUT/$name-$precision.err" | tr -d '"')\"}" >"$OUT/$name-$precision.json"
        fi
    done
done

"$BIN" data synth --out "$OUT/shards" --train-shards 4 --samples-per-shard 500 --test-samples 10 --image-size 512 >/dev/null
"$BIN" bench loader --data "$OUT/shards/train-{00000..00003}.tar" --workers "$(nproc)" --batch 64 \
    --batches "$LOADER_BATCHES" --json >"$OUT/loader.json" 2>/dev/null

python3 - "$OUT" "$BATCH" <<'PY'
import json, pathlib, sys
out, batch = pathlib.Path(sys.argv[1]), sys.argv[2]
rows = []
for f in sorted(out.glob("*-f32.json")) + sorted(out.glob("*-bf16.json")):
    name, precision = f.stem.rsplit("-", 1)
    r = json.loads(f.read_text())
    if "error" in r:
        rows.append((name, precision, "failed: " + r["error"][:60], "", "", "", ""))
        continue
    mem = r.get("peak_gpu_mib") or r.get("peak_rss_mb")
    mfu = r.get("mfu")
    rows.append((name, precision, f"{r['samples_per_s']:.1f}", f"{mem:.0f}" if mem else "-",
                 f"{r['forward_gflops_per_sample']:.1f}", f"{r['model_tflops_per_s']:.2f}",
                 f"{100 * mfu:.1f}%" if mfu is not None else "-"))
head = ("model", "precision", "samples/s", "peak MiB", "fwd GFLOP/sample", "TFLOP/s", "MFU")
rows.sort(key=lambda r: (r[0], r[1] != "f32"))
widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
print(f"align training step, batch {batch}")
for r in [head, tuple("-" * w for w in widths)] + rows:
    print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))
loader = json.loads((out / "loader.json").read_text())
rate = loader.get("images_per_second") or loader.get("images_per_s")
print(f"\nloader (512 px JPEGs -> 289 px crops): {rate:.0f} images/s" if rate else f"\nloader: {loader}")
PY
