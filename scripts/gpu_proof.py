#!/usr/bin/env python3
"""The helper of scripts/gpu-proof.sh: step 3's runs and the report. Standard library only; the
PyTorch rows need torch, timm and transformers (scripts/bench_torch.py) and are skipped without.

  gpu_proof.py bench --align BIN --device cuda|cpu --out RAW/3-model --deadline EPOCH_S
                     [--peak-f32 TFLOPS] [--peak-bf16 TFLOPS] [--bench-torch scripts/bench_torch.py]
      Step 3. For each tower pair, in the targets' order (ViT-B/16, EfficientNet-B7, ViT-B/32,
      EfficientNet-B3, all with BERT-base): `align bench model` in bf16 and f32 at the largest
      power-of-two batch that fits, starting from a per-model power of two and halving on
      out-of-memory (at most three times); then the same model in PyTorch at the same batch in
      one worker process per tower pair. GPU memory is also sampled from outside every 20 ms
      through NVML for both sides, above the memory in use before the process started. Writes
      rows.json after every change, so a run cut short keeps what it measured; stops starting
      runs when the deadline nears.

  gpu_proof.py report --raw RAW --out DIR
      Reads every step's raw output under RAW, compares the training losses with the CPU's,
      prints the table and writes DIR/gpu-proof.table and DIR/gpu-proof.json. Exits 1 when a
      pass/fail row failed or a step could not run.

  gpu_proof.py torch-worker --bench-torch PATH      (internal: PyTorch rows sent on stdin)

Tolerances (environment): GPU_PROOF_F32_RTOL (1e-3: the largest per-step |loss - cpu loss| / cpu
loss over the run; ~1e-4 expected), GPU_PROOF_BF16_MEAN (0.05: the mean of that over the run) and
GPU_PROOF_BF16_MAX (0.15: its largest).
"""
import argparse
import ctypes
import gc
import importlib.util
import json
import math
import os
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

PREFIX = "@@gpu-proof "
OOM = re.compile(r"out[ _]of[ _]memory|ALLOC_FAILED", re.IGNORECASE)

# Step 3's tower pairs, in the order they run: the targets' rows first, so that a run cut short
# by its time budget still has them. `start` is the first batch tried (halved on out-of-memory).
CUDA_MODELS = [
    {"key": "vit-b16", "name": "ViT-B/16 + BERT-base", "image_tower": "vit-b16", "image_size": 224, "text_tower": "bert-base", "start": 512},
    # The slowest steps: fewer of them.
    {"key": "effnet-b7", "name": "EfficientNet-B7 + BERT-base", "image_tower": "efficientnet-b7", "image_size": 289,
     "text_tower": "bert-base", "start": 128, "warmup": 1, "steps": 3},
    {"key": "vit-b32", "name": "ViT-B/32 + BERT-base", "image_tower": "vit-b32", "image_size": 224, "text_tower": "bert-base", "start": 1024},
    {"key": "effnet-b3", "name": "EfficientNet-B3 + BERT-base", "image_tower": "efficientnet-b3", "image_size": 300,
     "text_tower": "bert-base", "start": 256},
]
# The dry run: tiny towers standing in for the two targets' models.
CPU_MODELS = [
    {"key": "vit-b16", "name": "ViT-Ti/16 + BERT-tiny (for ViT-B/16)", "image_tower": "vit-ti16", "image_size": 32,
     "text_tower": "bert-tiny", "start": 8},
    {"key": "effnet-b7", "name": "EfficientNet-B0 + BERT-tiny (for B7)", "image_tower": "efficientnet-b0", "image_size": 64,
     "text_tower": "bert-tiny", "start": 8},
]
TABLE_ORDER = ["vit-b32", "vit-b16", "effnet-b3", "effnet-b7"]

SETTINGS = {
    # text_len, embed_dim, warmup, steps, halvings, per-run cap (s), least time worth starting (s),
    # the largest batch tried (the dry run pretends larger ones do not fit, to exercise the search)
    "cuda": {"text_len": 64, "embed_dim": 640, "warmup": 2, "steps": 5, "halvings": 3, "cap_s": 120, "min_start_s": 20,
             "max_batch": None},
    "cpu": {"text_len": 16, "embed_dim": 128, "warmup": 1, "steps": 2, "halvings": 3, "cap_s": 120, "min_start_s": 5, "max_batch": 4},
}


def tolerances():
    return {
        "f32_max_rel": float(os.environ.get("GPU_PROOF_F32_RTOL", "1e-3")),
        "f32_expected": 1e-4,
        "bf16_mean_rel": float(os.environ.get("GPU_PROOF_BF16_MEAN", "0.05")),
        "bf16_max_rel": float(os.environ.get("GPU_PROOF_BF16_MAX", "0.15")),
    }


