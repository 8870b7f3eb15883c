#!/usr/bin/env python3
"""The PyTorch side of `align bench model`: the same dual encoder, the same batch, image size, text
length and loss (ALIGN's symmetric normalised softmax with label smoothing 0.1, summed), AdamW.

Two model families:

- The CPU comparisons of BENCHMARKS.md (the default, unchanged): a Hugging Face AlignModel with an
  EfficientNet-B0 vision tower and a BERT-mini text tower, or with `--image-tower vit-ti16` a
  Hugging Face ViTModel of DeiT-Ti size and its [CLS] state projected like the text.
- Any other pair of towers (`--image-tower vit-b32 | vit-b16 | efficientnet-b3 | efficientnet-b7 |
  ...`, `--text-tower bert-base | ...`): the image tower from timm (ViT: the [CLS] state after the
  final LayerNorm; EfficientNet: the last block's pooled feature without the 1x1 head convolution,
  as ALIGN has it, stochastic depth 0.2), BERT from a transformers config, both projected to
  `--embed-dim` (the image without bias, the text with, as align). Random weights: nothing is
  downloaded.

`--device cuda` times on the GPU (synchronising at phase boundaries, as align does) and reports
peak GPU memory three ways: `peak_gpu_mib` (device memory in use, total - free, sampled after each
phase: align's method), `max_allocated_mib` and `max_reserved_mib` (PyTorch's allocator). f32
runs in strict f32 (TF32 off for matmuls and cuDNN, like align's cuBLAS calls); `--precision bf16`
runs forward and loss under bf16 autocast with f32 weights and optimizer state. `--json` prints
one JSON object.

    pip install torch transformers          # and timm for the towers beyond the two below
    python3 scripts/bench_torch.py --batch 16 --image-size 224 --steps 5
    align bench model --image-tower efficientnet-b0 --text-tower bert-mini --batch 16 \\
        --image-size 224 --steps 5 --set 'optimizer.kind="adamw"' --set model.image_projection=false \\
        --set model.embed_dim=320
    python3 scripts/bench_torch.py --image-tower vit-ti16 --batch 32 --image-size 224 --steps 5
    align bench model --image-tower vit-ti16 --text-tower bert-mini --batch 32 --image-size 224 \\
        --steps 5 --set 'optimizer.kind="adamw"' --set model.embed_dim=320
    # ViT-Ti with 8-pixel patches at 64 px (64 patches) + BERT-tiny (2 layers), batch 128
    python3 scripts/bench_torch.py --image-tower vit-ti16 --patch-size 8 --image-size 64 \\
        --text-tower bert-tiny --batch 128 --embed-dim 320 --steps 5
    align bench model --image-tower vit-ti16 --text-tower bert-tiny --batch 128 --image-size 64 \\
        --steps 5 --set model.vit.patch_size=8 --set 'optimizer.kind="adamw"' --set model.image_projection=true \\
        --set model.embed_dim=320

    # On a GPU: ViT-B/16 + BERT-base in bf16, as scripts/gpu-proof.sh runs it
    python3 scripts/bench_torch.py --device cuda --image-tower vit-b16 --text-tower bert-base \\
        --batch 256 --image-size 224 --precision bf16 --steps 5 --warmup 2 --json
    align bench model --device cuda --image-tower vit-b16 --text-tower bert-base --batch 256 \\
        --image-size 224 --precision bf16 --steps 5 --warmup 2 --set 'optimizer.kind="adamw"' --json
"""
import argparse
import json
import resource
import time

# Towers the BENCHMARKS.md figures were taken with: Hugging Face's AlignModel (and ViTModel).
LEGACY_IMAGE_TOWERS = ("efficientnet-b0", "vit-ti16")
LEGACY_TEXT_TOWER = "bert-mini"

TIMM_IMAGE_TOWERS = {
    "vit-ti16": "vit_tiny_patch16_224",
    "vit-s16": "vit_small_patch16_224",
    "vit-b32": "vit_base_patch32_224",
    "vit-b16": "vit_base_patch16_224",
    **{f"efficientnet-b{i}": f"efficientnet_b{i}" for i in range(8)},
}

