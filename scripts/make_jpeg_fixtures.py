"""JPEGs in the forms the web has, and the pixels PIL decodes them to (`convert("RGB")`, as
open_clip and transformers read images): tests/fixtures/jpeg/NAME.jpg and NAME.rgb (raw RGB
bytes, row by row). align's evaluation path must give the same pixels.

Run by hand: python scripts/make_jpeg_fixtures.py (Pillow with libjpeg-turbo). Writes the
same bytes every run.
"""

import json
from pathlib import Path

import numpy as np
from PIL import Image, features

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "jpeg"


def scene(w, h, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    r = (x * 255 // max(w - 1, 1)).astype(np.uint8)
    g = (y * 255 // max(h - 1, 1)).astype(np.uint8)
    b = ((x ^ y) * 7 % 256).astype(np.uint8)
    img = np.stack([r, g, b], -1).astype(np.int16)
    img += rng.integers(-20, 21, img.shape, dtype=np.int16)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    forms = {
        "q75-420-37x23": (scene(37, 23, 1), dict(quality=75)),
        "q90-444-40x32": (scene(40, 32, 2), dict(quality=90, subsampling=0)),
        "q80-422-33x41": (scene(33, 41, 3), dict(quality=80, subsampling=1)),
        "progressive-48x30": (scene(48, 30, 4), dict(quality=85, progressive=True)),
        "restarts-64x16": (scene(64, 16, 5), dict(quality=70, restart_marker_blocks=2)),
        "grey-29x35": (scene(29, 35, 6).convert("L"), dict(quality=80)),
    }
    for name, (img, opts) in forms.items():
        path = OUT / f"{name}.jpg"
        img.save(path, "JPEG", **opts)
        rgb = np.asarray(Image.open(path).convert("RGB"))
        (OUT / f"{name}.rgb").write_bytes(rgb.tobytes())
    (OUT / "versions.json").write_text(
        json.dumps({"pillow": Image.__version__, "libjpeg_turbo": features.version("libjpeg_turbo")}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
