#!/usr/bin/env python3
"""SigLIP 2 fixtures: a fixed-resolution SigLIP 2 directory, a classic SigLIP directory whose tokenizer
returns an attention mask, and a NaFlex Siglip2Model directory, each with tokenizer and image processor
files as transformers saves them, awkward image files, and what transformers computes with them when
used the way a user does (AutoProcessor, then the model on everything the processor returned).

Writes tests/fixtures/siglip2/:
- images/: six small files made here (each < 50 KB), smooth gradients and blobs plus seeded noise
  (so the resize filter matters): tiny-5x3.png (RGB, 5 wide x 3 high), wide-96x24.jpg (4:1),
  grey-45x31.png (mode L), cmyk-48x36.jpg (a CMYK JPEG; PIL opens it as mode CMYK),
  rgba-28x36.png (RGBA: an opaque band, a fully transparent corner and an alpha ramp, colourful
  under the transparent parts, so alpha handling shows), photo-40x30.jpg (plain RGB). The 1:4 tall
  JPEG is tests/fixtures/preprocess/tall-1to4.jpg (150x600, 38 KB, RGB), reused. Image paths in the
  JSON files are relative to tests/fixtures.
- fixed/: a fixed-resolution SigLIP 2 checkpoint laid out as google/siglip2-base-patch16-224 is:
  SiglipModel (model_type "siglip"; vision 32 px, patch 8, width 32, 2 layers, 2 heads, MLP 64;
  text width 32, 2 layers, 2 heads, MLP 64, 16 positions; gelu_pytorch_tanh, layer_norm_eps 1e-6).
  Tokenizer: a Gemma-style byte-fallback BPE built here with the `tokenizers` library (ids <pad> 0,
  <eos> 1, <bos> 2, <unk> 3, <mask> 4, byte tokens <0x00>..<0xFF> 5..260, then BPE pieces trained
  on generated captions; normalizer Replace(" " -> "\u2581") only, no Metaspace, no pre-tokenizer,
  decoder Replace + ByteFallback + Fuse), wrapped as GemmaTokenizer (transformers 5.x has no separate
  "Fast" class: GemmaTokenizerFast is the same class) with the settings of transformers' SigLIP 2
  conversion script (add_bos_token False, add_eos_token True: "<text> <eos>"; padding_side "right";
  model_input_names ["input_ids"]), saved with save_pretrained (tokenizer.json + tokenizer_config.json).
  AutoTokenizer reloads it as GemmaTokenizer (no lower-casing). Image processor: SiglipImageProcessor
  32x32, resample 2 (bilinear), rescale 1/255, mean/std 0.5, saved with save_pretrained.
- legacy-mask/: a classic SigLIP (v1) SiglipModel of the same shapes with a SiglipTokenizer on a
  300-piece SentencePiece unigram model trained here (T5 layout <pad> 0, </s> 1, <unk> 2, no BOS,
  nmt_nfkc; pad token </s>), saved by transformers 5.x with its own defaults: nothing overrides
  model_input_names, so the processor returns an attention_mask and model(**inputs) passes it to the
  text tower (the google/siglip-* repos carry model_input_names ["input_ids"]; directories written by
  transformers 5 do not). SiglipTokenizer canonicalises text (lower case, ASCII punctuation removed,
  whitespace collapsed) before SentencePiece. Image processor as google/siglip-base-patch16-224: 32x32,
  resample 3 (bicubic).
- naflex/: a NaFlex Siglip2Model (model_type "siglip2"; vision patch 4, num_patches 16 = a 4x4
  learned position grid, width 32, 2 layers, 2 heads, MLP 64; text as in fixed/ with the same
  tokenizer files) and Siglip2ImageProcessor(patch_size 4, max_num_patches 64). AutoTokenizer reloads
  this directory's GemmaTokenizer files as Siglip2Tokenizer ("siglip2" is in transformers'
  MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), which puts Lowercase() in front of the normalizer, so
  the same files give different ids here than in fixed/.
- every directory also has special_tokens_map.json in the Hub repos' form (transformers 5 writes none).
- fixed-io.safetensors / legacy-mask-io.safetensors: the processor's outputs for all captions and all
  image files (input_ids, attention_mask where the processor returns one, pixel_values), text_embeds
  and image_embeds exactly as model(**inputs) returns them (L2-normalised), text_features and
  image_features (get_text_features / get_image_features pooler_output: NOT normalised), text_
  features_no_mask (legacy-mask only: the same ids without the mask), logits_per_image, logit_scale,
  logit_bias; and per file "file/<image path>/pixel_values" and ".../image_features" (the processor
  on that one PIL image, Image.open'ed, nothing converted here; not normalised).
- naflex-io.safetensors: everything the processor returned (pixel_values [b, 64, 48],
  pixel_attention_mask [b, 64] int32, spatial_shapes [b, 2] int64, input_ids), text_embeds /
  image_embeds (normalised, from model(**inputs)), text_features / image_features (not normalised),
  logits_per_image, logit_scale, logit_bias, and per file at max_num_patches 64 and 16:
  "file/<image path>/max<n>/{pixel_values,pixel_attention_mask,spatial_shapes,image_features}".
- fixed.json, legacy-mask.json, naflex.json: captions, image files, the processor call, the keys,
  shapes and dtypes the processor returned, the ids and tokens per caption, the classes AutoProcessor
  gave, the tokenizer_config.json / preprocessor_config.json / config.json transformers wrote (as
  read back), pooling rules, and versions; naflex.json also the spatial_shapes of every file at
  max_num_patches 16, 64 and 256, what raw Image.open images do to the NaFlex processor, and the
  resize / patch-order / position-embedding facts checked below.

How the captions and images go in (the user's call):
    processor = AutoProcessor.from_pretrained(dir)
    inputs = processor(text=CAPTIONS, images=images, padding="max_length", max_length=16,
                       truncation=True, return_tensors="pt")      # NaFlex: + max_num_patches=64, patch_size=4
    out = model(**inputs)
truncation=True is needed: SiglipProcessor does not truncate with only padding/max_length (the
long caption would make a ragged batch). patch_size=4 is needed for NaFlex: Siglip2Processor's class
defaults (images_kwargs max_num_patches 256, patch_size 16) override the values the image processor
loaded from preprocessor_config.json, so without it the processor cuts 16-px patches.
Images: fixed/ and legacy-mask/ get PIL.Image.open(file) as is. The NaFlex image processor
(do_convert_rgb unset) fails on mode L, CMYK and RGBA images, so naflex/ gets
transformers.image_utils.load_image(file) (EXIF transpose, then PIL convert("RGB"): alpha dropped, grey
replicated, CMYK by PIL's formula); the raw failures are recorded in naflex.json.

Effective checks (asserted): the reloaded model equals the saved one; fixed/'s pixel_values equal a
by-hand torchvision bilinear antialiased resize of the uint8 image to 32x32; legacy-mask's embeddings
change when the mask is left out; NaFlex pixel_values equal a by-hand pipeline (size from
transformers' scale search, torchvision bilinear antialiased resize of the uint8 image, x/255, (x -
0.5)/0.5, patches in row-major order, each patch flattened (row, column, channel), zero padding);
the NaFlex position embeddings equal F.interpolate(grid, mode="bilinear", align_corners=False,
antialias=True) of the 4x4 grid, padding positions filled with the resized grid's first row; the
per-file embeddings equal the batch's rows.

Weights: each model is built after torch.manual_seed (transformers' own init), then every LayerNorm
weight is set to 1 + N(0, 0.2^2) and every bias (LayerNorm, Linear, patch embedding, attention
in_proj) to N(0, 0.2^2) from a seeded generator; logit_scale = ln 10, logit_bias = -10. fp32.

Deterministic: run twice, the bytes are the same. Nothing is downloaded.

Written with: torch 2.15.0, torchvision 0.29.2, transformers 5.24.0, tokenizers 0.23.3,
sentencepiece 0.2.3, Pillow 13.0.0, safetensors 0.8.0, numpy 2.4.6 (run by hand, not by CI).
"""
import io
import json
import math
import os
import shutil
import tempfile

