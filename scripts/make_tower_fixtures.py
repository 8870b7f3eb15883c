#!/usr/bin/env python3
"""Tower fixtures: tiny Hugging Face CLIP, SigLIP and VisionTextDualEncoder directories, complete with
tokenizer and image processor files, and what transformers computes with them.

Writes tests/fixtures/towers/:
- clip-tiny/: CLIPModel (ViT 32 px, patch 8, width 32, 2 layers, 4 heads; text width 32, 2 layers,
  16 positions; projection 16) with CLIP's default activation quick_gelu, x * sigmoid(1.702 x).
  text_config bos/eos/pad = 0/2/1 as openai/clip-vit-base-patch32 has them: with eos_token_id == 2
  CLIPTextModel pools at `input_ids.argmax(-1)` (the highest id, i.e. the first <|endoftext|>).
- clip-tiny-gelu/: the same shapes with hidden_act "gelu" (exact erf GELU) in both towers, as the
  open_clip conversions of LAION's checkpoints have it, and bos/eos/pad = 812/813/1 (the real ids of
  the specials, as newer conversions write them): with eos_token_id != 2 CLIPTextModel pools at the
  first position whose id == eos_token_id. Both rules pick the same token here, because
  <|endoftext|> is the largest id and also the padding token; the two configs exercise both
  branches. The two directories differ in their weights as well (different seeds).
  The CLIP tokenizer is a real CLIP byte-level BPE cut short: OpenAI's merge list (the
  bpe_simple_vocab_16e6.txt.gz that open_clip ships, read from the installed package, nothing
  downloaded), its first 300 merges, and the vocabulary built the way CLIP builds it (256 byte
  symbols, the same with </w>, one entry per merge, then <|startoftext|> 812 and <|endoftext|> 813;
  ids below 812 are the real CLIP ids). transformers' CLIPTokenizer (5.x: the tokenizers-backed
  class) writes tokenizer.json and tokenizer_config.json (model_max_length 16).
- siglip-tiny/: SiglipModel (vision: no class token, post_layernorm, multi-head attention pooling
  head "MAP"; text: bidirectional, final_layer_norm, last position, linear head), GELU-tanh,
  layer_norm_eps 1e-6, logit_scale and logit_bias set. Text positions 64 = model_max_length 64,
  as google/siglip-base-patch16-224 (the zero-shot pipeline pads SigLIP to 64 whatever the
  tokenizer says, so fewer positions would break it). Tokenizer: a 200-piece SentencePiece unigram
  model trained here on generated English-like text, with T5's layout of specials (<pad> 0, </s> 1,
  <unk> 2, no BOS) and nmt_nfkc normalisation, saved by SiglipTokenizer (spiece.model +
  tokenizer_config.json with model_input_names ["input_ids"] as the Google repos have it, so the
  processor gives no attention mask and the model attends to the padding). transformers 5.23 has
  no slow->fast converter for SiglipTokenizer, so there is no tokenizer.json.
- vtde-tiny/: VisionTextDualEncoderModel from a tiny ViTModel (32 px, patch 8, width 32, with its
  tanh pooler) and a tiny BertModel (WordPiece vocab.txt written here); projection 16.
  BertTokenizer (tokenizers-backed) and ViTImageProcessor (32x32, mean/std 0.5).
- every directory also has preprocessor_config.json (the image processor's own save_pretrained, the
  layout the Hub repos have; ProcessorMixin.save_pretrained in 5.x would write processor_config.json
  instead) and a special_tokens_map.json written here in the Hub repos' form (transformers 5.x no
  longer writes one). AutoModel and AutoProcessor load each directory; the references below are
  computed with the reloaded model and processor. AutoProcessor gives the torchvision-backed image
  processors (CLIPImageProcessor, SiglipImageProcessor, ViTImageProcessor); their PIL twins
  (CLIPImageProcessorPil, ...) differ from them by up to one 8-bit level on these JPEGs.
- images/: three smooth seeded pictures saved as JPEG (quality 90) of 50x40, 32x64 and 100x100.
- <name>-io.safetensors, per model: pixel_values (4 seeded normal images at 32 px), image_embeds
  (get_image_features, not normalised), image_embeds_normalised, vision_last_hidden_state,
  vision_pooler_output (the vision model's pooler, before any projection), input_ids and
  attention_mask from the model's own processor on four captions (the last one longer than the
  maximum, so truncation shows; SigLIP's processor returns no mask, its attention_mask here is all
  ones, which is what the model does without one), token_type_ids for BERT, text_embeds
  (get_text_features, not normalised), text_embeds_normalised, text_last_hidden_state,
  text_pooler_output, logits_per_image (full forward, images x captions), logit_scale (and
  logit_bias), jpeg_pixel_values (the JPEGs through load_image and the model's AutoProcessor) and
  jpeg_image_embeds.
- expected.json: the JPEGs' order and, per model, the captions, the tokenizer call, the exact token
  ids, model_max_length, the processor / image processor / tokenizer classes, the pooling rule and
  the zero-shot pipeline's scores on the first JPEG.

Every weight is its initial value plus seeded N(0, 0.05^2) noise, so nothing sits at its init; then
logit_scale is set to ln 20 (CLIP), ln 15 (SigLIP, with logit_bias -3.25) and ln 12 (VTDE).

`--check DIR --like NAME` loads a directory that align exported with AutoModel and AutoProcessor,
embeds the fixture NAME's pixel_values, captions (tokenised by the loaded processor, the ids compared
with the fixture's) and JPEGs, prints the largest differences from the fixture and runs the
zero-shot-image-classification pipeline on DIR; it exits 1 if any embedding, pixel or pipeline
score differs by more than 1e-4 or the token ids differ.

Written with: torch 2.15.0, transformers 5.23.0, tokenizers 0.23.3, sentencepiece 0.2.3,
Pillow 13.0.0, safetensors 0.8.0, numpy 2.4.6, open_clip_torch 3.3.0 (only its BPE merges file)
(run by hand, not by CI).
"""
import argparse
import copy
import gzip
import importlib.util
import io
import json
import math
import os
import sys
import tempfile

