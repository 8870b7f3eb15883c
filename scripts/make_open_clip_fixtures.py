#!/usr/bin/env python3
"""open_clip fixtures: tiny models in open_clip's native checkpoint format (the folder layout of the
open_clip repos on the Hugging Face Hub), made and reloaded with open_clip's own code, and what
open_clip computes with them.

Writes tests/fixtures/open_clip/:
- clip-native/: open_clip's `CLIP` class (native VisionTransformer + the text tower flattened into
  the top level: `token_embedding`, `positional_embedding`, `transformer.resblocks.N.*`, `ln_final`,
  `text_projection` as an (width, embed_dim) Parameter, `logit_scale` 0-dim). Vision: 32 px,
  patch 8, width 32, 2 layers, head_width 8 (open_clip derives the vision heads as width //
  head_width, so 4 heads; the default head_width 64 would give 0), mlp_ratio 4. Text: the real CLIP
  vocabulary (49408, so open_clip's SimpleTokenizer works unchanged), context_length 16, width 8,
  2 heads, 2 layers, causal mask, pool_type "argmax" (the position of the highest id, the
  <end_of_text> 49407). embed_dim 16. quick_gelu true (x * sigmoid(1.702 x) in both towers).
  Written by open_clip's `push_to_hf_hub.save_for_hf(..., safe_serialization=True)`:
  open_clip_model.safetensors (model.state_dict(); the causal attn_mask buffer is non-persistent,
  so it is not in the file) and open_clip_config.json = {"model_cfg": ..., "preprocess_cfg":
  {mean, std, interpolation, resize_mode}} (the keys save_config_for_hf writes; no "size": that
  comes from vision_cfg.image_size). preprocess: OpenAI mean/std, bicubic, resize_mode "shortest".
  The text width is 8 to keep the 49408-row token embedding at 1.6 MB (fp32; no fp16 needed).
  No tokenizer files: save_for_hf calls tokenizer.save_pretrained, which SimpleTokenizer lacks
  (push_to_hf_hub swaps in the Hub's openai/clip-vit-large-patch14 HF tokenizer files, ~3.6 MB,
  which open_clip never reads for a model without text_cfg.hf_tokenizer_name), so a no-op stands in.
- clip-native-bin/: the same shapes, another seed, quick_gelu false (exact erf GELU, nn.GELU), only
  open_clip_pytorch_model.bin (torch.save of the state dict: a zip pickle, what save_for_hf writes
  with safe_serialization=False). Its open_clip_config.json is save_config_for_hf's plus "size": 32
  and "fill_color": 0 (both accepted by open_clip; size is overridden by vision_cfg.image_size),
  with resize_mode "squash" and interpolation "bilinear".
- custom-text/: open_clip's `CustomTextCLIP` (custom_text true) with both towers native: vision as
  above (keys `visual.*`), text under `text.*` (TextTransformer) with no_causal_mask true,
  pool_type "last", proj_bias true (text.text_projection is an nn.Linear: weight (16, 16) + bias),
  init_logit_bias set (logit_bias parameter, 0-dim), norm_kwargs eps 1e-6 and act_kwargs
  {"approximate": "tanh"} in both towers (GELU-tanh), quick_gelu false: SigLIP's text-tower recipe
  on a native open_clip ViT (no shipped open_clip config pairs custom_text with a native ViT except
  CoCa; SigLIP's vision towers are timm trunks). Its text_cfg names hf_tokenizer_name, so
  get_tokenizer("local-dir:DIR") loads an HFTokenizer from DIR itself (for local-dir open_clip
  always uses the folder, whatever the name says): CLIP's byte-level BPE cut to OpenAI's first 300
  merges (vocab 814: 256 bytes, 256 bytes+</w>, 300 merges, <|startoftext|> 812, <|endoftext|> 813,
  the same tokenizer as tests/fixtures/towers/clip-tiny), saved by transformers' CLIPTokenizer
  (tokenizer.json + tokenizer_config.json), with tokenizer_kwargs {"clean": "canonicalize"} as the
  SigLIP configs have (punctuation removed, lower case); the HFTokenizer pads to max_length with
  the pad token (<|endoftext|> 813) and truncates keeping <|endoftext|> last. vocab_size 814,
  width 16, 4 heads, 2 layers, context 16. preprocess: mean/std 0.5, bicubic, "squash".
- <name>-io.safetensors, per model: pixel_values (4 seeded normal images at 32 px), image_features
  (model.encode_image, not normalised), image_features_normalised, image_pooled (the vision tower's
  pooled token after ln_post, before `proj`), input_ids (open_clip.get_tokenizer("local-dir:DIR") on
  the four captions), text_features (model.encode_text, not normalised), text_features_normalised,
  text_pooled (after ln_final and pooling, before text_projection), logits_per_image (get_logits:
  exp(logit_scale) * cos (+ logit_bias)), logit_scale (the raw parameter, reshaped to [1]),
  logit_bias (custom-text), jpeg_pixel_values (the four image files through open_clip's val
  transform from create_model_and_transforms, images opened with PIL.Image.open and passed as
  they are; all four are RGB files) and jpeg_image_features.
- expected.json: the images (paths relative to tests/fixtures) and, per model, the captions, the
  exact token ids, the tokenizer, the open_clip_config.json written, the final preprocess cfg and
  the val transform's repr, the weights file, every state-dict key with shape and dtype, the
  pooling rule, logit_scale / logit_bias, and the versions.

Every weight is its initial value plus seeded N(0, 0.05^2) noise, so nothing sits at its init;
then logit_scale is set to ln 20 (clip-native), ln 12 (clip-native-bin) and ln 15 with
logit_bias -3.25 (custom-text). All references come from the model reloaded by
open_clip.create_model_and_transforms("local-dir:DIR") (strict load), checked against the model
that was saved.

`--check DIR --like NAME` loads a folder that align exported (`align export --format open_clip`)
with open_clip.create_model_and_transforms("local-dir:DIR") and open_clip.get_tokenizer, embeds the
fixture NAME's pixel_values, captions (the ids compared with the fixture's) and image files, and
prints the largest differences; it exits 1 if a feature, pixel or logit differs by more than 1e-4,
the ids differ or the preprocess cfg differs.

Written with: torch 2.15.0, open_clip_torch 3.3.0, torchvision 0.29.2, transformers 5.24.0,
tokenizers 0.23.3, ftfy 6.3.1, Pillow 13.0.0, safetensors 0.8.0, numpy 2.4.6 (run by hand, not by
CI; nothing downloaded).
"""
import argparse
import gzip
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file

