"""What the speculation policy measured on this machine, kept between processes (as the kernel
choices are): a fresh process's policy starts from the rates, gains and step times its last run
measured for the same model, strategy, settings and CPU, instead of measuring every mode again.

A fresh controller measures each mode a few times per batch size before it trusts the averages; a
speculative round at a batch size where it loses (at batch 16 on 2 cores, ~2.4x a plain step per
token) costs a short generation, or a server's first minutes, several percent. Started from what was
measured before, the controller takes the better mode at once and re-measures the other only now and
then (the longest interval where the saved rates say it clearly loses); the measurements go on as
before, and the file follows them. Every mode gives the same tokens, so a stale file costs speed only.

``$HISPEC_HOME/policy/<key>.json``; ``HISPEC_POLICY_MEMORY=0`` turns it off (the test suite does).
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch

from .. import envs

_MEMORIES: dict[str, "Memory"] = {}
SAVE_EVERY_S = 30.0  # at most one write in this many seconds, unless a batch size or mode was measured first


@functools.cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def policy_key(model, strategy) -> str:
    """What the measurements depend on: the model's shape, weight format and KV dtype, its exits, the
    strategy and its settings, the device (the CPU's model name and the threads)."""
    cfg = model.cfg
    parts = [cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
             cfg.num_kv_heads, model.weight_format, str(model.kv_dtype), sorted(model.exits), str(model.device),
             strategy.name, repr(strategy.spec), _cpu_name(), torch.get_num_threads()]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def _path(key: str) -> Path:
    return envs.HISPEC_HOME / "policy" / f"{key}.json"


def load(key: str) -> dict | None:
    """The state saved under ``key`` (None: none, unreadable, or memory off)."""
    if not envs.HISPEC_POLICY_MEMORY:
        return None
    try:
        return json.loads(_path(key).read_text())
    except (OSError, ValueError):
        return None


def save(key: str, state: dict) -> None:
    """Write ``state`` under ``key`` (atomically; a failure to write is ignored: it only costs speed)."""
    if not envs.HISPEC_POLICY_MEMORY:
        return
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def memory_for(key: str) -> "Memory":
    """The process's one ``Memory`` of ``key``: the engines of a key (``Generator`` makes one a call)
    share its write interval and its one write at exit."""
    m = _MEMORIES.get(key)
    if m is None:
        m = _MEMORIES[key] = Memory(key)
    return m


class Memory:
    """One policy's link to its file: ``load`` once, ``maybe_save`` as requests finish (at once where
    the state has a batch size or mode the file lacks, else at most every ``SAVE_EVERY_S``); the last
    state offered is written when the process exits."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._saved_at: float | None = None
        self._saved_keys: set[str] = set()
        self._pending: dict | None = None
        atexit.register(self._flush)

    def load(self) -> dict | None:
        return load(self.key)

    def maybe_save(self, state: dict) -> None:
        now = time.monotonic()
        keys = set(state.get("rates", {})) | {f"free:{b}" for b in state.get("free", {})}
        if self._saved_at is None or now - self._saved_at >= SAVE_EVERY_S or not keys <= self._saved_keys:
            save(self.key, state)
            self._saved_at, self._saved_keys, self._pending = now, keys, None
        else:
            self._pending = state

    def _flush(self) -> None:
        if self._pending is not None:
            save(self.key, self._pending)
            self._pending = None
