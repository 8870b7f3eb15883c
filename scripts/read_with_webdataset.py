#!/usr/bin/env python3
"""Reads shards with the Python webdataset library and prints what it sees, to check that shards
align writes (`align data synth`, `align data build`) are readable unchanged.

    python3 scripts/read_with_webdataset.py 'runs/demo/data/train-{00000..00007}.tar'
"""
import collections
import sys

import webdataset as wds


def main(spec):
    n, fields = 0, collections.Counter()
    first = None
    for s in wds.WebDataset(spec, shardshuffle=False):
        n += 1
        fields.update(k for k in s if not k.startswith("__"))
        if first is None:
            first = (s["__key__"], s.get("txt", b"").decode())
    print(f"samples: {n}")
    print(f"fields: {dict(fields)}")
    print(f"first: {first}")


if __name__ == "__main__":
    main(sys.argv[1])
