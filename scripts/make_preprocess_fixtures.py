#!/usr/bin/env python3
"""Preprocessing parity fixtures: image files of awkward shapes and formats, and what Hugging Face
transformers makes of them end to end (file bytes -> processor -> AlignModel image embedding).

Writes tests/fixtures/preprocess/:
- the images: JPEGs from 40 px to 1024 px, 4:1 and 1:4 aspect, greyscale, CMYK, a PNG with alpha
  and an odd-sized PNG, made from seeded noise and shapes (no photographs, nothing downloaded);
- model/: a complete Hugging Face AlignModel directory (AutoModel and AutoProcessor load it): the
  tiny model of tests/fixtures/hf/align-tiny run at 289 px (EfficientNet takes any size), with
  ALIGN's processor as kakaobrain/align-base configures it (resize to 346x346 with PIL's
  antialiased bilinear, centre crop 289, x/127.5 - 1, no mean/std);
- expected.safetensors: per image, transformers' image embedding and a 17x17 grid of its pixel
  values (the full 289x289 arrays would be megabytes); the images' order is in expected.json.

A random tiny network is either blind to its input (every image gets the same embedding, so any
pipeline would pass) or chaotic (one 8-bit level of noise changes it). Its BatchNorm statistics are
therefore calibrated on these images and the variances scaled by 1.1, which sits between the two
like a trained model: +-1 level of pixel noise moves the embeddings by < 3e-5 in cosine, bicubic
instead of bilinear by up to 4e-3, resizing to 320 instead of 346 by up to 1.4e-2.

Images are read as transformers' own pipelines read them: `load_image` (PIL, converted to RGB;
alpha dropped, greyscale replicated, CMYK converted by PIL's formula). The processor is the PIL
one (`EfficientNetImageProcessorPil`), transformers' reference implementation; its torchvision
variant differs from it by rounding.

The Rust test (tests/preprocess_parity.rs) runs align's evaluation preprocessing on the same files
and requires per-image cosine >= 0.999 with these embeddings.

Written with: torch 2.15.0, transformers 5.23.0, Pillow 13.0.0, numpy (run by hand, not by CI).
"""
import json
import os
import shutil

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import AlignModel
from transformers.image_utils import load_image
from transformers.models.efficientnet import EfficientNetImageProcessorPil

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures")
OUT = os.path.join(FIXTURES, "preprocess")
GRID = 17


def picture(w, h, seed):
    """Smooth colour fields, hard-edged shapes and a little noise: content with detail at every
    scale, so a wrong filter, offset or aspect shows in the pixels and the embedding."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.zeros((h, w, 3))
    for c in range(3):
        fx, fy = rng.uniform(0.5, 6.0, 2)
        phase = rng.uniform(0, 2 * np.pi)
        img[..., c] = 128 + 90 * np.sin(2 * np.pi * (fx * x / w + fy * y / h) + phase)
    for _ in range(12):
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        r = rng.uniform(0.03, 0.2) * min(w, h) + 1
        colour = rng.uniform(0, 255, 3)
        if rng.random() < 0.5:
            mask = (x - cx) ** 2 + (y - cy) ** 2 < r * r
        else:
            mask = (abs(x - cx) < r) & (abs(y - cy) < r * 0.6)
        img[mask] = colour
    # Thin stripes: the content an un-antialiased downscale aliases.
    img[::7, :, 1] = 255 - img[::7, :, 1]
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_images():
    specs = [
        ("tiny-40.jpg", 40, 40),
        ("square-1024.jpg", 1024, 1024),
        ("photo-500x375.jpg", 500, 375),
        ("wide-4to1.jpg", 800, 200),
        ("tall-1to4.jpg", 150, 600),
        ("grey-300x200.jpg", 300, 200),
        ("cmyk-320x240.jpg", 320, 240),
        ("alpha-256x192.png", 256, 192),
        ("odd-347x289.png", 347, 289),
    ]
    names = []
    for i, (name, w, h) in enumerate(specs):
        rgb = Image.fromarray(picture(w, h, seed=100 + i))
        path = os.path.join(OUT, name)
        if name.startswith("grey"):
            rgb.convert("L").save(path, quality=90)
        elif name.startswith("cmyk"):
            rgb.convert("CMYK").save(path, quality=90)
        elif name.startswith("alpha"):
            a = np.clip(np.linspace(0, 255, w)[None, :] + np.zeros((h, 1)), 0, 255).astype(np.uint8)
            rgba = rgb.copy()
            rgba.putalpha(Image.fromarray(a))
            rgba.save(path)
        elif name.endswith(".png"):
            rgb.save(path)
        else:
            rgb.save(path, quality=88)
        names.append(name)
    return names


VARIANCE_SCALE = 1.1


def calibrate(model, pixels, variance_scale):
    """BatchNorm running statistics of the vision tower measured on `pixels`, variances scaled."""
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # a cumulative average: one batch gives its exact statistics
    model.train()
    with torch.no_grad():
        model.vision_model(pixel_values=pixels)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_var.mul_(variance_scale)


def main():
    os.makedirs(OUT, exist_ok=True)
    names = make_images()
    processor = EfficientNetImageProcessorPil(
        size={"height": 346, "width": 346}, crop_size={"height": 289, "width": 289}, do_center_crop=True,
        resample=Image.Resampling.BILINEAR, do_rescale=True, rescale_factor=1 / 127.5, rescale_offset=True,
        do_normalize=False, include_top=False)
    model = AlignModel.from_pretrained(os.path.join(FIXTURES, "hf", "align-tiny"))
    images = [load_image(os.path.join(OUT, n)) for n in names]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    calibrate(model, pixels, VARIANCE_SCALE)
    model.eval()
    model_dir = os.path.join(OUT, "model")
    model.save_pretrained(model_dir, safe_serialization=True)
    processor.save_pretrained(model_dir)
    shutil.copy(os.path.join(FIXTURES, "hf", "align-tiny", "vocab.txt"), model_dir)
    with torch.no_grad():
        embeds = model.get_image_features(pixel_values=pixels)
    if not torch.is_tensor(embeds):
        embeds = embeds.pooler_output
    idx = torch.linspace(0, pixels.shape[-1] - 1, GRID).round().long()
    grid = pixels[:, :, idx][:, :, :, idx]
    save_file({"image_embeds": embeds.contiguous(), "pixel_grid": grid.contiguous(),
               "grid_index": idx.to(torch.int64).contiguous()}, os.path.join(OUT, "expected.safetensors"))
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump({"names": names, "grid": GRID}, f, indent=1)
    print("wrote", len(names), "images; embeddings", tuple(embeds.shape), "pixels", tuple(pixels.shape))


if __name__ == "__main__":
    main()
