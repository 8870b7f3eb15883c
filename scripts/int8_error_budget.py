#!/usr/bin/env python3
"""How far simulated low-precision linear layers move a CLIP model's image-text cosine scores.

Scores every pair of a webdataset tar the way `align data score` does (the cosine of the pair's
normalised image and text embeddings, captions padded to the tokenizer's full length), first in
f32 and then with the operands of the large linear products rounded by a simulated ("fake")
quantization scheme, and reports the largest and the mean absolute difference from the f32 scores
over all pairs. The aim is to find out which operand precision keeps the largest difference within
2e-3.

A linear call is quantized when its product has at least 2,097,152 multiply-adds (m·n·k, m being
the rows of the flattened input), the smallest product align's `--precision int8` and `--precision
bf16` hand to their kernels; the decision is made per call. Attention score products, the patch
embedding and the embeddings stay f32. The reference scheme is align's int8: the weight [n, k]
symmetric per output channel (scale max|w|/127, round half to even, clipped to -127..127) and the
input [m, k] asymmetric per row (lo = min(row, 0), hi = max(row, 0), scale (hi-lo)/255, zero point
round(-lo/scale), codes clamped to 0..255). Both operands are dequantized and multiplied in f32,
and the bias is added in f32. The other variants keep one operand f32, give each group of 128 or
32 along k its own scale, use 9 or 10 bits (weights max|w|/(2^(b-1)-1), inputs (hi-lo)/(2^b-1)),
round both operands to bfloat16 instead, or leave one tower in f32.

Besides the largest and the mean absolute difference, the table gives the signed mean and the
standard deviation of the differences. The signed mean is the shift every score shares; it is large
where the embeddings of different samples lie close together, as in a randomly initialised model,
because one perturbation of the weights then moves all of them alike, and it changes sign and size
with the particular rounding. The line above the table gives the mean cosine between the f32
embeddings of different images and of different texts for that reason.

Data loading, preprocessing and tokenization come from scripts/bench_embed.py (its transformers
runner, AutoModel and AutoProcessor from the checkpoint folder). Run by hand, not by CI; nothing is
downloaded, and it takes a few minutes on two cores for a ViT-B/32 and 256 pairs:

    pip install torch transformers pillow
    python3 scripts/int8_error_budget.py --checkpoint /tmp/bench-embed/clip-vit-b32 \\
        --data /tmp/bench-embed/data/shard-000.tar --batch 64

--json prints one JSON object instead of the table. Written with torch 2.15.0 and transformers
5.24.0.
"""
import argparse
import collections
import io
import json
import os
import sys
import time
import types

import torch
import torch.nn.functional as F

MIN_MACS = 2_097_152
TARGET = 2e-3

SCHEMES = {"W8A8": dict(w=8, x=8), "W8A32": dict(w=8), "W32A8": dict(x=8), "W8A8 g128": dict(w=8, x=8, group=128),
           "W8A8 g32": dict(w=8, x=8, group=32), "W9A9": dict(w=9, x=9), "W10A10": dict(w=10, x=10), "bf16": dict(bf16=True)}
VARIANTS = [
    ("W8A8 (per channel x per row)", "W8A8", "W8A8"),
    ("W8A32 (weights only)", "W8A32", "W8A32"),
    ("W32A8 (inputs only)", "W32A8", "W32A8"),
    ("W8A8, groups of 128 along k", "W8A8 g128", "W8A8 g128"),
    ("W8A8, groups of 32 along k", "W8A8 g32", "W8A8 g32"),
    ("W9A9", "W9A9", "W9A9"),
    ("W10A10", "W10A10", "W10A10"),
    ("bf16 operands", "bf16", "bf16"),
    ("W8A8, text tower f32", "W8A8", "f32"),
    ("W8A8, image tower f32", "f32", "W8A8"),
]


def fake_weight(w, bits, group):
    n, k = w.shape
    v = w.reshape(n, k // group, group)
    qmax = 2 ** (bits - 1) - 1
    scale = v.abs().amax(-1, keepdim=True) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(v / safe), -qmax, qmax)
    return (q * scale).reshape(n, k)


def fake_input(x, bits, group):
    k = x.shape[-1]
    v = x.reshape(-1, k // group, group)
    levels = 2 ** bits - 1
    lo, hi = torch.aminmax(v, dim=-1, keepdim=True)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = (hi - lo) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / safe)
    return (v / safe).round_().add_(zero).clamp_(0, levels).sub_(zero).mul_(scale).reshape(x.shape)


class Simulation:
    """Wraps every nn.Linear's forward; `scheme` None runs them unchanged."""

    def __init__(self, model):
        self.scheme, self.weights, self.calls = None, {}, collections.Counter()
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.forward = types.MethodType(self.wrap(name), module)

    def use(self, scheme):
        self.scheme, self.weights, self.calls = scheme, {}, collections.Counter()

    def wrap(self, name):
        sim = self

        def forward(module, x):
            s = sim.scheme
            n, k = module.weight.shape
            m = x.numel() // k
            big = m * n * k >= MIN_MACS
            sim.calls[(name, m, n, k, big)] += 1
            if s is None or not big:
                return F.linear(x, module.weight, module.bias)
            group = s.get("group") or k
            if k % group:
                raise SystemExit(f"{name}: k={k} is not a multiple of the group size {group}")
            w = sim.weights.get(name)
            if w is None:
                if s.get("bf16"):
                    w = module.weight.to(torch.bfloat16).float()
                else:
                    w = fake_weight(module.weight, s["w"], group) if s.get("w") else module.weight
                sim.weights[name] = w
            if s.get("bf16"):
                x = x.to(torch.bfloat16).float()
            elif s.get("x"):
                x = fake_input(x, s["x"], group)
            return F.linear(x, w, module.bias)

        return forward