def log(msg):
    print(f"gpu-proof: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# GPU memory from outside the measured process (NVML through ctypes; no Python package needed)


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class GpuMemory:
    """Polls the device's used memory every `period` seconds while a window is open; a window's
    result is its highest reading minus the baseline given when it opened, in MiB. Without NVML
    (no driver, the dry run) every result is None."""

    def __init__(self, index, enabled=True, period=0.02):
        self.lib = None
        self.handle = ctypes.c_void_p()
        self.lock = threading.Lock()
        self.peak = None
        self.active = False
        if not enabled:
            return
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            lib.nvmlDeviceGetHandleByIndex_v2.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)]
            lib.nvmlDeviceGetMemoryInfo.argtypes = [ctypes.c_void_p, ctypes.POINTER(_NvmlMemory)]
            if lib.nvmlInit_v2() == 0 and lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)) == 0:
                self.lib = lib
        except (OSError, AttributeError):
            self.lib = None
        if self.lib is not None and self.used_mib() is not None:
            threading.Thread(target=self._poll, args=(period,), daemon=True).start()
        else:
            self.lib = None

    def used_mib(self):
        if self.lib is None:
            return None
        m = _NvmlMemory()
        if self.lib.nvmlDeviceGetMemoryInfo(self.handle, ctypes.byref(m)) != 0:
            return None
        return m.used / 2**20

    def _poll(self, period):
        while True:
            used = self.used_mib()
            with self.lock:
                if self.active and used is not None:
                    self.peak = used if self.peak is None else max(self.peak, used)
            time.sleep(period)

    def begin(self):
        with self.lock:
            self.active = True
            self.peak = None

    def end(self, baseline):
        with self.lock:
            self.active = False
            peak = self.peak
        last = self.used_mib()
        if last is not None:
            peak = last if peak is None else max(peak, last)
        if peak is None or baseline is None:
            return None
        return max(peak - baseline, 0.0)


# ---------------------------------------------------------------------------------------------
# Step 3: align bench model and PyTorch


