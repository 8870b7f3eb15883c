#!/usr/bin/env python3
"""assets/clip-bpe-merges.txt.gz: the merges of CLIP's byte-level BPE that its 49,408-token
vocabulary uses, for reading open_clip checkpoints that ship no tokenizer files (open_clip's own
SimpleTokenizer reads them from the bpe_simple_vocab_16e6.txt.gz inside its package).

CLIP uses lines 1..48894 of that file (`merges[1:49152-256-2+1]`): the first line is a version
header, and 48,894 merges plus 512 byte symbols and 2 specials make the 49,408 ids. This script
keeps exactly those lines, with the header, and writes them gzip-compressed with a zero timestamp
so that the bytes do not depend on when it ran. align builds the vocabulary from them the way CLIP
does (src/data/clip_bpe.rs).

Run by hand with open_clip installed (open_clip_torch 3.3.0 here):
    python3 scripts/make_clip_bpe_asset.py
"""
import gzip
import io
import os

import open_clip

SOURCE = os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
OUT = os.path.join(os.path.dirname(__file__), "..", "assets", "clip-bpe-merges.txt.gz")
USED = 49152 - 256 - 2

lines = gzip.open(SOURCE).read().decode("utf-8").split("\n")
kept = lines[: 1 + USED]
assert len(kept) == USED + 1 and kept[-1] == "jeky ll</w>", kept[-1]
buf = io.BytesIO()
with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0, filename="") as f:
    f.write(("\n".join(kept) + "\n").encode("utf-8"))
with open(OUT, "wb") as f:
    f.write(buf.getvalue())
print(f"{OUT}: {len(kept) - 1} merges, {len(buf.getvalue())} bytes")