import numpy as np
import sentencepiece as spm
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import (AutoModel, AutoProcessor, BertConfig, BertTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel,
                          CLIPTokenizer, SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipTokenizer,
                          VisionTextDualEncoderConfig, VisionTextDualEncoderModel, ViTConfig, ViTImageProcessor, pipeline)
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.image_utils import load_image

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "towers")
IMAGES = os.path.join(OUT, "images")
TOL = 1e-4

CAPTIONS = [
    "a photo of a cat",
    "Two DOGS & a café!",
    "red car",
    "A very long caption: an old man riding a brown horse near the river on a sunny morning, while two "
    "small children play with a blue ball in the park and a large white bird flies over the water, "
    "past the tall trees behind the wooden house.",
]
ZERO_SHOT_LABELS = ["cat", "dog"]
CLIP_MERGES = 300
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


# ----------------------------------------------------------------------------------------------
# Images


def smooth_picture(w, h, seed):
    """A colour gradient with a few soft blobs: smooth, so JPEG keeps it nearly intact, and
    different at every position, so a wrong crop or resize shows."""
    rng = np.random.default_rng(seed)
    ys, xs = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
    img = np.empty((h, w, 3))
    for c in range(3):
        a, b = rng.uniform(-120, 120, 2)
        img[..., c] = 128 + a * (xs - 0.5) + b * (ys - 0.5)
    for _ in range(4):
        cx, cy = rng.uniform(0.1, 0.9, 2)
        sigma = rng.uniform(0.08, 0.25)
        weight = np.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / (2 * sigma * sigma))
        img += weight[..., None] * rng.uniform(-110, 110, 3)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def write_jpegs():
    os.makedirs(IMAGES, exist_ok=True)
    names = []
    for i, (w, h) in enumerate([(50, 40), (32, 64), (100, 100)]):
        name = f"smooth-{w}x{h}.jpg"
        Image.fromarray(smooth_picture(w, h, seed=500 + i)).save(os.path.join(IMAGES, name), quality=90)
        names.append(name)
    return names