import numpy as np
import PIL
import safetensors
import sentencepiece as spm
import tokenizers
import torch
import torchvision
import transformers
from PIL import Image
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from torch.nn import functional as F
from torchvision.transforms.v2 import functional as tvF
from transformers import (AutoImageProcessor, AutoModel, AutoProcessor, GemmaTokenizer, Siglip2Config,
                          Siglip2ImageProcessor, Siglip2Model, SiglipConfig, SiglipImageProcessor, SiglipModel,
                          SiglipTokenizer)
from transformers.image_utils import load_image
from transformers.models.siglip2.image_processing_siglip2 import get_image_size_for_max_num_patches

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.normpath(os.path.join(HERE, "..", "tests", "fixtures"))
OUT = os.path.join(FIXTURES, "siglip2")
IMAGES = os.path.join(OUT, "images")

MAX_LENGTH = 16
NAFLEX_PATCHES = 64
NAFLEX_PATCH = 4
LN10 = math.log(10.0)

CAPTIONS = [
    "\ufb01ve \ufb02u\ufb00y \ufb01sh in a \ufb01eld",                  # ligatures fi fl ff
    "\uff21\uff22\uff23 \uff42\uff4c\uff4f\uff43\uff4b\uff53 on a table",  # full-width ABC blocks
    "fish &amp; chips &lt;3",                                          # HTML entities, as text
    "a family \U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466 on the beach \U0001F3D6\uFE0F",  # ZWJ, VS16
    "一只猫坐在窗台上",                                                  # CJK
    "قطة تجلس على النافذة",                                             # Arabic
    "एक बिल्ली खिड़की पर बैठी है",                                          # Devanagari
    "Кошка сидит на окне",                                              # Cyrillic
    "A RED CAR ON A WET STREET",                                        # upper case
    "  café   naïve  ",                                                 # accents, runs of spaces
    "A very long caption: an old fisherman mends his green nets on the quay at dawn while three "
    "gulls circle above the harbour and a small red boat drifts past the lighthouse.",  # truncated
]

