"""Timing kernels against each other on this machine (the choices in ``matmul.py``, ``quant.py``
and ``select.py`` are made this way)."""
from __future__ import annotations

import time


def interleaved_medians(fns: dict, reps: int, warmup: int = 0) -> dict:
    """Median seconds of each call in ``fns`` (name -> function), the calls interleaved so a busy
    moment of the machine hits every one alike; the first ``warmup`` rounds are not counted."""
    times: dict = {name: [] for name in fns}
    for r in range(warmup + reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: sorted(v)[len(v) // 2] for name, v in times.items()}