class Bench:
    def __init__(self, a):
        self.a = a
        self.mode = "cpu" if a.device == "cpu" else "cuda"
        self.s = dict(SETTINGS[self.mode])
        if a.max_batch is not None:
            self.s["max_batch"] = a.max_batch or None
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        index = int(a.device.split(":")[1]) if a.device.startswith("cuda:") else 0
        self.mem = GpuMemory(index, enabled=self.mode == "cuda")
        self.models = CPU_MODELS if self.mode == "cpu" else CUDA_MODELS
        self.rows = []
        self.notes = []
        if self.s["max_batch"]:
            self.notes.append(f"batches above {self.s['max_batch']} count as out of memory here, to exercise the batch search")
        self.torch_skipped = self.torch_missing()
        if self.torch_skipped:
            log(f"{self.torch_skipped}: PyTorch rows skipped")
            self.notes.append(f"{self.torch_skipped}: PyTorch rows skipped")

    def remaining(self):
        return self.a.deadline - time.time()

    def timeout(self):
        """Seconds the next run may take, or None when too little time is left to start one."""
        left = self.remaining() - 3
        if left < self.s["min_start_s"]:
            return None
        return min(self.s["cap_s"], left)

    def torch_missing(self):
        for name in ("torch", "timm", "transformers"):
            if importlib.util.find_spec(name) is None:
                return f"{name} not installed"
        return None

    def steps(self, m):
        return self.a.steps or m.get("steps", self.s["steps"])

    def warmup(self, m):
        return m.get("warmup", self.s["warmup"])

    def peak(self, precision):
        return self.a.peak_bf16 if precision == "bf16" else self.a.peak_f32

    def save(self, complete=False):
        doc = {
            "device": self.a.device,
            "settings": self.s,
            "align_kernels": os.environ.get("ALIGN_KERNELS") or "align (default)",
            "peak_tflops": {"f32": self.a.peak_f32, "bf16": self.a.peak_bf16},
            "external_memory": self.mem.lib is not None,
            "torch_skipped": self.torch_skipped,
            "notes": self.notes,
            "complete": complete,
            "rows": self.rows,
        }
        tmp = self.out / "rows.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(self.out / "rows.json")

    # --- align ---

    def align_once(self, m, precision, batch):
        """One `align bench model` run: (outcome, result or None, attempt record)."""
        name = f"align-{m['key']}-{precision}-b{batch}"
        attempt = {"batch": batch, "file": name}
        cap = self.s["max_batch"]
        if cap is not None and batch > cap:
            attempt.update(outcome="oom", note=f"over the dry run's largest batch {cap}: counted as out of memory", seconds=0.0)
            return "oom", None, attempt
        timeout = self.timeout()
        if timeout is None:
            attempt.update(outcome="skipped", note="out of time", seconds=0.0)
            return "skipped", None, attempt
        cmd = [self.a.align, "--device", self.a.device, "bench", "model", "--image-tower", m["image_tower"], "--text-tower", m["text_tower"],
               "--batch", str(batch), "--image-size", str(m["image_size"]), "--text-len", str(self.s["text_len"]),
               "--steps", str(self.steps(m)), "--warmup", str(self.warmup(m)), "--precision", precision, "--json",
               "--set", f"model.embed_dim={self.s['embed_dim']}", "--set", 'optimizer.kind="adamw"']
        peak = self.peak(precision)
        if peak:
            cmd += ["--peak-tflops", str(peak)]
        (self.out / f"{name}.cmd").write_text(" ".join(cmd) + "\n")
        log(f"step 3: align {m['name']} {precision} batch {batch}")
        baseline = self.mem.used_mib()
        self.mem.begin()
        t0 = time.time()
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
            stdout, stderr, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc = None
        seconds = time.time() - t0
        sampled = self.mem.end(baseline)
        (self.out / f"{name}.json").write_text(stdout)
        (self.out / f"{name}.err").write_text(stderr)
        attempt.update(seconds=round(seconds, 2), rc=rc)
        if rc is None:
            attempt.update(outcome="timeout", note=f"stopped after {timeout:.0f} s")
            return "timeout", None, attempt
        lacks = cpu_lacks_bf16(stderr) if rc != 0 and self.mode == "cpu" else None
        if lacks:
            attempt.update(outcome="skipped", note=lacks)
            return "skipped", None, attempt
        if rc != 0:
            kind = "oom" if OOM.search(stderr) else "error"
            attempt.update(outcome=kind, note=last_line(stderr))
            return kind, None, attempt
        try:
            r = json.loads(stdout)
        except json.JSONDecodeError:
            attempt.update(outcome="error", note="no JSON on stdout")
            return "error", None, attempt
        r["sampled_peak_mib"] = sampled
        attempt["outcome"] = "ok"
        return "ok", r, attempt

    def align_search(self, m, precision, start):
        """The largest fitting power-of-two batch from `start` down: the row."""
        row = {"model": m["key"], "name": m["name"], "image_tower": m["image_tower"], "text_tower": m["text_tower"],
               "image_size": m["image_size"], "text_len": self.s["text_len"], "embed_dim": self.s["embed_dim"], "precision": precision,
               "warmup": self.warmup(m), "steps": self.steps(m),
               "batch": None, "align": None, "attempts": [], "torch": None, "torch_attempts": []}
        self.rows.append(row)
        batch = start
        for _ in range(self.s["halvings"] + 1):
            outcome, r, attempt = self.align_once(m, precision, batch)
            row["attempts"].append(attempt)
            self.save()
            if outcome == "ok":
                row["batch"], row["align"] = batch, r
                break
            if outcome != "oom" or batch == 1:
                row["align_error"] = f"{outcome}: {attempt.get('note', '')}".strip()
                break
            batch //= 2
        else:
            row["align_error"] = f"out of memory down to batch {batch * 2}"
        self.save()
        return row

    # --- PyTorch ---

    def torch_rows(self, m, rows):
        """The model's rows in PyTorch, at align's batch (halved up to twice on out-of-memory), in
        one worker process."""
        todo = [r for r in rows if r["batch"]]
        for r in rows:
            if not r["batch"]:
                r["torch_skipped"] = "align found no batch"
        if self.torch_skipped:
            for r in todo:
                r["torch_skipped"] = self.torch_skipped
            return
        if not todo:
            return
        if self.timeout() is None:
            for r in todo:
                r["torch_skipped"] = "out of time"
            return
        log(f"step 3: PyTorch {m['name']} (starting a worker)")
        baseline = self.mem.used_mib()
        worker = TorchWorker(self.a, self.out / f"torch-{m['key']}.log")
        try:
            ready = worker.wait(("READY", "UNAVAILABLE"), min(120, max(self.remaining() - 3, 1)))
            if ready[0] != "READY":
                reason = {"TIMEOUT": "did not start in time", "EOF": "exited at start (see its log)"}.get(ready[0], ready[0])
                if isinstance(ready[1], dict):
                    reason = ready[1].get("reason", reason)
                if ready[0] == "UNAVAILABLE":
                    self.torch_skipped = reason
                    self.notes.append(f"{reason}: PyTorch rows skipped")
                    log(f"{reason}: PyTorch rows skipped")
                for r in todo:
                    r["torch_skipped"] = f"PyTorch worker: {reason}"
                return
            info = ready[1]
            for r in todo:
                batch = r["batch"]
                for _ in range(3):
                    timeout = self.timeout()
                    if timeout is None:
                        r["torch_skipped"] = "out of time"
                        break
                    argv = ["--device", self.a.device, "--impl", "timm", "--image-tower", m["image_tower"], "--text-tower", m["text_tower"],
                            "--batch", str(batch), "--image-size", str(m["image_size"]), "--text-len", str(self.s["text_len"]),
                            "--embed-dim", str(self.s["embed_dim"]), "--steps", str(self.steps(m)), "--warmup", str(self.warmup(m)),
                            "--precision", r["precision"], "--json"]
                    log(f"step 3: PyTorch {m['name']} {r['precision']} batch {batch}")
                    t0 = time.time()
                    self.mem.begin()
                    res = worker.request(argv, timeout)
                    sampled = self.mem.end(baseline)
                    attempt = {"batch": batch, "seconds": round(time.time() - t0, 2)}
                    r["torch_attempts"].append(attempt)
                    if res is None:
                        attempt["outcome"] = "timeout"
                        r["torch_error"] = f"no result within {timeout:.0f} s (worker stopped)"
                        worker.close(kill=True)
                        self.save()
                        return self.torch_restart(m, rows, r)
                    if "error" in res:
                        attempt.update(outcome="oom" if res.get("oom") else "error", note=res["error"][:300])
                        if res.get("oom") and batch > 1:
                            batch //= 2
                            self.save()
                            continue
                        r["torch_error"] = res["error"][:300]
                        if res.get("dead"):
                            worker.close()
                            self.save()
                            return self.torch_restart(m, rows, r)
                        break
                    attempt["outcome"] = "ok"
                    res["sampled_peak_mib"] = sampled
                    res["versions"] = info
                    r["torch"] = res
                    r["torch_batch"] = batch
                    break
                else:
                    r["torch_error"] = f"out of memory down to batch {batch * 2}"
                self.save()
        finally:
            worker.close()

    def torch_restart(self, m, rows, failed):
        """After a worker died or hung: the rows not yet tried, in a fresh worker."""
        rest = [r for r in rows if r is not failed and r["batch"] and r["torch"] is None and not r["torch_attempts"]]
        if rest:
            self.torch_rows(m, rest)

    def same_batch(self, m, rows):
        """Where PyTorch fit only a smaller batch than align: align again at PyTorch's batch."""
        for r in rows:
            tb = r.get("torch_batch")
            if r["torch"] and r["batch"] and tb and tb < r["batch"]:
                outcome, res, attempt = self.align_once(m, r["precision"], tb)
                attempt["rerun"] = "at PyTorch's batch"
                r["attempts"].append(attempt)
                if outcome == "ok":
                    r["align_at_torch_batch"] = res
                self.save()

    def run(self):
        self.save()
        for m in self.models:
            bf16 = self.align_search(m, "bf16", m["start"])
            # f32 never fits more than bf16: start from bf16's batch.
            f32 = self.align_search(m, "f32", bf16["batch"] or m["start"])
            self.torch_rows(m, [bf16, f32])
            self.same_batch(m, [bf16, f32])
            self.save()
        self.save(complete=True)
        return 0


