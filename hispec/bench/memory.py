"""Peak memory of one generation, without psutil.

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (tensor bytes).
- CPU on Linux: the process's peak resident set (``VmHWM``), reset before each generation by
  writing ``5`` to ``/proc/self/clear_refs``, so each strategy gets its own peak. Before the
  reset, glibc's ``malloc_trim(0)`` hands freed heap pages back to the system, so the resident
  set starts near the live memory and the peak shows what the generation itself added.
- elsewhere: ``resource.getrusage`` ``ru_maxrss`` (the process's peak so far; not resettable).

``bytes`` is the peak (weights and everything else the process holds included); ``added`` is
the peak minus the memory in use when the generation started: its own working memory (KV
blocks it filled, activations, logits, speculative state).
"""
from __future__ import annotations

import re
import sys

import torch

from ..kernels import hugepages

_STATUS = {key: re.compile(rf"^{key}:\s+(\d+)\s+kB", re.M) for key in ("VmHWM", "VmRSS")}


def _read_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = _STATUS[key].search(f.read())
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def _read_hwm() -> int | None:
    return _read_status("VmHWM")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _ru_maxrss() -> int | None:
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def method(device: torch.device) -> str:
    """How ``PeakMemory`` measures on this device (written into results.json)."""
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated (tensor bytes)"
    if _read_hwm() is not None and _reset_hwm():
        return "process peak RSS (VmHWM; heap trimmed and peak reset before each generation)"
    return "process peak RSS so far (ru_maxrss; not resettable here)"


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.bytes``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start: int | None = None
        self.bytes: int | None = None

    @property
    def added(self) -> int | None:
        return None if self.bytes is None or self.start is None else max(self.bytes - self.start, 0)

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = int(torch.cuda.memory_allocated(self.device))
        else:
            hugepages.trim_heap()
            if _reset_hwm():
                self.start = _read_status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self.bytes = _read_hwm() or _ru_maxrss()


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Measured memory bandwidth in bytes/s: the best of ``repeats`` copies of an ``nbytes`` tensor
    (each copy reads and writes ``nbytes``, so 2 x nbytes move)."""
    import time

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def step_weight_bytes(model) -> int:
    """Bytes of weights a one-token step reads: every parameter and buffer (quantized layers keep
    their blocks as buffers), each tensor once, the embedding tables excepted (a step reads one row;
    a tied head's table is counted as the head)."""
    from itertools import chain

    from torch import nn

    seen = {}
    for mod in model.modules():
        if isinstance(mod, nn.Embedding) or hasattr(mod, "rows"):  # nn.Embedding, GGUFEmbedding
            continue
        for t in chain(mod.parameters(recurse=False), mod.buffers(recurse=False)):
            seen[id(t)] = t
    return sum(t.numel() * t.element_size() for t in seen.values())


def roofline(model, seconds_per_token: float, bandwidth: float) -> dict:
    """How close one-token decoding comes to the memory roofline: every weight byte is read once
    per token, so a step cannot take less than ``weight_bytes / bandwidth``."""
    weight_bytes = step_weight_bytes(model)
    floor = weight_bytes / bandwidth
    return {"weight_bytes": weight_bytes, "bandwidth_bytes_per_second": round(bandwidth),
            "floor_seconds_per_token": round(floor, 5), "seconds_per_token": round(seconds_per_token, 5),
            "fraction_of_roofline": round(floor / seconds_per_token, 3) if seconds_per_token else None}