# align's BERT presets: (layers, hidden, heads); the MLP is 4 x hidden.
BERT_TOWERS = {
    "bert-tiny": (2, 128, 2),
    "bert-mini": (4, 256, 4),
    "bert-small": (4, 512, 8),
    "bert-medium": (8, 512, 8),
    "bert-base": (12, 768, 12),
    "bert-large": (24, 1024, 16),
}


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--text-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--image-tower", choices=sorted(set(LEGACY_IMAGE_TOWERS) | set(TIMM_IMAGE_TOWERS)), default="efficientnet-b0")
    p.add_argument("--text-tower", choices=sorted(BERT_TOWERS), default=LEGACY_TEXT_TOWER)
    p.add_argument("--patch-size", type=int, default=0,
                   help="a timm ViT's patch size in place of its preset's (align: --set model.vit.patch_size=N)")
    p.add_argument("--embed-dim", type=int, default=640, help="shared embedding width (timm towers; the legacy pair uses 320)")
    p.add_argument("--impl", choices=["auto", "hf", "timm"], default="auto",
                   help="auto: Hugging Face's AlignModel for efficientnet-b0 / vit-ti16 with bert-mini (the CPU figures), timm otherwise")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    p.add_argument("--channels-last", action="store_true", help="images and convolutions in channels-last layout")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


def uses_legacy(a):
    if a.impl == "hf":
        if a.image_tower not in LEGACY_IMAGE_TOWERS or a.text_tower != LEGACY_TEXT_TOWER:
            raise SystemExit(f"--impl hf has only {' / '.join(LEGACY_IMAGE_TOWERS)} with {LEGACY_TEXT_TOWER}")
        return True
    if a.patch_size and a.image_tower.startswith("vit"):
        if a.impl == "hf":
            raise SystemExit("--patch-size needs the timm towers (--impl timm or auto)")
        return False
    return a.impl == "auto" and a.image_tower in LEGACY_IMAGE_TOWERS and a.text_tower == LEGACY_TEXT_TOWER


def legacy_model(a):
    """AlignModel (EfficientNet-B0 + BERT-mini, embedding 320), or its vision tower swapped for a
    DeiT-Ti-sized ViTModel. Returns (module, image_fn, text_fn)."""
    import torch
    import torch.nn.functional as F
    from transformers import AlignConfig, AlignModel, AlignTextConfig, AlignVisionConfig, ViTConfig, ViTModel

    # EfficientNet-B0 scaling; the feature width (320) is the embedding size, as ALIGN has it.
    vision = AlignVisionConfig(width_coefficient=1.0, depth_coefficient=1.0, image_size=a.image_size, hidden_dim=1280, drop_connect_rate=0.2)
    text = AlignTextConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg = AlignConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=320, temperature_init_value=1.0)
    model = AlignModel(cfg).train()
    if a.image_tower == "vit-ti16":
        vit = ViTModel(ViTConfig(image_size=a.image_size, patch_size=16, hidden_size=192, num_hidden_layers=12, num_attention_heads=3,
                                 intermediate_size=768, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), add_pooling_layer=False)
        model.vision_model = vit.train()
        model.visual_projection = torch.nn.Linear(192, 320, bias=False)

        def image_fn(images):
            return F.normalize(model.visual_projection(model.vision_model(pixel_values=images).last_hidden_state[:, 0, :]), dim=-1)
    else:
        def image_fn(images):
            return F.normalize(model.vision_model(pixel_values=images).pooler_output, dim=-1)

    def text_fn(ids, mask):
        cls = model.text_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0, :]
        return F.normalize(model.text_projection(cls), dim=-1)

    return model, image_fn, text_fn


def timm_model(a):
    """A timm image tower and a transformers BERT, both projected to `--embed-dim`, with ALIGN's
    learnable temperature. Returns (module, image_fn, text_fn)."""
    import timm
    import torch
    import torch.nn.functional as F
    from transformers import BertConfig, BertModel

    name = TIMM_IMAGE_TOWERS[a.image_tower]
    if a.image_tower.startswith("vit"):
        # num_classes=0: the forward pass returns the [CLS] state after the final LayerNorm.
        patch = {"patch_size": a.patch_size} if a.patch_size else {}
        image = timm.create_model(name, pretrained=False, num_classes=0, img_size=a.image_size, **patch)
    else:
        image = timm.create_model(name, pretrained=False, num_classes=0, drop_rate=0.0, drop_path_rate=0.2)
        # ALIGN pools the last block's output: no 1x1 head convolution (and its BatchNorm).
        image.conv_head = torch.nn.Identity()
        image.bn2 = torch.nn.Identity()
    with torch.no_grad():
        width = image.eval()(torch.zeros(1, 3, a.image_size, a.image_size)).shape[-1]
    layers, hidden, heads = BERT_TOWERS[a.text_tower]
    text = BertModel(BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                intermediate_size=4 * hidden, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                     add_pooling_layer=False)

    class Dual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.image = image
            self.text = text
            self.visual_projection = torch.nn.Linear(width, a.embed_dim, bias=False)
            self.text_projection = torch.nn.Linear(hidden, a.embed_dim)
            self.temperature = torch.nn.Parameter(torch.tensor(1.0))

    model = Dual().train()

    def image_fn(images):
        return F.normalize(model.visual_projection(model.image(images)), dim=-1)

    def text_fn(ids, mask):
        cls = model.text(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0, :]
        return F.normalize(model.text_projection(cls), dim=-1)

    return model, image_fn, text_fn