# ----------------------------------------------------------------------------------------------
# Tokenizers


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
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump(entries, f, indent=2, sort_keys=True)
        f.write("\n")


def clip_tokenizer():
    """CLIP's byte-level BPE with OpenAI's first CLIP_MERGES merges."""
    spec = importlib.util.find_spec("open_clip")
    path = os.path.join(spec.submodule_search_locations[0], "bpe_simple_vocab_16e6.txt.gz")
    lines = gzip.open(path).read().decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1:1 + CLIP_MERGES]]  # line 0 is the version header
    symbols = list(bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    assert len(set(vocab)) == len(vocab)
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges, model_max_length=16)


def english_like_text(n, seed):
    words = """a an the this that some many few one two three four five photo picture image painting drawing of with
    without on in under over near beside behind between above below at by from into through cat cats dog dogs bird
    birds horse horses cow sheep fish bear zebra giraffe elephant mouse man men woman women child children boy girl
    person people player team crowd red blue green yellow orange purple pink brown black white grey dark bright small
    large big little tiny huge tall short long old young new wooden metal plastic glass tree trees house houses car
    cars bus truck train plane boat bicycle road street grass sky water river lake sea beach mountain hill field
    forest garden park city town table chair bed sofa kitchen room window door wall floor plate bowl cup cake pizza
    sitting standing walking running playing eating drinking holding riding flying swimming looking is are and or
    very next to top side front back inside outside together sunny cloudy snowy night day morning evening while past
    flies play ball caption sandwich kite umbrella skateboard surfboard snow rain light shadow close view corner bridge
    tower clock sign market shop bench fence stone sand wave boats kitchen counter laptop phone book bag hat shirt""".split()
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=rng.integers(3, 14))) for _ in range(n)]


def siglip_tokenizer(workdir):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(english_like_text(4000, seed=7)), model_writer=model, vocab_size=200, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
        character_coverage=1.0, num_threads=1, minloglevel=2)
    path = os.path.join(workdir, "spiece.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return SiglipTokenizer(path, model_max_length=64, model_input_names=["input_ids"])


def bert_vocab():
    words = sorted(set("""a an the of on in near with while and past behind over photo cat dog dogs two small large old
    very long man horse river sunny morning children play ball park white bird water trees house caption red blue
    brown car grass near playing riding green flies tall wooden""".split()))
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    return (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(".,:;!?'\"()-") + [str(d) for d in range(10)] + letters
            + ["##" + c for c in letters] + words + ["##s", "##ing", "##ed", "##er", "##ly"])


# ----------------------------------------------------------------------------------------------
# Models


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def clip_model(act, bos, eos, pad, vocab_size, seed):
    torch.manual_seed(seed)
    text = dict(vocab_size=vocab_size, max_position_embeddings=16, hidden_act=act, bos_token_id=bos, eos_token_id=eos,
                pad_token_id=pad, attention_dropout=0.0, dropout=0.0, projection_dim=16, **SMALL)
    vision = dict(image_size=32, patch_size=8, hidden_act=act, attention_dropout=0.0, dropout=0.0, projection_dim=16,
                  **SMALL)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    perturb(model, seed + 1)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(20.0))  # CLIP's init is log(1/0.07) = 2.6592
    return model.eval()