import open_clip
from open_clip.push_to_hf_hub import save_config_for_hf, save_for_hf
from open_clip.tokenizer import HFTokenizer, SimpleTokenizer, bytes_to_unicode, default_bpe
from open_clip.transformer import text_global_pool

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures")
OUT = os.path.join(FIXTURES, "open_clip")
TOL = 1e-4

CAPTIONS = [
    "a photo of a cat",
    "Two DOGS &amp; a Café: the dog’s “ball”!",
    "red car",
    "A very long caption: an old man riding a brown horse near the river on a sunny morning, while two "
    "small children play with a blue ball in the park.",
]
# Paths relative to tests/fixtures. All RGB, so whether a caller converts to RGB before or after
# open_clip's resize makes no difference (open_clip's val transform resizes first, then converts).
IMAGES = [
    "towers/images/smooth-50x40.jpg",
    "towers/images/smooth-32x64.jpg",
    "preprocess/odd-347x289.png",
    "preprocess/tall-1to4.jpg",
]
OPENAI_MEAN = list(open_clip.OPENAI_DATASET_MEAN)
OPENAI_STD = list(open_clip.OPENAI_DATASET_STD)

VISION = {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 8}

MODELS = {
    "clip-native": {
        "seed": 60,
        "logit_scale": math.log(20.0),
        "weights": "safetensors",
        "model_cfg": {
            "embed_dim": 16,
            "quick_gelu": True,
            "vision_cfg": dict(VISION),
            "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 8, "heads": 2, "layers": 2},
        },
        "preprocess_cfg": {"mean": OPENAI_MEAN, "std": OPENAI_STD, "interpolation": "bicubic",
                           "resize_mode": "shortest"},
        "pooling": "text: ln_final over every position, then the position of input_ids.argmax(-1) (the highest id: "
                   "the first <end_of_text> 49407), then @ text_projection (width, embed_dim); vision: ln_post(class "
                   "token) @ proj (width, embed_dim)",
    },
    "clip-native-bin": {
        "seed": 70,
        "logit_scale": math.log(12.0),
        "weights": "bin",
        "model_cfg": {
            "embed_dim": 16,
            "quick_gelu": False,
            "vision_cfg": dict(VISION),
            "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 8, "heads": 2, "layers": 2},
        },
        "preprocess_cfg": {"mean": OPENAI_MEAN, "std": OPENAI_STD, "interpolation": "bilinear",
                           "resize_mode": "squash"},
        "extra_preprocess_keys": {"size": 32, "fill_color": 0},
        "pooling": "as clip-native (exact erf GELU instead of QuickGELU)",
    },
    "custom-text": {
        "seed": 80,
        "logit_scale": math.log(15.0),
        "logit_bias": -3.25,
        "weights": "safetensors",
        "model_cfg": {
            "embed_dim": 16,
            "init_logit_bias": -10,
            "custom_text": True,
            "vision_cfg": dict(VISION, norm_kwargs={"eps": 1e-6}, act_kwargs={"approximate": "tanh"}),
            "text_cfg": {
                "context_length": 16,
                "vocab_size": 814,
                "hf_tokenizer_name": "align-fixtures/clip-bpe-300",
                "tokenizer_kwargs": {"clean": "canonicalize"},
                "width": 16,
                "heads": 4,
                "layers": 2,
                "no_causal_mask": True,
                "proj_bias": True,
                "pool_type": "last",
                "norm_kwargs": {"eps": 1e-6},
                "act_kwargs": {"approximate": "tanh"},
            },
        },
        "preprocess_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bicubic",
                           "resize_mode": "squash"},
        "pooling": "text (text.*): bidirectional attention (no mask at all, padding attended), ln_final over every "
                   "position, then the last position (index 15: a padding <|endoftext|> when the caption is short), "
                   "then text.text_projection (nn.Linear with bias); vision: ln_post(class token) @ proj",
    },
}