# Relative to tests/fixtures; all but preprocess/tall-1to4.jpg are written by write_images().
IMAGE_FILES = [
    "siglip2/images/tiny-5x3.png",
    "siglip2/images/wide-96x24.jpg",
    "preprocess/tall-1to4.jpg",
    "siglip2/images/grey-45x31.png",
    "siglip2/images/cmyk-48x36.jpg",
    "siglip2/images/rgba-28x36.png",
    "siglip2/images/photo-40x30.jpg",
]

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, attention_dropout=0.0)


# ----------------------------------------------------------------------------------------------
# Images


def picture(w, h, seed):
    """Colour gradients, a few soft blobs and N(0, 8^2) noise, as uint8 [h, w, 3]."""
    rng = np.random.default_rng(seed)
    ys, xs = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
    img = np.empty((h, w, 3))
    for c in range(3):
        a, b = rng.uniform(-130, 130, 2)
        img[..., c] = 128 + a * (xs - 0.5) + b * (ys - 0.5)
    for _ in range(3):
        cx, cy = rng.uniform(0.15, 0.85, 2)
        sigma = rng.uniform(0.1, 0.3)
        img += np.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / (2 * sigma * sigma))[..., None] * rng.uniform(-100, 100, 3)
    img += rng.normal(0, 8, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def write_images():
    os.makedirs(IMAGES, exist_ok=True)
    for f in os.listdir(IMAGES):
        os.remove(os.path.join(IMAGES, f))

    def path(name):
        return os.path.join(IMAGES, name)

    Image.fromarray(picture(5, 3, 900)).save(path("tiny-5x3.png"))
    Image.fromarray(picture(96, 24, 901)).save(path("wide-96x24.jpg"), quality=90)
    Image.fromarray(picture(45, 31, 902)).convert("L").save(path("grey-45x31.png"))
    Image.fromarray(picture(48, 36, 903)).convert("CMYK").save(path("cmyk-48x36.jpg"), quality=90)
    rgba = np.concatenate([picture(28, 36, 904), np.zeros((36, 28, 1), np.uint8)], axis=-1)
    rgba[..., 3] = np.rint(np.linspace(0, 255, 28))[None, :].astype(np.uint8)  # a left-to-right alpha ramp
    rgba[:8, :, 3] = 255  # an opaque band at the top
    rgba[-10:, -10:, 3] = 0  # a fully transparent corner
    Image.fromarray(rgba, "RGBA").save(path("rgba-28x36.png"))
    Image.fromarray(picture(40, 30, 905)).save(path("photo-40x30.jpg"), quality=90)

    info = {}
    for rel in IMAGE_FILES:
        full = os.path.join(FIXTURES, rel)
        with Image.open(full) as im:
            info[rel] = {"format": im.format, "mode": im.mode, "size_wh": list(im.size), "bytes": os.path.getsize(full)}
        assert info[rel]["bytes"] < 50_000, (rel, info[rel])
    expected_modes = {"tiny-5x3.png": "RGB", "grey-45x31.png": "L", "cmyk-48x36.jpg": "CMYK", "rgba-28x36.png": "RGBA"}
    for rel, mode in expected_modes.items():
        assert info["siglip2/images/" + rel]["mode"] == mode, info
    return info


def open_raw(rel):
    """The file as PIL opens it: no conversion."""
    im = Image.open(os.path.join(FIXTURES, rel))
    im.load()
    return im


# ----------------------------------------------------------------------------------------------
# Tokenizers

WORDS = """a an the this that one two three four some several many of with on in under over near beside
behind above across along around into from by at photo picture close-up view drawing painting sketch cat
cats kitten dog dogs puppy horse horses bird birds gull gulls duck fish boat boats ship car cars truck bus
train bicycle man men woman women child children boy girl people crowd fisherman farmer red green blue
yellow white black brown grey orange purple golden small large big little old young tall short wooden
stone metal glass sunny rainy foggy snowy bright dark quiet busy street road river lake sea beach harbour
quay bridge lighthouse field forest mountain hill garden park city village house window door table chair
plate bowl cup bread cake soup apple orange flowers tree trees grass sky cloud clouds water wave waves
sitting standing walking running playing eating drinking holding flying swimming sleeping looking drifts
circle mends nets dawn morning evening night while past and or very next""".split()
EXTRA_LINES = ["Кошка спит на окне", "собака и кошка", "猫在窗台上", "一只狗", "Fish and chips!", "A BIG RED BUS",
               "Two cats, one dog.", "(a photo) of the sea"]


def generated_captions(n, seed):
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        words = list(rng.choice(WORDS, size=int(rng.integers(3, 12))))
        if rng.random() < 0.5:
            words[0] = words[0].capitalize()
        if rng.random() < 0.1:
            words = [w.upper() for w in words]
        line = " ".join(words)
        if rng.random() < 0.3:
            line += rng.choice([".", "!", ",", "?"])
        lines.append(line)
        if i % 40 == 0:
            lines.append(EXTRA_LINES[(i // 40) % len(EXTRA_LINES)])
    return lines


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
BPE_PIECES = 240


def gemma_style_tokenizer():
    """A byte-fallback BPE in Gemma's form, trained here; wrapped as transformers' GemmaTokenizer with
    the SigLIP 2 conversion's settings."""
    # Train the pieces on captions split before each "\u2581" (so pieces start at word starts, as
    # SentencePiece's do); the final tokenizer, like Gemma's, has no pre-tokenizer.
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=BPE_PIECES, min_frequency=2, special_tokens=[], show_progress=False,
                                  limit_alphabet=80)
    trainer_tok.train_from_iterator(generated_captions(3000, seed=21), trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {s: i for i, s in enumerate(GEMMA_SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        assert piece not in vocab, piece
        vocab[piece] = len(vocab)
    merges = [tuple(m) for m in trained["merges"]]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in GEMMA_SPECIALS])
    # transformers' SigLIP 2 conversion: GemmaTokenizerFast.from_pretrained(gemma, add_bos_token=False,
    # add_eos_token=True, padding_side="right", model_input_names=["input_ids"]).
    return GemmaTokenizer(tokenizer_object=tok, add_bos_token=False, add_eos_token=True, padding_side="right",
                          model_input_names=["input_ids"])


def sentencepiece_tokenizer(workdir):
    """A 300-piece unigram model (T5's specials), trained on generated captions plus some of the fixture
    captions (CJK, Cyrillic, ligatures, full width), so those have pieces and Arabic, Devanagari and
    emoji fall to <unk>."""
    lines = generated_captions(3000, seed=31) + [CAPTIONS[i] for i in (0, 1, 4, 7)] * 10
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=300, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
        character_coverage=1.0, num_threads=1, minloglevel=2)
    path = os.path.join(workdir, "spiece.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return SiglipTokenizer(path, model_max_length=64)


def write_special_tokens_map(tokenizer, directory):
    """special_tokens_map.json as the Hub repos carry it (transformers 5 writes none)."""
    by_content = {str(t): t for t in tokenizer.added_tokens_decoder.values()}
    entries = {}
    for key, content in tokenizer.special_tokens_map.items():
        if not isinstance(content, str):
            continue
        t = by_content.get(content)
        entries[key] = ({"content": content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                         "single_word": t.single_word} if t is not None else content)
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump(entries, f, indent=2, sort_keys=True)
        f.write("\n")


# ----------------------------------------------------------------------------------------------
# Models


def randomise(model, seed):
    """LayerNorm weights 1 + N(0, 0.2^2); every bias N(0, 0.2^2); logit_scale ln 10, logit_bias -10."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ln_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.LayerNorm)}
        for name, p in model.named_parameters():
            if id(p) in ln_weights:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias") and name != "logit_bias":
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
        model.logit_scale.fill_(LN10)
        model.logit_bias.fill_(-10.0)
    return model.eval()


def text_config(vocab_size, pad, bos, eos):
    return dict(vocab_size=vocab_size, max_position_embeddings=MAX_LENGTH, pad_token_id=pad, bos_token_id=bos,
                eos_token_id=eos, **TINY)


def fixed_model(vocab_size, seed):
    torch.manual_seed(seed)
    config = SiglipConfig(text_config=text_config(vocab_size, 0, 2, 1),
                          vision_config=dict(image_size=32, patch_size=8, **TINY))
    return randomise(SiglipModel(config), seed + 1)


def legacy_model(vocab_size, pad_id, eos_id, seed):
    torch.manual_seed(seed)
    config = SiglipConfig(text_config=text_config(vocab_size, pad_id, None, eos_id),
                          vision_config=dict(image_size=32, patch_size=8, **TINY))
    return randomise(SiglipModel(config), seed + 1)


def naflex_model(vocab_size, seed):
    torch.manual_seed(seed)
    config = Siglip2Config(text_config=text_config(vocab_size, 0, 2, 1),
                           vision_config=dict(patch_size=NAFLEX_PATCH, num_patches=16, **TINY))
    return randomise(Siglip2Model(config), seed + 1)


# ----------------------------------------------------------------------------------------------
# Helpers


def save_directory(name, model, tokenizer, image_processor):
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    image_processor.save_pretrained(d)
    write_special_tokens_map(tokenizer, d)
    return d


def read_json(directory, name):
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


def describe(inputs):
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in inputs.items()}


def tokens_of(processor, inputs):
    return [processor.tokenizer.convert_ids_to_tokens(row) for row in inputs["input_ids"].tolist()]


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def versions():
    return {"torch": torch.__version__, "torchvision": torchvision.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "sentencepiece": spm.__version__, "Pillow": PIL.__version__, "safetensors": safetensors.__version__,
            "numpy": np.__version__}


def write_outputs(name, tensors, record):
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    path = os.path.join(OUT, f"{name}-io.safetensors")
    save_file(tensors, path)
    record["io"] = f"siglip2/{name}-io.safetensors"
    record["io_tensors"] = {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
                            for k, v in sorted(tensors.items())}
    record["versions"] = versions()
    with open(os.path.join(OUT, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
        f.write("\n")


TEXT_CALL = {"padding": "max_length", "max_length": MAX_LENGTH, "truncation": True}

POOLING_SIGLIP = ("text: final_layer_norm(last hidden state) at position -1 (the last of the 16, a padding token "
                  "when the caption is shorter), then head (Linear); vision: post_layernorm(all patches), then the "
                  "attention-pooling head (probe query, nn.MultiheadAttention, residual + MLP(LayerNorm))")


# ----------------------------------------------------------------------------------------------
# B and C: fixed resolution


def make_fixed_like(name, model, tokenizer, image_processor, info, check_mask):
    d = save_directory(name, model, tokenizer, image_processor)
    loaded = AutoModel.from_pretrained(d).eval()
    assert same_weights(loaded, model), name
    processor = AutoProcessor.from_pretrained(d)
    images = [open_raw(rel) for rel in IMAGE_FILES]
    inputs = processor(text=CAPTIONS, images=images, return_tensors="pt", **TEXT_CALL)
    with torch.no_grad():
        out = loaded(**inputs)
        text_in = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
        text_features = loaded.get_text_features(**text_in).pooler_output
        image_features = loaded.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
    assert torch.allclose(out.text_embeds, text_features / text_features.norm(dim=-1, keepdim=True), atol=1e-6)
    assert torch.allclose(out.image_embeds, image_features / image_features.norm(dim=-1, keepdim=True), atol=1e-6)
    tensors = dict(inputs)
    tensors.update(text_embeds=out.text_embeds, image_embeds=out.image_embeds, text_features=text_features,
                   image_features=image_features, logits_per_image=out.logits_per_image,
                   logit_scale=loaded.logit_scale.detach().reshape(1), logit_bias=loaded.logit_bias.detach().reshape(1))
    if check_mask:
        assert "attention_mask" in inputs, f"{name}: the processor returned no attention_mask"
        with torch.no_grad():
            no_mask = loaded.get_text_features(input_ids=inputs["input_ids"]).pooler_output
        short = inputs["attention_mask"].min(dim=1).values == 0
        diff = (no_mask - text_features).abs().max(dim=1).values
        assert (diff[short] > 1e-3).all() and (diff[~short] < 1e-5).all(), diff
        tensors["text_features_no_mask"] = no_mask
    per_file = {}
    for rel in IMAGE_FILES:
        one = processor(images=open_raw(rel), return_tensors="pt")
        with torch.no_grad():
            feats = loaded.get_image_features(**one).pooler_output
        tensors[f"file/{rel}/pixel_values"] = one["pixel_values"]
        tensors[f"file/{rel}/image_features"] = feats
        i = IMAGE_FILES.index(rel)
        assert torch.allclose(one["pixel_values"][0], inputs["pixel_values"][i], atol=1e-6), rel
        assert torch.allclose(feats[0], image_features[i], atol=1e-5), rel
        per_file[rel] = sorted(one.keys())

    # By hand: bilinear (or bicubic) antialiased torchvision resize of the uint8 image, x/255, (x-0.5)/0.5.
    ip = processor.image_processor
    interp = {2: tvF.InterpolationMode.BILINEAR, 3: tvF.InterpolationMode.BICUBIC}[int(ip.resample)]
    rel = "siglip2/images/photo-40x30.jpg"
    x = torch.from_numpy(np.array(open_raw(rel))).permute(2, 0, 1).contiguous()
    by_hand = (tvF.resize(x, [32, 32], interpolation=interp, antialias=True).float() / 255 - 0.5) / 0.5
    got = tensors[f"file/{rel}/pixel_values"][0]
    assert (got - by_hand).abs().max().item() < 1e-5, (got - by_hand).abs().max()

    record = {
        "dir": f"siglip2/{name}",
        "model_class": type(loaded).__name__,
        "config_model_type": loaded.config.model_type,
        "captions": CAPTIONS,
        "images": IMAGE_FILES,
        "image_files": {rel: info[rel] for rel in IMAGE_FILES},
        "images_given_as": "PIL.Image.open(file), nothing converted",
        "processor_call": dict(TEXT_CALL, return_tensors="pt", text="captions", images="images"),
        "processor_outputs": describe(inputs),
        "per_file_processor_outputs": per_file,
        "input_ids": inputs["input_ids"].tolist(),
        "attention_mask": inputs["attention_mask"].tolist() if "attention_mask" in inputs else None,
        "tokens": tokens_of(processor, inputs),
        "processor_class": type(processor).__name__,
        "image_processor_class": type(processor.image_processor).__name__,
        "tokenizer_class": type(processor.tokenizer).__name__,
        "padding_side": processor.tokenizer.padding_side,
        "tokenizer_model_input_names": list(processor.tokenizer.model_input_names),
        "pad_token_id": processor.tokenizer.pad_token_id,
        "eos_token_id": processor.tokenizer.eos_token_id,
        "vocab_size": len(processor.tokenizer),
        "tokenizer_config.json": read_json(d, "tokenizer_config.json"),
        "preprocessor_config.json": read_json(d, "preprocessor_config.json"),
        "config.json": read_json(d, "config.json"),
        "files": sorted(os.listdir(d)),
        "pooling": POOLING_SIGLIP + ("; the attention_mask is passed to the text encoder (padding keys masked "
                                     "for every query); position -1 is still pooled" if check_mask else
                                     "; no attention_mask: padding is attended to"),
        "embeds": "text_embeds / image_embeds: model(**inputs) outputs, L2-normalised; text_features / "
                  "image_features and file/*/image_features: get_*_features pooler_output, not normalised",
        "logits_per_image": "images x captions: exp(logit_scale) * cos + logit_bias",
    }
    print(f"{name}: {type(processor).__name__} ({record['image_processor_class']}, {record['tokenizer_class']}); "
          f"keys {sorted(inputs.keys())}")
    return tensors, record


# ----------------------------------------------------------------------------------------------
# D: NaFlex


def naflex_by_hand(image, max_num_patches, patch):
    """transformers' NaFlex pipeline rebuilt: size search, resize, rescale/normalise, patches, padding."""
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()
    h, w = get_image_size_for_max_num_patches(x.shape[1], x.shape[2], patch, max_num_patches)
    y = (tvF.resize(x, [h, w], interpolation=tvF.InterpolationMode.BILINEAR, antialias=True).float() / 255 - 0.5) / 0.5
    gh, gw = h // patch, w // patch
    rows = []
    for py in range(gh):  # patches row-major; inside a patch: pixel row, pixel column, channel
        for px in range(gw):
            block = y[:, py * patch:(py + 1) * patch, px * patch:(px + 1) * patch]  # [c, ky, kx]
            rows.append(block.permute(1, 2, 0).reshape(-1))
    patches = torch.stack(rows)
    padded = torch.zeros(max_num_patches, patches.shape[1])
    padded[:len(rows)] = patches
    mask = torch.zeros(max_num_patches, dtype=torch.int32)
    mask[:len(rows)] = 1
    return padded, mask, (gh, gw)


def check_position_embeddings(model, shapes, max_length):
    """The model's resize equals F.interpolate(bilinear, align_corners=False, antialias=True) on the
    grid; padding positions get the resized grid's first entry."""
    emb = model.vision_model.embeddings
    grid = emb.position_embedding.weight.detach().reshape(emb.position_embedding_size, emb.position_embedding_size, -1)
    spatial = torch.tensor(shapes, dtype=torch.long)
    got = emb.resize_positional_embeddings(grid, spatial, max_length)
    worst = 0.0
    for i, (gh, gw) in enumerate(shapes):
        ref = F.interpolate(grid.permute(2, 0, 1)[None], size=(gh, gw), mode="bilinear", align_corners=False,
                            antialias=True)[0].permute(1, 2, 0).reshape(gh * gw, -1)
        worst = max(worst, (got[i, :gh * gw] - ref).abs().max().item())
        if gh * gw < max_length:
            worst = max(worst, (got[i, gh * gw:] - ref[0]).abs().max().item())
    assert worst < 1e-5, worst
    return worst


def make_naflex(model, tokenizer, info):
    image_processor = Siglip2ImageProcessor(patch_size=NAFLEX_PATCH, max_num_patches=NAFLEX_PATCHES, do_resize=True,
                                            do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                                            do_rescale=True, rescale_factor=1 / 255)
    d = save_directory("naflex", model, tokenizer, image_processor)
    loaded = AutoModel.from_pretrained(d).eval()
    assert same_weights(loaded, model)
    processor = AutoProcessor.from_pretrained(d)
    images = [load_image(os.path.join(FIXTURES, rel)) for rel in IMAGE_FILES]
    call = dict(TEXT_CALL, max_num_patches=NAFLEX_PATCHES, patch_size=NAFLEX_PATCH)
    inputs = processor(text=CAPTIONS, images=images, return_tensors="pt", **call)
    assert inputs["pixel_values"].shape[1:] == (NAFLEX_PATCHES, 3 * NAFLEX_PATCH ** 2), inputs["pixel_values"].shape

    # Without patch_size the processor's class defaults win over preprocessor_config.json.
    default_call = processor(images=images[:1], return_tensors="pt", max_num_patches=NAFLEX_PATCHES)
    without_patch_size = describe(default_call)

    with torch.no_grad():
        out = loaded(**inputs)
        text_in = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
        text_features = loaded.get_text_features(**text_in).pooler_output
        vis_in = {k: inputs[k] for k in ("pixel_values", "pixel_attention_mask", "spatial_shapes")}
        image_features = loaded.get_image_features(**vis_in).pooler_output
    assert torch.allclose(out.image_embeds, image_features / image_features.norm(dim=-1, keepdim=True), atol=1e-6)
    assert torch.allclose(out.text_embeds, text_features / text_features.norm(dim=-1, keepdim=True), atol=1e-6)
    tensors = dict(inputs)
    tensors.update(text_embeds=out.text_embeds, image_embeds=out.image_embeds, text_features=text_features,
                   image_features=image_features, logits_per_image=out.logits_per_image,
                   logit_scale=loaded.logit_scale.detach().reshape(1), logit_bias=loaded.logit_bias.detach().reshape(1))

    # The padded patches do not reach the embedding: change them and nothing moves.
    noisy = inputs["pixel_values"].clone()
    noisy[inputs["pixel_attention_mask"] == 0] = 7.0
    with torch.no_grad():
        again = loaded.get_image_features(pixel_values=noisy, pixel_attention_mask=inputs["pixel_attention_mask"],
                                          spatial_shapes=inputs["spatial_shapes"]).pooler_output
    padding_effect = (again - image_features).abs().max().item()
    assert padding_effect < 1e-5, padding_effect

    image_processor_only = AutoImageProcessor.from_pretrained(d)
    pil_processor = AutoImageProcessor.from_pretrained(d, backend="pil")
    spatial = {}
    raw_open = {}
    worst_by_hand = 0.0
    worst_pil = 0.0
    all_shapes = set()
    for i, rel in enumerate(IMAGE_FILES):
        image = images[i]
        spatial[rel] = {}
        for n in (16, 64, 256):
            o = processor(images=image, return_tensors="pt", max_num_patches=n, patch_size=NAFLEX_PATCH)
            gh, gw = o["spatial_shapes"][0].tolist()
            spatial[rel][str(n)] = [gh, gw]
            all_shapes.add((n, gh, gw))
            by_hand, mask, hw = naflex_by_hand(image, n, NAFLEX_PATCH)
            assert list(hw) == [gh, gw], (rel, n, hw, gh, gw)
            assert torch.equal(o["pixel_attention_mask"][0], mask), (rel, n)
            worst_by_hand = max(worst_by_hand, (o["pixel_values"][0] - by_hand).abs().max().item())
            if n in (16, 64):
                with torch.no_grad():
                    feats = loaded.get_image_features(**o).pooler_output
                for k, v in o.items():
                    tensors[f"file/{rel}/max{n}/{k}"] = v
                tensors[f"file/{rel}/max{n}/image_features"] = feats
                if n == NAFLEX_PATCHES:
                    assert torch.allclose(o["pixel_values"][0], inputs["pixel_values"][i], atol=1e-6), rel
                    assert torch.allclose(feats[0], image_features[i], atol=1e-5), rel
                p = pil_processor(images=image, return_tensors="pt", max_num_patches=n)
                worst_pil = max(worst_pil, (p["pixel_values"][0] - o["pixel_values"][0]).abs().max().item())
        try:
            r = processor(images=open_raw(rel), return_tensors="pt", max_num_patches=NAFLEX_PATCHES,
                          patch_size=NAFLEX_PATCH)
            raw_open[rel] = {"mode": info[rel]["mode"], "result": "ok",
                             "equals_load_image": bool(torch.equal(r["pixel_values"], tensors[f"file/{rel}/max64/pixel_values"]))}
        except Exception as e:  # noqa: BLE001 - recorded, this is the point
            raw_open[rel] = {"mode": info[rel]["mode"], "result": f"{type(e).__name__}: {e}"}
    assert worst_by_hand < 1e-5, worst_by_hand
    pos_worst = check_position_embeddings(loaded, sorted({(gh, gw) for _, gh, gw in all_shapes}), 256)

    record = {
        "dir": "siglip2/naflex",
        "model_class": type(loaded).__name__,
        "config_model_type": loaded.config.model_type,
        "captions": CAPTIONS,
        "images": IMAGE_FILES,
        "image_files": {rel: info[rel] for rel in IMAGE_FILES},
        "images_given_as": "transformers.image_utils.load_image(file): exif_transpose, then PIL convert('RGB')",
        "raw_image_open": raw_open,
        "processor_call": dict(call, return_tensors="pt", text="captions", images="images"),
        "processor_outputs": describe(inputs),
        "processor_outputs_without_patch_size": without_patch_size,
        "input_ids": inputs["input_ids"].tolist(),
        "attention_mask": inputs["attention_mask"].tolist() if "attention_mask" in inputs else None,
        "tokens": tokens_of(processor, inputs),
        "spatial_shapes": spatial,
        "processor_class": type(processor).__name__,
        "image_processor_class": type(processor.image_processor).__name__,
        "auto_image_processor_class": type(image_processor_only).__name__,
        "pil_image_processor_class": type(pil_processor).__name__,
        "max_abs_diff_torchvision_vs_pil": worst_pil,
        "tokenizer_class": type(processor.tokenizer).__name__,
        "tokenizer_normalizer": str(processor.tokenizer.backend_tokenizer.normalizer),
        "padding_side": processor.tokenizer.padding_side,
        "tokenizer_model_input_names": list(processor.tokenizer.model_input_names),
        "vocab_size": len(processor.tokenizer),
        "tokenizer_config.json": read_json(d, "tokenizer_config.json"),
        "preprocessor_config.json": read_json(d, "preprocessor_config.json"),
        "config.json": read_json(d, "config.json"),
        "files": sorted(os.listdir(d)),
        "size_rule": "get_image_size_for_max_num_patches: binary search of scale in [1e-6, 100] until the interval "
                     "is < 1e-5; each side becomes max(patch, ceil(side * scale / patch) * patch); a scale is "
                     "accepted when (H/patch) * (W/patch) <= max_num_patches; the final size uses the lower bound",
        "resize": "torchvision.transforms.v2.functional.resize on the uint8 CHW tensor, InterpolationMode.BILINEAR "
                  "(resample 2), antialias=True (no effect when enlarging); then x / 255, (x - 0.5) / 0.5",
        "patch_order": "pixel_values[b, p, (ky * patch + kx) * 3 + c]: patches p in row-major order over the "
                       "(H/patch) x (W/patch) grid, then zero rows up to max_num_patches (pixel_attention_mask 0)",
        "position_embeddings": "the 4x4 grid resized to spatial_shapes as F.interpolate(mode='bilinear', "
                               "align_corners=False, antialias=True) (written out as explicit weights in 5.24), "
                               "flattened row-major; padding positions get the resized grid's first entry "
                               f"(checked: max |diff| {pos_worst:.2e})",
        "mask": "pixel_attention_mask -> create_bidirectional_mask -> every encoder layer (padding keys masked for "
                "all queries) and the MAP head (probe attends only to real patches: additive finfo.min mask, "
                "repeated per head, as attn_mask of nn.MultiheadAttention); padding pixel values have no effect "
                f"(checked: max |diff| {padding_effect:.1e} after overwriting them)",
        "pooling": "text: final_layer_norm(last hidden state) at position -1, then head; no attention_mask "
                   "(model_input_names ['input_ids']), padding attended to. Vision: post_layernorm, masked MAP head",
        "embeds": "text_embeds / image_embeds: model(**inputs) outputs, L2-normalised; text_features / "
                  "image_features and file/*/image_features: get_*_features pooler_output, not normalised",
    }
    print(f"naflex: {type(processor).__name__} ({record['image_processor_class']}, {record['tokenizer_class']}); "
          f"keys {sorted(inputs.keys())}; |by hand| {worst_by_hand:.1e}, |tv - PIL| {worst_pil:.4f}")
    return tensors, record


# ----------------------------------------------------------------------------------------------


def main():
    os.makedirs(OUT, exist_ok=True)
    info = write_images()

    gemma = gemma_style_tokenizer()
    vocab_size = len(gemma)
    assert vocab_size < 600 and gemma.convert_tokens_to_ids("<0x00>") == 5, vocab_size

    fixed_proc = SiglipImageProcessor(size={"height": 32, "width": 32}, resample=2, do_resize=True, do_rescale=True,
                                      rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5, 0.5, 0.5],
                                      image_std=[0.5, 0.5, 0.5])
    tensors, record = make_fixed_like("fixed", fixed_model(vocab_size, seed=60), gemma, fixed_proc, info,
                                      check_mask=False)
    assert record["tokenizer_class"] == "GemmaTokenizer" and record["attention_mask"] is None
    write_outputs("fixed", tensors, record)
    fixed_ids = record["input_ids"]

    with tempfile.TemporaryDirectory() as workdir:
        stok = sentencepiece_tokenizer(workdir)
        legacy_proc = SiglipImageProcessor(size={"height": 32, "width": 32}, resample=3, do_resize=True,
                                           do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                                           image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        model = legacy_model(stok.vocab_size, stok.pad_token_id, stok.eos_token_id, seed=70)
        tensors, record = make_fixed_like("legacy-mask", model, stok, legacy_proc, info, check_mask=True)
    write_outputs("legacy-mask", tensors, record)

    tensors, record = make_naflex(naflex_model(vocab_size, seed=80), gemma, info)
    assert record["tokenizer_class"] == "Siglip2Tokenizer"
    record["input_ids_differ_from_fixed"] = [i for i, (a, b) in enumerate(zip(record["input_ids"], fixed_ids)) if a != b]
    write_outputs("naflex", tensors, record)

    for root, _, files in os.walk(OUT):
        for f in files:
            size = os.path.getsize(os.path.join(root, f))
            assert size < 2_000_000, (f, size)
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(OUT) for f in fs)
    print(f"{total / 1e3:.0f} kB in {OUT}")


if __name__ == "__main__":
    main()