class TorchWorker:
    """`gpu_proof.py torch-worker` in a child process; requests and results are JSON lines."""

    def __init__(self, a, log_path):
        self.logf = open(log_path, "a")
        cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "torch-worker", "--bench-torch", a.bench_torch]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.logf, text=True, bufsize=1)
        self.q = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            if line.startswith(PREFIX):
                kind, _, payload = line[len(PREFIX):].strip().partition(" ")
                try:
                    self.q.put((kind, json.loads(payload) if payload else None))
                except json.JSONDecodeError:
                    self.q.put((kind, None))
            else:
                self.logf.write(line)
        self.q.put(("EOF", None))

    def wait(self, kinds, timeout):
        end = time.time() + timeout
        while True:
            left = end - time.time()
            if left <= 0:
                return ("TIMEOUT", None)
            try:
                kind, payload = self.q.get(timeout=left)
            except queue.Empty:
                return ("TIMEOUT", None)
            if kind in kinds or kind == "EOF":
                return (kind, payload)

    def request(self, argv, timeout):
        """The result dict; {"error", "dead": True} when the worker exited; None on timeout."""
        try:
            self.p.stdin.write(json.dumps({"argv": argv}) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            return {"error": "the PyTorch worker exited", "dead": True}
        kind, payload = self.wait(("RESULT",), timeout)
        if kind == "RESULT" and isinstance(payload, dict):
            return payload
        if kind == "EOF":
            return {"error": f"the PyTorch worker exited (status {self.p.wait()}); see its log", "dead": True}
        return None

    def close(self, kill=False):
        if self.p.poll() is None:
            if kill:
                self.p.kill()
            try:
                self.p.stdin.close()
            except OSError:
                pass
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        if not self.logf.closed:
            self.logf.flush()


def torch_worker(a):
    def say(kind, payload):
        sys.stdout.write(f"{PREFIX}{kind} {json.dumps(payload)}\n")
        sys.stdout.flush()

    try:
        spec = importlib.util.spec_from_file_location("bench_torch", a.bench_torch)
        bt = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bt)
        import torch
        import timm
        import transformers
    except ImportError as e:
        say("UNAVAILABLE", {"reason": f"{e.name or e} not installed"})
        return 0
    info = {"torch": torch.__version__, "timm": timm.__version__, "transformers": transformers.__version__,
            "cuda": torch.cuda.is_available()}
    say("READY", info)
    for line in sys.stdin:
        if not line.strip():
            continue
        argv = json.loads(line)["argv"]
        ns = bt.parse_args(argv)
        if ns.device.startswith("cuda") and not torch.cuda.is_available():
            say("RESULT", {"error": "this PyTorch has no CUDA device"})
            continue
        say("BEGIN", None)
        try:
            r = bt.measure(ns)
        except Exception as e:  # the row's failure, reported; the worker goes on
            oom = isinstance(e, torch.cuda.OutOfMemoryError) or bool(OOM.search(str(e)))
            if not oom:
                traceback.print_exc(file=sys.stderr)
            r = {"error": f"{type(e).__name__}: {e}", "oom": oom}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        say("RESULT", r)
    return 0


def join_notes(*parts):
    return ": ".join(p for p in parts if p)


def cpu_lacks_bf16(stderr):
    """A note that align refused bf16 for want of AVX-512 BF16 (its stderr ends so), or None. On
    such a CPU the dry run has no bf16 path to try (a GPU's bf16 needs no such instruction): those rows are skipped,
    never counted as failures."""
    line = last_line(stderr)
    return "this CPU lacks AVX-512 BF16, which bf16 needs on the CPU" if "AVX-512 BF16" in line and "lacks" in line else None