def siglip_model(vocab_size, seed):
    torch.manual_seed(seed)
    text = dict(vocab_size=vocab_size, max_position_embeddings=64, attention_dropout=0.0, bos_token_id=None, eos_token_id=1,
                pad_token_id=1, **SMALL)
    vision = dict(image_size=32, patch_size=8, attention_dropout=0.0, **SMALL)
    model = SiglipModel(SiglipConfig(text_config=text, vision_config=vision))
    perturb(model, seed + 1)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(15.0))
        model.logit_bias.fill_(-3.25)
    return model.eval()


def vtde_model(vocab_size, seed):
    torch.manual_seed(seed)
    vit = ViTConfig(image_size=32, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **SMALL)
    bert = BertConfig(vocab_size=vocab_size, max_position_embeddings=16, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, **SMALL)
    config = VisionTextDualEncoderConfig.from_vision_text_configs(vit, bert, projection_dim=16)
    model = VisionTextDualEncoderModel(config)
    perturb(model, seed + 1)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(12.0))
    return model.eval()


# ----------------------------------------------------------------------------------------------
# The models' own outputs


def text_kwargs(name):
    """How the captions are tokenised: as a user of each model does it (SigLIP: max_length padding)."""
    if name.startswith("siglip"):
        return {"padding": "max_length", "truncation": True, "max_length": 64}
    return {"padding": True, "truncation": True}


def pixel_inputs():
    return torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(11))


