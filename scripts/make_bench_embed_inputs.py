#!/usr/bin/env python3
"""Inputs for `align bench embed` and its PyTorch reference scripts/bench_embed.py: a webdataset
shard of photo-sized JPEGs with captions, and randomly initialised checkpoints of real sizes in the
formats align reads (Hugging Face CLIPModel and AlignModel folders, an open_clip folder), so that
forward-only embedding throughput and memory can be measured on both sides with no download.

Writes, under --out (default /tmp/align-bench-embed):
- data/shard-000.tar: 256 samples as img2dataset writes them (webdataset layout: KEY.jpg then
  KEY.txt per sample, keys 000000..000255, ustar/pax headers with mode 0444 and owner "bigdata" as
  webdataset's TarWriter sets them, a fixed mtime so the bytes do not depend on when it ran). The
  JPEGs (quality 90, PIL's default 4:2:0) are 640x480 for even keys and 480x640 for odd keys, so
  every prefix has both orientations; each is seeded photo-like content: a sky/ground gradient with
  a tilted horizon, soft lighting, 5-14 translucent shapes, a slight blur and sensor noise (so the
  JPEGs are 40-85 KB, 64 KB median, like photos rather than flat colour). Each caption is 8-20
  English-like words.
- clip-vit-b32/: a transformers CLIPModel with openai/clip-vit-base-patch32's architecture (vision
  ViT-B/32 at 224, width 768, 12 layers, 12 heads; text width 512, 12 layers, 8 heads, 77
  positions, vocab 49408; quick_gelu; projection 512; text bos/eos/pad ids 0/2/1 as that config
  has them, so the text tower pools at input_ids.argmax(-1), the first <|endoftext|>), randomly
  initialised by transformers' own init under torch.manual_seed, saved with save_pretrained
  (model.safetensors, float32). CLIP's tokenizer: vocab.json and merges.txt built the way CLIP
  builds them from the merges open_clip ships (bpe_simple_vocab_16e6.txt.gz, lines 1..48894),
  tokenizer.json and tokenizer_config.json (model_max_length 77) from transformers' CLIPTokenizer
  (or, with --clip-bpe DIR, those four files copied from DIR), a special_tokens_map.json in the
  Hub's form, and openai's legacy preprocessor_config.json (feature_extractor_type
  CLIPFeatureExtractor, integer size / crop_size 224, bicubic, OpenAI mean/std).
- clip-vit-b16/: the same with patch 16 (openai/clip-vit-base-patch16), another seed.
- align-b3-bert-base/: a transformers AlignModel with an EfficientNet-B3 image tower
  (AlignVisionConfig with B3's scaling as transformers' EfficientNet conversion script has it:
  width_coefficient 1.2, depth_coefficient 1.4, image_size 300, hidden_dim 1536 (in AlignVision
  only the average-pool kernel size), depthwise_padding [5, 18]) and the AlignTextConfig defaults
  as its text tower (BERT-base: 768 wide, 12 layers, 12 heads, vocab 30522, 512 positions).
  projection_dim is 384, the width of B3's last block (round_filters(320) at width 1.2): AlignModel
  has no image projection, so image embeddings are that block's pooled features and the text is
  projected to the same width. (kakaobrain/align-base's 640 is B7's width; with 640 here
  AlignModel.forward could not compare the two and align refuses the config.) The tokenizer is a
  WordPiece vocab.txt of 30522 entries ([PAD] [UNK] [CLS] [SEP] [MASK] at ids 0-4, punctuation,
  digits, letters and their ## forms, every word the captions use, then generated words and ##
  pieces), tokenizer.json and tokenizer_config.json from transformers' BertTokenizer (lower case,
  model_max_length 64, ALIGN's text length), a special_tokens_map.json, and an
  EfficientNetImageProcessor preprocessor_config.json in kakaobrain/align-base's form at 300 px:
  a square bilinear resize to 359 (300 * 346/289, rounded; align's fallback without this file
  rounds up, to 360), a centre crop to 300, x/127.5 - 1 (rescale_offset), do_normalize false,
  include_top false. config.json has model_type "align" (save_pretrained writes it); align's
  AlignModel reader recognises a folder by that model_type.
- clip-vit-b32-open_clip/: open_clip's ViT-B-32-quickgelu (its built-in config: the same shapes as
  clip-vit-b32, open_clip's own init, another seed) in open_clip's folder format, written by
  open_clip.push_to_hf_hub.save_for_hf: open_clip_config.json ({"model_cfg", "preprocess_cfg"})
  and open_clip_model.safetensors. No tokenizer files: the model uses open_clip's SimpleTokenizer,
  whose BPE ships inside open_clip; load it with "local-dir:DIR".

Each folder is loaded back offline (AutoModel and AutoProcessor; open_clip's
create_model_and_transforms and get_tokenizer with local-dir:), its weights compared with the
model that was saved, and the classes, parameter counts and folder sizes printed. About 2.3 GB in
all (float32 weights).

Run by hand, not by CI; nothing is downloaded (HF_HUB_OFFLINE is set):
    python3 scripts/make_bench_embed_inputs.py --out /tmp/align-bench-embed
    python3 scripts/bench_embed.py --checkpoint /tmp/align-bench-embed/clip-vit-b32 \\
        --data /tmp/align-bench-embed/data/shard-000.tar --batch 32 --library transformers

Written with: torch 2.15.0, transformers 5.24.0, tokenizers 0.23.3, open_clip_torch 3.3.0,
Pillow 13.0.0, safetensors 0.8.0, numpy 2.4.6.
"""
import argparse
import gzip
import io
import json
import os
import shutil
import tarfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