def last_line(text):
    """The error a command's stderr ends with: its `Error:` line or panic message when there is one
    (a backtrace may follow it), else its last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("Error:", "error:")) or "panicked at" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else ""


# ---------------------------------------------------------------------------------------------
# The report


def read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_kv(path):
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            k, sep, v = line.partition("\t")
            if sep:
                out[k] = v
    except OSError:
        pass
    return out


def read_commands(raw):
    out = {}
    try:
        for line in (raw / "commands.jsonl").read_text().splitlines():
            try:
                c = json.loads(line)
                out[c["name"]] = c
            except (json.JSONDecodeError, KeyError):
                pass
    except OSError:
        pass
    return out


def read_losses(path):
    losses = {}
    try:
        for line in Path(path).read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "eval" not in r and "loss" in r and "step" in r:
                losses[int(r["step"])] = float(r["loss"]) if r["loss"] is not None else math.nan
    except OSError:
        return None
    return losses


def command_note(c):
    if c is None:
        return "did not run"
    if c.get("timed_out"):
        return f"stopped by its time limit after {c.get('seconds', 0):.0f} s"
    if c.get("rc", 0) != 0:
        return f"exit status {c.get('rc')}"
    return ""


def report_ops(raw, commands):
    c = commands.get("1-ops/ops")
    doc = read_json(raw / "1-ops" / "ops.out")
    step = {"command": c, "tolerance": None, "rows": [], "failed_ops": []}
    if not doc or "ops" not in doc:
        step["status"] = "error"
        step["error"] = join_notes(command_note(c) or "no JSON", last_line(read_text(raw / "1-ops" / "ops.err")))
        return step
    tol = float(doc.get("tolerance", 1e-4))
    step["tolerance"] = tol
    step["device"] = doc.get("device")
    for op in doc["ops"]:
        fe, be = op.get("forward_error"), op.get("backward_error")
        ok = fe is not None and be is not None and fe <= tol and be <= tol
        step["rows"].append({**op, "pass": ok})
        if not ok:
            step["failed_ops"].append(op.get("op"))
    if step["failed_ops"] or (c and c.get("rc", 0) != 0):
        step["status"] = "fail"
        if not step["failed_ops"]:
            step["error"] = command_note(c)
    else:
        step["status"] = "pass"
    return step


def read_text(path):
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def report_training(raw, commands, env):
    tol = tolerances()
    d = raw / "2-train"
    step = {"tolerances": tol, "steps": int(env.get("train_steps") or 0), "batch": int(env.get("train_batch") or 0),
            "reference": "cpu-f32", "rows": []}
    runs = []
    for line in read_text(d / "runs.txt").splitlines():
        parts = line.split("\t")
        if len(parts) in (3, 4):
            runs.append((parts + ["cpu-f32"])[:4])
    want = step["steps"]

    def reference(name):
        losses = read_losses(d / f"{name}.metrics.jsonl")
        if not losses:
            return None, f"the CPU reference run {name} produced no losses (" + (command_note(commands.get(f"2-train/{name}")) or "no metrics") + ")"
        if want and len(losses) < want:
            return None, f"the CPU reference run {name} logged {len(losses)} of {want} steps"
        return losses, None

    for name, precision, kernels, ref_name in runs:
        ref, ref_problem = reference(ref_name)
        row = {"run": name, "precision": precision, "kernels": kernels, "reference": ref_name, "pass": False}
        losses = read_losses(d / f"{name}.metrics.jsonl")
        lacks = cpu_lacks_bf16(read_text(d / f"{name}.err")) if env.get("mode") == "cpu" and precision == "bf16" else None
        if lacks and not losses:
            row.update({"pass": None, "skipped": lacks})
        elif ref_problem:
            row["error"] = ref_problem
        elif not losses:
            row["error"] = join_notes("no losses (" + (command_note(commands.get(f"2-train/{name}")) or "no metrics") + ")",
                                      last_line(read_text(d / f"{name}.err")))
        else:
            steps = sorted(ref)
            missing = [s for s in steps if s not in losses]
            rel = [abs(losses[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in steps if s in losses]
            finite = all(math.isfinite(x) for x in rel)
            row.update(steps_compared=len(rel), final_loss=losses.get(steps[-1]), reference_final_loss=ref[steps[-1]])
            if rel and finite:
                row.update(max_rel=max(rel), mean_rel=statistics.fmean(rel), median_rel=statistics.median(rel),
                           first10_max_rel=max(rel[:10]), worst_step=steps[rel.index(max(rel))])
                over = [s for s, x in zip(steps, rel) if x > tol["f32_expected"]]
                row["first_step_over_1e-4"] = over[0] if over else None
            if missing:
                row["error"] = f"{len(missing)} steps missing (from step {missing[0]})"
            elif not finite:
                row["error"] = "a loss is not finite"
            elif precision == "f32":
                row["criterion"] = f"max rel <= {tol['f32_max_rel']:g}"
                row["pass"] = row["max_rel"] <= tol["f32_max_rel"]
            else:
                row["criterion"] = f"mean rel <= {tol['bf16_mean_rel']:g}, max rel <= {tol['bf16_max_rel']:g}"
                row["pass"] = row["mean_rel"] <= tol["bf16_mean_rel"] and row["max_rel"] <= tol["bf16_max_rel"]
        step["rows"].append(row)
    if not runs:
        step["status"] = "error"
        step["error"] = "no training runs were recorded (" + (command_note(commands.get("2-train/tokenizer")) or "see the log") + ")"
    else:
        # A skipped row (pass None) neither passes nor fails; every other row must pass.
        step["status"] = "pass" if all(r["pass"] is not False for r in step["rows"]) else "fail"
    return step


def mem_of(side, mode):
    """A side's peak memory in MiB and how it was measured."""
    if not side:
        return None, None
    if mode == "cuda":
        if side.get("sampled_peak_mib") is not None:
            return side["sampled_peak_mib"], "sampled"
        if side.get("peak_gpu_mib") is not None:
            return side["peak_gpu_mib"], "after each phase"
        return None, None
    return side.get("peak_rss_mb"), "peak RSS"