def measure(a):
    """Times `a.warmup + a.steps` training steps; returns the figures as a dict. A CUDA
    out-of-memory error propagates (torch.cuda.OutOfMemoryError)."""
    import torch
    import torch.nn.functional as F

    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:
        # Strict f32 like align's cuBLAS calls; bf16 runs under autocast either way.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    legacy = uses_legacy(a)
    model, image_fn, text_fn = legacy_model(a) if legacy else timm_model(a)
    model = model.to(device)
    memory_format = torch.channels_last if a.channels_last else torch.contiguous_format
    if a.channels_last:
        model = model.to(memory_format=memory_format)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-5)
    images = torch.randn(a.batch, 3, a.image_size, a.image_size, device=device).contiguous(memory_format=memory_format)
    ids = (1000 + (torch.arange(a.batch * a.text_len) * 7919) % 20000).reshape(a.batch, a.text_len).to(device)
    mask = torch.ones_like(ids)
    labels = torch.arange(a.batch, device=device)
    bf16 = a.precision == "bf16"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    peak_gpu = [0.0]

    def sample_gpu():
        if cuda:
            free, total = torch.cuda.mem_get_info(device)
            peak_gpu[0] = max(peak_gpu[0], (total - free) / 2**20)

    fwd = bwd = step = 0.0
    final_loss = None
    for i in range(a.warmup + a.steps):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            img = image_fn(images)
            txt = text_fn(ids, mask)
            logits = txt @ img.t() / model.temperature
            loss = F.cross_entropy(logits, labels, label_smoothing=0.1) + F.cross_entropy(logits.t(), labels, label_smoothing=0.1)
        final_loss = loss.item()
        t1 = time.perf_counter()
        sample_gpu()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync()
        t2 = time.perf_counter()
        sample_gpu()
        opt.step()
        sync()
        t3 = time.perf_counter()
        sample_gpu()
        if i >= a.warmup:
            fwd, bwd, step = fwd + t1 - t0, bwd + t2 - t1, step + t3 - t2
    n = max(a.steps, 1)
    total = (fwd + bwd + step) / n
    r = {
        "implementation": "transformers AlignModel" if legacy else "timm + transformers BertModel",
        "device": str(device),
        "precision": a.precision,
        "image_tower": a.image_tower,
        "text_tower": a.text_tower,
        "batch": a.batch,
        "image_size": a.image_size,
        "text_len": a.text_len,
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "forward_ms": 1000 * fwd / n,
        "backward_ms": 1000 * bwd / n,
        "optimizer_ms": 1000 * step / n,
        "step_ms": 1000 * total,
        "samples_per_s": a.batch / total,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "final_loss": final_loss,
        "torch": torch.__version__,
    }
    if cuda:
        r["peak_gpu_mib"] = peak_gpu[0]
        r["max_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        r["max_reserved_mib"] = torch.cuda.max_memory_reserved(device) / 2**20
        r["gpu"] = torch.cuda.get_device_name(device)
    if not legacy:
        r["attention"] = getattr(model.text.config, "_attn_implementation", None)
    return r


def main():
    a = parse_args()
    r = measure(a)
    if a.json:
        print(json.dumps(r))
        return
    print(f"threads {r['threads']}, parameters {r['parameters'] / 1e6:.2f} M")
    print(f"forward {r['forward_ms']:.1f} ms, backward {r['backward_ms']:.1f} ms, optimizer {r['optimizer_ms']:.1f} ms")
    line = f"samples/s {r['samples_per_s']:.2f}, peak RSS {r['peak_rss_mb']:.0f} MiB"
    if "peak_gpu_mib" in r:
        line += f", peak GPU {r['peak_gpu_mib']:.0f} MiB in use ({r['max_allocated_mib']:.0f} MiB allocated by PyTorch)"
    print(line)


if __name__ == "__main__":
    main()
