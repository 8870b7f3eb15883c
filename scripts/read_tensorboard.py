#!/usr/bin/env python3
"""Reads a run's TensorBoard event files with the `tensorboard` package (pip install tensorboard)
and checks them against the run's metrics.jsonl, the log they are derived from.

    python3 scripts/read_tensorboard.py checkpoints/RUN

Prints the tags TensorBoard found with their point counts and last values, the config text, and
exits non-zero if any scalar of the metrics log is missing or differs (beyond f32 rounding).
"""
import json
import math
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def flatten(prefix, value, out):
    if isinstance(value, dict):
        for k, v in value.items():
            if k not in ("images", "texts", "classes"):
                flatten(f"{prefix}/{k}", v, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = float(value)


def expected(record):
    out = {}
    if "eval" in record:
        flatten("eval", record["eval"], out)
    else:
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"train/{k}"] = float(v)
    return out


def main():
    run = Path(sys.argv[1])
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags["scalars"]}
    print(f"{'tag':40} {'points':>7} {'last':>12}")
    for t in sorted(scalars):
        last = scalars[t][max(scalars[t])]
        print(f"{t:40} {len(scalars[t]):>7} {last:>12.6g}")
    for t in tags.get("tensors", []):
        text = acc.Tensors(t)[0].tensor_proto.string_val[0].decode()
        print(f"\ntext {t!r}: {len(text)} characters, first line {text.splitlines()[0]!r}")

    bad = 0
    checked = 0
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for tag, value in expected(record).items():
            got = scalars.get(tag, {}).get(record["step"])
            checked += 1
            if got is None or not math.isclose(got, value, rel_tol=1e-6, abs_tol=1e-30):
                bad += 1
                print(f"MISMATCH {tag} at step {record['step']}: log {value}, events {got}")
    print(f"\n{checked} scalars of metrics.jsonl checked against the event files, {bad} mismatches")
    sys.exit(1 if bad or not checked else 0)


if __name__ == "__main__":
    main()