SAMPLES = 256
JPEG_QUALITY = 90
TAR_MTIME = 1_700_000_000  # fixed, so the shard's bytes do not depend on the clock
OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]
BERT_VOCAB_SIZE = 30522
ALIGN_TEXT_LEN = 64
B3 = dict(width_coefficient=1.2, depth_coefficient=1.4, image_size=300, hidden_dim=1536, depthwise_padding=[5, 18])


# ----------------------------------------------------------------------------------------------
# Images


def photo(w, h, rng):
    """A seeded picture with a photo's statistics: smooth gradients, edges, texture and noise."""
    ys, xs = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
    horizon = rng.uniform(0.3, 0.7) + rng.uniform(-0.15, 0.15) * (xs - 0.5)
    sky_top, sky_low, ground_high, ground_low = rng.uniform(0, 255, (4, 3))
    t_sky = np.clip(ys / horizon, 0, 1)[..., None]
    t_ground = np.clip((ys - horizon) / (1 - horizon), 0, 1)[..., None]
    img = np.where((ys < horizon)[..., None], sky_top + (sky_low - sky_top) * t_sky,
                   ground_high + (ground_low - ground_high) * t_ground)
    for _ in range(rng.integers(1, 4)):  # soft light sources
        cx, cy, sigma = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.1, 0.4)
        img += np.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / (2 * sigma * sigma))[..., None] * rng.uniform(-60, 80, 3)
    pic = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).convert("RGBA")

    overlay = Image.new("RGBA", (w, h), (0, 0, 0, 0))
    draw = ImageDraw.Draw(overlay)
    for _ in range(rng.integers(5, 15)):
        colour = tuple(int(c) for c in rng.integers(0, 256, 3)) + (int(rng.integers(120, 256)),)
        x0, y0 = rng.uniform(-0.1, 0.9) * w, rng.uniform(-0.1, 0.9) * h
        x1, y1 = x0 + rng.uniform(0.05, 0.5) * w, y0 + rng.uniform(0.05, 0.5) * h
        kind = rng.integers(0, 4)
        if kind == 0:
            draw.ellipse([x0, y0, x1, y1], fill=colour)
        elif kind == 1:
            draw.rectangle([x0, y0, x1, y1], fill=colour)
        elif kind == 2:
            pts = [(float(rng.uniform(x0, x1)), float(rng.uniform(y0, y1))) for _ in range(rng.integers(3, 7))]
            draw.polygon(pts, fill=colour)
        else:
            draw.line([x0, y0, x1, y1], fill=colour, width=int(rng.integers(2, 12)))
    pic = Image.alpha_composite(pic, overlay).convert("RGB").filter(ImageFilter.GaussianBlur(rng.uniform(0.6, 1.6)))

    # low-frequency shading (a coarse random grid, upsampled) and per-pixel sensor noise
    coarse = rng.normal(1.0, 0.12, (int(rng.integers(3, 8)), int(rng.integers(3, 8)))).astype(np.float32)
    shade = np.asarray(Image.fromarray(coarse, mode="F").resize((w, h), Image.BICUBIC))[..., None]
    out = np.asarray(pic, dtype=np.float32) * shade + rng.normal(0, rng.uniform(3, 8), (h, w, 3))
    return Image.fromarray(np.clip(np.rint(out), 0, 255).astype(np.uint8))


