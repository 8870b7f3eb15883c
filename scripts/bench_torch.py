#!/usr/bin/env python3
"""The PyTorch side of `align bench model`: the same dual encoder (Hugging Face AlignModel with an
EfficientNet-B0 vision tower and a BERT-mini text tower, or with `--image-tower vit-ti16` a
Hugging Face ViTModel of DeiT-Ti size and its [CLS] state projected like the text), the same batch,
image size, text length and loss (ALIGN's symmetric normalised softmax with label smoothing 0.1,
summed), AdamW, on the CPU with as many threads as cores.

    pip install torch transformers
    python3 scripts/bench_torch.py --batch 16 --image-size 224 --steps 5
    align bench model --image-tower efficientnet-b0 --text-tower bert-mini --batch 16 \
        --image-size 224 --steps 5 --set 'optimizer.kind="adamw"' --set model.image_projection=false \
        --set model.embed_dim=320
    python3 scripts/bench_torch.py --image-tower vit-ti16 --batch 32 --image-size 224 --steps 5
    align bench model --image-tower vit-ti16 --text-tower bert-mini --batch 32 --image-size 224 \
        --steps 5 --set 'optimizer.kind="adamw"' --set model.embed_dim=320
"""
import argparse
import resource
import time

import torch
import torch.nn.functional as F
from transformers import AlignConfig, AlignModel, AlignTextConfig, AlignVisionConfig, ViTConfig, ViTModel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--text-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--image-tower", choices=["efficientnet-b0", "vit-ti16"], default="efficientnet-b0")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    # EfficientNet-B0 scaling; the feature width (320) is the embedding size, as ALIGN has it.
    vision = AlignVisionConfig(width_coefficient=1.0, depth_coefficient=1.0, image_size=a.image_size, hidden_dim=1280, drop_connect_rate=0.2)
    text = AlignTextConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg = AlignConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=320, temperature_init_value=1.0)
    model = AlignModel(cfg).train()
    if a.image_tower == "vit-ti16":
        vit = ViTModel(ViTConfig(image_size=a.image_size, patch_size=16, hidden_size=192, num_hidden_layers=12, num_attention_heads=3,
                                 intermediate_size=768, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), add_pooling_layer=False)
        model.vision_model = vit.train()
        model.visual_projection = torch.nn.Linear(192, 320, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-5)
    images = torch.randn(a.batch, 3, a.image_size, a.image_size)
    ids = (1000 + (torch.arange(a.batch * a.text_len) * 7919) % 20000).reshape(a.batch, a.text_len)
    mask = torch.ones_like(ids)
    labels = torch.arange(a.batch)
    fwd = bwd = step = 0.0
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        if a.image_tower == "vit-ti16":
            img = F.normalize(model.visual_projection(model.vision_model(pixel_values=images).last_hidden_state[:, 0, :]), dim=-1)
        else:
            img = F.normalize(model.vision_model(pixel_values=images).pooler_output, dim=-1)
        cls = model.text_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0, :]
        txt = F.normalize(model.text_projection(cls), dim=-1)
        logits = txt @ img.t() / model.temperature
        loss = F.cross_entropy(logits, labels, label_smoothing=0.1) + F.cross_entropy(logits.t(), labels, label_smoothing=0.1)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= a.warmup:
            fwd, bwd, step = fwd + t1 - t0, bwd + t2 - t1, step + t3 - t2
    n = a.steps
    total = (fwd + bwd + step) / n
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = sum(p.numel() for p in model.parameters())
    print(f"threads {torch.get_num_threads()}, parameters {params / 1e6:.2f} M")
    print(f"forward {1000 * fwd / n:.1f} ms, backward {1000 * bwd / n:.1f} ms, optimizer {1000 * step / n:.1f} ms")
    print(f"samples/s {a.batch / total:.2f}, peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main()
