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
- timm-siglip/: a SigLIP model as open_clip's ViT-B-16-SigLIP2 config has it (CustomTextCLIP,
  custom_text true, init_logit_bias -10, vision tower a timm trunk with timm_pool "map" and
  timm_proj "none") at toy size. The trunk is timm's VisionTransformer registered here with
  timm.models.register_model as "vit_pico_patch8_siglip_32" (timm names fix the sizes; open_clip
  builds it by timm.create_model(name, num_classes=0, global_pool="map", pretrained=False), and any
  code that loads this folder with open_clip must import this script's module first): img_size 32,
  patch 8 (16 tokens), embed_dim 128, depth 2, 2 heads of 64, mlp_ratio 2 (hidden 256; the only
  departure from the vit_*_siglip_* recipe, whose mlp_ratio 4 would put the weights file at
  2.5 MB), no class token, attention-pool head (AttentionPoolLatent, mlp_ratio 2 as well), timm's
  defaults otherwise: LayerNorm eps 1e-6, nn.GELU (erf, not tanh), qkv bias, no qk norm, no layer
  scale. Keys visual.trunk.{patch_embed.proj, pos_embed (1, 16, 128), blocks.N.{norm1, attn.qkv,
  attn.proj, norm2, mlp.fc1, mlp.fc2}, norm, attn_pool.{latent (1, 1, 128), q, kv, proj, norm,
  mlp.fc1, mlp.fc2}}; fc_norm, head and visual.head are Identity / empty (no weights). Forward:
  patches + pos_embed, blocks (x + attn(norm1(x)), x + mlp(norm2(x))), norm on every token, then
  MAP: q = attn_pool.q(latent), (k, v) = attn_pool.kv(tokens), softmax(q k^T / sqrt(64)) v per
  head, y = attn_pool.proj(.), y = y + attn_pool.mlp(attn_pool.norm(y)), the single latent row is
  the image feature (128 = embed_dim). Text: open_clip TextTransformer under text.*: vocab 400,
  context 16, width 32, 2 heads, 2 layers, no causal mask, GELU tanh, LayerNorm eps 1e-6,
  pool_type "last", text_projection nn.Linear(32, 128) with bias. text_cfg.hf_tokenizer_name is
  "timm/ViT-B-16-SigLIP2" with tokenizer_kwargs {"clean": "canonicalize"}; as for clipa the name is
  never resolved (checked offline: the folder's 400-piece tokenizer is the one loaded). The
  tokenizer: a SentencePiece-style Unigram model of 400 pieces built by hand (<pad> 0, </s> 1, <unk>
  2, "\u2581" 3, characters, suffixes, "\u2581word" pieces, letter pairs; tokenizers' own
  UnigramTrainer gives a different vocabulary on every run), NFKC + Replace(" {2,}", " "),
  Metaspace (prepend "always"), TemplateProcessing "$A </s>", wrapped as transformers'
  PreTrainedTokenizerFast (pad "</s>", eos "</s>", unk "<unk>", model_max_length 16; transformers 5
  saves it as tokenizer_class "TokenizersBackend", tokenizer.json + tokenizer_config.json). So
  ids are pieces + </s>, cut to 15 pieces + </s>, padded with </s> (1): position 15 is always 1.
  Weights: open_clip / timm init after torch.manual_seed(110), then randomise (seed 111: N(0,
  0.05^2) noise on every parameter, the latent included; LayerNorm 1 + N(0, 0.2^2) / N(0, 0.2^2)),
  logit_scale ln 10, logit_bias -10. preprocess_cfg: SigLIP's (pretrained._slpcfg): mean / std 0.5,
  bicubic, resize_mode "squash". Written by save_for_hf(..., safe_serialization=True).
- timm-siglip-io.safetensors (model reloaded with create_model_and_transforms("local-dir:
  timm-siglip"), checked against the saved model and against the forward written out with plain
  torch ops): pixel_values, image_features (encode_image, not normalised), image_tokens (the trunk's
  tokens after its final norm, before the attention pool, (4, 16, 128)), jpeg_image_features,
  input_ids (get_tokenizer("local-dir:timm-siglip") on six captions: plain, snake_case with
  punctuation, upper case, entities (the &hellip; becomes "..." under NFKC, one fused <unk>), CJK,
  one longer than 16 pieces), text_features (not normalised), text_pooled (position 15 after
  ln_final, before text_projection), logits_per_image (exp(logit_scale) cos + logit_bias),
  logit_scale and logit_bias (the raw parameters, shape [1]).
- xlmr/: open_clip's xlm-roberta-base-ViT-B-32 layout (an HF text tower, CustomTextCLIP) at toy
  size. Vision: the standard native ViT (32 px, patch 8, width 32, 2 layers, head_width 8, ln_pre,
  ln_post on every token, class token pooled, @ proj; erf GELU). Text: text_cfg {hf_model_name and
  hf_tokenizer_name "xlm-roberta-base" (as the real config), hf_proj_type "mlp", hf_pooler_type
  "mean_pooler", context_length 16}; HFTextEncoder wraps transformers' XLMRobertaModel (no pooler:
  add_pooling_layer is True only for cls_pooler) under text.transformer.*, and text.proj.{0, 2} is
  Linear(32, 24, no bias), GELU, Linear(24, 16, no bias). The folder also holds the tiny
  XLMRobertaConfig as config.json (hidden 32, 2 layers, 2 heads, intermediate 64,
  max_position_embeddings 18 = 16 + padding_idx 1 + 1, type_vocab_size 1, pad 1, bos 0, eos 2,
  layer_norm_eps 1e-5, vocab 402): built with hf_model_name set to the folder's path, so that
  AutoConfig.from_pretrained reads it (pretrained_text=False: AutoModel.from_config, nothing read).
  open_clip resolves hf_model_name with AutoConfig.from_pretrained(name) even when the folder has
  the weights, so create_model_and_transforms("local-dir:xlmr") fails offline ("xlm-roberta-base"
  is not on this machine; recorded in zoo-expected.json); it is reloaded here with a top-level
  text_cfg override naming the folder (hf_model_pretrained false), open_clip then loading
  open_clip_model.safetensors strictly, and checked against CustomTextCLIP + load_state_dict. The
  tokenizer: a SentencePiece Unigram model of 400 pieces trained in memory (one thread, so the
  same every run) on XLMR_CORPUS (English, German, French, Chinese, Japanese, Korean, Arabic,
  Russian, Hindi captions, plus each with a capital first letter), nmt_nfkc, converted by
  XLMRobertaTokenizer.from_pretrained from a folder holding only sentencepiece.bpe.model (fairseq
  order: <s> 0, <pad> 1, </s> 2, <unk> 3, piece i >= 3 at id i + 1, <mask> 401; Unigram unk_id 3;
  normalizer Precompiled; pre-tokenizer WhitespaceSplit + Metaspace "always"; "<s> $A </s>"),
  saved as tokenizer.json + tokenizer_config.json (transformers 5 writes no sentencepiece model).
  Weights: open_clip / transformers init after torch.manual_seed(130), randomise(seed 131),
  logit_scale ln 20; preprocess_cfg the tag's (pretrained._pcfg: OpenAI mean / std, bicubic,
  resize_mode "shortest"). Written by save_for_hf(..., safe_serialization=True).
- xlmr-io.safetensors: pixel_values, image_features, image_pooled (class token after ln_post),
  jpeg_image_features, input_ids (get_tokenizer("local-dir:xlmr"): HFTokenizer, clean
  "whitespace", <s> pieces </s> cut to 16, padded with <pad> 1, on ten captions: English,
  German umlauts (exactly 14 pieces: no padding), the fi ligature and French accents, Chinese +
  Japanese, Arabic, Russian, Hindi, emoji (<unk> 3), one longer than 14 pieces, and one with the
  literal text "<pad>" and "<mask>", which the tokenizer matches as special tokens: a 1 mid-row),
  position_ids (RoBERTa's: cumsum(ids != 1) * (ids != 1) + 1), text_hidden (XLMRobertaModel's
  last_hidden_state with attention_mask ids != 1), text_pooled (mean over the unmasked positions),
  text_features (not normalised; checked against the forward written out with plain torch ops),
  logits_per_image and logit_scale.
- zoo-expected.json: {"versions", "images", "models": {"clipa": {captions, input_ids, tokenizer,
  open_clip_config written, final preprocess cfg, val transform repr, weights file, state dict
  keys with shapes, pooling, logit_scale, files}, "timm-siglip": {the same, plus timm_model},
  "xlmr": {the same without caption_indices, plus hf_config (config.json) and load}}}.

Written with: torch 2.15.0, open_clip_torch 3.3.0, torchvision 0.29.2, transformers 5.24.0,
tokenizers 0.23.3, sentencepiece 0.2.3, ftfy 6.3.1, Pillow 13.0.0, safetensors 0.8.0, numpy 2.4.6 (run by hand, not by
CI; nothing downloaded: HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE are set before anything imports).
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import collections
import json
import math
import shutil
import string
import unicodedata
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file
from timm.models import register_model
from timm.models.vision_transformer import VisionTransformer, _create_vision_transformer

import open_clip
from open_clip.constants import (IMAGENET_MEAN, IMAGENET_STD, INCEPTION_MEAN, INCEPTION_STD, OPENAI_DATASET_MEAN,
                                  OPENAI_DATASET_STD)
from open_clip.push_to_hf_hub import save_for_hf
from open_clip.tokenizer import HFTokenizer, SimpleTokenizer, get_clean_fn
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


# The tiny SentencePiece-style (T5 / SigLIP v1 style) tokenizer of timm-siglip: a Unigram model of
# 400 pieces, built by hand (the tokenizers UnigramTrainer is not deterministic from run to run).
UNIGRAM_SIZE = 400
UNIGRAM_SPECIALS = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2 as in T5; padding uses </s> (1), as SigLIP's does
UNIGRAM_SUFFIXES = ["es", "ed", "ing", "er", "ers", "ly", "en", "ion", "tion", "ation", "ren", "ness", "able"]


def unigram_vocab():
    """[(piece, score)]: the specials, a lone "\u2581", every alphanumeric character of the cleaned captions
    (plus a-z, 0-9), some suffixes, "\u2581word" for the words of up to 5 letters, then the commonest
    letter pairs until there are 400 pieces. Scores: characters -12, "\u2581" -10, pairs -9, suffixes -8,
    words -6 + log(count) / 4, so the Viterbi segmentation takes the fewest, longest pieces."""
    clean = get_clean_fn("canonicalize")
    texts = [unicodedata.normalize("NFKC", clean(c)) for c in CAPTIONS] + [" ".join(WORDS)]
    vocab = [(t, 0.0) for t in UNIGRAM_SPECIALS] + [("\u2581", -10.0)]

    def add(piece, score):
        if piece not in have and len(vocab) < UNIGRAM_SIZE:
            vocab.append((piece, score))
            have.add(piece)

    have = {p for p, _ in vocab}
    for c in sorted({ch for t in texts for ch in t if ch.isalnum()} | set(string.ascii_lowercase + string.digits)):
        add(c, -12.0)
    for piece in UNIGRAM_SUFFIXES:
        add(piece, -8.0)
    words = collections.Counter(w for t in texts for w in t.split())
    for w, n in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
        if w.isascii() and w.isalpha() and len(w) <= 5:
            add("\u2581" + w, round(-6.0 + 0.25 * math.log(n), 4))
    pairs = collections.Counter(w[i:i + 2] for t in texts for w in t.split() if w.isascii() and w.isalpha()
                                for i in range(len(w) - 1))
    for pair, _ in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0])):
        add(pair, -9.0)
    assert len(vocab) == UNIGRAM_SIZE and len(have) == UNIGRAM_SIZE, len(vocab)
    return vocab


