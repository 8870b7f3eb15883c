#!/usr/bin/env python3
"""The Python side of `align bench loader`: webdataset + PIL with the same ALIGN train transform
(resize to 346x346 bilinear, random 289 crop, random horizontal flip, x/127.5 - 1, CHW float32),
batches of the same size, the same number of worker processes, each reading its own shards as a
PyTorch DataLoader's workers would.

    pip install webdataset pillow numpy
    python3 scripts/bench_loader_python.py 'bench/train-{00000..00003}.tar' --workers 2 --batch 64 --batches 50
    align bench loader --data 'bench/train-{00000..00003}.tar' --workers 2 --batch 64 --batches 50
"""
import argparse
import multiprocessing as mp
import random
import time

import braceexpand
import numpy as np
import webdataset as wds
from PIL import Image


def transform(img, rng, resize=346, size=289):
    img = img.convert("RGB").resize((resize, resize), Image.BILINEAR)
    x, y = rng.randint(0, resize - size), rng.randint(0, resize - size)
    img = img.crop((x, y, x + size, y + size))
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    a = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return np.ascontiguousarray(a.transpose(2, 0, 1))


def worker(shards, batch, queue, seed):
    rng = random.Random(seed)
    ds = wds.WebDataset(shards, shardshuffle=False).shuffle(1000).decode("pil").to_tuple("jpg", "txt")
    while True:
        imgs, caps = [], []
        for img, cap in ds:
            imgs.append(transform(img, rng))
            caps.append(cap)
            if len(imgs) == batch:
                queue.put(np.stack(imgs).shape)
                imgs, caps = [], []


def main():
    p = argparse.ArgumentParser()
    p.add_argument("spec")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=50)
    a = p.parse_args()
    shards = list(braceexpand.braceexpand(a.spec))
    queue = mp.Queue(maxsize=4 * a.workers)
    procs = [mp.Process(target=worker, args=(shards[w :: a.workers], a.batch, queue, w), daemon=True) for w in range(a.workers)]
    for pr in procs:
        pr.start()
    for _ in range(a.workers):
        queue.get()
    t0 = time.time()
    for _ in range(a.batches):
        queue.get()
    dt = time.time() - t0
    print(f"images/s: {a.batches * a.batch / dt:.1f} ({a.workers} workers, batch {a.batch}, {dt:.2f} s)")


if __name__ == "__main__":
    main()
