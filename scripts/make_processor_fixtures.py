#!/usr/bin/env python3
"""Image-processor fixtures: four real Hugging Face `preprocessor_config.json` forms, legacy ones
included, and exactly what transformers makes of them.

align reads a checkpoint's `preprocessor_config.json` into its evaluation transform
(src/io/hf/preprocess.rs). The files on the Hub come in several generations, and the same key means
different things in different processor classes: an integer `"size": 224` is a shortest-edge resize
for CLIPImageProcessor (class attribute `default_to_square = False`) but a 224x224 warp for
ViTImageProcessor (`default_to_square` left at BaseImageProcessor's True); keys the file does not
have take the class's defaults, and the class itself comes from `image_processor_type`, else from
the legacy `feature_extractor_type` with "FeatureExtractor" replaced by "ImageProcessor", else from
config.json's model_type (never from `processor_class`). These fixtures pin what transformers does.

Writes tests/fixtures/processors/:
- <form>/preprocessor_config.json for four forms, each key for key as the Hub repo has it (same keys,
  same values, no others; sorted and indented as transformers' to_json_string writes them), except
  that the sizes are scaled down so the outputs are small:
  - clip-legacy/   openai/clip-vit-base-patch32: the legacy CLIPFeatureExtractor file ("size" and
                   "crop_size" as plain integers, no image_processor_type, no do_rescale or
                   rescale_factor); 224 -> 32.
  - vit-legacy/    google/vit-base-patch16-224-in21k: the legacy ViTFeatureExtractor file (integer
                   "size", no crop keys, no rescale keys); 224 -> 32.
  - siglip/        google/siglip-base-patch16-224: SiglipImageProcessor, size {height, width},
                   processor_class SiglipProcessor; 224 -> 32.
  - align-base/    kakaobrain/align-base: EfficientNetImageProcessor, size 346x346 -> 40x40, centre
                   crop 289 -> 32, x/127.5 - 1 (rescale_offset), do_normalize false, include_top
                   false, bilinear. Its image_mean / image_std are written as [0.5, 0.5, 0.5] (what
                   transformers' ALIGN conversion script saved with the 4.27 defaults); they could
                   not be checked against the Hub offline and do not matter: do_normalize is false.
- expected.safetensors: per form and image, the full pixel_values that
  `AutoImageProcessor.from_pretrained(<form>/)` gives for the image file read with
  transformers.image_utils.load_image (the way transformers' pipelines read files: EXIF transpose,
  then PIL's convert("RGB"), which drops alpha, replicates grey and converts CMYK by PIL's formula),
  one float32 [3, 32, 32] tensor each, named "<form>/<image>" (e.g. "clip-legacy/tall-1to4.jpg").
  AutoImageProcessor in transformers 5.x gives the torchvision-backed class (CLIPImageProcessor,
  ViTImageProcessor, SiglipImageProcessor, EfficientNetImageProcessor); the same images through
  the PIL-backed twin (backend="pil": CLIPImageProcessorPil, ...) are stored as
  "pil/<form>/<image>". The two differ by rounding in the resize: by one 8-bit level at most on
  these images (0.015 after CLIP's std, 0.0078 after a std of 0.5 or ALIGN's x/127.5).
  "raw/<form>/alpha-256x192.png": the alpha PNG opened with PIL.Image.open and given to the
  processor as an RGBA image, for the forms whose class converts to RGB itself (do_convert_rgb true:
  CLIP, SigLIP): transformers' convert_to_rgb composites transparency onto white, unlike load_image.
- expected.json: the images' order, and per form: the Hub repo, the scaling, the classes
  AutoImageProcessor gives (default and backend="pil"), the settings as the processor object
  resolved them (resize rule and size, crop, resample, rescale factor and offset, normalisation,
  include_top, do_convert_rgb, default_to_square), the per-channel affine map from 8-bit values to
  pixel values those settings make (pixel = scale * x + bias, after resize and crop), the size each
  image is resized to before the crop, and the largest |torchvision - PIL| difference.

The images are tests/fixtures/preprocess/'s (made by make_preprocess_fixtures.py): JPEGs from 40 px
to 1024 px, 4:1 and 1:4, greyscale, CMYK, a PNG with alpha and an odd-sized PNG. Nothing random is
drawn here; nothing is downloaded.

Effective check (asserted when the script runs): the 1:4 image tall-1to4.jpg (150x600) through the
legacy CLIP form must be a shortest-edge resize to 32x128 (int(32 * 600 / 150) = 128) followed by a
centre crop of rows 48..80, not a square 32x32 resize. The script rebuilds that pipeline by hand with
torchvision (bicubic, antialiased) and with PIL, requires the processors' outputs to match it within
1e-5, and requires the square-resize alternative to differ from it by more than 0.5. It also checks
that the ViT legacy form warps every image to 32x32 (its integer size is a square), that SigLIP
crops nothing, and that align-base resizes to 40x40 and crops rows/columns 4..36.

Written with: torch 2.15.0, torchvision 0.29.2, transformers 5.24.0, Pillow 13.0.0, numpy 2.4.6,
safetensors 0.8.0 (run by hand, not by CI).
"""
import json
import os