def shapes(calls):
    """Calls per (tower, m, n, k) and the layers behind them, split by whether the product was quantized."""
    out = {True: {}, False: {}}
    for (name, m, n, k, big), count in sorted(calls.items()):
        entry = out[big].setdefault(("text" if name.startswith("text") else "image", m, n, k), [0, set()])
        entry[0] += count
        entry[1].add(name.split(".")[-1])
    return {big: [dict(tower=t, m=m, n=n, k=k, calls=c, layers=sorted(kinds)) for (t, m, n, k), (c, kinds) in sorted(d.items())]
            for big, d in out.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a transformers CLIPModel folder")
    p.add_argument("--data", required=True, help="a webdataset tar (KEY.jpg + KEY.txt per sample)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    started = time.perf_counter()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_embed
    from PIL import Image

    runner = bench_embed.Transformers(argparse.Namespace(checkpoint=a.checkpoint, text_len=0, padding="max_length"))
    inputs = []
    for batch in bench_embed.batches(a.data, a.batch, 0):
        pixels = runner.preprocess([Image.open(io.BytesIO(b)).convert("RGB") for _, b, _ in batch])
        inputs.append((pixels, runner.tokenize([c for _, _, c in batch])))
    sim = Simulation(runner.model)

    embeds, calls = {}, None
    with torch.inference_mode():
        for scheme in ["f32", *SCHEMES]:
            sim.use(SCHEMES.get(scheme))
            images = torch.cat([runner.embed_images(px) for px, _ in inputs]).float()
            texts = torch.cat([runner.embed_texts(tok) for _, tok in inputs]).float()
            embeds[scheme] = (F.normalize(images, dim=-1), F.normalize(texts, dim=-1))
            if scheme == "W8A8":
                calls = shapes(sim.calls)

    def scores(image_scheme, text_scheme):
        return (embeds[image_scheme][0] * embeds[text_scheme][1]).sum(-1).double()

    def closeness(e):
        n = e.shape[0]
        return ((e @ e.T).sum().item() - n) / (n * (n - 1)) if n > 1 else None

    reference = scores("f32", "f32")
    rows = []
    for label, image_scheme, text_scheme in VARIANTS:
        diff = scores(image_scheme, text_scheme) - reference
        top = diff.abs().max().item()
        rows.append(dict(variant=label, max=top, mean=diff.abs().mean().item(), signed_mean=diff.mean().item(),
                         std=diff.std().item() if len(diff) > 1 else 0.0, within_target=top <= TARGET))
    result = {
        "checkpoint": a.checkpoint, "data": a.data, "pairs": len(reference), "batch": a.batch,
        "threads": torch.get_num_threads(), "text_len": runner.text_len, "min_macs": MIN_MACS, "target_max": TARGET,
        "f32_scores": {"min": reference.min().item(), "max": reference.max().item()},
        "f32_mean_cosine": {"images": closeness(embeds["f32"][0]), "texts": closeness(embeds["f32"][1])},
        "quantized_products": calls[True], "f32_products": calls[False], "variants": rows,
        "seconds": round(time.perf_counter() - started, 1),
        "versions": {"torch": torch.__version__, "transformers": sys.modules["transformers"].__version__},
    }
    if a.json:
        print(json.dumps(result))
        return
    print(f"{result['pairs']} pairs, batch {a.batch}, text length {runner.text_len}, {result['threads']} threads")
    print(f"f32 scores: min {result['f32_scores']['min']:.6f}, max {result['f32_scores']['max']:.6f}")
    close = result["f32_mean_cosine"]
    if close["images"] is not None:
        print(f"f32 embeddings: mean cosine between images {close['images']:.3f}, between texts {close['texts']:.3f}")
    for big, title in ((True, "quantized"), (False, "left f32")):
        total = sum(s["calls"] for s in calls[big])
        print(f"linear calls {title} (m·n·k {'>=' if big else '<'} {MIN_MACS:,}) in one pass: {total}")
        for s in calls[big]:
            print(f"  {s['tower']:<5} m={s['m']:<5} n={s['n']:<5} k={s['k']:<5} {s['calls']:>4} calls  ({', '.join(s['layers'])})")
    width = max(len(r["variant"]) for r in rows)
    print(f"\n{'variant':<{width}}  {'max |diff|':>10}  {'mean |diff|':>11}  {'mean diff':>10}  {'std diff':>9}  max <= {TARGET:g}")
    for r in rows:
        print(f"{r['variant']:<{width}}  {r['max']:>10.3e}  {r['mean']:>11.3e}  {r['signed_mean']:>+10.2e}  {r['std']:>9.2e}  "
              f"{'yes' if r['within_target'] else 'no'}")
    print(f"\n{result['seconds']:.1f} s")


if __name__ == "__main__":
    main()
