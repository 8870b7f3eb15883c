#!/usr/bin/env python3
"""Writes the tar fixtures align's reader is tested against, with the reference tools:

- tests/fixtures/wds-writer.tar: written by webdataset's TarWriter (Python tarfile, pax headers);
- tests/fixtures/gnu-tar.tar: written by GNU tar (--format=gnu, long-name records);
- tests/fixtures/expected.json: the samples webdataset itself reads from each (key and fields,
  with the txt caption), which the Rust test compares against.

Run by hand (needs `pip install webdataset pillow` and GNU tar); CI only reads the outputs.
"""
import io
import json
import os
import subprocess
import tempfile

import webdataset as wds
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures")


def jpeg(color):
    buf = io.BytesIO()
    Image.new("RGB", (20, 16), color).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def png(color):
    buf = io.BytesIO()
    Image.new("RGB", (12, 12), color).save(buf, format="PNG")
    return buf.getvalue()


LONG = "nested/" + "d" * 90 + "/" + "sample-with-a-very-long-key-" + "k" * 80


def samples():
    return [
        {"__key__": "000000000", "jpg": jpeg((200, 30, 30)), "txt": "a red square", "json": {"caption": "a red square", "width": 20}, "cls": 3},
        {"__key__": "000000001", "png": png((30, 200, 30)), "txt": "a green tile\nsecond caption", "cls": 7},
        {"__key__": LONG, "jpg": jpeg((30, 30, 200)), "txt": "blue, with a long key"},
        {"__key__": "dir.with.dots/000000003", "jpg": jpeg((90, 90, 90)), "txt": "grey", "seg.png": png((1, 2, 3))},
    ]


def write_with_tarwriter(path):
    with wds.TarWriter(path) as sink:
        for s in samples():
            sink.write(s)


def write_with_gnu_tar(path):
    with tempfile.TemporaryDirectory() as d:
        names = []
        for s in samples():
            for field, value in s.items():
                if field == "__key__":
                    continue
                if isinstance(value, dict):
                    value = json.dumps(value).encode()
                elif isinstance(value, str):
                    value = value.encode()
                elif isinstance(value, int):
                    value = str(value).encode()
                name = f"{s['__key__']}.{field.upper() if field == 'txt' else field}"
                full = os.path.join(d, name)
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "wb") as f:
                    f.write(value)
                names.append(name)
        subprocess.run(["tar", "--format=gnu", "--owner=0", "--group=0", "--mtime=@0", "-cf", os.path.abspath(path), *names], cwd=d, check=True)


def read_with_webdataset(path):
    out = []
    for s in wds.WebDataset(path, shardshuffle=False):
        fields = sorted(k for k in s if not k.startswith("__"))
        txt = s.get("txt")
        out.append({"key": s["__key__"], "fields": fields, "txt": txt.decode() if txt is not None else None})
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    expected = {}
    for name, writer in [("wds-writer.tar", write_with_tarwriter), ("gnu-tar.tar", write_with_gnu_tar)]:
        path = os.path.join(OUT, name)
        writer(path)
        expected[name] = read_with_webdataset(path)
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