import numpy as np
import PIL
import safetensors
import torch
import torchvision
import transformers
from PIL import Image
from safetensors.torch import save_file
from torchvision.transforms.v2 import functional as tvF
from transformers import AutoImageProcessor
from transformers.image_transforms import get_resize_output_image_size
from transformers.image_utils import ChannelDimension, load_image

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures")
IMAGES = os.path.join(FIXTURES, "preprocess")
OUT = os.path.join(FIXTURES, "processors")

OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]

# The Hub files, key for key, with only the sizes scaled down (224 -> 32; ALIGN 346 -> 40, 289 -> 32).
FORMS = {
    "clip-legacy": {
        "repo": "openai/clip-vit-base-patch32",
        "scaled": "size 224 -> 32, crop_size 224 -> 32",
        "config": {
            "crop_size": 32,
            "do_center_crop": True,
            "do_normalize": True,
            "do_resize": True,
            "feature_extractor_type": "CLIPFeatureExtractor",
            "image_mean": OPENAI_MEAN,
            "image_std": OPENAI_STD,
            "resample": 3,
            "size": 32,
        },
    },
    "vit-legacy": {
        "repo": "google/vit-base-patch16-224-in21k",
        "scaled": "size 224 -> 32",
        "config": {
            "do_normalize": True,
            "do_resize": True,
            "feature_extractor_type": "ViTFeatureExtractor",
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "resample": 2,
            "size": 32,
        },
    },
    "siglip": {
        "repo": "google/siglip-base-patch16-224",
        "scaled": "size 224x224 -> 32x32",
        "config": {
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "SiglipImageProcessor",
            "image_std": [0.5, 0.5, 0.5],
            "processor_class": "SiglipProcessor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"height": 32, "width": 32},
        },
    },
    "align-base": {
        "repo": "kakaobrain/align-base",
        "scaled": "size 346x346 -> 40x40, crop_size 289x289 -> 32x32",
        "config": {
            "crop_size": {"height": 32, "width": 32},
            "do_center_crop": True,
            "do_normalize": False,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "EfficientNetImageProcessor",
            "image_std": [0.5, 0.5, 0.5],
            "include_top": False,
            "processor_class": "AlignProcessor",
            "resample": 2,
            "rescale_factor": 0.00784313725490196,
            "rescale_offset": True,
            "size": {"height": 40, "width": 40},
        },
    },
}

RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def size_dict(s):
    """A SizeDict (or None) as a plain dict of its set keys."""
    if s is None:
        return None
    return {k: v for k, v in dict(s).items() if v is not None}


def effective(p):
    """The settings that decide the pixels, read from the processor object's attributes (after
    transformers applied the class defaults and converted integer sizes)."""
    size = size_dict(p.size)
    if set(size) == {"shortest_edge"}:
        resize = {"rule": "shortest_edge", "shortest_edge": size["shortest_edge"]}
    elif set(size) == {"height", "width"}:
        resize = {"rule": "height_width", "height": size["height"], "width": size["width"]}
    else:
        resize = {"rule": "other", **size}
    crop = size_dict(p.crop_size) if p.do_center_crop else None
    return {
        "do_resize": bool(p.do_resize),
        "resize": resize,
        "default_to_square": bool(p.default_to_square),
        "do_center_crop": bool(p.do_center_crop),
        "crop": crop,
        "resample": int(p.resample),
        "resample_name": RESAMPLE_NAMES[int(p.resample)],
        "do_rescale": bool(p.do_rescale),
        "rescale_factor": float(p.rescale_factor),
        "rescale_offset": bool(getattr(p, "rescale_offset", False)),
        "do_normalize": bool(p.do_normalize),
        "image_mean": [float(x) for x in p.image_mean],
        "image_std": [float(x) for x in p.image_std],
        "include_top": bool(getattr(p, "include_top", False)),
        "do_convert_rgb": p.do_convert_rgb,
    }