def jpeg_bytes(img):
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------
# Captions

DETS = ["a", "the", "one", "two", "three", "some", "many", "a few", "this", "that"]
ADJS = """small large big little tiny huge tall short long old young new wooden metal plastic glass red blue green
yellow orange purple pink brown black white grey dark bright shiny quiet busy empty crowded sunny cloudy""".split()
NOUNS = """cat dog bird horse cow sheep bear zebra giraffe elephant man woman child boy girl person player team
car bus truck train plane boat bicycle kite umbrella skateboard surfboard bench clock sign tower bridge
table chair bed sofa plate bowl cup cake pizza sandwich laptop phone book bag hat shirt ball""".split()
PLACES = """road street grass sky water river lake sea beach mountain hill field forest garden park city town
kitchen room window door wall floor market shop corner fence sand snow station harbour yard""".split()
VERBS = """sitting standing walking running playing eating drinking resting waiting sleeping jumping riding
flying swimming looking parked leaning""".split()
PREPS = ["on", "in", "under", "over", "near", "beside", "behind", "above", "below", "across", "along", "next to"]
TIMES = ["in the morning", "in the evening", "at night", "at sunset", "on a rainy day", "during the day",
         "in winter", "in summer"]


IRREGULAR = {"man": "men", "woman": "women", "child": "children", "person": "people", "sheep": "sheep"}
PLURAL_DETS = {"two", "three", "some", "many", "a few"}


def plural(noun):
    if noun in IRREGULAR:
        return IRREGULAR[noun]
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    return noun + "s"


def caption(rng):
    """8-20 English-like words: a subject, a verb, a place, then extra phrases."""
    def pick(xs):
        return xs[int(rng.integers(len(xs)))]

    def noun_phrase(nouns):
        det = pick(DETS)
        adj = [pick(ADJS)] if rng.random() < 0.7 else []
        noun = plural(pick(nouns)) if det in PLURAL_DETS else pick(nouns)
        if det == "a" and (adj or [noun])[0][0] in "aeiou":
            det = "an"
        return det.split() + adj + [noun]

    extras = [
        lambda: ["with"] + noun_phrase(NOUNS),
        lambda: pick(TIMES).split(),
        lambda: ["while"] + noun_phrase(NOUNS) + [pick(VERBS)],
        lambda: ["and"] + noun_phrase(NOUNS),
        lambda: pick(PREPS).split() + noun_phrase(PLACES),
    ]
    while True:
        target = int(rng.integers(8, 21))
        words = noun_phrase(NOUNS) + [pick(VERBS)] + pick(PREPS).split() + noun_phrase(PLACES)
        for _ in range(50):
            if len(words) >= target:
                break
            extra = pick(extras)()
            if len(words) + len(extra) <= 20:
                words += extra
        if 8 <= len(words) <= 20:
            text = " ".join(words)
            text = text[0].upper() + text[1:]
            return text + "." if rng.random() < 0.5 else text


def caption_words():
    phrases = DETS + ADJS + NOUNS + PLACES + VERBS + PREPS + TIMES + ["an", "with", "while", "and"]
    phrases += [plural(n) for n in NOUNS + PLACES]
    return sorted({w for phrase in phrases for w in phrase.split()})


# ----------------------------------------------------------------------------------------------
# The shard