# ----------------------------------------------------------------------------------------------
# Tokenizer for custom-text


class _NoTokenizerFiles:
    """Stands in for the tokenizer in save_for_hf where the model uses open_clip's SimpleTokenizer
    (which has no save_pretrained and no files: its BPE table ships inside open_clip)."""

    def save_pretrained(self, directory):
        pass


def clip_bpe_300():
    """CLIP's byte-level BPE with OpenAI's first 300 merges (as tests/fixtures/towers/clip-tiny)."""
    from transformers import CLIPTokenizer
    lines = gzip.open(default_bpe()).read().decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1:301]]  # line 0 is the version header
    symbols = list(bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    assert len(vocab) == 814 and len(set(vocab)) == 814
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges, model_max_length=16)


# ----------------------------------------------------------------------------------------------
# Models


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def pixel_inputs():
    return torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(11))


def image_pooled(model, pixel_values):
    """The vision tower's pooled output before the projection."""
    v = model.visual
    x = v._embeds(pixel_values)
    x = v.transformer(x)
    pooled, _ = v._pool(x)
    return pooled


def text_pooled(model, ids):
    """The text tower's pooled output before the projection (CLIP: top-level text modules)."""
    if isinstance(model, open_clip.CustomTextCLIP):
        t = model.text
        x, attn_mask = t._embeds(ids)
        x = t.transformer(x, attn_mask=attn_mask)
        x = t.ln_final(x)
        return text_global_pool(x, ids, t.pool_type, eos_token_id=t.eos_id)
    x = model.token_embedding(ids) + model.positional_embedding
    x = model.transformer(x, attn_mask=model.attn_mask)
    x = model.ln_final(x)
    return text_global_pool(x, ids, model.text_pool_type, eos_token_id=model.text_eos_id)