def affine(e):
    """Per channel, pixel = scale * x + bias for an 8-bit value x, as the settings `e` compute it:
    x * rescale_factor, minus 1 with rescale_offset, (. - mean) / std, and / std again with
    include_top (EfficientNet's classifier normalisation)."""
    def f(x, c):
        y = float(x)
        if e["do_rescale"]:
            y *= e["rescale_factor"]
            if e["rescale_offset"]:
                y -= 1.0
        if e["do_normalize"]:
            y = (y - e["image_mean"][c]) / e["image_std"][c]
        if e["include_top"]:
            y = y / e["image_std"][c]
        return y
    bias = [f(0, c) for c in range(3)]
    scale = [f(1, c) - bias[c] for c in range(3)]
    return {"scale": scale, "bias": bias}


def resized_hw(e, h, w):
    """The size an image of h x w is resized to before the crop, by transformers' own rule."""
    r = e["resize"]
    if r["rule"] == "height_width":
        return [r["height"], r["width"]]
    if r["rule"] == "shortest_edge":
        dummy = np.zeros((1, h, w))
        return list(get_resize_output_image_size(dummy, r["shortest_edge"], default_to_square=False,
                                                 input_data_format=ChannelDimension.FIRST))
    raise ValueError(f"no rule for {r}")


def write_form(name, form):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    # transformers' to_json_string: json.dumps(indent=2, sort_keys=True) + "\n", as on the Hub.
    with open(os.path.join(d, "preprocessor_config.json"), "w") as f:
        f.write(json.dumps(form["config"], indent=2, sort_keys=True) + "\n")
    return d