def write_shard(path, seed):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    total = 0
    lengths = []
    with tarfile.open(path + ".tmp", "w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(SAMPLES):
            rng = np.random.default_rng([seed, i])
            w, h = (640, 480) if i % 2 == 0 else (480, 640)
            text = caption(rng)
            lengths.append(len(text.split()))
            for ext, data in (("jpg", jpeg_bytes(photo(w, h, rng))), ("txt", text.encode("utf-8"))):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size, info.mtime, info.mode = len(data), TAR_MTIME, 0o444
                info.uname = info.gname = "bigdata"
                tar.addfile(info, io.BytesIO(data))
                total += len(data) if ext == "jpg" else 0
    os.replace(path + ".tmp", path)
    print(f"{path}: {SAMPLES} samples, JPEGs {total / SAMPLES / 1024:.0f} KB on average, captions "
          f"{min(lengths)}-{max(lengths)} words, {os.path.getsize(path) / 2**20:.1f} MiB")


# ----------------------------------------------------------------------------------------------
# Tokenizer files


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def write_special_tokens_map(tokenizer, directory, as_objects):
    """special_tokens_map.json in the form the Hub repos carry (transformers 5.x writes none)."""
    by_content = {str(t): t for t in tokenizer.added_tokens_decoder.values()}
    entries = {}
    for key, content in tokenizer.special_tokens_map.items():
        if not isinstance(content, str):
            continue
        tok = by_content.get(content)
        if as_objects and tok is not None:
            entries[key] = {"content": content, "lstrip": tok.lstrip, "normalized": tok.normalized, "rstrip": tok.rstrip,
                            "single_word": tok.single_word}
        else:
            entries[key] = content
    write_json(os.path.join(directory, "special_tokens_map.json"), entries)


def tidy_tokenizer_config(directory):
    """Drops the keys transformers 5.x adds about where it was loaded from."""
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    for key in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(key, None)
    write_json(path, cfg)


def clip_tokenizer_files(directory, clip_bpe):
    """CLIP's tokenizer files in `directory`: copied from `clip_bpe` if given, else built from the
    merges inside open_clip exactly as CLIP builds its 49408-entry vocabulary."""
    from transformers import CLIPTokenizerFast

    if clip_bpe:
        for name in ("vocab.json", "merges.txt", "tokenizer.json"):
            shutil.copyfile(os.path.join(clip_bpe, name), os.path.join(directory, name))
        saved = os.path.join(clip_bpe, "saved", "tokenizer_config.json")
        shutil.copyfile(saved if os.path.isfile(saved) else os.path.join(clip_bpe, "tokenizer_config.json"),
                        os.path.join(directory, "tokenizer_config.json"))
        tidy_tokenizer_config(directory)
    else:
        import open_clip
        from open_clip.tokenizer import bytes_to_unicode

        source = os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
        lines = gzip.open(source).read().decode("utf-8").split("\n")
        merges = lines[1:1 + 49152 - 256 - 2]  # line 0 is the version header; 48894 merges
        symbols = list(bytes_to_unicode().values())
        vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m.split()) for m in merges]
        vocab += ["<|startoftext|>", "<|endoftext|>"]
        assert len(vocab) == 49408 == len(set(vocab))
        with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump({t: i for i, t in enumerate(vocab)}, f, ensure_ascii=False)
        with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
        # from_pretrained on a folder holding only vocab.json and merges.txt reads the two files
        tok = CLIPTokenizerFast.from_pretrained(directory, model_max_length=77)
        tok.save_pretrained(directory)
        tidy_tokenizer_config(directory)
    tok = CLIPTokenizerFast.from_pretrained(directory)
    assert len(tok) == 49408 and tok.model_max_length == 77, (len(tok), tok.model_max_length)
    write_special_tokens_map(tok, directory, as_objects=True)


