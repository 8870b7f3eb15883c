#!/usr/bin/env python3
"""The PyTorch side of `align bench embed`: forward-only embedding throughput and peak memory of a
checkpoint on the CPU, measured the way align measures it, with the checkpoint's own libraries.

Reads every sample of a webdataset tar in order (members grouped by key as webdataset groups them:
the part of the name before the first dot; the image is the jpg/jpeg/png/webp member, the caption
the txt member), and in batches of --batch:
1. decodes each image with PIL (`Image.open(...).convert("RGB")`),
2. preprocesses the batch with the checkpoint's own image processor,
3. tokenises the batch's captions with the checkpoint's own tokenizer,
4. computes the image embeddings and the text embeddings under torch.inference_mode(),
all in this one process, one batch after the other, as a DataLoader with num_workers=0 would
(decoding never overlaps the forward passes). The last batch may be short.

--library transformers: AutoModel.from_pretrained(DIR) and AutoProcessor.from_pretrained(DIR)
(CLIPModel, AlignModel, SiglipModel, ...); images through processor.image_processor(images=...),
captions through processor.tokenizer, embeddings from model.get_image_features(pixel_values) and
model.get_text_features(input_ids, attention_mask[, token_type_ids]) (their pooler_output in
transformers 5.x; not normalised). In transformers 5.x AutoProcessor gives the torchvision-backed
image processors (CLIPImageProcessor, EfficientNetImageProcessor, ...), which run on torch and so
on torch's threads.
--library open_clip: open_clip.create_model_and_transforms("local-dir:DIR") and
open_clip.get_tokenizer("local-dir:DIR"), i.e. a folder in open_clip's own format
(open_clip_config.json + open_clip_model.safetensors or open_clip_pytorch_model.bin); the val
transform per image, then torch.stack; model.encode_image and model.encode_text. open_clip reads
a transformers CLIPModel folder only through "hf-hub:ORG/NAME", which needs the Hub; such a
--checkpoint is passed through as it is and works only from the local Hugging Face cache
(HF_HUB_OFFLINE is set). A transformers folder with --library open_clip is refused.

Captions are padded to a fixed length and truncated to it by default (--padding max_length): the
tokenizer's model_max_length (CLIP 77, ALIGN 64), as align pads and as open_clip always does; with
--padding longest, to the longest caption of each batch (what CLIPProcessor(text, padding=True)
callers get). --text-len overrides the length.

Reported: images and texts embedded, seconds (wall clock from the first tar read and image decode
to the last text embedding of the last batch; model loading excluded and reported apart),
images_per_s (= images / seconds: one image and one caption make a pair), peak_rss_mib (the
process's peak resident set size from getrusage's ru_maxrss, model loading included, in MiB), and
load_peak_rss_mib (the same just before the timed loop, so the part the loop adds shows), the time
spent per phase (decode = tar read + PIL decode, preprocess, tokenize, image forward, text forward),
each batch's seconds and the embedding widths. By default there is no warm-up batch: the first
one carries torch's one-time costs (the bf16 copies of the weights under autocast among them).
--warmup N first embeds the data's first N batches untimed, inside the same autocast region, then
times the pass over all of it. torch uses all cores by default (torch's own default), --threads N sets
torch.set_num_threads(N). --json prints one JSON object whose first keys are those `align bench
embed --json` prints: {"images", "texts", "seconds", "images_per_s", "peak_rss_mib"}. --limit N
embeds only the first N samples; --save-embeddings FILE writes the embeddings (safetensors:
image_embeds, text_embeds, float32, in tar order) to compare with align's. --scores-out FILE is the
PyTorch side of `align bench`'s scoring comparison (`align data score`): each pair's cosine of its
normalised embeddings, written with its key and caption as Parquet (pyarrow) before the clock
stops.

    pip install torch transformers pillow safetensors        # and open_clip_torch for open_clip,
                                                             # onnxruntime onnx for --int8 onnxruntime
    python3 scripts/make_bench_embed_inputs.py --out /tmp/align-bench-embed
    python3 scripts/bench_embed.py --checkpoint /tmp/align-bench-embed/clip-vit-b32 \\
        --data /tmp/align-bench-embed/data/shard-000.tar --batch 32 --library transformers --json
    python3 scripts/bench_embed.py --checkpoint /tmp/align-bench-embed/clip-vit-b32-open_clip \\
        --data /tmp/align-bench-embed/data/shard-000.tar --batch 32 --library open_clip --json
    align bench embed --checkpoint /tmp/align-bench-embed/clip-vit-b32 \\
        --data /tmp/align-bench-embed/data/shard-000.tar --batch 32 --json

--int8 dynamic | onnxruntime runs the same loop on the int8 peers align's `--precision int8` is
measured against: PyTorch's dynamic quantization of the model's nn.Linear layers, or the model
exported to ONNX and quantized by ONNX Runtime (see --help).

Run by hand, not by CI; nothing is downloaded. Written with torch 2.15.0, transformers 5.24.0,
open_clip_torch 3.3.0, Pillow 13.0.0, onnxruntime 1.32.0 and onnx 1.23.2.
"""
import argparse
import io
import itertools
import json
import os
import re
import resource
import sys
import tarfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
# webdataset's base_plus_ext: the key is the name up to the first dot of its last component
KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a transformers model folder, or an open_clip folder "
                   "(open_clip_config.json), or with --library open_clip hf-hub:ORG/NAME from the local cache")
    p.add_argument("--data", required=True, help="a webdataset tar (KEY.jpg + KEY.txt per sample)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--library", choices=["transformers", "open_clip"],
                   help="default: open_clip for a folder with open_clip_config.json, else transformers")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's, all cores)")
    p.add_argument("--limit", type=int, default=0, help="embed only the first N samples")
    p.add_argument("--warmup", type=int, default=0, help="untimed batches first (the data's first ones, images and "
                   "captions, inside the same autocast region, whose weight casts it keeps), then every batch timed; "
                   "the counterpart of `align bench embed --warmup`")
    p.add_argument("--padding", choices=["max_length", "longest"], default="max_length",
                   help="transformers tokenizers: pad every caption to the text length (default) or each batch to its longest")
    p.add_argument("--text-len", type=int, default=0, help="text length (default: the tokenizer's model_max_length / context_length)")
    p.add_argument("--save-embeddings", metavar="FILE", help="write image_embeds and text_embeds (safetensors)")
    p.add_argument("--scores-out", metavar="FILE", help="score as `align data score` does: each pair's cosine, written "
                   "with its key and caption to this Parquet file (pyarrow) inside the timed loop")
    p.add_argument("--int8", choices=["dynamic", "onnxruntime"],
                   help="int8 forward passes, timed as the f32 ones (transformers models only): 'dynamic' is "
                        "torch.ao.quantization.quantize_dynamic on every nn.Linear (qint8 weights, activations "
                        "quantized per batch); 'onnxruntime' exports get_image_features and get_text_features to ONNX "
                        "(torch.onnx.export, TorchScript exporter) and runs onnxruntime.quantization.quantize_dynamic's "
                        "int8 model (per-channel QInt8 weights, uint8 activations) in an InferenceSession on --threads "
                        "threads; export and quantization count as loading")
    p.add_argument("--autocast-bf16", action="store_true", help="run the forward passes under torch.autocast('cpu', "
                   "torch.bfloat16): PyTorch's bf16 inference, the counterpart of `align ... --precision bf16`")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def samples(path, limit):
    """(key, image bytes, caption) for each sample, in tar order, read as a stream."""
    count = 0
    key, fields = None, {}

    def finish():
        image = next((fields[e] for e in IMAGE_EXTS if e in fields), None)
        if image is None or "txt" not in fields:
            raise SystemExit(f"{path}: sample {key!r} lacks an image or a txt member ({sorted(fields)})")
        return key, image, fields["txt"].decode("utf-8")

    with tarfile.open(path, "r|") as tar:
        for member in tar:
            if not member.isfile():
                continue
            m = KEY_EXT.match(member.name)
            if not m:
                continue
            k, ext = m.group(1), m.group(2).lower()
            if k != key and key is not None:
                yield finish()
                count += 1
                if limit and count >= limit:
                    return
                fields = {}
            key = k
            fields[ext] = tar.extractfile(member).read()
    if key is not None:
        yield finish()


