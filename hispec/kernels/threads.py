"""Which threads run parallel regions: one thread computes, the others never do.

PyTorch and hispec's kernels run in OpenMP (libgomp) parallel regions. libgomp keeps a pool of
worker threads for every thread that has started a parallel region, for as long as that thread
lives, and its waiting workers spin only while the process's pools hold no more threads than it
has CPUs. Past that, every barrier is a futex sleep and a wake-up. A server that loads its model
in the main thread (quantizing, tiling and timing kernels there) and then steps it from its engine
thread holds two pools. On a 2-core machine each parallel region then cost ~45 us instead of ~2,
and the server's steps took ~1.8x the same steps run offline: ~70% and ~60% busy threads where
offline ones are 100% busy.

So a process that computes from a thread other than its main one loads its model with
:func:`in_own_thread`, whose pool ends with that thread, and calls :func:`set_threads` at the
start of the thread that computes. The main thread then never starts a parallel region.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")
_warned = False  # check_thread says it once a process


def in_own_thread(fn: Callable[..., T], *args, name: str = "hispec-load", **kwargs) -> T:
    """``fn(*args, **kwargs)`` run in a new thread that ends when it returns: its result, or the
    exception it raised, raised here. The thread's OpenMP pool ends with it."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    # a daemon: a Ctrl-C that ends the caller's wait ends the process, not after the load
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["result"]  # type: ignore[return-value]


def set_threads(n: int | None) -> None:
    """This thread's parallel regions (PyTorch's and hispec's kernels) run on ``n`` threads; None
    leaves them as they are. The setting is the calling thread's own: a thread started later
    takes PyTorch's last one when it first computes, and hispec's kernels take libgomp's default
    (``OMP_NUM_THREADS``, else every CPU) until it is called there."""
    if n is not None:
        torch.set_num_threads(max(1, int(n)))


def check_thread(loaded_in: threading.Thread | None) -> None:
    """Says once a process (a warning) when a model loaded by thread ``loaded_in`` computes on
    several threads from another thread while ``loaded_in`` still lives: two OpenMP pools, whose
    parallel regions then sleep and wake through the OS (see above)."""
    global _warned
    current = threading.current_thread()
    if _warned or loaded_in is None or current is loaded_in or not loaded_in.is_alive():
        return
    if torch.get_num_threads() <= 1:
        return
    _warned = True
    log.warning("the model was loaded in thread %r and now computes in %r while that thread lives on: "
                "each holds a pool of OpenMP threads, and with more of them than CPUs every parallel region "
                "sleeps and wakes through the OS (on 2 cores, steps took 1.8x as long). Load and generate in "
                "the same thread, or load with hispec.kernels.threads.in_own_thread(Generator.from_pretrained, "
                "...) and call set_threads(n) in the thread that generates.", loaded_in.name, current.name)