def bert_vocab(seed):
    """30522 WordPiece entries: the specials, characters, the captions' words, then generated
    words and ## pieces."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    digits = [str(d) for d in range(10)]
    punct = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + punct + digits + letters
    vocab += ["##" + c for c in letters + digits]
    vocab += ["##" + s for s in "es ed ing er est ly ness tion ment able ful less ish ous ive al".split()]
    vocab += [w for w in caption_words() if w not in vocab]  # "a" is there already
    seen = set(vocab)
    assert len(seen) == len(vocab)
    rng = np.random.default_rng(seed)
    onsets = [""] + "b c d f g h j k l m n p r s t v w y z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sm sn sp st str sw th tr wh".split()
    vowels = "a e i o u ai au ea ee ie oa oo ou".split()
    codas = [""] * 4 + "b d g k l m n p r s t x ck ll nd ng nt rd rk rn rt sh ss st th".split()
    while len(vocab) < BERT_VOCAB_SIZE:
        word = "".join(onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))] + codas[rng.integers(len(codas))]
                       for _ in range(rng.integers(1, 4)))
        if rng.random() < 0.3:
            word = "##" + word
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    return vocab


# ----------------------------------------------------------------------------------------------
# Models


def param_count(model):
    return sum(p.numel() for p in model.parameters())


def folder_mib(directory):
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)) / 2**20


def fresh(directory):
    if os.path.isdir(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)


def projection(model, name):
    layer = getattr(model, name, None)
    return param_count(layer) if layer is not None else 0


def check_hf(directory, model, summary):
    """Loads the folder back as a user would and compares the weights with `model`'s."""
    from transformers import AutoModel, AutoProcessor

    loaded = AutoModel.from_pretrained(directory).eval()
    processor = AutoProcessor.from_pretrained(directory)
    saved = model.state_dict()
    got = loaded.state_dict()
    assert saved.keys() == got.keys(), sorted(set(saved) ^ set(got))
    for k, v in saved.items():
        assert torch.equal(v, got[k]), f"{directory}: {k} differs after reloading"
    ids = processor.tokenizer(["A small brown dog sitting on the wooden bench."])["input_ids"][0]
    n = param_count(loaded)
    summary.append({
        "folder": os.path.basename(directory), "model": type(loaded).__name__, "processor": type(processor).__name__,
        "image_processor": type(processor.image_processor).__name__, "tokenizer": type(processor.tokenizer).__name__,
        "parameters": n, "vision": param_count(loaded.vision_model) + projection(loaded, "visual_projection"),
        "text": param_count(loaded.text_model) + projection(loaded, "text_projection"),
        "model_max_length": processor.tokenizer.model_max_length, "mib": folder_mib(directory),
    })
    print(f"{os.path.basename(directory)}: {type(loaded).__name__} {n:,} parameters; "
          f"{type(processor).__name__}({type(processor.image_processor).__name__}, {type(processor.tokenizer).__name__}); "
          f"ids of a caption {ids}")


def make_clip(directory, patch, seed, clip_bpe, summary):
    from transformers import CLIPConfig, CLIPModel

    fresh(directory)
    # CLIPTextConfig / CLIPVisionConfig defaults are openai/clip-vit-base-patch32's shapes; the
    # special ids are that config's (0/2/1), which selects argmax pooling.
    text = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=0, eos_token_id=2, pad_token_id=1,
                projection_dim=512)
    vision = dict(image_size=224, patch_size=patch, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, hidden_act="quick_gelu", projection_dim=512)
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=512)).eval()
    model.save_pretrained(directory)
    clip_tokenizer_files(directory, clip_bpe)
    write_json(os.path.join(directory, "preprocessor_config.json"), {
        "crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": OPENAI_MEAN, "image_std": OPENAI_STD,
        "resample": 3, "size": 224,
    })
    check_hf(directory, model, summary)


def make_align(directory, seed, summary):
    from transformers import AlignConfig, AlignModel, AlignTextConfig, AlignVisionConfig, BertTokenizer

    fresh(directory)
    vision = AlignVisionConfig(**B3)
    text = AlignTextConfig()
    # AlignModel has no image projection: the embedding width is the last block's width.
    from transformers.models.align.modeling_align import round_filters
    width = round_filters(vision, vision.out_channels[-1])
    torch.manual_seed(seed)
    model = AlignModel(AlignConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=width)).eval()
    model.save_pretrained(directory)
    with open(os.path.join(directory, "config.json")) as f:
        assert json.load(f)["model_type"] == "align"

    vocab = bert_vocab(seed + 1)
    assert len(vocab) == BERT_VOCAB_SIZE == text.vocab_size
    with open(os.path.join(directory, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(vocab) + "\n")
    tok = BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True, model_max_length=ALIGN_TEXT_LEN)
    tok.save_pretrained(directory)
    tidy_tokenizer_config(directory)
    write_special_tokens_map(tok, directory, as_objects=False)
    size = round(B3["image_size"] * 346 / 289)
    crop = B3["image_size"]
    write_json(os.path.join(directory, "preprocessor_config.json"), {
        "crop_size": {"height": crop, "width": crop}, "do_center_crop": True, "do_normalize": False, "do_rescale": True,
        "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "EfficientNetImageProcessor",
        "image_std": [0.5, 0.5, 0.5], "include_top": False, "processor_class": "AlignProcessor", "resample": 2,
        "rescale_factor": 1 / 127.5, "rescale_offset": True, "size": {"height": size, "width": size},
    })
    check_hf(directory, model, summary)
    # every caption word is one WordPiece token, not [UNK]
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(directory)
    assert all(len(ids) == 1 and ids[0] != t.unk_token_id for ids in t(caption_words(), add_special_tokens=False)["input_ids"])


