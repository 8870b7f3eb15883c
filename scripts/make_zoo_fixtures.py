#!/usr/bin/env python3
"""open_clip "zoo" fixtures: awkward web captions through open_clip's tokenizers, and a tiny
CLIPA-style model (native open_clip `CLIP` with a BERT WordPiece tokenizer), made and reloaded with
open_clip's own code, and what open_clip computes with them.

Writes tests/fixtures/open_clip/:
- captions.json: {"versions", "captions", "context_length": 32, "ids": {"lower", "whitespace",
  "canonicalize"}, "cleaned": {same modes}, "ids16"}. The captions are awkward web text: Latin
  ligatures, full-width forms and the ideographic space U+3000, half-width katakana, HTML entities
  (named, numeric, legacy without ';', upper case, double-escaped &amp;amp;amp;, and a line with
  "<b>" so ftfy leaves its entities alone), mojibake, curly quotes, emoji (ZWJ family, a flag), CJK,
  Arabic, Devanagari, Cyrillic, upper-case Greek with a final sigma, combining accents, C1 controls
  \\x93..\\x94, tabs / newlines / CRLF / U+2028, no-break spaces, a BOM, a terminal colour escape,
  underscores and punctuation, a whitespace-only caption and a caption longer than 32 tokens.
  ids[mode] = open_clip.tokenizer.SimpleTokenizer(context_length=32, clean=mode)(captions): [sot] +
  BPE(clean(text)) + [eot], cut to 32 with the last token set to <end_of_text>, zero padded.
  cleaned[mode] = the tokenizer's clean_fn(text) (lower: ftfy.fix_text, html.unescape twice, strip,
  whitespace collapsed, lower case; whitespace: the same without lower case; canonicalize: basic
  clean, '_' -> ' ', string.punctuation removed, lower case, whitespace collapsed). ids16 =
  open_clip.get_tokenizer("local-dir:clip-native") (SimpleTokenizer, context 16, clean "lower").
  Written with ensure_ascii, so the control characters, BOM and U+2028 survive as \\u escapes.
- captions-io.safetensors: input_ids (int64 [n, 16], = ids16) and text_features (float32 [n, 16],
  encode_text of the clip-native fixture model reloaded with
  open_clip.create_model_and_transforms("local-dir:clip-native"), not normalised).
- clipa/: CLIPA's recipe (as open_clip's ViT-*-CLIPA configs) at toy size: the native `CLIP` class
  (custom_text false, text tower flattened into the top level), embed_dim 16, quick_gelu false
  (erf GELU). Vision: 32 px, patch 8, width 32, 2 layers, head_width 8 (4 heads), mlp_ratio 4,
  no_ln_pre true (ln_pre is nn.Identity, no weights), pool_type "avg" (mean of the patch tokens,
  the class token excluded) and final_ln_after_pool true (ln_post applied to the pooled vector,
  not to every token), then @ visual.proj. Text: vocab 300 (the tiny BERT vocabulary below),
  context 16, width 16, 2 heads, 2 layers, no_causal_mask true (attn_mask None: every position,
  padding included, attends everywhere), pool_type "last" (ln_final over every position, then
  position 15, whatever the token), then @ text_projection. hf_tokenizer_name "bert-base-uncased"
  and tokenizer_kwargs {"strip_sep_token": true}, as the real CLIPA configs. The name is never
  resolved: open_clip.get_tokenizer("local-dir:DIR") builds HFTokenizer(DIR) whenever text_cfg
  has a non-empty hf_tokenizer_name, so AutoTokenizer reads the folder's own files (checked here
  with HF_HUB_OFFLINE=1: the loaded vocabulary is the 300-token one). HFTokenizer: clean
  "whitespace" (its default: ftfy + html.unescape twice + whitespace collapsed, no lower case;
  BERT's normaliser lower-cases and strips accents), tokenizer(texts, max_length=16,
  padding="max_length", truncation=True) -> [CLS] wordpieces [SEP] [PAD]..., then strip_sep_token
  replaces every id equal to sep_token_id with 0 (literally 0, which is [PAD] here as in BERT).
  So position 15 always holds id 0: a pad, or the stripped [SEP] of a caption of 14+ pieces.
  The tokenizer: a hand-listed uncased WordPiece vocabulary of 300 entries ([PAD] 0, [UNK] 1,
  [CLS] 2, [SEP] 3, [MASK] 4, ASCII punctuation, digits, a-z, ##a-##z, ##0-##9, some suffixes,
  a few CJK characters, and the common English words of the captions), wrapped as transformers'
  BertTokenizer (= BertTokenizerFast in transformers 5: BertNormalizer(clean_text, chinese chars
  split, lowercase, strip_accents follows lowercase), BertPreTokenizer, WordPiece "##",
  TemplateProcessing [CLS] $A [SEP]), model_max_length 512, and written by save_for_hf's
  tokenizer.save_pretrained (transformers 5 writes tokenizer.json and tokenizer_config.json only;
  this script adds vocab.txt, one token per line in id order, as bert-base-uncased ships it, and
  special_tokens_map.json as transformers 4 wrote it). Weights: open_clip's init (torch.manual_seed(90)) plus seeded N(0, 0.05^2) noise on
  every parameter, LayerNorm weights and biases then redrawn as 1 + N(0, 0.2^2) and N(0, 0.2^2)
  so that none is identity; logit_scale ln 25. Written by
  push_to_hf_hub.save_for_hf(..., safe_serialization=True): open_clip_model.safetensors +
  open_clip_config.json; preprocess_cfg is CLIPA's (pretrained._apcfg): ImageNet mean/std,
  bilinear, resize_mode "squash".
- clipa-io.safetensors (from the model reloaded with create_model_and_transforms("local-dir:clipa"),
  strict load, checked against the model that was saved): pixel_values (the four image files of
  make_open_clip_fixtures.py opened with PIL.Image.open and passed to the val transform as they
  are), image_features (encode_image(pixel_values), not normalised), image_pooled (after avg pool
  and ln_post, before proj), jpeg_image_features (encode_image of the val transform applied to the
  files opened again: the same pixels as pixel_values, so equal to image_features), input_ids
  (get_tokenizer("local-dir:clipa") on six captions: one plain, one upper case, one with
  entities, one with combining accents, one CJK, one longer than 16 pieces), text_features (not
  normalised), text_pooled (position 15 after ln_final, before text_projection), logits_per_image
  (get_logits) and logit_scale (the raw parameter, shape [1]).
- zoo-expected.json: {"versions", "images", "models": {"clipa": {captions, input_ids, tokenizer,
  open_clip_config written, final preprocess cfg, val transform repr, weights file, state dict
  keys with shapes, pooling, logit_scale, files}}}.

Written with: torch 2.15.0, open_clip_torch 3.3.0, torchvision 0.29.2, transformers 5.24.0,
tokenizers 0.23.3, ftfy 6.3.1, Pillow 13.0.0, safetensors 0.8.0, numpy 2.4.6 (run by hand, not by
CI; nothing downloaded: HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE are set before anything imports).
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json
import math
import shutil
import string
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import save_file

import open_clip
from open_clip.constants import IMAGENET_MEAN, IMAGENET_STD
from open_clip.push_to_hf_hub import save_for_hf
from open_clip.tokenizer import HFTokenizer, SimpleTokenizer
from open_clip.transformer import text_global_pool

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures")
OUT = os.path.join(FIXTURES, "open_clip")

# Paths relative to tests/fixtures (the images of make_open_clip_fixtures.py; all RGB).
IMAGES = [
    "towers/images/smooth-50x40.jpg",
    "towers/images/smooth-32x64.jpg",
    "preprocess/odd-347x289.png",
    "preprocess/tall-1to4.jpg",
]

CAPTIONS = [
    "a photo of a cat",
    "\ufb01sh and \ufb02our on the \u0133ssel bridge",  # ligatures fi, fl, ij
    "\uff21\uff22\uff23\uff11\uff12\uff13\uff01\u3000full-width\u3000text",  # ＡＢＣ１２３！ + U+3000
    "\uff76\uff80\uff76\uff85 \uff83\uff7d\uff84 \uff7a\uff70\uff8b\uff70 shop",  # half-width katakana
    "caf&eacute; &hellip; tom &amp;amp;amp; jerry&rsquo;s",
    "numeric &#233;t&#233; and a smile &#x1F600;",
    "&copy 2020 photo by &EACUTE;mile",
    "<b>bold</b> text &amp; caf&eacute; stays escaped",
    "\u201cCurly\u201d \u2018quotes\u2019 and the dog\u2019s ball",
    "family \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 and flag \U0001F1EF\U0001F1F5 party \U0001F389",
    "\u6771\u4eac\u306e\u591c\u666f \u5199\u771f",  # 東京の夜景 写真
    "\u0635\u0648\u0631\u0629 \u0642\u0637\u0629 \u0639\u0644\u0649 \u0627\u0644\u0623\u0631\u064a\u0643\u0629",
    "\u090f\u0915 \u092c\u093f\u0932\u094d\u0932\u0940 \u0915\u0940 \u0924\u0938\u094d\u0935\u0940\u0930",  # एक बिल्ली की तस्वीर
    "\u041a\u043e\u0448\u043a\u0430 \u043d\u0430 \u0434\u0438\u0432\u0430\u043d\u0435",  # Кошка на диване
    "\u039f\u0394\u039f\u03a3 \u03c3\u03c4\u03b7\u03bd \u0391\u03b8\u03ae\u03bd\u03b1",  # ΟΔΟΣ στην Αθήνα
    "cafe\u0301 de\u0301ja\u0300 vu",  # combining acute / grave
    "\x93quoted\x94 by an old windows page",  # C1 controls (cp1252 curly quotes)
    "caf\u00c3\u00a9 with s\u00c3\u00b6ren",  # mojibake of café / sören
    "tabs\tand\nnewlines\r\nand\u2028a line separator",
    "non\u00a0breaking\u00a0spaces and a\u202fnarrow one",
    "\ufeffa bom at the start",
    "\x1b[31mred text\x1b[0m in a terminal",
    "snake_case_caption with -- punctuation!!! (really?) #tag @user 3.5",
    "A DOG Running On The BEACH",
    " \t\u3000 ",  # whitespace only
    "An extremely long caption: an old man in a red hat is riding a brown horse near the river on a sunny "
    "morning, while two small children play with a blue ball and a black dog in the green park behind them.",
]
CONTEXT_LENGTH = 32
CLEAN_MODES = ["lower", "whitespace", "canonicalize"]
CLIPA_CAPTIONS = [0, 23, 4, 15, 10, 25]  # plain, upper case, entities, combining, CJK, long

# The tiny uncased WordPiece vocabulary (300 entries).
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SUFFIXES = ["##es", "##ed", "##ing", "##er", "##ly", "##le", "##en", "##on", "##an", "##in",
            "##at", "##or", "##ar", "##ro", "##ri", "##de", "##te", "##ss", "##ll", "##th", "##ch", "##sh"]
CJK = ["\u6771", "\u4eac", "\u306e", "\u591c", "\u666f", "\u5199", "\u771f"]
WORDS = """a an the of and on in at by with to is are for from near while behind them two one old new red
blue green black white brown small big long very photo picture image cat cats dog dogs ball man woman
children child play plays playing riding ride horse river sunny morning park hat text bold stays escaped
cafe caf tom jerry numeric smile copy photo by family flag party full width shop quotes curly quoted page
windows fish flour bridge bom start terminal snake case caption punctuation really tag user tabs newlines
line separator non breaking spaces narrow beach running extremely vu deja ete emile soren eacute this that
it its has have was be not or but as out up down over under here there what when where who how all some
no yes my your our their his her he she we they you i me us him car street house tree water sky sea city
road table chair food bird flower mountain snow""".split()


def tiny_vocab():
    vocab = list(SPECIALS)
    vocab += list(string.punctuation) + list(string.digits) + list(string.ascii_lowercase)
    vocab += ["##" + c for c in string.ascii_lowercase] + ["##" + c for c in string.digits]
    vocab += SUFFIXES + CJK
    for w in WORDS:
        if w not in vocab and len(vocab) < 300:
            vocab.append(w)
    assert len(vocab) == 300 and len(set(vocab)) == 300, len(vocab)
    return vocab


def bert_tokenizer():
    from transformers import BertTokenizerFast
    vocab = tiny_vocab()
    tok = BertTokenizerFast(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True, model_max_length=512)
    assert (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id) == (0, 1, 2, 3, 4)
    return tok, vocab


# ----------------------------------------------------------------------------------------------


def versions():
    import ftfy
    import numpy
    import PIL
    import safetensors
    import tokenizers
    import torchvision
    import transformers
    return {"torch": torch.__version__, "open_clip": open_clip.__version__, "torchvision": torchvision.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "ftfy": ftfy.__version__, "Pillow": PIL.__version__, "safetensors": safetensors.__version__,
            "numpy": numpy.__version__}


def dump_json(obj, path, ensure_ascii):
    """json with indent 1, but every list of ints on one line (checked to parse back to obj)."""
    def enc(o, ind):
        pad = " " * ind
        if isinstance(o, dict):
            if not o:
                return "{}"
            items = [f'{pad} {json.dumps(k, ensure_ascii=ensure_ascii)}: {enc(v, ind + 1)}' for k, v in o.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        if isinstance(o, list):
            if all(isinstance(x, int) and not isinstance(x, bool) for x in o):
                return "[" + ", ".join(str(x) for x in o) + "]"
            if not o:
                return "[]"
            return "[\n" + ",\n".join(f"{pad} {enc(x, ind + 1)}" for x in o) + "\n" + pad + "]"
        return json.dumps(o, ensure_ascii=ensure_ascii)
    text = enc(obj, 0) + "\n"
    assert json.loads(text) == obj
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def load(directory):
    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + os.path.abspath(directory))
    tokenizer = open_clip.get_tokenizer("local-dir:" + os.path.abspath(directory))
    return model.eval(), preprocess, tokenizer


def open_images(preprocess):
    return torch.stack([preprocess(Image.open(os.path.join(FIXTURES, p))) for p in IMAGES])


# ----------------------------------------------------------------------------------------------
# 1. captions


def make_captions(vers):
    ids, cleaned = {}, {}
    for mode in CLEAN_MODES:
        tok = SimpleTokenizer(context_length=CONTEXT_LENGTH, clean=mode)
        ids[mode] = tok(CAPTIONS).tolist()
        cleaned[mode] = [tok.clean_fn(c) for c in CAPTIONS]
    model, _, tokenizer = load(os.path.join(OUT, "clip-native"))
    assert isinstance(tokenizer, SimpleTokenizer) and tokenizer.context_length == 16
    ids16 = tokenizer(CAPTIONS)
    assert ids16.shape == (len(CAPTIONS), 16)
    # context 16 is the context-32 'lower' ids cut to 16 with <end_of_text> last where they overflow
    for row16, row32 in zip(ids16.tolist(), ids["lower"]):
        n = sum(1 for t in row32 if t)
        assert row16 == (row32[:16] if n <= 16 else row32[:15] + [tokenizer.eot_token_id])
    with torch.no_grad():
        feats = model.encode_text(ids16)
    dump_json({"versions": vers, "captions": CAPTIONS, "context_length": CONTEXT_LENGTH,
               "tokenizer": "open_clip.tokenizer.SimpleTokenizer(context_length=32, clean=mode); ids16: "
                            "open_clip.get_tokenizer('local-dir:clip-native') (context 16, clean 'lower')",
               "ids": ids, "cleaned": cleaned, "ids16": ids16.tolist()},
              os.path.join(OUT, "captions.json"), ensure_ascii=True)
    save_file({"input_ids": ids16.to(torch.int64).contiguous(), "text_features": feats.contiguous()},
              os.path.join(OUT, "captions-io.safetensors"))
    longest = max(sum(1 for t in r if t) for r in ids["lower"])
    print(f"captions: {len(CAPTIONS)}, longest {longest} ids at context 32 (lower)")


# ----------------------------------------------------------------------------------------------
# 2. clipa

CLIPA = {
    "seed": 90,
    "logit_scale": math.log(25.0),
    "model_cfg": {
        "embed_dim": 16,
        "quick_gelu": False,
        "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 8,
                       "mlp_ratio": 4, "no_ln_pre": True, "pool_type": "avg", "final_ln_after_pool": True},
        "text_cfg": {"context_length": 16, "vocab_size": 300, "hf_tokenizer_name": "bert-base-uncased",
                     "tokenizer_kwargs": {"strip_sep_token": True}, "width": 16, "heads": 2, "layers": 2,
                     "pool_type": "last", "no_causal_mask": True},
    },
    "preprocess_cfg": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD),
                       "interpolation": "bilinear", "resize_mode": "squash"},
    "pooling": "text: token_embedding + positional_embedding, bidirectional transformer (no mask, padding attended), "
               "ln_final over every position, then position 15 (pool_type 'last'; always id 0 there after "
               "strip_sep_token), then @ text_projection (width, embed_dim); vision: conv1 patches + class token + "
               "positional_embedding, no ln_pre, transformer, mean over the patch tokens (class token excluded), "
               "then ln_post on the pooled vector (final_ln_after_pool), then @ proj (width, embed_dim)",
}


def randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        for _, m in model.named_modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))


def clipa_image_pooled(model, pixels):
    v = model.visual
    x = v.transformer(v._embeds(pixels))
    pooled = v.ln_post(x[:, 1:].mean(dim=1))  # avg over patches, then LN (final_ln_after_pool)
    ref, _ = v._pool(x)
    assert torch.equal(pooled, ref)
    return pooled


def clipa_text_pooled(model, ids):
    x = model.token_embedding(ids) + model.positional_embedding
    assert model.attn_mask is None
    x = model.ln_final(model.transformer(x, attn_mask=None))
    pooled = x[:, -1]
    assert torch.equal(pooled, text_global_pool(x, ids, model.text_pool_type))
    return pooled


def make_clipa(vers):
    d = os.path.join(OUT, "clipa")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    model_cfg = json.loads(json.dumps(CLIPA["model_cfg"]))
    # the architecture from the config through open_clip's local-dir path (the builder never reads
    # hf_tokenizer_name, so "bert-base-uncased" is harmless here)
    with open(os.path.join(d, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": model_cfg, "preprocess_cfg": CLIPA["preprocess_cfg"]}, f, indent=2)
    torch.manual_seed(CLIPA["seed"])
    model = open_clip.create_model("local-dir:" + os.path.abspath(d)).eval()
    assert type(model) is open_clip.CLIP and isinstance(model.visual.ln_pre, torch.nn.Identity)
    randomise(model, CLIPA["seed"] + 1)
    with torch.no_grad():
        model.logit_scale.fill_(CLIPA["logit_scale"])
    os.remove(os.path.join(d, "open_clip_config.json"))
    tok, vocab = bert_tokenizer()
    save_for_hf(model, tok, model_cfg, d, safe_serialization=True)
    # transformers 5 writes only tokenizer.json and tokenizer_config.json; add the two files a
    # transformers 4 save (and bert-base-uncased's vocab.txt) would have
    if not os.path.exists(os.path.join(d, "vocab.txt")):
        with open(os.path.join(d, "vocab.txt"), "w", encoding="utf-8") as f:
            f.write("".join(t + "\n" for t in vocab))
    if not os.path.exists(os.path.join(d, "special_tokens_map.json")):
        with open(os.path.join(d, "special_tokens_map.json"), "w") as f:
            json.dump({"cls_token": "[CLS]", "mask_token": "[MASK]", "pad_token": "[PAD]", "sep_token": "[SEP]",
                       "unk_token": "[UNK]"}, f, indent=2)
            f.write("\n")
    written = json.loads((Path(d) / "open_clip_config.json").read_text())
    assert written["model_cfg"]["text_cfg"]["hf_tokenizer_name"] == "bert-base-uncased"

    loaded, preprocess, tokenizer = load(d)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.strip_sep_token and len(tokenizer.tokenizer) == 300
    assert tokenizer.tokenizer.convert_ids_to_tokens(list(range(5))) == SPECIALS
    captions = [CAPTIONS[i] for i in CLIPA_CAPTIONS]
    ids = tokenizer(captions).to(torch.int64)
    assert ids.shape == (6, 16) and (ids[:, -1] == 0).all() and not (ids == 3).any()
    assert (ids[:, 0] == 2).all() and ids[-1].ne(0).sum() == 15  # the long caption fills 15 slots
    # the same ids without strip_sep_token, as transformers gives them for the cleaned text: [SEP]
    # where 0 is now
    raw = tokenizer.tokenizer([tokenizer.clean_fn(c) for c in captions], max_length=16, padding="max_length", truncation=True,
                              return_tensors="pt").input_ids
    assert torch.equal(torch.where(raw == 3, torch.zeros_like(raw), raw), ids)

    pixels = open_images(preprocess)
    with torch.no_grad():
        image_features = loaded.encode_image(pixels)
        text_features = loaded.encode_text(ids)
        logits_per_image, _ = loaded.get_logits(pixels, ids)
        img_pooled = clipa_image_pooled(loaded, pixels)
        txt_pooled = clipa_text_pooled(loaded, ids)
        assert torch.allclose(img_pooled @ loaded.visual.proj, image_features, atol=1e-6)
        assert torch.allclose(txt_pooled @ loaded.text_projection, text_features, atol=1e-6)
        assert torch.equal(model.encode_image(pixels), image_features)
        assert torch.equal(model.encode_text(ids), text_features)
        jpeg_features = loaded.encode_image(open_images(preprocess))
    tensors = {
        "pixel_values": pixels,
        "image_features": image_features,
        "image_pooled": img_pooled,
        "jpeg_image_features": jpeg_features,
        "input_ids": ids,
        "text_features": text_features,
        "text_pooled": txt_pooled,
        "logits_per_image": logits_per_image,
        "logit_scale": loaded.logit_scale.detach().reshape(1),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(OUT, "clipa-io.safetensors"))

    sd = loaded.state_dict()
    t = tokenizer.tokenizer
    record = {
        "dir": "clipa",
        "io": "clipa-io.safetensors",
        "weights_file": "open_clip_model.safetensors",
        "model_class": type(loaded).__name__,
        "open_clip_config": written,
        "final_preprocess_cfg": {k: list(v) if isinstance(v, tuple) else v
                                 for k, v in loaded.visual.preprocess_cfg.items()},
        "val_transform": repr(preprocess),
        "caption_indices": CLIPA_CAPTIONS,
        "captions": captions,
        "input_ids": ids.tolist(),
        "tokenizer": {"class": "open_clip.tokenizer.HFTokenizer", "hf_class": type(t).__name__,
                      "source": "the folder itself (local-dir), not hf_tokenizer_name",
                      "context_length": tokenizer.context_length, "clean": "whitespace",
                      "call": "tokenizer(texts, max_length=context_length, padding='max_length', truncation=True)",
                      "strip_sep_token": "ids == sep_token_id replaced by 0",
                      "cls_token_id": t.cls_token_id, "sep_token_id": t.sep_token_id,
                      "pad_token_id": t.pad_token_id, "unk_token_id": t.unk_token_id, "vocab_size": len(t)},
        "pooling": CLIPA["pooling"],
        "activation": "gelu (erf)",
        "layer_norm_eps": 1e-5,
        "logit_scale": tensors["logit_scale"].item(),
        "logit_bias": None,
        "state_dict": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in sd.items()},
        "files": sorted(os.listdir(d)),
    }
    dump_json({"versions": vers, "images": IMAGES,
               "image_open": "PIL.Image.open(tests/fixtures/<path>) passed to the val transform as it is",
               "models": {"clipa": record}},
              os.path.join(OUT, "zoo-expected.json"), ensure_ascii=True)
    print(f"clipa: {type(loaded).__name__}, {len(sd)} tensors, ids {ids.tolist()}, files {record['files']}")


def main():
    vers = versions()
    make_captions(vers)
    make_clipa(vers)
    paths = [os.path.join(OUT, n) for n in ("captions.json", "captions-io.safetensors", "clipa-io.safetensors",
                                            "zoo-expected.json")]
    paths += sorted(os.path.join(OUT, "clipa", n) for n in os.listdir(os.path.join(OUT, "clipa")))
    for p in paths:
        os.chmod(p, 0o644)  # safetensors writes 0600
        assert os.path.getsize(p) < 2_000_000, p
        print(f"  {os.path.relpath(p, OUT)}: {os.path.getsize(p)} bytes")


if __name__ == "__main__":
    main()