def report_models(raw, mode):
    doc = read_json(raw / "3-model" / "rows.json")
    step = {"rows": []}
    if not doc:
        step["status"] = "error"
        step["error"] = "no results (rows.json missing): " + last_line(read_text(raw / "3-model.err"))
        return step
    step.update(settings=doc.get("settings"), peak_tflops=doc.get("peak_tflops"), align_kernels=doc.get("align_kernels"), torch_skipped=doc.get("torch_skipped"),
                notes=doc.get("notes", []), complete=doc.get("complete", False), external_memory=doc.get("external_memory"))
    errors = []
    for r in doc.get("rows", []):
        a = r.get("align")
        t = r.get("torch")
        # The comparison is at PyTorch's batch when it fit only a smaller one.
        a_cmp = r.get("align_at_torch_batch") or a
        row = {k: r.get(k) for k in ("model", "name", "image_tower", "text_tower", "image_size", "text_len", "embed_dim", "precision",
                                     "warmup", "steps", "batch", "attempts", "torch_attempts", "torch_batch")}
        row["align"] = a
        row["torch"] = t
        if a:
            row["align_samples_per_s"] = a.get("samples_per_s")
            row["align_mfu"] = a.get("mfu")
            row["align_peak_mib"], row["memory_method"] = mem_of(a, mode)
            row["forward_gflops_per_sample"] = a.get("forward_gflops_per_sample")
        else:
            row["align_error"] = r.get("align_error") or "not measured"
            # Out of time (skipped or stopped) leaves the step incomplete; anything else is an error.
            if not row["align_error"].startswith(("skipped", "timeout")):
                errors.append(f"{r.get('name')} {r.get('precision')}: {row['align_error']}")
        if t:
            row["torch_samples_per_s"] = t.get("samples_per_s")
            flops = (a_cmp or {}).get("forward_gflops_per_sample")
            peak = (doc.get("peak_tflops") or {}).get(r.get("precision"))
            if flops and peak:
                row["torch_mfu"] = 3 * flops * 1e9 * t["samples_per_s"] / (peak * 1e12)
            tm, _ = mem_of(t, mode)
            am, _ = mem_of(a_cmp, mode)
            row["torch_peak_mib"] = tm
            row["torch_max_allocated_mib"] = t.get("max_allocated_mib")
            if a_cmp and a_cmp.get("samples_per_s") and t.get("samples_per_s"):
                row["ratio"] = a_cmp["samples_per_s"] / t["samples_per_s"]
                row["compared_at_batch"] = r.get("torch_batch")
            if am and tm:
                row["memory_ratio"] = am / tm
            if r.get("torch_batch") and r.get("batch") and r["torch_batch"] < r["batch"]:
                row["torch_note"] = f"PyTorch ran out of memory at batch {r['batch']}; compared at {r['torch_batch']}"
        else:
            row["torch_skipped"] = r.get("torch_skipped") or r.get("torch_error") or ("not measured" if a else "align found no batch")
        step["rows"].append(row)
    step["errors"] = errors
    if errors:
        step["status"] = "error"
    elif not doc.get("complete"):
        step["status"] = "incomplete"
    else:
        step["status"] = "done"
    return step


def report_loader(raw, commands):
    c = commands.get("4-loader/loader")
    doc = read_json(raw / "4-loader" / "loader.out")
    if not doc or "images_per_second" not in doc:
        note = command_note(c) or command_note(commands.get("4-loader/synth")) or "no JSON"
        return {"status": "error", "error": join_notes(note, last_line(read_text(raw / "4-loader" / "loader.err")))}
    workers = doc.get("workers") or 1
    return {"status": "done", "images_per_s": doc["images_per_second"], "workers": workers,
            "images_per_s_per_core": doc["images_per_second"] / workers, "batch": doc.get("batch_size"),
            "image_size": doc.get("image_size"), "seconds": doc.get("seconds"), "skipped": doc.get("skipped")}


def report_embed(raw, commands):
    c = commands.get("5-embed/embed")
    doc = read_json(raw / "5-embed" / "embed.out")
    if not doc or "images_per_s" not in doc:
        note = command_note(c) or "no JSON"
        return {"status": "error", "error": join_notes(note, last_line(read_text(raw / "5-embed" / "embed.err")))}
    return {"status": "done", "images": doc["images"], "texts": doc["texts"], "images_per_s": doc["images_per_s"],
            "batch": doc.get("batch"), "peak_rss_mib": doc.get("peak_rss_mib")}


def find_row(models, key, precision):
    for r in models.get("rows", []):
        if r.get("model") == key and r.get("precision") == precision:
            return r
    return None


def targets(steps, mode):
    m = steps["model"]
    out = []
    dry = " (dry-run stand-in)" if mode == "cpu" else ""
    v = find_row(m, "vit-b16", "bf16")
    name = (v or {}).get("name", "ViT-B/16 + BERT-base")
    ratio = (v or {}).get("ratio")
    out.append({"target": f"{name} bf16: align samples/s >= 1.0x PyTorch{dry}", "value": ratio, "threshold": 1.0,
                "met": None if ratio is None else ratio >= 1.0, "note": (v or {}).get("torch_skipped")})
    mfu = (v or {}).get("align_mfu")
    out.append({"target": f"{name} bf16: align MFU >= 40%{dry}", "value": mfu, "threshold": 0.40,
                "met": None if mfu is None else mfu >= 0.40, "note": None if mfu is not None else "no peak TFLOP/s for this device"})
    mr = (v or {}).get("memory_ratio")
    met = None if mr is None else mr <= 1.0
    note = None
    if v and v.get("torch_note"):
        met, note = True, v["torch_note"]
    out.append({"target": f"{name} bf16: align peak memory <= PyTorch's{dry}", "value": mr, "threshold": 1.0, "met": met,
                "note": note or (v or {}).get("torch_skipped")})
    for precision in ("bf16", "f32"):
        e = find_row(m, "effnet-b7", precision)
        name = (e or {}).get("name", "EfficientNet-B7 + BERT-base")
        ratio = (e or {}).get("ratio")
        out.append({"target": f"{name} {precision}: align samples/s >= 0.8x PyTorch{dry}", "value": ratio, "threshold": 0.8,
                    "met": None if ratio is None else ratio >= 0.8, "note": (e or {}).get("torch_skipped")})
    ok = steps["ops"]["status"] == "pass" and steps["training"]["status"] == "pass"
    out.append({"target": "every row of (1) and (2) passes", "value": None, "threshold": None, "met": ok, "note": None})
    return out


def fmt(x, spec, none="-"):
    return none if x is None else format(x, spec)


