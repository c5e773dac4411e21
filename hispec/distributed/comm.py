"""The process group of a tensor-parallel model and its collectives, with timeouts and counters.

Two groups over the same ranks: ``data`` (NCCL on CUDA, gloo on CPU) carries the model's
all-reduces and all-gathers; ``control`` (always gloo, on CPU) carries the leader's commands
(see ``runtime.py``). Every collective has a timeout, so a rank that dies or stops answering
makes the others raise :class:`TensorParallelError` instead of waiting for ever.

Every collective is counted (calls and payload bytes per kind) so the cost of a forward call
under tensor parallelism is measured, not assumed (``CommCounter``).
"""
from __future__ import annotations

import datetime
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import envs

DEFAULT_TIMEOUT_S = envs.HISPEC_TP_TIMEOUT


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or stopped answering; the message says which and why."""


@dataclass
class CommCounter:
    """Collective calls and payload bytes (what each rank contributes) by kind."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, t: torch.Tensor) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += t.numel() * t.element_size()

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return {k: (self.calls[k], self.bytes[k]) for k in self.calls}

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


def split_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s part when ``n`` items are split as evenly as possible."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class Comm:
    """One rank's view of the group: rank, size, the two process groups, the counters."""

    def __init__(self, rank: int, world_size: int, data_group=None, control_group=None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, nccl: bool = False) -> None:
        self.rank, self.world_size = rank, world_size
        # NCCL: waiting with a timeout would block the CPU on every collective; its watchdog enforces
        # the group's timeout instead (and tears the process down, TORCH_NCCL_ASYNC_ERROR_HANDLING)
        self.nccl = nccl
        self.data_group, self.control_group = data_group, control_group
        self.timeout_s = timeout_s
        self.counter = CommCounter()
        self.broken = False  # a collective failed: the group cannot be used any more

    # ---- the model's collectives (data group) ----------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place. Every rank ends with the same bits (ring/tree
        all-reduce computes each element once and distributes it)."""
        if self.world_size == 1:
            return t
        self.counter.add("all_reduce", t)
        self._wait_data(dist.all_reduce(t, group=self.data_group, async_op=True), "all_reduce")
        return t

    def all_gather_last(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each rank's ``t [..., sizes[rank]]`` along the last dimension -> ``[..., sum(sizes)]``."""
        if self.world_size == 1:
            return t
        width = max(sizes)
        if t.shape[-1] < width:  # all-gather needs equal shapes: pad, then cut
            t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self.counter.add("all_gather", t)
        self._wait_data(dist.all_gather(parts, t, group=self.data_group, async_op=True), "all_gather")
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def broadcast_data(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` to every rank (same shape and dtype allocated beforehand), in place."""
        if self.world_size > 1:
            self.counter.add("broadcast", t)
            self._wait_data(dist.broadcast(t, 0, group=self.data_group, async_op=True), "broadcast")
        return t

    # ---- the leader's commands (control group, CPU) ---------------------------------------
    def broadcast_control(self, t: torch.Tensor, timeout_s: float | None = None) -> torch.Tensor:
        """Rank 0's int64 CPU tensor ``t`` to every rank, in place."""
        self._wait(dist.broadcast(t, 0, group=self.control_group, async_op=True), "command broadcast", timeout_s)
        return t

    def _wait_data(self, work, what: str) -> None:
        if self.nccl:
            work.wait()  # orders the current CUDA stream after the collective; the CPU runs on
        else:
            self._wait(work, what)

    def _wait(self, work, what: str, timeout_s: float | None = None) -> None:
        timeout = datetime.timedelta(seconds=timeout_s or self.timeout_s)
        try:
            done = work.wait(timeout)
        except Exception as e:  # gloo: a peer closed its connection; NCCL: the watchdog aborted
            self.broken = True
            raise TensorParallelError(f"tensor-parallel rank {self.rank}/{self.world_size}: {what} failed "
                                      f"(another rank exited or failed): {str(e).splitlines()[0]}") from None
        if done is False:
            self.broken = True
            raise TensorParallelError(f"tensor-parallel rank {self.rank}/{self.world_size}: {what} timed out after "
                                      f"{timeout.total_seconds():.0f} s (another rank stopped answering)")


def init_group(rank: int, world_size: int, address: str, device: torch.device,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> Comm:
    """Join the group at ``address`` (``file://...`` or ``tcp://host:port``): NCCL for CUDA devices, else gloo."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size, timeout=timeout,
                            **({"device_id": device} if device.type == "cuda" else {}))
    data = dist.group.WORLD
    control = dist.new_group(backend="gloo", timeout=timeout)
    return Comm(rank, world_size, data, control, timeout_s, nccl=backend == "nccl")