def unigram_tokenizer(model_max_length):
    """transformers PreTrainedTokenizerFast (TokenizersBackend in transformers 5) over a tokenizers
    Tokenizer laid out as T5's tokenizer.json: normalizer NFKC + Replace(" {2,}", " ") (T5 has the
    sentencepiece "Precompiled" nmt_nfkc map first), Metaspace("\u2581", prepend_scheme "always",
    split), Unigram (unk_id 2, no byte fallback; runs of unknown characters fuse into one <unk>),
    TemplateProcessing "$A </s>", Metaspace decoder; pad "</s>", eos "</s>", unk "<unk>"."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = unigram_vocab()
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    tok.add_special_tokens(UNIGRAM_SPECIALS)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="</s>", eos_token="</s>", unk_token="<unk>",
                                 model_max_length=model_max_length)
    assert (hf.pad_token_id, hf.eos_token_id, hf.unk_token_id, len(hf)) == (1, 1, 2, UNIGRAM_SIZE)
    return hf


# A timm ViT at toy size, in the form of timm's vit_*_siglip_* models (no class token, attention-pool
# "map" head). timm model names fix the sizes, so it is registered under a name of its own; anything
# that loads the timm-siglip folder with open_clip must import this module first (or register it).
PICO_NAME = "vit_pico_patch8_siglip_32"
PICO_ARGS = dict(img_size=32, patch_size=8, embed_dim=128, depth=2, num_heads=2, mlp_ratio=2.0,
                 class_token=False, global_pool="map")


def vit_pico_patch8_siglip_32(pretrained=False, **kwargs):
    """timm entrypoint: VisionTransformer(**PICO_ARGS) with timm's defaults otherwise (LayerNorm eps
    1e-6, nn.GELU (erf), qkv bias, no qk norm, no layer scale). open_clip's TimmModel calls it through
    timm.create_model(name, num_classes=0, global_pool="map", pretrained=False)."""
    if kwargs.get("pretrained_cfg") is None:
        kwargs["pretrained_cfg"] = dict(input_size=(3, 32, 32), mean=tuple(INCEPTION_MEAN), std=tuple(INCEPTION_STD),
                                        interpolation="bicubic", num_classes=0)
    return _create_vision_transformer(PICO_NAME, pretrained=pretrained, **dict(PICO_ARGS, **kwargs))


if not timm.is_model(PICO_NAME):
    register_model(vit_pico_patch8_siglip_32)


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
    print(f"clipa: {type(loaded).__name__}, {len(sd)} tensors, ids {ids.tolist()}, files {record['files']}")
    return record


# ----------------------------------------------------------------------------------------------
# 3. timm-siglip

TIMM_SIGLIP = {
    "seed": 110,
    "logit_scale": math.log(10.0),
    "logit_bias": -10.0,
    "model_cfg": {
        "embed_dim": 128,
        "init_logit_bias": -10,
        "custom_text": True,
        "vision_cfg": {"image_size": 32, "timm_model_name": PICO_NAME, "timm_model_pretrained": False,
                       "timm_pool": "map", "timm_proj": "none"},
        "text_cfg": {"context_length": 16, "vocab_size": UNIGRAM_SIZE, "hf_tokenizer_name": "timm/ViT-B-16-SigLIP2",
                     "tokenizer_kwargs": {"clean": "canonicalize"}, "width": 32, "heads": 2, "layers": 2,
                     "no_causal_mask": True, "proj_bias": True, "pool_type": "last", "norm_kwargs": {"eps": 1e-6},
                     "act_kwargs": {"approximate": "tanh"}},
    },
    "preprocess_cfg": {"mean": list(INCEPTION_MEAN), "std": list(INCEPTION_STD),
                       "interpolation": "bicubic", "resize_mode": "squash"},
    "pooling": "vision (visual.trunk, timm VisionTransformer): patch_embed.proj (conv 8x8 stride 8) flattened to "
               "16 tokens in row-major order, + pos_embed (1, 16, 128) (no class token), blocks "
               "(x + attn(norm1(x)), x + mlp(norm2(x)); fused qkv; nn.GELU erf), norm over every token, then "
               "attn_pool (MAP): q = attn_pool.q(latent) (1 query), k, v = split(attn_pool.kv(tokens)), "
               "2 heads of 64, softmax(q k^T / 8) v, then attn_pool.proj, then y + attn_pool.mlp(attn_pool.norm(y)) "
               "(no residual around the attention, the norm is only on the MLP branch), the one latent row "
               "taken; fc_norm and head are Identity (no weights); timm_proj 'none': visual.head is empty; "
               "text: token_embedding + positional_embedding, bidirectional transformer (no mask, padding attended; "
               "GELU tanh), ln_final over every position, then position 15 (pool_type 'last': always </s> (1), "
               "the appended eos or padding), then text.text_projection (nn.Linear with bias)",
}
TIMM_SIGLIP_CAPTIONS = [0, 22, 23, 4, 10, 25]  # plain, snake_case + punctuation, upper case, entities, CJK, long


def timm_siglip_image_by_hand(trunk, pixels):
    """The trunk's forward written out with plain torch ops: (tokens after trunk.norm, pooled)."""
    B = pixels.shape[0]
    C, H = trunk.embed_dim, trunk.blocks[0].attn.num_heads
    D = C // H
    pe = trunk.patch_embed.proj
    x = F.conv2d(pixels, pe.weight, pe.bias, stride=8).flatten(2).transpose(1, 2)  # (B, 16, C), row-major
    x = x + trunk.pos_embed

    def ln(m, t):
        assert m.eps == 1e-6
        return F.layer_norm(t, (C,), m.weight, m.bias, 1e-6)

    def attend(q, k, v):  # (B, H, Lq, D), (B, H, N, D) -> (B, Lq, C)
        a = ((q * D ** -0.5) @ k.transpose(-2, -1)).softmax(-1)
        return (a @ v).transpose(1, 2).reshape(q.shape[0], q.shape[2], C)

    def mlp(m, t):
        return m.fc2(F.gelu(m.fc1(t)))  # erf GELU

    for blk in trunk.blocks:
        h = ln(blk.norm1, x)
        q, k, v = blk.attn.qkv(h).reshape(B, -1, 3, H, D).permute(2, 0, 3, 1, 4)
        x = x + blk.attn.proj(attend(q, k, v))
        x = x + mlp(blk.mlp, ln(blk.norm2, x))
    tokens = ln(trunk.norm, x)
    ap = trunk.attn_pool
    q = ap.q(ap.latent.expand(B, -1, -1)).reshape(B, 1, H, D).transpose(1, 2)
    k, v = ap.kv(tokens).reshape(B, -1, 2, H, D).permute(2, 0, 3, 1, 4)
    y = ap.proj(attend(q, k, v))
    y = y + mlp(ap.mlp, ln(ap.norm, y))
    return tokens, y[:, 0]