def batches(path, size, limit):
    batch = []
    for sample in samples(path, limit):
        batch.append(sample)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def features(out):
    """get_*_features returns a tensor in transformers 4.x, a model output (pooler_output) in 5.x."""
    return out if hasattr(out, "shape") else out.pooler_output


class Transformers:
    def __init__(self, a):
        from transformers import AutoModel, AutoProcessor

        self.model = AutoModel.from_pretrained(a.checkpoint).eval()
        self.processor = AutoProcessor.from_pretrained(a.checkpoint)
        self.image_processor = self.processor.image_processor
        self.tokenizer = self.processor.tokenizer
        self.text_len = a.text_len or self.tokenizer.model_max_length
        self.padding = a.padding
        self.describe = {
            "model": type(self.model).__name__,
            "processor": type(self.processor).__name__,
            "image_processor": type(self.image_processor).__name__,
            "tokenizer": type(self.tokenizer).__name__,
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
        }

    def preprocess(self, images):
        return self.image_processor(images=images, return_tensors="pt")["pixel_values"]

    def tokenize(self, captions):
        t = self.tokenizer(captions, padding=self.padding, truncation=True, max_length=self.text_len, return_tensors="pt")
        return {k: v for k, v in t.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    def embed_images(self, pixels):
        return features(self.model.get_image_features(pixel_values=pixels))

    def embed_texts(self, tokens):
        return features(self.model.get_text_features(**tokens))


def onnx_int8(runner, a, workdir):
    """Exports the runner's two feature functions to ONNX, quantizes them with onnxruntime's dynamic
    int8 quantization, and swaps the runner's embed_* for InferenceSession runs."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    class Images(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, pixel_values):
            return features(self.model.get_image_features(pixel_values=pixel_values))

    class Texts(torch.nn.Module):
        def __init__(self, model, names):
            super().__init__()
            self.model, self.names = model, names

        def forward(self, *tensors):
            return features(self.model.get_text_features(**dict(zip(self.names, tensors))))

    from PIL import Image

    probe = runner.preprocess([Image.new("RGB", (640, 480))])
    tokens = runner.tokenize(["a photo of a dog", "two cats"])
    names = list(tokens)
    options = ort.SessionOptions()
    if a.threads:
        options.intra_op_num_threads = a.threads
    sessions = {}
    for what, module, inputs, input_names in (
        ("images", Images(runner.model), (probe,), ["pixel_values"]),
        ("texts", Texts(runner.model, names), tuple(tokens[n] for n in names), names),
    ):
        f32, int8 = os.path.join(workdir, f"{what}.onnx"), os.path.join(workdir, f"{what}-int8.onnx")
        axes = {n: {0: "batch"} for n in input_names}
        if what == "texts":
            axes = {n: {0: "batch", 1: "length"} for n in input_names}
        torch.onnx.export(module, inputs, f32, input_names=input_names, output_names=["embeds"],
                          dynamic_axes={**axes, "embeds": {0: "batch"}}, opset_version=17, dynamo=False)
        quantize_dynamic(f32, int8, weight_type=QuantType.QInt8, per_channel=True)
        sessions[what] = ort.InferenceSession(int8, options, providers=["CPUExecutionProvider"])

    def run(what, feeds):
        out = sessions[what].run(None, {k: v.numpy() for k, v in feeds.items()})[0]
        return torch.from_numpy(np.ascontiguousarray(out))

    runner.embed_images = lambda pixels: run("images", {"pixel_values": pixels})
    runner.embed_texts = lambda tokens: run("texts", tokens)
    runner.describe["model"] += " -> ONNX Runtime " + ort.__version__ + " dynamic int8"


class OpenClip:
    def __init__(self, a):
        import open_clip

        name = a.checkpoint
        if not name.startswith("hf-hub:"):
            if not os.path.isfile(os.path.join(name, "open_clip_config.json")):
                raise SystemExit(f"{name} has no open_clip_config.json: open_clip reads its own folder format only "
                                 "(a transformers folder needs --library transformers)")
            name = "local-dir:" + os.path.abspath(name)
        self.model, _, self.transform = open_clip.create_model_and_transforms(name)
        self.model.eval()
        self.tokenizer = open_clip.get_tokenizer(name)
        self.text_len = a.text_len or self.tokenizer.context_length
        self.describe = {
            "model": "open_clip " + type(self.model).__name__,
            "processor": "open_clip val transform: " + " -> ".join(type(t).__name__ for t in self.transform.transforms),
            "image_processor": repr(self.transform).replace("\n", " "),
            "tokenizer": type(self.tokenizer).__name__,
        }

    def preprocess(self, images):
        import torch
        return torch.stack([self.transform(img) for img in images])

    def tokenize(self, captions):
        return self.tokenizer(captions, context_length=self.text_len)

    def embed_images(self, pixels):
        return self.model.encode_image(pixels)

    def embed_texts(self, tokens):
        return self.model.encode_text(tokens)


def measure(a):
    import torch
    from PIL import Image

    if a.threads:
        torch.set_num_threads(a.threads)
    library = a.library
    if library is None:
        library = "open_clip" if os.path.isfile(os.path.join(a.checkpoint, "open_clip_config.json")) else "transformers"
    t0 = time.perf_counter()
    runner = Transformers(a) if library == "transformers" else OpenClip(a)
    if a.int8 and library != "transformers":
        raise SystemExit("--int8 quantizes transformers models only")
    if a.int8 == "dynamic":
        runner.model = torch.ao.quantization.quantize_dynamic(runner.model, {torch.nn.Linear}, dtype=torch.qint8)
        runner.describe["model"] += " (quantize_dynamic qint8, engine " + torch.backends.quantized.engine + ")"
    elif a.int8 == "onnxruntime":
        import tempfile
        workdir = tempfile.mkdtemp(prefix="bench-embed-onnx-")
        with torch.inference_mode(False), torch.no_grad():
            onnx_int8(runner, a, workdir)
    load_seconds = time.perf_counter() - t0
    load_peak = peak_rss_mib()
    params = sum(p.numel() for p in runner.model.parameters())
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in runner.model.parameters()})

    phases = dict.fromkeys(["decode", "preprocess", "tokenize", "image_forward", "text_forward"], 0.0)
    images = texts = 0
    batch_seconds = []
    kept_images, kept_texts = [], []
    scored = {"key": [], "caption": [], "clip_score": []}
    non_finite = 0
    image_dim = text_dim = None
    text_shape = None
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast_bf16)
    with torch.inference_mode(), autocast:
        for batch in itertools.islice(batches(a.data, a.batch, a.limit), a.warmup):
            tokens = runner.tokenize([c for _, _, c in batch])
            runner.embed_images(runner.preprocess([Image.open(io.BytesIO(b)).convert("RGB") for _, b, _ in batch]))
            runner.embed_texts(tokens)
        start = time.perf_counter()
        data = iter(batches(a.data, a.batch, a.limit))
        while True:
            t = time.perf_counter()
            batch = next(data, None)
            if batch is None:
                phases["decode"] += time.perf_counter() - t
                break
            pil = [Image.open(io.BytesIO(b)).convert("RGB") for _, b, _ in batch]
            t1 = time.perf_counter()
            pixels = runner.preprocess(pil)
            t2 = time.perf_counter()
            tokens = runner.tokenize([c for _, _, c in batch])
            t3 = time.perf_counter()
            image_embeds = runner.embed_images(pixels)
            t4 = time.perf_counter()
            text_embeds = runner.embed_texts(tokens)
            t5 = time.perf_counter()
            for key, dt in zip(phases, (t1 - t, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                phases[key] += dt
            batch_seconds.append(round(t5 - t, 4))
            images += image_embeds.shape[0]
            texts += text_embeds.shape[0]
            image_dim, text_dim = image_embeds.shape[-1], text_embeds.shape[-1]
            ids = tokens["input_ids"] if isinstance(tokens, dict) else tokens
            text_shape = list(ids.shape)
            non_finite += int((~torch.isfinite(image_embeds)).sum()) + int((~torch.isfinite(text_embeds)).sum())
            if a.save_embeddings:
                kept_images.append(image_embeds.float().clone())
                kept_texts.append(text_embeds.float().clone())
            if a.scores_out:
                unit = lambda x: torch.nn.functional.normalize(x.float(), dim=-1)
                cosines = (unit(image_embeds) * unit(text_embeds)).sum(-1)
                scored["key"].extend(k for k, _, _ in batch)
                scored["caption"].extend(c for _, _, c in batch)
                scored["clip_score"].extend(cosines.tolist())
        if a.scores_out:
            import pyarrow as pa
            import pyarrow.parquet as pq
            table = pa.table({"key": scored["key"], "caption": scored["caption"],
                              "score": pa.array(scored["clip_score"], pa.float32())})
            pq.write_table(table, a.scores_out)
        seconds = time.perf_counter() - start

    if a.save_embeddings:
        from safetensors.torch import save_file
        save_file({"image_embeds": torch.cat(kept_images).contiguous(), "text_embeds": torch.cat(kept_texts).contiguous()},
                  a.save_embeddings)

    import PIL
    versions = {"torch": torch.__version__, "Pillow": PIL.__version__}
    if library == "transformers":
        import transformers
        versions["transformers"] = transformers.__version__
    else:
        import open_clip
        versions["open_clip"] = open_clip.__version__
    return {
        "images": images,
        "texts": texts,
        "seconds": round(seconds, 4),
        "images_per_s": round(images / seconds, 3) if seconds > 0 else None,
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "load_peak_rss_mib": round(load_peak, 1),
        "load_seconds": round(load_seconds, 3),
        "phases_s": {k: round(v, 4) for k, v in phases.items()},
        "batch_seconds": batch_seconds,
        "library": library,
        "checkpoint": a.checkpoint,
        "data": a.data,
        "batch": a.batch,
        "warmup": a.warmup,
        "threads": torch.get_num_threads(),
        "padding": "max_length" if library == "open_clip" else a.padding,
        "text_len": runner.text_len,
        "last_text_batch_shape": text_shape,
        "parameters": params,
        "dtypes": dtypes,
        "autocast": "bf16" if a.autocast_bf16 else None,
        "int8": a.int8,
        "image_embed_dim": image_dim,
        "text_embed_dim": text_dim,
        "non_finite_values": non_finite,
        **runner.describe,
        "versions": versions,
    }


def main(argv=None):
    a = parser().parse_args(argv)
    if a.batch < 1:
        raise SystemExit("--batch must be at least 1")
    r = measure(a)
    if r["non_finite_values"]:
        print(f"warning: {r['non_finite_values']} embedding values are not finite", file=sys.stderr)
    if a.json:
        print(json.dumps(r))
        return
    rows = [
        ("library", f"{r['library']} ({', '.join(f'{k} {v}' for k, v in r['versions'].items())})"),
        ("checkpoint", f"{r['checkpoint']}: {r['model']}, {r['parameters']:,} parameters ({'/'.join(r['dtypes'])})"),
        ("processor", f"{r['processor']}: {r['image_processor']}, {r['tokenizer']}"),
        *([("attention", r["attn_implementation"])] if r.get("attn_implementation") else []),
        ("text", f"padding {r['padding']}, length {r['text_len']}"),
        ("batch", r["batch"]),
        ("threads", r["threads"]),
        ("images", r["images"]),
        ("texts", r["texts"]),
        ("seconds", f"{r['seconds']:.3f}"),
        ("images_per_s", f"{r['images_per_s']:.2f}" if r["images_per_s"] is not None else "-"),
        ("peak_rss_mib", f"{r['peak_rss_mib']:.1f}"),
        ("load_peak_rss_mib", f"{r['load_peak_rss_mib']:.1f}"),
        ("load_seconds", f"{r['load_seconds']:.2f}"),
        ("phases (s)", ", ".join(f"{k} {v:.3f}" for k, v in r["phases_s"].items())),
        ("batches (s)", ", ".join(f"{v:.3f}" for v in r["batch_seconds"])),
        ("embedding widths", f"image {r['image_embed_dim']}, text {r['text_embed_dim']}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