def table(headers, rows, indent="   "):
    cols = [headers] + rows
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cols):
        lines.append(indent + "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())
        if j == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return lines


def mark(ok):
    return "skipped" if ok is None else "pass" if ok else "FAIL"


def render(doc):
    env, steps = doc["device"], doc["steps"]
    mode = env.get("mode")
    L = []
    title = f"align GPU proof on {env.get('gpu') or 'no GPU'}"
    if mode == "cpu":
        title = "align GPU proof: DRY RUN on the CPU (tiny sizes; the figures mean nothing)"
    L.append(title)
    facts = [f"{k} {env[k]}" for k in ("driver", "gpu_memory", "compute_cap", "cpu_cores") if env.get(k)]
    if facts:
        L.append("   " + ", ".join(facts))
    if env.get("binary"):
        L.append(f"   binary {env['binary']}" + (f" ({env['build']})" if env.get("build") else ""))
    if doc.get("libraries"):
        L.append("   libraries: " + "; ".join(f"{k} {v}" for k, v in doc["libraries"].items()))
    L.append("")

    o = steps["ops"]
    n = len(o.get("rows", []))
    head = f"1. Kernels on {env.get('device', '?')} (f32) against the CPU in f64, forward and backward"
    if o.get("tolerance") is not None:
        head += f", tolerance {o['tolerance']:.0e}"
    L.append(f"{head}: {o['status'].upper()}" + (f" ({n - len(o['failed_ops'])}/{n} pass)" if n else ""))
    if o.get("error"):
        L.append(f"   {o['error']}")
    if o.get("rows"):
        L += table(["op", "shape", "fwd err", "bwd err", "ms/call", ""],
                   [[r.get("op"), r.get("shape"), fmt(r.get("forward_error"), ".1e"), fmt(r.get("backward_error"), ".1e"),
                     fmt(r.get("ms_per_call"), ".3f"), mark(r["pass"])] for r in o["rows"]])
    L.append("")

    t = steps["training"]
    tol = t["tolerances"]
    L.append(f"2. Demo model, {t.get('steps')} steps of batch {t.get('batch')}, same seed and batches, losses against the CPU in f32: "
             f"{t['status'].upper()}")
    L.append(f"   tolerance: f32 per-step |loss - cpu| / cpu <= {tol['f32_max_rel']:g} (expected ~{tol['f32_expected']:g}); "
             f"bf16 mean <= {tol['bf16_mean_rel']:g} and max <= {tol['bf16_max_rel']:g}")
    if t.get("error"):
        L.append(f"   {t['error']}")
    if t.get("rows"):
        L += table(["run", "kernels", "max rel", "mean rel", "first 10 max", "worst step", "final loss (cpu)", ""],
                   [[r["run"], r["kernels"], fmt(r.get("max_rel"), ".1e"), fmt(r.get("mean_rel"), ".1e"), fmt(r.get("first10_max_rel"), ".1e"),
                     fmt(r.get("worst_step") if r.get("max_rel") else None, "d"),
                     f"{fmt(r.get('final_loss'), '.4f')} ({fmt(r.get('reference_final_loss'), '.4f')})",
                     mark(r["pass"]) + (f": {r.get('error') or r.get('skipped')}" if r.get("error") or r.get("skipped") else "")]
                    for r in t["rows"]])
    L.append("")

    m = steps["model"]
    L.append(f"3. Training step (align bench model), align against PyTorch on the same device at the same batch: {m['status'].upper()}")
    if m.get("error"):
        L.append(f"   {m['error']}")
    s = m.get("settings") or {}
    if s:
        peaks = m.get("peak_tflops") or {}
        L.append(f"   {s.get('warmup')} warm-up + {s.get('steps')} timed steps{' (B7: 1 + 3)' if mode == 'cuda' else ''}, text {s.get('text_len')} tokens, AdamW, "
                 f"embed {s.get('embed_dim')}, ALIGN_KERNELS={m.get('align_kernels')}; batch: the largest power of two that fits, "
                 f"halving from a start; MFU against {fmt(peaks.get('bf16'), 'g')} (bf16) / {fmt(peaks.get('f32'), 'g')} (f32) TFLOP/s")
        if mode == "cuda":
            how = "sampled every 20 ms through NVML above the idle device" if m.get("external_memory") else "device memory in use after each phase"
            L.append(f"   peak memory: {how}, both sides")
    for note in m.get("notes") or []:
        L.append(f"   {note}")
    rows = sorted(m.get("rows", []), key=lambda r: (TABLE_ORDER.index(r["model"]) if r["model"] in TABLE_ORDER else 9, r["precision"] != "f32"))
    if rows:
        mem = "peak MiB" if mode == "cuda" else "RSS MiB"
        trs = []
        for r in rows:
            tried = " ".join(("=" if x.get("rerun") else "") + f"{x['batch']}" + ("" if x.get("outcome") == "ok" else f":{x.get('outcome')}")
                             for x in r.get("attempts") or [])
            if r.get("align"):
                a_cells = [fmt(r.get("batch"), "d"), fmt(r.get("align_samples_per_s"), ".1f"), pct(r.get("align_mfu")),
                           fmt(r.get("align_peak_mib"), ".0f")]
            else:
                a_cells = [fmt(r.get("batch"), "d"), r.get("align_error", "-")[:40], "", ""]
            if r.get("torch"):
                t_cells = [fmt(r.get("torch_samples_per_s"), ".1f"), pct(r.get("torch_mfu")), fmt(r.get("torch_peak_mib"), ".0f"),
                           fmt(r.get("ratio"), ".2f") + ("*" if r.get("torch_note") else ""), fmt(r.get("memory_ratio"), ".2f")]
            else:
                t_cells = [(r.get("torch_skipped") or "-")[:40], "", "", "", ""]
            trs.append([r["name"], r["precision"], tried] + a_cells + t_cells)
        L += table(["model", "prec", "batches tried", "batch", "align samples/s", "MFU", mem, "PyTorch samples/s", "MFU", mem, "speed ratio", "mem ratio"], trs)
        if any(r.get("torch_note") for r in rows):
            L.append("   * PyTorch ran out of memory at align's batch: compared at PyTorch's largest (=B: align re-run there)")
    L.append("")

    ld = steps["loader"]
    if ld["status"] == "done":
        L.append(f"4. Loader (align bench loader): {ld['images_per_s']:.0f} images/s with {ld['workers']} workers, "
                 f"{ld['images_per_s_per_core']:.0f} per core ({env.get('loader_source_px', '?')} px images -> "
                 f"{ld.get('image_size')} px crops, batch {ld.get('batch')})")
    else:
        L.append(f"4. Loader (align bench loader): ERROR: {ld.get('error')}")
    em = steps["embed"]
    if em["status"] == "done":
        L.append(f"5. Forward-only embedding (align bench embed): {em['images_per_s']:.1f} images/s, {em['images']} images "
                 f"and {em['texts']} texts at batch {em['batch']}, peak {em['peak_rss_mib'] or 0:.0f} MiB host memory")
    else:
        L.append(f"5. Forward-only embedding (align bench embed): ERROR: {em.get('error')}")
    L.append("")

    L.append("Targets")
    L += table(["target", "value", "met"],
               [[x["target"], tfmt(x), {True: "yes", False: "NO", None: "unknown"}[x["met"]] + (f" ({x['note']})" if x.get("note") else "")]
                for x in doc["targets"]])
    L.append("")
    L.append(f"Overall: {'PASS' if doc['passed'] else 'FAIL'}" + ("" if doc["passed"] else ": " + "; ".join(doc["failures"])))
    return "\n".join(L) + "\n"


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def tfmt(x):
    v = x["value"]
    if v is None:
        return "-"
    if "MFU" in x["target"]:
        return pct(v)
    return f"{v:.2f}"


def report(a):
    raw = Path(a.raw)
    out = Path(a.out)
    env = read_kv(raw / "env.txt")
    for k in ("cpu_cores", "train_steps", "train_batch", "budget_s", "loader_source_px"):
        if env.get(k, "").isdigit():
            env[k] = int(env[k])
    for k in ("peak_bf16_tflops", "peak_f32_tflops", "seconds"):
        try:
            env[k] = float(env[k])
        except (KeyError, ValueError):
            env[k] = None
    commands = read_commands(raw)
    mode = env.get("mode", "cuda")
    steps = {
        "ops": report_ops(raw, commands),
        "training": report_training(raw, commands, env),
        "model": report_models(raw, mode),
        "loader": report_loader(raw, commands),
        "embed": report_embed(raw, commands),
    }
    # Steps left out with GPU_PROOF_STEPS are not failures.
    asked = (env.get("steps") or "1 2 3 4 5").split()
    failures = []
    if "1" in asked and steps["ops"]["status"] != "pass":
        failures.append("step 1: " + (", ".join(steps["ops"]["failed_ops"]) or steps["ops"].get("error", "error")))
    if "2" in asked and steps["training"]["status"] != "pass":
        bad = [r["run"] for r in steps["training"]["rows"] if r["pass"] is False]
        failures.append("step 2: " + (", ".join(bad) or steps["training"].get("error", "error")))
    if "3" in asked and steps["model"]["status"] == "error":
        failures.append("step 3: " + ("; ".join(steps["model"].get("errors") or []) or steps["model"].get("error", "error")))
    if "4" in asked and steps["loader"]["status"] == "error":
        failures.append("step 4: " + steps["loader"].get("error", "error"))
    if "5" in asked and steps["embed"]["status"] == "error":
        failures.append("step 5: " + steps["embed"].get("error", "error"))
    libs = read_kv(raw / "libs.txt")
    doc = {
        "device": env,
        "libraries": libs,
        "steps": steps,
        "targets": None,
        "passed": not failures,
        "failures": failures,
        "seconds": env.get("seconds"),
    }
    doc["targets"] = targets(steps, mode)
    text = render(doc)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-proof.table").write_text(text)
    (out / "gpu-proof.json").write_text(json.dumps(doc, indent=1))
    sys.stdout.write(text)
    return 0 if doc["passed"] else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--align", required=True)
    b.add_argument("--device", default="cuda")
    b.add_argument("--out", required=True)
    b.add_argument("--deadline", type=float, required=True, help="seconds since the epoch after which no run starts")
    b.add_argument("--peak-f32", type=float)
    b.add_argument("--peak-bf16", type=float)
    b.add_argument("--bench-torch", default=str(Path(__file__).resolve().parent / "bench_torch.py"))
    b.add_argument("--steps", type=int, default=0, help="timed steps per run (default: 5 on a GPU, 2 on the CPU)")
    b.add_argument("--max-batch", type=int, help="count larger batches as out of memory (0: no limit; default: 4 on the CPU)")
    r = sub.add_parser("report")
    r.add_argument("--raw", required=True)
    r.add_argument("--out", required=True)
    w = sub.add_parser("torch-worker")
    w.add_argument("--bench-torch", required=True)
    a = p.parse_args()
    if a.cmd == "bench":
        return Bench(a).run()
    if a.cmd == "report":
        return report(a)
    return torch_worker(a)


if __name__ == "__main__":
    sys.exit(main())
