#!/usr/bin/env python3
"""align against PyTorch at equal precision, side by side in one sitting: the three training-step
configurations of BENCHMARKS.md (f32 against f32, bf16 against PyTorch's bf16 autocast) and
forward-only embedding (f32 / f32, bf16 / autocast, int8 / dynamic int8) with the inputs
scripts/make_bench_embed_inputs.py writes.

Each case runs both sides once a round, PyTorch first in odd rounds and align first in even
ones, so neither side always follows the other (a process that starts right after a large one
can meet slower memory). `--background-load` keeps one busy process at the lowest priority
beside every run, as on a shared machine. Embedding runs embed one untimed batch first on both
sides (`--embed-warmup N`; 0 times the first batch with each side's one-time costs), as the
training steps have a warm-up step. Every run is a process of its own; the figures kept are the in-process
rate each side reports (`align bench model` / `align bench embed` and scripts/bench_torch.py /
scripts/bench_embed.py, all with --json), the whole process's wall time and its peak resident
memory (from wait4). The table gives each side's median and the ratio of the medians; --json
writes every run as well.

    python3 scripts/make_bench_embed_inputs.py --out /tmp/bench-embed
    python3 scripts/bench_side_by_side.py --align target/release/align --inputs /tmp/bench-embed \\
        --rounds 2 --json side-by-side.json

Standard library only; the PyTorch scripts run under --python (default: this interpreter).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (key, name, align's `bench model` flags, bench_torch.py's flags)
TRAINING = [
    ("vit-ti16", "ViT-Ti/16 + BERT-mini, batch 32, 224 px",
     ["--image-tower", "vit-ti16", "--text-tower", "bert-mini", "--batch", "32", "--image-size", "224",
      "--set", "model.image_projection=true", "--set", "model.embed_dim=320"],
     ["--image-tower", "vit-ti16", "--batch", "32", "--image-size", "224"]),
    ("b0", "EfficientNet-B0 + BERT-mini, batch 16, 224 px",
     ["--image-tower", "efficientnet-b0", "--text-tower", "bert-mini", "--batch", "16", "--image-size", "224",
      "--set", "model.image_projection=false", "--set", "model.embed_dim=320"],
     ["--batch", "16", "--image-size", "224"]),
    ("vit-ti8", "ViT-Ti/8 + BERT-tiny, batch 128, 64 px",
     ["--image-tower", "vit-ti16", "--text-tower", "bert-tiny", "--batch", "128", "--image-size", "64",
      "--set", "model.vit.patch_size=8", "--set", "model.image_projection=true", "--set", "model.embed_dim=320"],
     ["--image-tower", "vit-ti16", "--patch-size", "8", "--image-size", "64", "--text-tower", "bert-tiny", "--batch", "128",
      "--embed-dim", "320"]),
]

# (key, name, folder under --inputs)
EMBEDDING = [
    ("vit-b32", "ViT-B/32", "clip-vit-b32"),
    ("vit-b16", "ViT-B/16", "clip-vit-b16"),
    ("b3-bert-base", "EfficientNet-B3 + BERT-base", "align-b3-bert-base"),
]

# align's --precision, and bench_embed.py's flags for the same precision.
EMBED_PRECISIONS = {"f32": [], "bf16": ["--autocast-bf16"], "int8": ["--int8", "dynamic"]}


def measure(cmd):
    """One process: (its JSON or None, wall seconds, peak RSS MiB, stderr's last line on failure)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        # Reaped here rather than by Popen.wait, for the child's own rusage (its peak RSS).
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.monotonic() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    peak = usage.ru_maxrss / 1024
    if p.returncode != 0:
        return None, wall, peak, (stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
    try:
        return json.loads(stdout), wall, peak, None
    except json.JSONDecodeError:
        return None, wall, peak, "no JSON on stdout"


def cases(a):
    """Every case: (key, name, kind ("train" or "embed"), precision, align's argv, PyTorch's argv)."""
    out = []
    threads = ["--threads", str(a.threads)]
    steps = ["--steps", str(a.steps), "--warmup", "1"]
    if "train" in a.only:
        for key, name, align_flags, torch_flags in TRAINING:
            for precision in a.train_precisions:
                align_argv = [a.align, "bench", "model", *align_flags, *steps, "--precision", precision,
                              "--set", 'optimizer.kind="adamw"', "--json"]
                torch_argv = [a.python, str(HERE / "bench_torch.py"), *torch_flags, *steps, "--precision", precision, *threads, "--json"]
                out.append((f"train-{key}-{precision}", name, "train", precision, align_argv, torch_argv))
    if "embed" in a.only:
        for key, name, folder in EMBEDDING:
            if key not in a.embed_models:
                continue
            model = str(Path(a.inputs) / folder)
            data = str(Path(a.inputs) / "data" / "shard-000.tar")
            for precision in a.embed_precisions:
                warmup = ["--warmup", str(a.embed_warmup)]
                align_argv = [a.align, "bench", "embed", "--checkpoint", model, "--data", data, "--precision", precision,
                              *warmup, "--json"]
                torch_argv = [a.python, str(HERE / "bench_embed.py"), "--checkpoint", model, "--data", data, "--batch", "64",
                              "--library", "transformers", "--padding", "longest", *threads, *EMBED_PRECISIONS[precision],
                              *warmup, "--json"]
                out.append((f"embed-{key}-{precision}", name, "embed", precision, align_argv, torch_argv))
    return out


def rate(kind, result):
    """The in-process figure: samples/s for a training step, images/s for embedding."""
    if result is None:
        return None
    return result.get("samples_per_s") if kind == "train" else result.get("images_per_s")


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--align", default="target/release/align")
    p.add_argument("--python", default=sys.executable, help="the interpreter with torch and transformers")
    p.add_argument("--inputs", default="/tmp/align-bench-embed", help="scripts/make_bench_embed_inputs.py's --out")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="PyTorch's threads (align uses every core)")
    p.add_argument("--steps", type=int, default=5, help="timed training steps, after one warm-up")
    p.add_argument("--embed-warmup", type=int, default=1, metavar="N",
                   help="embedding: N untimed batches on both sides before the timed pass over the whole data, as the "
                        "training steps have one warm-up step (0: time the first batch too, with each side's one-time "
                        "costs: packing or casting the weights, a batch's first memory)")
    p.add_argument("--only", nargs="+", choices=["train", "embed"], default=["train", "embed"])
    p.add_argument("--train-precisions", nargs="+", choices=["f32", "bf16"], default=["f32", "bf16"])
    p.add_argument("--embed-models", nargs="+", choices=[k for k, _, _ in EMBEDDING], default=["vit-b32"])
    p.add_argument("--embed-precisions", nargs="+", choices=list(EMBED_PRECISIONS), default=["f32", "bf16", "int8"])
    p.add_argument("--background-load", action="store_true",
                   help="keep one busy process at the lowest priority (nice 19) beside every run, as a shared machine has")
    p.add_argument("--json", metavar="FILE", help="write every run and the medians as JSON")
    a = p.parse_args()
    busy = None
    if a.background_load:
        busy = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
    try:
        return compare(a)
    finally:
        if busy:
            busy.kill()
            busy.wait()


def compare(a):
    todo = cases(a)
    runs = []
    total = a.rounds * len(todo) * 2
    t0 = time.monotonic()
    for rnd in range(1, a.rounds + 1):
        for key, name, kind, precision, align_argv, torch_argv in todo:
            sides = [("pytorch", torch_argv), ("align", align_argv)]
            if rnd % 2 == 0:
                sides.reverse()
            for side, argv in sides:
                result, wall, peak, error = measure(argv)
                runs.append({"case": key, "round": rnd, "side": side, "rate": rate(kind, result), "wall_s": round(wall, 3),
                             "peak_rss_mib": round(peak, 1), "error": error, "result": result})
                done = len(runs)
                eta = (time.monotonic() - t0) / done * (total - done)
                shown = "failed: " + error if error else f"{fmt(rate(kind, result), '.2f')}/s"
                print(f"[{done}/{total}, ETA {eta:.0f} s] round {rnd} {key} {side}: {shown}, whole process {wall:.1f} s",
                      file=sys.stderr, flush=True)

    rows = []
    for key, name, kind, precision, _, _ in todo:
        mine = [r for r in runs if r["case"] == key]
        side = {s: [r for r in mine if r["side"] == s] for s in ("align", "pytorch")}
        m = {s: {"rate": median(r["rate"] for r in side[s]), "wall_s": median(r["wall_s"] for r in side[s] if r["rate"] is not None),
                 "peak_rss_mib": median(r["peak_rss_mib"] for r in side[s]), "rates": [r["rate"] for r in side[s]]} for s in side}
        ratio = m["align"]["rate"] / m["pytorch"]["rate"] if m["align"]["rate"] and m["pytorch"]["rate"] else None
        whole = m["pytorch"]["wall_s"] / m["align"]["wall_s"] if m["align"]["wall_s"] and m["pytorch"]["wall_s"] else None
        rows.append({"case": key, "name": name, "kind": kind, "precision": precision, **m,
                     "speed_in_process": ratio, "speed_whole_process": whole})

    unit = {"train": "samples/s", "embed": "images/s"}
    print("| case | precision | align (rounds) | PyTorch (rounds) | speed in process | speed whole process | peak RSS align / PyTorch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        torch_name = {"f32": "f32", "bf16": "bf16 autocast", "int8": "dynamic int8"}[r["precision"]]
        cells = [
            f"{r['name']}" + (" (embed)" if r["kind"] == "embed" else ""),
            f"{r['precision']} / {torch_name}",
            f"{fmt(r['align']['rate'], '.2f')} {unit[r['kind']]} ({', '.join(fmt(x, '.2f') for x in r['align']['rates'])})",
            f"{fmt(r['pytorch']['rate'], '.2f')} ({', '.join(fmt(x, '.2f') for x in r['pytorch']['rates'])})",
            f"{fmt(r['speed_in_process'], '.2f')}×",
            f"{fmt(r['speed_whole_process'], '.2f')}×",
            f"{fmt(r['align']['peak_rss_mib'], ',.0f')} / {fmt(r['pytorch']['peak_rss_mib'], ',.0f')} MiB",
        ]
        print("| " + " | ".join(cells) + " |")
    failed = [r for r in runs if r["error"]]
    for r in failed:
        print(f"failed: round {r['round']} {r['case']} {r['side']}: {r['error']}", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps({"rounds": a.rounds, "threads": a.threads, "background_load": a.background_load,
                                            "embed_warmup": a.embed_warmup, "rows": rows,
                                            "runs": runs}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
