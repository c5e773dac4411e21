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

import math
import mmap
import re
import weakref
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


_arenas: list[tuple[weakref.ref, int, int]] = []  # (mapping, start, end) of each arena, for residency()


def _arena(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Zeroed tensors of these ``(shape, dtype)`` in one anonymous mapping advised for huge pages,
    which starts on a huge-page boundary, each tensor on a cache line and with a storage of its
    own (saved and compared as any tensor; each keeps the mapping alive)."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    # anonymous and private (a shared one is shmem, which THP's own setting usually keeps out):
    # zeros; the spare page lets it start aligned
    buf = mmap.mmap(-1, end + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    buf.madvise(mmap.MADV_HUGEPAGE)
    address = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
    skip = -address % HUGE_PAGE
    _arenas[:] = [a for a in _arenas if a[0]() is not None]  # (those whose tensors are all gone drop out)
    _arenas.append((weakref.ref(buf), address + skip, address + skip + end))
    return [torch.frombuffer(buf, dtype=torch.uint8, count=size, offset=skip + off).view(dtype).view(shape)
            if size else torch.empty(shape, dtype=dtype)
            for (shape, dtype), size, off in zip(specs, sizes, offsets)]


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
            inside = any(lo < end and start < hi for alive, start, end in _arenas if alive() is not None)
        elif inside and head in ("Rss:", "AnonHugePages:"):
            kib = int(line.split()[1]) * 1024
            resident += kib if head == "Rss:" else 0
            huge += kib if head == "AnonHugePages:" else 0
    return resident, huge


def in_arena(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is in one of this process's arenas (gathered already)."""
    address = t.data_ptr()
    return any(start <= address < end for alive, start, end in _arenas if alive() is not None)


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
    return _arena([(tuple(s), dtype) for s in shapes])


def gather(*modules: nn.Module, min_bytes: int | None = None) -> int:
    """Copy the CPU parameters and buffers of ``modules`` (contiguous, at least ``min_bytes``,
    default ``MIN_BYTES``, not only an embedding's table, not in an arena already) into one arena of huge pages and put
    the copies in their place (a tensor held under several names, such as tied embeddings, stays
    one tensor). Returns the bytes moved (0 where :func:`available` is false). Call it before
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
                            or t.numel() * t.element_size() < min_bytes or in_arena(t):
                        continue
                    tensors[id(t)] = t
                    places.setdefault(id(t), []).append((mod, name, is_param))
    for key, held_by in places.items():  # a lookup table reads one row a token: where it is does not matter
        if all(isinstance(mod, nn.Embedding) for mod, _, _ in held_by):
            del tensors[key]
    if not tensors:
        return 0
    moved = sum(t.numel() * t.element_size() for t in tensors.values())
    news = _arena([(tuple(t.shape), t.dtype) for t in tensors.values()])
    for (key, old), new in zip(tensors.items(), news):
        new.copy_(old)
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        for mod, name, is_param in places[key]:
            (mod._parameters if is_param else mod._buffers)[name] = new
    tensors.clear()  # the old tensors go once nothing else holds them
    for module in modules:
        for mod in module.modules():
            if hasattr(mod, "_replanned"):  # a decoder layer: its plans held the old tensors
                mod._replanned()
    return moved


def trim_heap() -> None:
    """Hand freed heap pages back to the system (glibc's ``malloc_trim(0)``: it keeps them otherwise,
    ~80 MB after loading Gemma 3 270M's blocks); a no-op elsewhere."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None