def embed(model, processor, name, captions, pixel_values, jpeg_paths):
    text = processor(text=captions, return_tensors="pt", **text_kwargs(name))
    text = {k: v for k, v in text.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        vision_out = model.vision_model(pixel_values=pixel_values)
        image_embeds = model.get_image_features(pixel_values=pixel_values).pooler_output
        text_out = model.text_model(**text)
        text_embeds = model.get_text_features(**text).pooler_output
        full = model(pixel_values=pixel_values, **text)
        images = [load_image(p) for p in jpeg_paths]
        jpeg_pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        jpeg_embeds = model.get_image_features(pixel_values=jpeg_pixels).pooler_output
    out = {
        "pixel_values": pixel_values,
        "image_embeds": image_embeds,
        "image_embeds_normalised": image_embeds / image_embeds.norm(dim=-1, keepdim=True),
        "vision_last_hidden_state": vision_out.last_hidden_state,
        "vision_pooler_output": vision_out.pooler_output,
        "input_ids": text["input_ids"].to(torch.int64),
        "attention_mask": text.get("attention_mask", torch.ones_like(text["input_ids"])).to(torch.int64),
        "text_embeds": text_embeds,
        "text_embeds_normalised": text_embeds / text_embeds.norm(dim=-1, keepdim=True),
        "text_last_hidden_state": text_out.last_hidden_state,
        "text_pooler_output": text_out.pooler_output,
        "logits_per_image": full.logits_per_image,
        "logit_scale": model.logit_scale.detach().reshape(1),
        "jpeg_pixel_values": jpeg_pixels,
        "jpeg_image_embeds": jpeg_embeds,
    }
    if "token_type_ids" in text:
        out["token_type_ids"] = text["token_type_ids"].to(torch.int64)
    if hasattr(model, "logit_bias"):
        out["logit_bias"] = model.logit_bias.detach().reshape(1)
    return {k: v.contiguous() for k, v in out.items()}, text


POOLING = {
    "clip-tiny": "text: final_layer_norm(last hidden state) at input_ids.argmax(-1) (eos_token_id == 2 in the config: "
                 "the highest id, the first <|endoftext|>), then text_projection; vision: post_layernorm(class token), "
                 "then visual_projection",
    "clip-tiny-gelu": "text: final_layer_norm(last hidden state) at the first position where input_ids == "
                      "eos_token_id (813), then text_projection; vision: post_layernorm(class token), then "
                      "visual_projection",
    "siglip-tiny": "text: final_layer_norm(last hidden state) at the last position (-1, a padding </s> when the "
                   "caption is short; no attention mask), then head (Linear); vision: post_layernorm(all patches), "
                   "then the attention-pooling head (probe query, MultiheadAttention, residual + MLP(layernorm))",
    "vtde-tiny": "text: BERT pooler tanh(dense([CLS] hidden state)), then text_projection; vision: ViT pooler "
                 "tanh(dense(layernorm'd class token)), then visual_projection",
}


def save_directory(name, model, tokenizer, image_processor, special_objects, extra_files=()):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    image_processor.save_pretrained(d)
    write_special_tokens_map(tokenizer, d, special_objects)
    for fname, content in extra_files:
        with open(os.path.join(d, fname), "w") as f:
            f.write(content)
    return d


def zero_shot(directory, image_path):
    classifier = pipeline("zero-shot-image-classification", model=directory, device="cpu")
    result = classifier(image_path, candidate_labels=ZERO_SHOT_LABELS)
    return {r["label"]: r["score"] for r in result}


def make_one(name, model, tokenizer, image_processor, special_objects, jpeg_names, extra_files=()):
    d = save_directory(name, model, tokenizer, image_processor, special_objects, extra_files)
    # A call leaves its padding and truncation set on the backend (and save_pretrained would write
    # them into tokenizer.json), so the comparison runs on a copy, after saving.
    in_memory_ids = copy.deepcopy(tokenizer)(CAPTIONS, **text_kwargs(name))["input_ids"]
    loaded = AutoModel.from_pretrained(d).eval()
    processor = AutoProcessor.from_pretrained(d)
    jpeg_paths = [os.path.join(IMAGES, n) for n in jpeg_names]
    tensors, text = embed(loaded, processor, name, CAPTIONS, pixel_inputs(), jpeg_paths)
    assert text["input_ids"].tolist() == in_memory_ids, f"{name}: the reloaded tokenizer tokenises differently"
    with torch.no_grad():  # the reloaded model is the model that was saved
        again = model.get_image_features(pixel_values=tensors["pixel_values"]).pooler_output
    assert torch.allclose(again, tensors["image_embeds"], atol=1e-6), name
    save_file(tensors, os.path.join(OUT, f"{name}-io.safetensors"))
    cfg = loaded.config
    record = {
        "dir": name,
        "io": f"{name}-io.safetensors",
        "model_class": type(loaded).__name__,
        "captions": CAPTIONS,
        "tokenizer_call": text_kwargs(name),
        "input_ids": text["input_ids"].tolist(),
        "attention_mask": text["attention_mask"].tolist() if "attention_mask" in text else None,
        "processor_returns": sorted(text.keys()),
        "model_max_length": processor.tokenizer.model_max_length,
        "processor_class": type(processor).__name__,
        "image_processor_class": type(processor.image_processor).__name__,
        "tokenizer_class": type(processor.tokenizer).__name__,
        "pad_token_id": processor.tokenizer.pad_token_id,
        "padding_side": processor.tokenizer.padding_side,
        "pooling": POOLING[name],
        "text_hidden_act": cfg.text_config.hidden_act,
        "vision_hidden_act": cfg.vision_config.hidden_act,
        "text_layer_norm_eps": cfg.text_config.layer_norm_eps,
        "vision_layer_norm_eps": cfg.vision_config.layer_norm_eps,
        "logit_scale": tensors["logit_scale"].item(),
        "logit_bias": tensors["logit_bias"].item() if "logit_bias" in tensors else None,
        "zero_shot": {"image": jpeg_names[0], "labels": ZERO_SHOT_LABELS, "scores": zero_shot(d, jpeg_paths[0])},
    }
    print(f"{name}: ids {tuple(text['input_ids'].shape)}, image_embeds {tuple(tensors['image_embeds'].shape)}, "
          f"zero-shot {record['zero_shot']['scores']}")
    return record


def make_all():
    os.makedirs(OUT, exist_ok=True)
    jpeg_names = write_jpegs()
    models = {}

    tok = clip_tokenizer()
    assert tok.backend_tokenizer.padding is None and tok.backend_tokenizer.truncation is None
    clip_proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    bos, eos = tok.bos_token_id, tok.eos_token_id
    models["clip-tiny"] = make_one("clip-tiny", clip_model("quick_gelu", 0, 2, 1, len(tok), seed=20), tok, clip_proc,
                                   True, jpeg_names)
    models["clip-tiny-gelu"] = make_one("clip-tiny-gelu", clip_model("gelu", bos, eos, 1, len(tok), seed=30), tok,
                                        clip_proc, True, jpeg_names)

    sig_proc = SiglipImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                                    rescale_factor=1 / 255)
    with tempfile.TemporaryDirectory() as workdir:
        stok = siglip_tokenizer(workdir)
        models["siglip-tiny"] = make_one("siglip-tiny", siglip_model(stok.vocab_size, seed=40), stok, sig_proc, True,
                                         jpeg_names)

    vocab = bert_vocab()
    btok = BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True, model_max_length=16)
    vit_proc = ViTImageProcessor(size={"height": 32, "width": 32})
    models["vtde-tiny"] = make_one("vtde-tiny", vtde_model(len(vocab), seed=50), btok, vit_proc, False, jpeg_names,
                                   extra_files=[("vocab.txt", "\n".join(vocab) + "\n")])

    import PIL
    import tokenizers
    import transformers
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump({"images": jpeg_names, "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                                      "tokenizers": tokenizers.__version__,
                                                      "sentencepiece": spm.__version__, "Pillow": PIL.__version__},
                   "models": models}, f, indent=1, ensure_ascii=False)
        f.write("\n")


