"""Large CPU tensors in transparent huge pages (2 MiB) rather than 4 KiB ones.

A decode step streams every weight once (~100 MB for the default model) and attention reads the
KV cache, both from memory. On 4 KiB pages that is ~25,000 pages a step, each a TLB miss with its
page walk, and the hardware prefetchers stop at each page's end. On 2 MiB pages it is ~50. One
decode step's matmuls (``scripts/bench-kernels-step.c``, default model, q8a, 2 threads, Zen 4)
took 4.4 / 5.2 / 11.8 ms at 1 / 4 / 16 rows with the weights where ``malloc`` put them and
3.6 / 4.0 / 10.1 ms in huge pages (interleaved medians).

Linux gives huge pages to the 2 MiB-aligned stretches of an anonymous mapping advised with
``MADV_HUGEPAGE`` (transparent huge pages set to ``madvise`` or ``always``), so the tensors here
are views of one such mapping (an *arena*): :func:`zeros` for new ones (the KV pool), :func:`gather`
to move a model's parameters and buffers there once it is loaded. The values and the layout are
unchanged, so is every result. Elsewhere (another OS, THP ``never``, ``HISPEC_HUGE_PAGES=0``, a GPU
model) tensors are left where they are.
"""
from __future__ import annotations

import mmap
import re
from pathlib import Path

import torch
from torch import nn

from .. import envs

HUGE_PAGE = 2 << 20  # bytes
ALIGN = 64  # each tensor starts on a cache line
MIN_BYTES = 64 << 10  # smaller parameters and buffers stay where they are (norms, biases)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent-huge-page setting (``always``, ``madvise``, ``never``), or ``""``
    where there is none (not Linux)."""
    try:
        found = re.search(r"\[(\w+)\]", THP_SETTING.read_text())
    except OSError:
        return ""
    return found.group(1) if found else ""


def available() -> bool:
    """Whether tensors can be placed in huge pages here."""
    return envs.HISPEC_HUGE_PAGES and hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Each size's start in an arena (cache-line aligned) and the arena's bytes."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    return offsets, end


_arenas: list[tuple[int, int]] = []  # (start, end) address of each arena made, for residency()


class _Arena:
    """``nbytes`` zeroed bytes starting on a huge-page boundary, in a mapping advised for huge
    pages; :meth:`tensor` cuts tensors from it, each with a storage of its own (saved and compared
    as any tensor; each keeps the mapping alive)."""

    def __init__(self, nbytes: int) -> None:
        # anonymous and private (a shared one is shmem, which THP's own setting usually keeps out):
        # zeros; the spare page lets it start aligned
        self.buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
        self.buf.madvise(mmap.MADV_HUGEPAGE)
        address = torch.frombuffer(self.buf, dtype=torch.uint8, count=1).data_ptr()
        self.skip = -address % HUGE_PAGE
        _arenas.append((address + self.skip, address + self.skip + nbytes))

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A ``shape`` ``dtype`` tensor on the arena's bytes from ``offset`` on."""
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(self.buf, dtype=torch.uint8, count=nbytes, offset=self.skip + offset)
        return raw.view(dtype).view(shape)


def residency() -> tuple[int, int]:
    """(bytes of this process's arenas that are resident, of those in huge pages), from
    ``/proc/self/smaps`` ((0, 0) where there is none). Linux gives a 2 MiB stretch a huge page when it
    is first touched and one is free; otherwise it stays in 4 KiB pages."""
    if not _arenas:
        return 0, 0
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0, 0
    resident = huge = 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = any(lo < end and start < hi for start, end in _arenas)
        elif inside and head in ("Rss:", "AnonHugePages:"):
            kib = int(line.split()[1]) * 1024
            resident += kib if head == "Rss:" else 0
            huge += kib if head == "AnonHugePages:" else 0
    return resident, huge


def describe() -> str:
    """Where the weights and KV cache are, for ``--stats``."""
    if not available():
        why = ("HISPEC_HUGE_PAGES=0" if not envs.HISPEC_HUGE_PAGES else
               f"transparent huge pages {thp_mode()}" if thp_mode() else "no transparent huge pages here")
        return f"weights and KV cache in 4 KiB pages ({why})"
    resident, huge = residency()
    return (f"weights and KV cache in huge pages where the OS gave them: {huge / 2**20:.0f} of "
            f"{resident / 2**20:.0f} MiB resident")


def zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed CPU tensors of these shapes in one arena of huge pages (``torch.zeros`` each where
    :func:`available` is false)."""
    if not available():
        return [torch.zeros(s, dtype=dtype) for s in shapes]
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [item * _numel(s) for s in shapes]
    offsets, total = _offsets(sizes)
    arena = _Arena(total)
    return [arena.tensor(o, s, dtype) for o, s in zip(offsets, shapes)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def gather(*modules: nn.Module, min_bytes: int | None = None) -> int:
    """Copy the CPU parameters and buffers of ``modules`` (contiguous, at least ``min_bytes``,
    default ``MIN_BYTES``, and not only an embedding's table) into one arena of huge pages and put
    the copies in their place (a tensor held under several names, such as tied embeddings, stays
    one tensor). Returns the arena's bytes (0 where :func:`available` is false). Call it before
    anything keeps a reference to the old tensors: a decoder layer's plans are dropped
    (``_replanned``), but a tensor held elsewhere keeps the old memory."""
    if not available():
        return 0
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    places: dict[int, list[tuple[nn.Module, str, bool]]] = {}  # id(tensor) -> where it is held
    tensors: dict[int, torch.Tensor] = {}
    for module in modules:
        for mod in module.modules():
            for is_param, held in ((True, mod._parameters), (False, mod._buffers)):
                for name, t in held.items():
                    if t is None or t.device.type != "cpu" or not t.is_contiguous() \
                            or t.numel() * t.element_size() < min_bytes:
                        continue
                    tensors[id(t)] = t
                    places.setdefault(id(t), []).append((mod, name, is_param))
    for key, held_by in places.items():  # a lookup table reads one row a token: where it is does not matter
        if all(isinstance(mod, nn.Embedding) for mod, _, _ in held_by):
            del tensors[key]
    if not tensors:
        return 0
    keys = list(tensors)
    sizes = [tensors[k].numel() * tensors[k].element_size() for k in keys]
    offsets, total = _offsets(sizes)
    arena = _Arena(total)
    for key, off in zip(keys, offsets):
        old = tensors.pop(key)
        new = arena.tensor(off, tuple(old.shape), old.dtype)
        new.copy_(old)
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        for mod, name, is_param in places[key]:
            (mod._parameters if is_param else mod._buffers)[name] = new
        del old
    for module in modules:
        for mod in module.modules():
            if hasattr(mod, "_replanned"):  # a decoder layer: its plans held the old tensors
                mod._replanned()
    return total
