"""results.json: machine, model, commit, config, strategies (see ``metrics``), targets."""
from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from ..paths import portable
from ..settings import StrategyName
from .memory import method as memory_method
from .metrics import mismatches, summarize
from .runner import BenchRun

AR = StrategyName.AR  # the reference: plain decoding, hispec's own

SCHEMA_VERSION = 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    info = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": str(device) if device.type != "cuda" else f"{device} ({torch.cuda.get_device_name(device)})",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "memory_measure": memory_method(device),
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages: other work on the machine skews timings."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def git_commit(path: Path | None = None) -> str | None:
    """The commit of the repository holding this package (``+dirty`` with local changes)."""
    where = path or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "") if sha else None


def model_info(generator, name: str) -> dict:
    model = generator.model
    cfg = model.cfg
    info = {
        "name": name,
        "path": portable(generator.model_path),
        "family": cfg.family,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "dtype": str(model.dtype).replace("torch.", ""),
        "weight_format": model.weight_format,
        "kv_cache_dtype": str(model.kv_dtype).replace("torch.", ""),
        "parameters": _parameters(model),
        "kernels": weight_kernels(model),
    }
    exits = generator.exits
    rec = generator.recommended_spec
    info["exit_heads"] = None if exits is None or (not exits.heads and rec is None) else {
        "path": portable(exits.path),
        "layers": sorted(int(k) for k in exits.heads),
        "recommended_spec": None if rec is None else
        {k: v for k, v in dataclasses.asdict(rec).items() if k != "num_layers"}}
    return info


def weight_kernels(model) -> list[str]:
    """The kernels the model's quantized weights ran on (``QuantLinear.kernel``: e.g. ``q4`` and ``q8``
    for the decoder's 4-bit blocks and a Q8_0 head), sorted; empty for float weights. Which 4-bit
    kernel runs is timed per machine (or set by ``HISPEC_Q4_KERNEL``), so a result file says it."""
    from ..kernels.quant import QuantLinear

    modules = getattr(model, "modules", None)
    if not callable(modules):
        return []
    return sorted({m.kernel for m in modules() if isinstance(m, QuantLinear)})


def _parameters(model) -> int | None:
    params = getattr(model, "parameters", None)
    if not callable(params):
        return None
    try:
        return sum(p.numel() for p in params())
    except TypeError:  # pragma: no cover
        return None


def targets(strategies: dict) -> dict:
    """The issue's targets as measured ratios (best variant of each kind)."""
    def best(kind: str) -> tuple[str | None, float | None]:
        rows = [(label, e["tokens_per_second"]) for label, e in strategies.items()
                if e["kind"] == kind and e["available"] and e["tokens_per_second"]]
        return max(rows, key=lambda r: r[1]) if rows else (None, None)

    ar, hf, ss, hs, ee = (best(k) for k in (AR, "hf", StrategyName.SELFSPEC, StrategyName.HISPEC, "hf-early-exit"))

    def ratio(a, b, goal: float, strict: bool = False) -> dict:
        value = round(a[1] / b[1], 3) if a[1] and b[1] else None
        met = None if value is None else (value > goal if strict else value >= goal)
        return {"value": value, "goal": goal, "met": met, "of": a[0], "against": b[0]}

    identical = [e["identical_to_ar"] for e in strategies.values()
                 if e["available"] and e["kind"] not in (AR, "peer")]  # peers' kernels differ: reported apart
    return {
        "ar_vs_hf": ratio(ar, hf, 1.5),
        "hispec_vs_ar": ratio(hs, ar, 2.0),
        "hispec_vs_best_selfspec": ratio(hs, ss, 1.3),
        "hispec_vs_best_hf_early_exit": ratio(hs, ee, 1.0, strict=True),
        "all_identical_to_ar": None if not identical or None in identical else all(identical),
    }


def build_results(run: BenchRun, generator, *, model_name: str, config: dict, started: float,
                  load_at_start: list[float] | None = None) -> dict:
    strategies = summarize(run)
    for label, entry in strategies.items():
        if entry["identical_to_ar"] is False:
            entry["mismatched_prompts"] = mismatches(run, label)
    machine = machine_info(generator.model.device)
    if load_at_start is not None:
        machine["load_average_at_start"] = load_at_start
    if hasattr(os, "getloadavg"):
        machine["load_average_at_end"] = load_average()
    ar = strategies.get(AR)
    if ar and ar.get("available") and ar.get("tokens_per_second") and generator.model.device.type == "cpu":
        from .memory import copy_bandwidth, roofline
        decode = ar.get("decode_tokens_per_second") or ar["tokens_per_second"]  # a step's time, prefill apart
        machine["memory_roofline_ar"] = roofline(generator.model, 1.0 / decode, copy_bandwidth())
    return {
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "machine": machine,
        "model": model_info(generator, model_name),
        "commit": git_commit(),
        "config": config,
        "strategies": strategies,
        "targets": targets(strategies),
    }