class _NoTokenizerFiles:
    """Stands in for the tokenizer in save_for_hf: the model uses open_clip's SimpleTokenizer, which
    has no files (its BPE table ships inside open_clip)."""

    def save_pretrained(self, directory):
        pass


def make_open_clip(directory, seed, summary):
    import open_clip
    from open_clip.push_to_hf_hub import save_for_hf

    fresh(directory)
    name = "ViT-B-32-quickgelu"
    model_cfg = open_clip.get_model_config(name)
    torch.manual_seed(seed)
    model = open_clip.create_model(name).eval()
    save_for_hf(model, _NoTokenizerFiles(), model_cfg, directory, safe_serialization=True)
    loaded, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + os.path.abspath(directory))
    tokenizer = open_clip.get_tokenizer("local-dir:" + os.path.abspath(directory))
    saved, got = model.state_dict(), loaded.state_dict()
    assert saved.keys() == got.keys()
    for k, v in saved.items():
        assert torch.equal(v, got[k]), f"{directory}: {k} differs after reloading"
    n = param_count(loaded)
    summary.append({
        "folder": os.path.basename(directory), "model": "open_clip " + type(loaded).__name__ + f" ({name})",
        "processor": "open_clip val transform", "image_processor": repr(preprocess).replace("\n", " "),
        "tokenizer": type(tokenizer).__name__, "parameters": n, "vision": param_count(loaded.visual),
        "text": n - param_count(loaded.visual) - loaded.logit_scale.numel(), "model_max_length": tokenizer.context_length, "mib": folder_mib(directory),
    })
    print(f"{os.path.basename(directory)}: open_clip {type(loaded).__name__} {n:,} parameters; {type(tokenizer).__name__}; "
          f"files {sorted(os.listdir(directory))}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/align-bench-embed", help="where to write (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip-bpe", metavar="DIR", help="copy CLIP's vocab.json, merges.txt, tokenizer.json and "
                   "[saved/]tokenizer_config.json from DIR instead of building them from open_clip's merges")
    p.add_argument("--only", nargs="+", choices=["data", "clip-vit-b32", "clip-vit-b16", "align-b3-bert-base",
                                                  "clip-vit-b32-open_clip"], help="write only these parts")
    a = p.parse_args()
    parts = a.only or ["data", "clip-vit-b32", "clip-vit-b16", "align-b3-bert-base", "clip-vit-b32-open_clip"]
    os.makedirs(a.out, exist_ok=True)
    summary = []
    if "data" in parts:
        write_shard(os.path.join(a.out, "data", "shard-000.tar"), a.seed)
    if "clip-vit-b32" in parts:
        make_clip(os.path.join(a.out, "clip-vit-b32"), 32, a.seed + 100, a.clip_bpe, summary)
    if "clip-vit-b16" in parts:
        make_clip(os.path.join(a.out, "clip-vit-b16"), 16, a.seed + 200, a.clip_bpe, summary)
    if "align-b3-bert-base" in parts:
        make_align(os.path.join(a.out, "align-b3-bert-base"), a.seed + 300, summary)
    if "clip-vit-b32-open_clip" in parts:
        make_open_clip(os.path.join(a.out, "clip-vit-b32-open_clip"), a.seed + 400, summary)
    if summary:
        print()
        print(f"{'folder':<24} {'parameters':>12} {'vision':>12} {'text':>12} {'MiB':>8}  classes")
        for s in summary:
            print(f"{s['folder']:<24} {s['parameters']:>12,} {s['vision']:>12,} {s['text']:>12,} {s['mib']:>8.1f}  "
                  f"{s['model']}, {s['processor']}, {s['tokenizer']} (text length {s['model_max_length']})")


if __name__ == "__main__":
    main()