# ----------------------------------------------------------------------------------------------
# --check


def check(directory, like):
    with open(os.path.join(OUT, "expected.json")) as f:
        expected = json.load(f)
    record = expected["models"][like]
    ref = load_file(os.path.join(OUT, record["io"]))
    model = AutoModel.from_pretrained(directory).eval()
    processor = AutoProcessor.from_pretrained(directory)
    print(f"{directory}: {type(model).__name__}, {type(processor).__name__} "
          f"({type(processor.image_processor).__name__}, {type(processor.tokenizer).__name__})")
    jpeg_paths = [os.path.join(IMAGES, n) for n in expected["images"]]
    got, text = embed(model, processor, like, record["captions"], ref["pixel_values"], jpeg_paths)
    failed = []
    if text["input_ids"].tolist() != record["input_ids"]:
        print("input_ids differ from the fixture's:\n  got     ", text["input_ids"].tolist(), "\n  expected",
              record["input_ids"])
        failed.append("input_ids")
    for key in ["image_embeds", "text_embeds", "jpeg_pixel_values", "jpeg_image_embeds", "logits_per_image"]:
        if got[key].shape != ref[key].shape:
            print(f"{key}: shape {tuple(got[key].shape)}, the fixture's {tuple(ref[key].shape)}")
            failed.append(key)
            continue
        diff = (got[key] - ref[key]).abs().max().item()
        print(f"{key}: max |difference| {diff:.3g}")
        if not diff <= TOL:
            failed.append(key)
    scores = zero_shot(directory, jpeg_paths[0])
    print("zero-shot-image-classification pipeline on", expected["images"][0], scores,
          "(fixture:", record["zero_shot"]["scores"], ")")
    for label, score in record["zero_shot"]["scores"].items():
        if not abs(scores.get(label, float("nan")) - score) <= TOL:
            failed.append("zero-shot " + label)
    if failed:
        print("MISMATCH:", ", ".join(failed))
        sys.exit(1)
    print("all within", TOL)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--check", metavar="DIR", help="a directory align exported")
    p.add_argument("--like", metavar="NAME", help="with --check: the fixture it should match (clip-tiny, clip-tiny-gelu, "
                   "siglip-tiny, vtde-tiny)")
    a = p.parse_args()
    if a.check:
        if not a.like:
            p.error("--check needs --like")
        check(a.check, a.like)
    else:
        make_all()
