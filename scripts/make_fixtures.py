#!/usr/bin/env python3
"""Parity fixtures from the reference implementation (Hugging Face transformers on PyTorch).

Builds tiny random-config models, perturbs every weight and BatchNorm statistic so nothing is at
its initial value, saves them in the Hugging Face layout (config.json + model.safetensors) under
tests/fixtures/hf/, and saves inputs and reference outputs beside them as safetensors:

- align-tiny: AlignModel (EfficientNet at width 0.25 / depth 0.3, 32 px, and a 2-layer BERT);
  outputs image_embeds, text_embeds (normalised), logits_per_text and the loss;
- bert-tiny: BertModel; output last_hidden_state;
- vit-tiny: ViTModel; output last_hidden_state.

The Rust tests (tests/hf_parity.rs) load the checkpoints and inputs and match the outputs to 1e-4.

`--check DIR [--outputs FILE]` loads an AlignModel that align saved (`align export`) with
`AlignModel.from_pretrained(DIR)` and compares its embeddings of the fixture inputs with the
fixture's, or with align's own embeddings of them saved in FILE (image_embeds, text_embeds).

Written with: torch 2.15.0, transformers 5.23.0, safetensors 0.8.0 (run by hand, not by CI).
"""
import argparse
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import (AlignConfig, AlignModel, AlignTextConfig, AlignVisionConfig, BertConfig, BertModel, ViTConfig,
                          ViTModel)

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "hf")


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))


def write_vocab(d):
    """A BERT vocabulary of the tiny models' size, so their directories are complete."""
    with open(os.path.join(d, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"word{i}" for i in range(5, 100)]) + "\n")


def tiny_align():
    vision = AlignVisionConfig(image_size=32, width_coefficient=0.25, depth_coefficient=0.3, hidden_dim=80, drop_connect_rate=0.0)
    text = AlignTextConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    # The image embedding is the last block's width (80 here), so the text projection maps to it.
    cfg = AlignConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=80, temperature_init_value=0.7)
    return AlignModel(cfg)


def align_inputs():
    g = torch.Generator().manual_seed(1)
    pixel_values = torch.randn(3, 3, 32, 32, generator=g)
    input_ids = torch.tensor([[2, 11, 12, 13, 3, 0, 0, 0], [2, 40, 41, 3, 0, 0, 0, 0], [2, 50, 51, 52, 53, 54, 55, 3]])
    attention_mask = (input_ids != 0).long()
    return pixel_values, input_ids, attention_mask


def make_align():
    torch.manual_seed(0)
    model = tiny_align()
    perturb(model, 1)
    model.eval()
    pixel_values, input_ids, attention_mask = align_inputs()
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values, return_loss=True)
    d = os.path.join(OUT, "align-tiny")
    model.save_pretrained(d, safe_serialization=True)
    write_vocab(d)
    save_file({
        "pixel_values": pixel_values.contiguous(),
        "input_ids": input_ids.contiguous(),
        "attention_mask": attention_mask.contiguous(),
        "image_embeds": out.image_embeds.contiguous(),
        "text_embeds": out.text_embeds.contiguous(),
        "logits_per_text": out.logits_per_text.contiguous(),
        "loss": out.loss.reshape(1).contiguous(),
    }, os.path.join(OUT, "align-tiny-io.safetensors"))


def make_bert():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertModel(cfg)
    perturb(model, 2)
    model.eval()
    _, input_ids, attention_mask = align_inputs()
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask)
    model.save_pretrained(os.path.join(OUT, "bert-tiny"), safe_serialization=True)
    write_vocab(os.path.join(OUT, "bert-tiny"))
    save_file({"input_ids": input_ids.contiguous(), "attention_mask": attention_mask.contiguous(),
               "last_hidden_state": out.last_hidden_state.contiguous()}, os.path.join(OUT, "bert-tiny-io.safetensors"))


def make_vit():
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = ViTModel(cfg, add_pooling_layer=False)
    perturb(model, 3)
    model.eval()
    pixel_values, _, _ = align_inputs()
    with torch.no_grad():
        out = model(pixel_values=pixel_values)
    model.save_pretrained(os.path.join(OUT, "vit-tiny"), safe_serialization=True)
    save_file({"pixel_values": pixel_values.contiguous(), "last_hidden_state": out.last_hidden_state.contiguous()},
              os.path.join(OUT, "vit-tiny-io.safetensors"))


def check(directory, outputs=None):
    model = AlignModel.from_pretrained(directory).eval()
    pixel_values, input_ids, attention_mask = align_inputs()
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values)
    ref = load_file(outputs or os.path.join(OUT, "align-tiny-io.safetensors"))
    for k in ["image_embeds", "text_embeds"]:
        print(k, "max |difference| vs the fixture:", (getattr(out, k) - ref[k]).abs().max().item())


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--check", help="an AlignModel directory written by align")
    p.add_argument("--outputs", help="with --check: align's embeddings of the fixture inputs (default: the fixture's)")
    a = p.parse_args()
    if a.check:
        check(a.check, a.outputs)
    else:
        os.makedirs(OUT, exist_ok=True)
        make_align()
        make_bert()
        make_vit()
