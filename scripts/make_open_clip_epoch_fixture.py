"""Writes tests/fixtures/open_clip/clip-native-epoch/epoch_3.pt: the clip-native-bin fixture's
weights (saved by torch from open_clip's model) in the layout of open_clip's own training
checkpoint, as `open_clip_train.main` saves it: a dict with `epoch`, `name`, `state_dict` (every
key behind DistributedDataParallel's `module.`) and `optimizer`, beside the model's
open_clip_config.json.

torch is not needed: the pickle inside torch's zip file is rewritten with stand-ins for torch's
classes, which pickle back to the same references, and the tensors' storages are copied as they
are. Run from the repository root:

    python3 scripts/make_open_clip_epoch_fixture.py
"""

import collections
import pickle
import shutil
import sys
import types
import zipfile
from pathlib import Path

SOURCE = Path("tests/fixtures/open_clip/clip-native-bin")
OUT = Path("tests/fixtures/open_clip/clip-native-epoch")


class Tensor:
    """torch._utils._rebuild_tensor_v2(...) as it was called, pickled back as the same call."""

    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return (rebuild, self.args)


def rebuild(*args):
    return Tensor(*args)


class Storage:
    def __init__(self, pid):
        self.pid = pid


# Stand-in modules, so that pickle resolves and writes `torch.FloatStorage` and
# `torch._utils._rebuild_tensor_v2` exactly as torch does.
torch = types.ModuleType("torch")
utils = types.ModuleType("torch._utils")
rebuild.__module__, rebuild.__qualname__ = "torch._utils", "_rebuild_tensor_v2"
utils._rebuild_tensor_v2 = rebuild
torch._utils = utils
for name in ["FloatStorage", "HalfStorage", "BFloat16Storage", "LongStorage"]:
    cls = type(name, (), {"__module__": "torch"})
    setattr(torch, name, cls)
sys.modules["torch"], sys.modules["torch._utils"] = torch, utils


class Reader(pickle.Unpickler):
    def persistent_load(self, pid):
        return Storage(pid)


class Writer(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, Storage) else None


def main():
    src = zipfile.ZipFile(SOURCE / "open_clip_pytorch_model.bin")
    prefix = src.namelist()[0].split("/")[0]
    state = Reader(src.open(f"{prefix}/data.pkl")).load()
    checkpoint = {
        "epoch": 3,
        "name": "clip-native",
        "state_dict": collections.OrderedDict((f"module.{k}", v) for k, v in state.items()),
        "optimizer": {"state": {}, "param_groups": [{"lr": 5e-4, "weight_decay": 0.2, "params": list(range(len(state)))}]},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    shutil.copy(SOURCE / "open_clip_config.json", OUT / "open_clip_config.json")
    with zipfile.ZipFile(OUT / "epoch_3.pt", "w", zipfile.ZIP_STORED) as out:
        for name in src.namelist():
            inner = name.split("/", 1)[1]
            if inner == "data.pkl":
                import io

                buf = io.BytesIO()
                Writer(buf, protocol=2).dump(checkpoint)
                out.writestr(f"epoch_3/{inner}", buf.getvalue())
            else:
                out.writestr(f"epoch_3/{inner}", src.read(name))
    print(f"wrote {OUT / 'epoch_3.pt'}")


if __name__ == "__main__":
    main()