def check_clip_tall(processor, processor_pil, image, got, got_pil):
    """tall-1to4.jpg (150 wide, 600 high) through the legacy CLIP form: shortest edge to 32 gives
    32 x 128 (w x h), the centre crop takes rows 48..80. Rebuilt by hand; a square resize must differ."""
    assert processor.size.shortest_edge == 32 and processor.crop_size.height == 32, processor.size
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()  # uint8 [3, 600, 150]
    assert tuple(x.shape) == (3, 600, 150), x.shape
    assert resized_hw(effective(processor), 600, 150) == [128, 32]
    mean = torch.tensor(OPENAI_MEAN)[:, None, None]
    std = torch.tensor(OPENAI_STD)[:, None, None]

    def norm(u8):
        return (u8.float() / 255.0 - mean) / std

    tv = tvF.resize(x, [128, 32], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    by_hand = norm(tv[:, 48:80, :])
    pil = torch.from_numpy(np.array(image.resize((32, 128), Image.Resampling.BICUBIC))).permute(2, 0, 1)
    by_hand_pil = norm(pil[:, 48:80, :])
    square = norm(tvF.resize(x, [32, 32], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True))
    d, d_pil, d_square = ((got - by_hand).abs().max().item(), (got_pil - by_hand_pil).abs().max().item(),
                          (got - square).abs().max().item())
    print(f"  effective check clip-legacy/tall-1to4.jpg: |hf - shortest-edge+crop by hand| = {d:.2e} "
          f"(PIL {d_pil:.2e}); |hf - square resize| = {d_square:.3f}")
    assert d < 1e-5 and d_pil < 1e-5, (d, d_pil)
    assert d_square > 0.5, d_square


def check_align_wide(image, got, got_pil):
    """wide-4to1.jpg through align-base: a 40x40 warp (bilinear, antialiased), the centre crop takes
    rows and columns 4..36, then x / 127.5 - 1. Rebuilt by hand with torchvision and with PIL."""
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()
    tv = tvF.resize(x, [40, 40], interpolation=tvF.InterpolationMode.BILINEAR, antialias=True)
    pil = torch.from_numpy(np.array(image.resize((40, 40), Image.Resampling.BILINEAR))).permute(2, 0, 1)
    d = (got - (tv[:, 4:36, 4:36].float() / 127.5 - 1)).abs().max().item()
    d_pil = (got_pil - (pil[:, 4:36, 4:36].float() / 127.5 - 1)).abs().max().item()
    print(f"  effective check align-base/wide-4to1.jpg: |hf - 40x40 warp + crop 4..36 by hand| = {d:.2e} (PIL {d_pil:.2e})")
    assert d < 1e-5 and d_pil < 1e-5, (d, d_pil)


def main():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(IMAGES, "expected.json")) as f:
        names = json.load(f)["names"]
    images = {n: load_image(os.path.join(IMAGES, n)) for n in names}
    tensors = {}
    report = {
        "images": names,
        "image_sizes_wh": {n: list(images[n].size) for n in names},
        "tensors": "'<form>/<image>': AutoImageProcessor (default backend); 'pil/<form>/<image>': "
                   "backend='pil'; 'raw/<form>/alpha-256x192.png': Image.open (RGBA) given to the "
                   "default processor. Each float32 [3, H, W].",
        "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                     "transformers": transformers.__version__, "Pillow": PIL.__version__,
                     "numpy": np.__version__, "safetensors": safetensors.__version__},
        "forms": {},
    }
    for name, form in FORMS.items():
        d = write_form(name, form)
        p = AutoImageProcessor.from_pretrained(d)
        p_pil = AutoImageProcessor.from_pretrained(d, backend="pil")
        e = effective(p)
        assert effective(p_pil) == e, (effective(p_pil), e)
        out_hw = [e["crop"]["height"], e["crop"]["width"]] if e["crop"] else [e["resize"]["height"], e["resize"]["width"]]
        worst = 0.0
        resized = {}
        for n in names:
            img = images[n]
            got = p(img, return_tensors="pt")["pixel_values"][0].float().contiguous()
            got_pil = p_pil(img, return_tensors="pt")["pixel_values"][0].float().contiguous()
            assert list(got.shape) == [3] + out_hw and got.shape == got_pil.shape, (name, n, got.shape, got_pil.shape)
            tensors[f"{name}/{n}"] = got
            tensors[f"pil/{name}/{n}"] = got_pil
            worst = max(worst, (got - got_pil).abs().max().item())
            w, h = img.size
            resized[n] = resized_hw(e, h, w)
            if name == "clip-legacy" and n == "tall-1to4.jpg":
                check_clip_tall(p, p_pil, img, got, got_pil)
            if name == "align-base" and n == "wide-4to1.jpg":
                check_align_wide(img, got, got_pil)
        if p.do_convert_rgb:
            raw = Image.open(os.path.join(IMAGES, "alpha-256x192.png"))
            assert raw.mode == "RGBA", raw.mode
            tensors[f"raw/{name}/alpha-256x192.png"] = p(raw, return_tensors="pt")["pixel_values"][0].float().contiguous()
        # The rules the Rust side has to reproduce, stated once more as plain facts.
        if name == "clip-legacy":
            assert e["resize"] == {"rule": "shortest_edge", "shortest_edge": 32} and e["crop"] == {"height": 32, "width": 32}
            assert e["do_rescale"] and abs(e["rescale_factor"] - 1 / 255) < 1e-12 and e["resample"] == 3
        if name == "vit-legacy":
            assert e["resize"] == {"rule": "height_width", "height": 32, "width": 32} and e["crop"] is None
            assert e["do_rescale"] and e["resample"] == 2 and e["do_convert_rgb"] is None
        if name == "siglip":
            assert e["resize"]["rule"] == "height_width" and e["crop"] is None
        if name == "align-base":
            assert e["resize"] == {"rule": "height_width", "height": 40, "width": 40} and e["crop"] == {"height": 32, "width": 32}
            assert e["rescale_offset"] and not e["do_normalize"] and not e["include_top"] and e["resample"] == 2
        report["forms"][name] = {
            "repo": form["repo"],
            "scaled": form["scaled"],
            "class": type(p).__name__,
            "pil_class": type(p_pil).__name__,
            "effective": e,
            "affine": affine(e),
            "output_hw": out_hw,
            "resized_hw": resized,
            "max_abs_diff_torchvision_vs_pil": worst,
        }
        print(f"{name:12s} {type(p).__name__:28s} resize {e['resize']} crop {e['crop']} "
              f"resample {e['resample_name']}; |torchvision - PIL| <= {worst:.4f}")
    save_file(tensors, os.path.join(OUT, "expected.safetensors"))
    os.chmod(os.path.join(OUT, "expected.safetensors"), 0o644)
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(r, x)) for r, _, xs in os.walk(OUT) for x in xs)
    print(f"wrote {len(tensors)} tensors for {len(names)} images and {len(FORMS)} forms; {total / 1e6:.2f} MB in {OUT}")


if __name__ == "__main__":
    main()