def timm_siglip_text_by_hand(text, ids):
    assert text.attn_mask is None
    x = text.token_embedding(ids) + text.positional_embedding
    x = text.ln_final(text.transformer(x, attn_mask=None))
    pooled = x[:, -1]
    assert torch.equal(pooled, text_global_pool(x, ids, text.pool_type))
    return pooled


def make_timm_siglip(vers):
    d = os.path.join(OUT, "timm-siglip")
    cfg = TIMM_SIGLIP
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    model_cfg = json.loads(json.dumps(cfg["model_cfg"]))
    with open(os.path.join(d, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": model_cfg, "preprocess_cfg": cfg["preprocess_cfg"]}, f, indent=2)
    torch.manual_seed(cfg["seed"])
    model = open_clip.create_model("local-dir:" + os.path.abspath(d)).eval()
    trunk = model.visual.trunk
    assert type(model) is open_clip.CustomTextCLIP and type(trunk) is VisionTransformer
    assert isinstance(trunk.fc_norm, torch.nn.Identity) and isinstance(trunk.head, torch.nn.Identity)
    assert trunk.cls_token is None and trunk.num_prefix_tokens == 0 and len(model.visual.head) == 0
    n_ln = sum(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    assert n_ln == 11, n_ln  # trunk: 2 x (norm1, norm2), norm, attn_pool.norm; text: 2 x (ln_1, ln_2), ln_final
    randomise(model, cfg["seed"] + 1)
    with torch.no_grad():
        model.logit_scale.fill_(cfg["logit_scale"])
        model.logit_bias.fill_(cfg["logit_bias"])
    os.remove(os.path.join(d, "open_clip_config.json"))
    save_for_hf(model, unigram_tokenizer(model_cfg["text_cfg"]["context_length"]), model_cfg, d,
                safe_serialization=True)
    written = json.loads((Path(d) / "open_clip_config.json").read_text())
    assert written["model_cfg"] == model_cfg

    loaded, preprocess, tokenizer = load(d)
    assert isinstance(tokenizer, HFTokenizer) and not tokenizer.strip_sep_token and len(tokenizer.tokenizer) == UNIGRAM_SIZE
    t = tokenizer.tokenizer
    assert t.convert_ids_to_tokens([0, 1, 2, 3]) == UNIGRAM_SPECIALS + ["\u2581"]
    captions = [CAPTIONS[i] for i in TIMM_SIGLIP_CAPTIONS]
    ids = tokenizer(captions).to(torch.int64)
    assert ids.shape == (6, 16) and (ids[:, -1] == 1).all() and (ids[-1, :15] != 1).all()  # long: 15 pieces + </s>
    assert (ids == 2).any()  # an <unk>
    pieces = [t.backend_tokenizer.encode(tokenizer.clean_fn(c), add_special_tokens=False).ids for c in captions]
    for row, p in zip(ids.tolist(), pieces):
        want = (p[:15] if len(p) > 15 else p) + [1]
        assert row == want + [1] * (16 - len(want)), (row, p)

    pixels = open_images(preprocess)
    with torch.no_grad():
        image_features = loaded.encode_image(pixels)
        text_features = loaded.encode_text(ids)
        logits_per_image, _ = loaded.get_logits(pixels, ids)
        tokens, pooled = timm_siglip_image_by_hand(loaded.visual.trunk, pixels)
        assert torch.allclose(tokens, loaded.visual.trunk.forward_features(pixels), atol=1e-5)
        assert torch.allclose(pooled, image_features, atol=1e-5)
        txt_pooled = timm_siglip_text_by_hand(loaded.text, ids)
        assert torch.allclose(loaded.text.text_projection(txt_pooled), text_features, atol=1e-6)
        assert torch.equal(model.encode_image(pixels), image_features)
        assert torch.equal(model.encode_text(ids), text_features)
        want_logits = (10.0 * F.normalize(image_features, dim=-1) @ F.normalize(text_features, dim=-1).T - 10.0)
        assert torch.allclose(logits_per_image, want_logits, atol=1e-4)
        jpeg_features = loaded.encode_image(open_images(preprocess))
    tensors = {
        "pixel_values": pixels,
        "image_features": image_features,
        "image_tokens": tokens,
        "jpeg_image_features": jpeg_features,
        "input_ids": ids,
        "text_features": text_features,
        "text_pooled": txt_pooled,
        "logits_per_image": logits_per_image,
        "logit_scale": loaded.logit_scale.detach().reshape(1),
        "logit_bias": loaded.logit_bias.detach().reshape(1),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(OUT, "timm-siglip-io.safetensors"))

    sd = loaded.state_dict()
    record = {
        "dir": "timm-siglip",
        "io": "timm-siglip-io.safetensors",
        "weights_file": "open_clip_model.safetensors",
        "model_class": type(loaded).__name__,
        "open_clip_config": written,
        "final_preprocess_cfg": {k: list(v) if isinstance(v, tuple) else v
                                 for k, v in loaded.visual.preprocess_cfg.items()},
        "val_transform": repr(preprocess),
        "caption_indices": TIMM_SIGLIP_CAPTIONS,
        "captions": captions,
        "input_ids": ids.tolist(),
        "tokenizer": {"class": "open_clip.tokenizer.HFTokenizer", "hf_class": type(t).__name__,
                      "source": "the folder itself (local-dir), not hf_tokenizer_name",
                      "context_length": tokenizer.context_length, "clean": "canonicalize",
                      "call": "tokenizer(texts, max_length=context_length, padding='max_length', truncation=True)",
                      "model": "Unigram (unk_id 2, no byte fallback), NFKC + Replace(' {2,}', ' '), "
                               "Metaspace(prepend_scheme 'always'), TemplateProcessing '$A </s>'",
                      "strip_sep_token": False,
                      "eos_token_id": t.eos_token_id, "pad_token_id": t.pad_token_id,
                      "unk_token_id": t.unk_token_id, "vocab_size": len(t)},
        "timm_model": {"name": PICO_NAME, "args": dict(PICO_ARGS),
                       "open_clip_kwargs": {"num_classes": 0, "global_pool": "map", "pretrained": False},
                       "registered_by": "scripts/make_zoo_fixtures.py (timm.models.register_model)"},
        "pooling": cfg["pooling"],
        "activation": "vision: gelu (erf) in the blocks and attn_pool.mlp; text: gelu (tanh)",
        "layer_norm_eps": 1e-6,
        "logit_scale": tensors["logit_scale"].item(),
        "logit_bias": tensors["logit_bias"].item(),
        "state_dict": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in sd.items()},
        "files": sorted(os.listdir(d)),
    }
    print(f"timm-siglip: {type(loaded).__name__}, {len(sd)} tensors, ids {ids.tolist()}, files {record['files']}")
    return record


# ----------------------------------------------------------------------------------------------
# 4. xlmr: open_clip's xlm-roberta-base-ViT-B-32 layout (an HF text tower) at toy size

# The multilingual text the tiny SentencePiece model is trained on (deterministic: trained in
# memory from this list, one thread).
XLMR_CORPUS = """a photo of a cat sitting on a red sofa
a dog running on the beach at sunset
two children playing with a blue ball in the park
an old man riding a brown horse near the river
a bowl of fresh fruit on a wooden table
the city skyline at night with bright lights
a woman reading a book in a quiet cafe
snow covered mountains under a clear blue sky
a small boat on a calm lake in the morning
a plate of pasta with tomato sauce and cheese
people walking down a busy street in the rain
a black and white photo of an old train station
ein Foto einer Katze auf einem roten Sofa
ein Hund läuft am Strand bei Sonnenuntergang
zwei Kinder spielen mit einem blauen Ball im Park
ein alter Mann reitet auf einem braunen Pferd am Fluss
eine Schüssel mit frischem Obst auf einem Holztisch
die Skyline der Stadt bei Nacht mit hellen Lichtern
schöne grüne Bäume und Blumen im Garten
Straße in München mit Fußgängern und Fahrrädern
Frühstück mit Brötchen, Käse und Kaffee
ein großes Haus über dem See
une photo d'un chat assis sur un canapé rouge
un chien qui court sur la plage au coucher du soleil
deux enfants jouent avec un ballon bleu dans le parc
un vieil homme à cheval près de la rivière
un bol de fruits frais sur une table en bois
la ville la nuit avec des lumières brillantes
une femme lit un livre dans un café à Paris
le cœur de l'œuvre est très élégant
un gâteau au chocolat et une crème brûlée
la fête de Noël en décembre, où est le garçon ?
桌子上的一只猫
海滩上奔跑的狗
公园里玩球的两个孩子
夜晚的城市天际线
一碗新鲜的水果
東京の夜景の写真
海辺を走る犬
公園で遊ぶ子供たち
赤いソファの上の猫
바닷가를 달리는 개
공원에서 노는 아이들
빨간 소파 위의 고양이
صورة قطة على أريكة حمراء
كلب يركض على الشاطئ عند غروب الشمس
طفلان يلعبان بكرة زرقاء في الحديقة
رجل عجوز يركب حصانا بنيا بالقرب من النهر
وعاء من الفاكهة الطازجة على طاولة خشبية
المدينة في الليل مع أضواء ساطعة
фотография кошки на красном диване
собака бежит по пляжу на закате
двое детей играют с синим мячом в парке
старик едет на коричневой лошади у реки
миска свежих фруктов на деревянном столе
ночной город с яркими огнями
кошка на диване
एक बिल्ली की तस्वीर लाल सोफे पर
समुद्र तट पर दौड़ता हुआ कुत्ता
पार्क में नीली गेंद से खेलते दो बच्चे
नदी के पास भूरे घोड़े पर सवार एक बूढ़ा आदमी
लकड़ी की मेज पर ताजे फलों का कटोरा
रात में शहर की रोशनी""".split("\n")
XLMR_SPM_PIECES = 400  # sentencepiece pieces (<unk> 0, <s> 1, </s> 2, then 397 learned)
XLMR_VOCAB = XLMR_SPM_PIECES + 2  # fairseq order: <s> <pad> </s> <unk>, pieces 3.. shifted by one, <mask> last

XLMR_CAPTIONS = [
    "A photo of a cat",
    "Sch\u00f6ne B\u00e4ume in M\u00fcnchen",  # umlauts
    "Un \ufb01lm tr\u00e8s \u00e9l\u00e9gant",  # the fi ligature U+FB01 (ftfy makes it "fi"), accents
    "\u516c\u56ed\u91cc\u7684\u5b69\u5b50 \u6771\u4eac\u306e\u591c\u666f",  # 公园里的孩子 東京の夜景
    "\u0635\u0648\u0631\u0629 \u0642\u0637\u0629",  # صورة قطة
    "\u041a\u043e\u0448\u043a\u0430 \u043d\u0430 \u0434\u0438\u0432\u0430\u043d\u0435",  # Кошка на диване
    "\u090f\u0915 \u092c\u093f\u0932\u094d\u0932\u0940",  # एक बिल्ली (virama)
    "party \U0001F389 family \U0001F468\u200d\U0001F469\u200d\U0001F467",  # emoji: <unk>
    "Zwei Kinder spielen mit einem blauen Ball im gr\u00fcnen Park, w\u00e4hrend ein alter Mann auf einem "
    "braunen Pferd am Fluss reitet.",  # longer than 14 pieces: truncated
    "a <pad> cat on a <mask>",  # literal special tokens: matched as added tokens (a <pad> mid-sequence)
]

XLMR = {
    "seed": 130,
    "logit_scale": math.log(20.0),
    "model_cfg": {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 8},
        "text_cfg": {"hf_model_name": "xlm-roberta-base", "hf_tokenizer_name": "xlm-roberta-base",
                     "hf_proj_type": "mlp", "hf_pooler_type": "mean_pooler", "context_length": 16},
    },
    # the xlm-roberta-base-ViT-B-32 tag's preprocessing (pretrained._pcfg: OpenAI mean / std)
    "preprocess_cfg": {"mean": list(OPENAI_DATASET_MEAN), "std": list(OPENAI_DATASET_STD),
                       "interpolation": "bicubic", "resize_mode": "shortest"},
    "hf_config": dict(vocab_size=XLMR_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=18, type_vocab_size=1, pad_token_id=1,
                      bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5, hidden_act="gelu",
                      architectures=["XLMRobertaForMaskedLM"]),
    "pooling": "text (HFTextEncoder): attention_mask = (ids != config.pad_token_id (1)); XLMRobertaModel "
               "(no pooler: add_pooling_layer is False unless hf_pooler_type is cls_pooler): embeddings = "
               "LayerNorm(word_embeddings[ids] + token_type_embeddings[0] + position_embeddings[pos]) with "
               "pos = cumsum(ids != 1) * (ids != 1) + 1 (RoBERTa / fairseq positions: 2, 3, ... for the tokens, "
               "1 for every <pad>, also a <pad> in the middle, after which the count carries on), then post-LN "
               "encoder layers (x = LN(x + attn(x)), x = LN(x + output(gelu(intermediate(x)))); padded keys "
               "masked out of every softmax), then mean_pooler: sum over positions of last_hidden_state * mask / "
               "mask.sum() (<s> and </s> included, <pad> excluded), then proj = Linear(32, 24, no bias), "
               "GELU (erf), Linear(24, 16, no bias) (hf_proj_type 'mlp': hidden (width + embed_dim) // 2); "
               "vision: standard open_clip ViT (conv1 patches, class token + positional_embedding, ln_pre, "
               "transformer, ln_post on every token, class token (pool_type 'tok'), @ proj)",
}


def xlmr_sentencepiece():
    """A SentencePiece Unigram model (the kind xlm-roberta-base's sentencepiece.bpe.model is) trained
    on XLMR_CORPUS and its lines with a capital first letter: 400 pieces, character_coverage 1.0, sentencepiece's defaults otherwise (nmt_nfkc
    normalisation with its precompiled map, <unk> 0, <s> 1, </s> 2, no <pad>, no byte fallback).
    Returns the serialized model proto."""
    import io
    import sentencepiece as spm
    buf = io.BytesIO()
    sentences = XLMR_CORPUS + [t[0].upper() + t[1:] for t in XLMR_CORPUS if t[0].islower()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=buf, model_type="unigram",
                                   vocab_size=XLMR_SPM_PIECES, character_coverage=1.0, num_threads=1,
                                   minloglevel=2)
    return buf.getvalue()


def xlmr_tokenizer(proto):
    """transformers' XLMRobertaTokenizer converted from the SentencePiece model as from_pretrained does it
    for a folder holding only sentencepiece.bpe.model (XLMRobertaConverter's order: <s> 0, <pad> 1,
    </s> 2, <unk> 3, the pieces after the first three with their scores, <mask> last; Unigram unk_id 3;
    normalizer Precompiled(the model's nmt_nfkc map); pre-tokenizer WhitespaceSplit + Metaspace
    (prepend "always"); TemplateProcessing "<s> $A </s>")."""
    import tempfile
    from transformers import XLMRobertaTokenizer
    with tempfile.TemporaryDirectory() as t:
        with open(os.path.join(t, "sentencepiece.bpe.model"), "wb") as f:
            f.write(proto)
        tok = XLMRobertaTokenizer.from_pretrained(t, model_max_length=512)
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.mask_token_id == XLMR_VOCAB - 1 and len(tok) == XLMR_VOCAB
    return tok


def xlmr_text_by_hand(text, ids):
    """HFTextEncoder.forward written out with plain torch ops: (position ids, last hidden state, mean
    pooled, projected)."""
    hf = text.transformer
    cfg = hf.config
    H, C = cfg.num_attention_heads, cfg.hidden_size
    D = C // H
    mask = (ids != cfg.pad_token_id).long()
    pos = torch.cumsum(mask, dim=1) * mask + cfg.pad_token_id
    e = hf.embeddings

    def ln(m, t):
        assert m.eps == 1e-5
        return F.layer_norm(t, (C,), m.weight, m.bias, 1e-5)

    x = ln(e.LayerNorm, e.word_embeddings.weight[ids] + e.token_type_embeddings.weight[0] + e.position_embeddings.weight[pos])
    bias = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(mask == 0, float("-inf"))[:, None, None, :]
    B, L = ids.shape
    for layer in hf.encoder.layer:
        a = layer.attention

        def heads(lin):
            return lin(x).reshape(B, L, H, D).transpose(1, 2)

        w = (heads(a.self.query) @ heads(a.self.key).transpose(-2, -1)) * D ** -0.5 + bias
        y = (w.softmax(-1) @ heads(a.self.value)).transpose(1, 2).reshape(B, L, C)
        x = ln(a.output.LayerNorm, x + a.output.dense(y))
        h = F.gelu(layer.intermediate.dense(x))
        x = ln(layer.output.LayerNorm, x + layer.output.dense(h))
    m = mask.unsqueeze(-1).to(x.dtype)
    pooled = (x * m).sum(1) / m.sum(1)
    p0, act, p2 = text.proj
    assert isinstance(act, torch.nn.GELU) and act.approximate == "none"
    projected = F.linear(F.gelu(F.linear(pooled, p0.weight)), p2.weight)
    return pos, x, pooled, projected


def make_xlmr(vers):
    from transformers import XLMRobertaConfig, XLMRobertaModel
    import sentencepiece
    d = os.path.join(OUT, "xlmr")
    cfg = XLMR
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    ad = os.path.abspath(d)
    proto = xlmr_sentencepiece()
    assert proto == xlmr_sentencepiece()  # deterministic
    tok = xlmr_tokenizer(proto)
    # the tiny architecture as config.json in the folder itself, so that AutoConfig.from_pretrained(folder)
    # finds it (the folder path stands in for "xlm-roberta-base" while building)
    XLMRobertaConfig(**cfg["hf_config"]).save_pretrained(d)
    model_cfg = json.loads(json.dumps(cfg["model_cfg"]))
    build_cfg = json.loads(json.dumps(model_cfg))
    build_cfg["text_cfg"]["hf_model_name"] = ad
    build_cfg["text_cfg"]["hf_tokenizer_name"] = ad
    with open(os.path.join(d, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": build_cfg, "preprocess_cfg": cfg["preprocess_cfg"]}, f, indent=2)
    torch.manual_seed(cfg["seed"])
    # pretrained_text=False: hf_model_pretrained False, so AutoModel.from_config (random init, no weights read)
    model = open_clip.create_model("local-dir:" + ad, pretrained_text=False).eval()
    assert type(model) is open_clip.CustomTextCLIP and type(model.text.transformer) is XLMRobertaModel
    assert model.text.transformer.pooler is None and isinstance(model.visual.ln_pre, torch.nn.LayerNorm)
    n_ln = sum(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    assert n_ln == 11, n_ln  # vision: ln_pre, 2 x (ln_1, ln_2), ln_post; text: embeddings, 2 x (attention, output)
    randomise(model, cfg["seed"] + 1)
    with torch.no_grad():
        model.logit_scale.fill_(cfg["logit_scale"])
    os.remove(os.path.join(d, "open_clip_config.json"))
    save_for_hf(model, tok, model_cfg, d, safe_serialization=True)
    written = json.loads((Path(d) / "open_clip_config.json").read_text())
    assert written["model_cfg"] == model_cfg and written["model_cfg"]["text_cfg"]["hf_model_name"] == "xlm-roberta-base"
    hf_written = json.loads((Path(d) / "config.json").read_text())

    # open_clip's own local-dir load: the HF config is looked up by hf_model_name, offline
    try:
        load(d)
        local_dir_load = "loads"
    except Exception as e:  # noqa: BLE001 (recorded, as what open_clip does offline)
        local_dir_load = f"fails offline: {type(e).__name__}: {str(e).splitlines()[0]}"
    assert local_dir_load.startswith("fails offline"), local_dir_load
    # ... so the folder itself is named as hf_model_name (a top-level text_cfg override); the weights are
    # then open_clip's own strict load_checkpoint of open_clip_model.safetensors
    override = dict(written["model_cfg"]["text_cfg"], hf_model_name=ad, hf_model_pretrained=False)
    loaded, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + ad, text_cfg=override)
    loaded = loaded.eval()
    tokenizer = open_clip.get_tokenizer("local-dir:" + ad)
    # the same by hand: the class built from the config with the folder path, the state dict loaded strictly
    from safetensors.torch import load_file
    by_hand = open_clip.CustomTextCLIP(**dict(written["model_cfg"], text_cfg=override)).eval()
    by_hand.load_state_dict(load_file(os.path.join(d, "open_clip_model.safetensors")), strict=True)

    assert isinstance(tokenizer, HFTokenizer) and not tokenizer.strip_sep_token and tokenizer.context_length == 16
    t = tokenizer.tokenizer
    assert type(t).__name__ == "XLMRobertaTokenizer" and len(t) == XLMR_VOCAB
    assert t.convert_ids_to_tokens([0, 1, 2, 3, XLMR_VOCAB - 1]) == ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    ids = tokenizer(XLMR_CAPTIONS).to(torch.int64)
    n = len(XLMR_CAPTIONS)
    assert ids.shape == (n, 16) and (ids[:, 0] == 0).all()
    assert (ids[8] != 1).all() and ids[8, 15] == 2  # the long one: <s> + 14 pieces + </s>
    assert (ids == 3).any()  # an <unk> (the emoji)
    assert ids[9, 2] == 1 and (ids[9] == XLMR_VOCAB - 1).any()  # literal <pad> -> 1 mid-sequence, <mask> -> 401
    for row, c in zip(ids.tolist(), XLMR_CAPTIONS):
        p = t(tokenizer.clean_fn(c), add_special_tokens=False).input_ids
        want = [0] + p[:14] + [2]
        assert row == want + [1] * (16 - len(want)), (row, p)

    pixels = open_images(preprocess)
    with torch.no_grad():
        image_features = loaded.encode_image(pixels)
        text_features = loaded.encode_text(ids)
        logits_per_image, _ = loaded.get_logits(pixels, ids)
        v = loaded.visual
        x = v.transformer(v._embeds(pixels))  # _embeds: patches, class token, positional_embedding, ln_pre
        img_pooled = v.ln_post(x)[:, 0]  # ln_post on every token, then the class token
        assert torch.equal(img_pooled, v._pool(x)[0])
        assert torch.allclose(img_pooled @ v.proj, image_features, atol=1e-6)
        pos, hidden, txt_pooled, projected = xlmr_text_by_hand(loaded.text, ids)
        out = loaded.text.transformer(input_ids=ids, attention_mask=(ids != 1).long())
        assert torch.allclose(out.last_hidden_state, hidden, atol=1e-5)
        assert torch.allclose(projected, text_features, atol=1e-5)
        assert pos[9, :4].tolist() == [2, 3, 1, 4] and pos.max() == 17
        assert torch.equal(model.encode_image(pixels), image_features)
        assert torch.equal(model.encode_text(ids), text_features)
        assert torch.equal(by_hand.encode_image(pixels), image_features)
        assert torch.equal(by_hand.encode_text(ids), text_features)
        jpeg_features = loaded.encode_image(open_images(preprocess))
    tensors = {
        "pixel_values": pixels,
        "image_features": image_features,
        "image_pooled": img_pooled,
        "jpeg_image_features": jpeg_features,
        "input_ids": ids,
        "position_ids": pos,
        "text_hidden": out.last_hidden_state,
        "text_features": text_features,
        "text_pooled": txt_pooled,
        "logits_per_image": logits_per_image,
        "logit_scale": loaded.logit_scale.detach().reshape(1),
    }
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, os.path.join(OUT, "xlmr-io.safetensors"))

    sd = loaded.state_dict()
    record = {
        "dir": "xlmr",
        "io": "xlmr-io.safetensors",
        "weights_file": "open_clip_model.safetensors",
        "model_class": type(loaded).__name__,
        "open_clip_config": written,
        "hf_config": hf_written,
        "load": {"local_dir": local_dir_load,
                 "used": "open_clip.create_model_and_transforms('local-dir:<dir>', text_cfg=dict(text_cfg, "
                         "hf_model_name='<dir>', hf_model_pretrained=False)): AutoConfig.from_pretrained(<dir>) "
                         "reads config.json, AutoModel.from_config(add_pooling_layer=False), then open_clip's strict "
                         "load_checkpoint of open_clip_model.safetensors; equal to CustomTextCLIP(**model_cfg with "
                         "that text_cfg) + load_state_dict(strict=True)"},
        "final_preprocess_cfg": {k: list(v) if isinstance(v, tuple) else v
                                 for k, v in loaded.visual.preprocess_cfg.items()},
        "val_transform": repr(preprocess),
        "captions": XLMR_CAPTIONS,
        "input_ids": ids.tolist(),
        "tokenizer": {"class": "open_clip.tokenizer.HFTokenizer", "hf_class": type(t).__name__,
                      "source": "the folder itself (local-dir), not hf_tokenizer_name",
                      "context_length": tokenizer.context_length, "clean": "whitespace",
                      "call": "tokenizer(texts, max_length=context_length, padding='max_length', truncation=True)",
                      "model": "Unigram (unk_id 3, no byte fallback) converted from a SentencePiece model of "
                               f"{XLMR_SPM_PIECES} pieces (fairseq order: <s> 0, <pad> 1, </s> 2, <unk> 3, "
                               "sentencepiece piece i >= 3 at id i + 1, <mask> last); normalizer Precompiled "
                               "(nmt_nfkc); pre-tokenizer WhitespaceSplit + Metaspace(prepend_scheme 'always'); "
                               "TemplateProcessing '<s> $A </s>'; special tokens in the text are matched as "
                               "added tokens",
                      "strip_sep_token": False,
                      "bos_token_id": t.bos_token_id, "eos_token_id": t.eos_token_id,
                      "pad_token_id": t.pad_token_id, "unk_token_id": t.unk_token_id,
                      "mask_token_id": t.mask_token_id, "vocab_size": len(t),
                      "sentencepiece": sentencepiece.__version__},
        "pooling": cfg["pooling"],
        "activation": "gelu (erf) everywhere (vision blocks, XLM-R hidden_act 'gelu', the mlp projection)",
        "layer_norm_eps": 1e-5,
        "logit_scale": tensors["logit_scale"].item(),
        "logit_bias": None,
        "state_dict": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in sd.items()},
        "files": sorted(os.listdir(d)),
    }
    print(f"xlmr: {type(loaded).__name__}, {len(sd)} tensors, ids {ids.tolist()}, files {record['files']}")
    return record


def main():
    vers = versions()
    make_captions(vers)
    records = {"clipa": make_clipa(vers), "timm-siglip": make_timm_siglip(vers), "xlmr": make_xlmr(vers)}
    dump_json({"versions": vers, "images": IMAGES,
               "image_open": "PIL.Image.open(tests/fixtures/<path>) passed to the val transform as it is",
               "models": records},
              os.path.join(OUT, "zoo-expected.json"), ensure_ascii=True)
    paths = [os.path.join(OUT, n) for n in ("captions.json", "captions-io.safetensors", "clipa-io.safetensors",
                                            "timm-siglip-io.safetensors", "xlmr-io.safetensors",
                                            "zoo-expected.json")]
    paths += sorted(os.path.join(OUT, "clipa", n) for n in os.listdir(os.path.join(OUT, "clipa")))
    paths += sorted(os.path.join(OUT, "timm-siglip", n) for n in os.listdir(os.path.join(OUT, "timm-siglip")))
    paths += sorted(os.path.join(OUT, "xlmr", n) for n in os.listdir(os.path.join(OUT, "xlmr")))
    for p in paths:
        os.chmod(p, 0o644)  # safetensors writes 0600
        assert os.path.getsize(p) < 2_000_000, p
        print(f"  {os.path.relpath(p, OUT)}: {os.path.getsize(p)} bytes")


if __name__ == "__main__":
    main()
