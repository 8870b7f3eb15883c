#!/usr/bin/env python3
"""By-hand check (not run by the tests, writes nothing under tests/fixtures): open_clip's real
`ViT-B-16-SigLIP` architecture (CustomTextCLIP: timm trunk vit_base_patch16_siglip_224 with the
attention-pool "map" head and timm_proj "none", text tower 12 x 768, vocab 32000, context 64), with
random weights, in open_clip's Hub folder format, and what open_clip computes with it.

    scripts/check_timm_siglip_base.py OUT

writes
- OUT/model/: open_clip.create_model("ViT-B-16-SigLIP", pretrained=None) (nothing downloaded: the
  config is built into open_clip and timm_model_pretrained is false) after torch.manual_seed(SEED),
  plus seeded N(0, 0.05^2) noise on every parameter and LayerNorm weights / biases redrawn as
  1 + N(0, 0.2^2) / N(0, 0.2^2) (make_zoo_fixtures.randomise), logit_scale ln 10, logit_bias -10;
  written by save_for_hf(..., safe_serialization=True) with open_clip's own model_cfg for the name
  (text_cfg.vocab_size 32000, hf_tokenizer_name "timm/ViT-B-16-SigLIP"), the preprocess cfg of
  open_clip's "webli" tag for it (mean / std 0.5, bicubic, resize_mode "squash": 224 x 224 without
  crop; create_model with pretrained=None would have left OpenAI's "shortest" cfg) and the tiny 400-piece
  Unigram tokenizer of the timm-siglip fixture (make_zoo_fixtures.unigram_tokenizer; its ids all lie
  below 400, which the 32000-row embedding accepts). About 800 MB (fp32).
- OUT/expected.json: {"versions", "model", "captions", "input_ids" (get_tokenizer("local-dir:
  OUT/model"), context 64), "text_features", "image_files" (absolute paths of the four fixture
  images), "image_features" (encode_image of the val transform of each file, opened with
  PIL.Image.open), "logit_scale", "logit_bias", "seconds"}; features are not normalised.
Everything is computed on the model reloaded with create_model_and_transforms("local-dir:OUT/model")
(strict load) and checked against the model that was saved.
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import make_zoo_fixtures as zoo  # sets HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE before open_clip loads

import json
import math
import shutil

import torch

import open_clip
from open_clip.model import set_model_preprocess_cfg
from open_clip.push_to_hf_hub import save_for_hf
from open_clip.transform import merge_preprocess_dict

NAME = "ViT-B-16-SigLIP"
SEED = 120


def main():
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT")
    start = time.time()
    out = os.path.abspath(sys.argv[1])
    d = os.path.join(out, "model")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    model_cfg = open_clip.get_model_config(NAME)
    assert model_cfg["vision_cfg"]["timm_model_name"] == "vit_base_patch16_siglip_224"
    assert model_cfg["text_cfg"]["vocab_size"] == 32000
    torch.manual_seed(SEED)
    model = open_clip.create_model(NAME, pretrained=None).eval()
    # create_model(NAME, pretrained=None) keeps open_clip's default (OpenAI) preprocess cfg; the Hub
    # folders (timm/ViT-B-16-SigLIP) carry SigLIP's, so set the "webli" tag's cfg (mean / std 0.5,
    # bicubic, squash) on the model before save_for_hf writes it
    pretrained_cfg = open_clip.get_pretrained_cfg(NAME, "webli")
    assert pretrained_cfg["resize_mode"] == "squash" and list(pretrained_cfg["mean"]) == [0.5, 0.5, 0.5]
    set_model_preprocess_cfg(model, merge_preprocess_dict(model.visual.preprocess_cfg, pretrained_cfg))
    zoo.randomise(model, SEED + 1)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(10.0))
        model.logit_bias.fill_(-10.0)
    save_for_hf(model, zoo.unigram_tokenizer(model_cfg["text_cfg"]["context_length"]), model_cfg, d,
                safe_serialization=True)

    loaded, preprocess, tokenizer = zoo.load(d)
    assert len(tokenizer.tokenizer) == zoo.UNIGRAM_SIZE and tokenizer.context_length == 64
    captions = [zoo.CAPTIONS[i] for i in zoo.TIMM_SIGLIP_CAPTIONS]
    ids = tokenizer(captions).to(torch.int64)
    files = [os.path.abspath(os.path.join(zoo.FIXTURES, p)) for p in zoo.IMAGES]
    pixels = zoo.open_images(preprocess)
    with torch.no_grad():
        text_features = loaded.encode_text(ids)
        image_features = loaded.encode_image(pixels)
        assert torch.equal(model.encode_text(ids), text_features)
        assert torch.equal(model.encode_image(pixels), image_features)
    assert text_features.shape == (len(captions), 768) and image_features.shape == (len(files), 768)
    seconds = round(time.time() - start, 1)
    expected = {
        "versions": zoo.versions(),
        "model": {"name": NAME, "seed": SEED, "dir": d, "val_transform": repr(preprocess),
                  "preprocess_cfg": {k: list(v) if isinstance(v, tuple) else v
                                     for k, v in loaded.visual.preprocess_cfg.items()}},
        "captions": captions,
        "input_ids": ids.tolist(),
        "text_features": text_features.tolist(),
        "image_files": files,
        "image_features": image_features.tolist(),
        "logit_scale": loaded.logit_scale.item(),
        "logit_bias": loaded.logit_bias.item(),
        "seconds": seconds,
    }
    with open(os.path.join(out, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, indent=1, ensure_ascii=True)
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
    print(f"{NAME}: {len(loaded.state_dict())} tensors, {size / 1e6:.1f} MB in {d}, "
          f"ids {[sum(1 for t in r if t != 1) for r in ids.tolist()]} pieces, {seconds} s")


if __name__ == "__main__":
    main()