def text_projection(model):
    return model.text.text_projection if isinstance(model, open_clip.CustomTextCLIP) else model.text_projection


def project(proj, x):
    return proj(x) if isinstance(proj, torch.nn.Linear) else x @ proj


def embed(model, preprocess, tokenizer, captions, pixel_values):
    ids = tokenizer(captions)
    with torch.no_grad():
        image_features = model.encode_image(pixel_values)
        text_features = model.encode_text(ids)
        logits_per_image, _ = model.get_logits(pixel_values, ids)
        img_pooled = image_pooled(model, pixel_values)
        txt_pooled = text_pooled(model, ids)
        assert torch.allclose(img_pooled @ model.visual.proj, image_features, atol=1e-6)
        assert torch.allclose(project(text_projection(model), txt_pooled), text_features, atol=1e-6)
        jpeg_pixels = torch.stack([preprocess(Image.open(os.path.join(FIXTURES, p))) for p in IMAGES])
        jpeg_features = model.encode_image(jpeg_pixels)
    out = {
        "pixel_values": pixel_values,
        "image_features": image_features,
        "image_features_normalised": F.normalize(image_features, dim=-1),
        "image_pooled": img_pooled,
        "input_ids": ids.to(torch.int64),
        "text_features": text_features,
        "text_features_normalised": F.normalize(text_features, dim=-1),
        "text_pooled": txt_pooled,
        "logits_per_image": logits_per_image,
        "logit_scale": model.logit_scale.detach().reshape(1),
        "jpeg_pixel_values": jpeg_pixels,
        "jpeg_image_features": jpeg_features,
    }
    if model.logit_bias is not None:
        out["logit_bias"] = model.logit_bias.detach().reshape(1)
    return {k: v.contiguous() for k, v in out.items()}


def load(directory):
    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + os.path.abspath(directory))
    tokenizer = open_clip.get_tokenizer("local-dir:" + os.path.abspath(directory))
    return model.eval(), preprocess, tokenizer


def tokenizer_record(tokenizer):
    if isinstance(tokenizer, SimpleTokenizer):
        return {"class": "open_clip.tokenizer.SimpleTokenizer", "context_length": tokenizer.context_length,
                "clean": "lower (ftfy.fix_text, html.unescape twice, strip, whitespace collapsed, lower case)",
                "sot_token_id": tokenizer.sot_token_id, "eot_token_id": tokenizer.eot_token_id, "pad_id": 0,
                "truncation": "[sot] + bpe + [eot], cut to context_length, last token set to eot",
                "vocab_size": tokenizer.vocab_size}
    assert isinstance(tokenizer, HFTokenizer)
    t = tokenizer.tokenizer
    return {"class": "open_clip.tokenizer.HFTokenizer", "hf_class": type(t).__name__,
            "context_length": tokenizer.context_length, "clean": "canonicalize",
            "call": "tokenizer(texts, max_length=context_length, padding='max_length', truncation=True)",
            "bos_token_id": t.bos_token_id, "eos_token_id": t.eos_token_id, "pad_token_id": t.pad_token_id,
            "vocab_size": len(t)}


