#!/usr/bin/env python3
"""tests/fixtures/pos_embed.json: grids of position embeddings resampled as open_clip's
`resize_pos_embed` resamples them (`F.interpolate(mode="bicubic", antialias=True,
align_corners=False)` on the [1, C, g, g] grid), up (4 -> 6, 3 -> 7) and down (7 -> 3, 6 -> 4),
from seeded normal values, for src/model/pos_embed.rs's test.

Run by hand (torch 2.15 here): python3 scripts/make_pos_embed_fixture.py
"""
import json
import os

import torch
import torch.nn.functional as F

torch.manual_seed(0)
cases = []
for old, new, channels in [(4, 6, 3), (3, 7, 2), (7, 3, 2), (6, 4, 3)]:
    grid = torch.randn(old, old, channels)
    out = F.interpolate(grid.permute(2, 0, 1).unsqueeze(0), size=(new, new), mode="bicubic", antialias=True, align_corners=False)
    out = out.squeeze(0).permute(1, 2, 0)
    cases.append({"old": old, "new": new, "channels": channels, "grid": grid.flatten().tolist(), "resized": out.flatten().tolist()})
path = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "pos_embed.json")
with open(path, "w") as f:
    json.dump({"torch": torch.__version__, "cases": cases}, f)
print(path)