def make_one(name, spec):
    d = os.path.join(OUT, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    model_cfg = json.loads(json.dumps(spec["model_cfg"]))
    # 1. the config alone, so open_clip builds the architecture from it (no weights yet: random init)
    with open(os.path.join(d, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": model_cfg, "preprocess_cfg": spec["preprocess_cfg"]}, f, indent=2)
    torch.manual_seed(spec["seed"])
    model = open_clip.create_model("local-dir:" + os.path.abspath(d)).eval()
    perturb(model, spec["seed"] + 1)
    with torch.no_grad():
        model.logit_scale.fill_(spec["logit_scale"])
        if "logit_bias" in spec:
            model.logit_bias.fill_(spec["logit_bias"])
    # 2. save as open_clip saves for the Hub
    os.remove(os.path.join(d, "open_clip_config.json"))
    tokenizer_saver = clip_bpe_300() if "hf_tokenizer_name" in model_cfg["text_cfg"] else _NoTokenizerFiles()
    save_for_hf(model, tokenizer_saver, model_cfg, d, safe_serialization=spec["weights"] == "safetensors")
    if "extra_preprocess_keys" in spec:
        path = Path(d) / "open_clip_config.json"
        cfg = json.loads(path.read_text())
        cfg["preprocess_cfg"] = {**spec["extra_preprocess_keys"], **cfg["preprocess_cfg"]}
        path.write_text(json.dumps(cfg, indent=2))
    weights = sorted(f for f in os.listdir(d) if f.endswith((".safetensors", ".bin")))
    assert weights == [{"safetensors": "open_clip_model.safetensors", "bin": "open_clip_pytorch_model.bin"}[spec["weights"]]]

    # 3. reload through open_clip's local-dir path; the references come from the reloaded model
    loaded, preprocess, tokenizer = load(d)
    tensors = embed(loaded, preprocess, tokenizer, CAPTIONS, pixel_inputs())
    with torch.no_grad():
        again = model.encode_image(tensors["pixel_values"])
        again_t = model.encode_text(tensors["input_ids"])
    assert torch.equal(again, tensors["image_features"]) and torch.equal(again_t, tensors["text_features"]), name
    # the images opened as RGB first give the same pixels (all four files are RGB)
    rgb = torch.stack([preprocess(Image.open(os.path.join(FIXTURES, p)).convert("RGB")) for p in IMAGES])
    assert torch.equal(rgb, tensors["jpeg_pixel_values"])
    save_file(tensors, os.path.join(OUT, f"{name}-io.safetensors"))

    sd = loaded.state_dict()
    written = json.loads((Path(d) / "open_clip_config.json").read_text())
    record = {
        "dir": name,
        "io": f"{name}-io.safetensors",
        "weights_file": weights[0],
        "model_class": type(loaded).__name__,
        "open_clip_config": written,
        "final_preprocess_cfg": {k: list(v) if isinstance(v, tuple) else v for k, v in loaded.visual.preprocess_cfg.items()},
        "val_transform": repr(preprocess),
        "captions": CAPTIONS,
        "input_ids": tensors["input_ids"].tolist(),
        "tokenizer": tokenizer_record(tokenizer),
        "pooling": spec["pooling"],
        "activation": ("quick_gelu" if model_cfg.get("quick_gelu") else
                       "gelu_tanh" if model_cfg["text_cfg"].get("act_kwargs") else "gelu (erf)"),
        "layer_norm_eps": model_cfg["text_cfg"].get("norm_kwargs", {}).get("eps", 1e-5),
        "logit_scale": tensors["logit_scale"].item(),
        "logit_bias": tensors["logit_bias"].item() if "logit_bias" in tensors else None,
        "state_dict": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in sd.items()},
        "files": sorted(os.listdir(d)),
    }
    print(f"{name}: {type(loaded).__name__}, {len(sd)} tensors, ids {tuple(tensors['input_ids'].shape)}, "
          f"files {record['files']}")
    return record


def make_all():
    os.makedirs(OUT, exist_ok=True)
    models = {name: make_one(name, spec) for name, spec in MODELS.items()}
    import ftfy
    import PIL
    import safetensors
    import tokenizers
    import torchvision
    import transformers
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump({"images": IMAGES,
                   "image_open": "PIL.Image.open(tests/fixtures/<path>) passed to the val transform as it is",
                   "versions": {"torch": torch.__version__, "open_clip": open_clip.__version__,
                                "torchvision": torchvision.__version__, "transformers": transformers.__version__,
                                "tokenizers": tokenizers.__version__, "ftfy": ftfy.__version__,
                                "Pillow": PIL.__version__, "safetensors": safetensors.__version__},
                   "models": models}, f, indent=1, ensure_ascii=False)
        f.write("\n")
    total = 0
    for root, _, files in os.walk(OUT):
        for fn in sorted(files):
            p = os.path.join(root, fn)
            os.chmod(p, 0o644)  # safetensors writes 0600
            total += os.path.getsize(p)
            print(f"  {os.path.relpath(p, OUT)}: {os.path.getsize(p)} bytes")
    print(f"total {total} bytes")


# ----------------------------------------------------------------------------------------------
# --check


def check(directory, like):
    with open(os.path.join(OUT, "expected.json")) as f:
        expected = json.load(f)
    record = expected["models"][like]
    ref = load_file(os.path.join(OUT, record["io"]))
    model, preprocess, tokenizer = load(directory)
    print(f"{directory}: {type(model).__name__} (fixture: {record['model_class']}), tokenizer "
          f"{type(tokenizer).__name__}, weights {sorted(f for f in os.listdir(directory) if f.endswith(('.safetensors', '.bin', '.pth')))}")
    failed = []
    if type(model).__name__ != record["model_class"]:
        print("  note: a different model class (key layout) from the fixture's")
    pp = {k: list(v) if isinstance(v, tuple) else v for k, v in model.visual.preprocess_cfg.items()}
    for k, v in record["final_preprocess_cfg"].items():
        mine = pp.get(k)
        if isinstance(v, list):
            same = isinstance(mine, list) and len(mine) == len(v) and all(abs(a - b) <= 1e-7 for a, b in zip(mine, v))
        else:
            same = mine == v
        if not same:
            print(f"preprocess_cfg {k}: {pp.get(k)!r}, the fixture's {v!r}")
            failed.append("preprocess_cfg " + k)
    got = embed(model, preprocess, tokenizer, record["captions"], ref["pixel_values"])
    if got["input_ids"].tolist() != record["input_ids"]:
        print("input_ids differ from the fixture's:\n  got     ", got["input_ids"].tolist(), "\n  expected",
              record["input_ids"])
        failed.append("input_ids")
    keys = ["image_features", "text_features", "jpeg_pixel_values", "jpeg_image_features", "logits_per_image",
            "logit_scale", "image_pooled", "text_pooled"]
    if "logit_bias" in ref or "logit_bias" in got:
        keys.append("logit_bias")
    for key in keys:
        if key not in got or key not in ref:
            print(f"{key}: missing ({'exported' if key not in got else 'fixture'})")
            failed.append(key)
            continue
        if got[key].shape != ref[key].shape:
            print(f"{key}: shape {tuple(got[key].shape)}, the fixture's {tuple(ref[key].shape)}")
            failed.append(key)
            continue
        diff = (got[key] - ref[key]).abs().max().item()
        print(f"{key}: max |difference| {diff:.3g}")
        if not diff <= TOL:
            failed.append(key)
    if failed:
        print("MISMATCH:", ", ".join(failed))
        sys.exit(1)
    print("all within", TOL)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--check", metavar="DIR", help="an open_clip folder align exported")
    p.add_argument("--like", metavar="NAME", help="with --check: the fixture it should match (" + ", ".join(MODELS) + ")")
    a = p.parse_args()
    if a.check:
        if not a.like:
            p.error("--check needs --like")
        check(a.check, a.like)
    else:
        make_all()
