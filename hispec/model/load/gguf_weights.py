"""A GGUF file's own quantized blocks as :class:`~hispec.kernels.quant.QuantLinear` layers.

``gguf_convert`` writes a float32 copy of a GGUF model (the reference). This module reads the
same file's quantized tensors without dequantizing them and puts them on hispec's block kernels
(see ``quant.py``), in one of two forms, both blocks of 32 inputs per output row:

- the 4-bit form ``w = d * q + m`` (``q`` 0..15, ``d``, ``m`` float16; kernels ``q4``, ``q8a``,
  ``int4``: :meth:`QuantLinear.from_blocks`), and
- the 8-bit form ``w = d * q`` (``q`` int8, ``d`` float16; kernels ``q8``, ``q8a8``, ``int4x2``:
  :meth:`QuantLinear.from_q8_blocks`), also with a scale per 16 values (Q6_K; ``q8``, ``q8a8``).

GGUF block layouts (ggml's ``block_*`` structs, little-endian; ``d``, ``dmin``, ``m`` float16) and
how each maps::

    Q4_0 (32 weights, 18 bytes): d, qs[16]       w[j] = d * (q[j] - 8)
        4-bit form: m = -8 d (exact in float16); 8-bit form: q - 8, d (exact)
    Q4_1 (32 weights, 20 bytes): d, m, qs[16]    w[j] = d * q[j] + m
        4-bit form as stored (exact)
        for both: q[j] = qs[j] & 15 and q[j + 16] = qs[j] >> 4, j < 16 ("legacy" nibble order)
    Q5_0 (32 weights, 22 bytes): d, qh[4], qs[16]  w[j] = d * (q[j] - 16), q 5-bit:
        low 4 bits as Q4_0's nibbles, bit 4 of q[j] = bit j of qh read as a little-endian uint32
        8-bit form: q - 16 in -16..15, d (exact)
    Q8_0 (32 weights, 34 bytes): d, qs[32] int8  w[j] = d * qs[j]
        8-bit form as stored (exact)
    Q4_K (256 weights, 144 bytes): d, dmin, scales[12], qs[128]
        8 sub-blocks of 32, each with a 6-bit scale sc and a 6-bit min mn packed in scales:
        j < 4: sc = scales[j] & 63, mn = scales[j + 4] & 63;
        j >= 4: sc = (scales[j + 4] & 15) | (scales[j - 4] >> 6) << 4,
                mn = (scales[j + 4] >> 4) | (scales[j] >> 6) << 4;
        qs in 4 chunks of 32 bytes, each 64 weights: the low nibbles are its first 32 (sub-block
        2c), the high nibbles its last 32 (sub-block 2c + 1) ("K" nibble order);
        w = d * sc * q - dmin * mn.
        4-bit form per sub-block: d' = d * sc, m' = -dmin * mn, each computed exactly in float32
        and rounded once to float16, the only rounding: relative error <= 2^-11 of d' and of m'
        where they are normal float16, exact below (measured max 4.880e-4 for both on 41k random
        super-blocks: d, dmin in 1e-4..2e-2, random scale bytes); a weight moves by at most
        2^-11 (|d' q| + |m'|) (measured max 1.43e-3 of its sub-block's largest |w|, where d' q
        and m' nearly cancel). The nibbles are unpacked to ``q [N, K]`` and repacked by
        ``from_blocks`` in the legacy order the kernels read. A tensor whose d' or m' overflow
        float16 (not seen in real files) is requantized (below).
    Q6_K (256 weights, 210 bytes): ql[128], qh[64], scales[16] int8, d
        per half of 128 weights (ql 64 bytes, qh 32): values l, l + 32, l + 64, l + 96 (l < 32)
        take the low nibbles of ql[l], ql[l + 32], then their high nibbles, and bits 0-1, 2-3, 4-5,
        6-7 of qh[l] above them: q in 0..63; w = d * scales[j] * (q - 32), j = value / 16.
        8-bit form with a scale per 16 values ("group 16", kernels q8 and q8a8): q - 32 in
        -32..31, d16 = d * scales[j] computed exactly in float32 and rounded once to float16, the
        only rounding: relative error <= 2^-11 where d16 is a normal float16, exact below
        (measured max 4.8757e-4 over the 737,280 Q6_K scales of Gemma 3 270M's Q4_K_M file, 4.880e-4
        on random super-blocks); a weight moves by at most 2^-11 |d16 q|, i.e. 4.88e-4 of its
        16-value group's largest |w|. Without hispec's kernels (int4x2: no group of 16) it is
        requantized (below).

A fused layer (``FUSED``: q/k/v, gate/up) runs on the file's blocks when all its parts map to one
form (types may differ: Q5_0 + Q8_0 in the 8-bit form, Q4_K + Q4_0 in the 4-bit form; the 4-bit
form is preferred where both fit, i.e. all parts Q4_0; Q6_K's group of 16 is taken by the whole
layer, a scale per 32 being two equal ones per 16). Otherwise (a Q5_1, Q5_K, Q2_K, Q3_K, IQ*, F16,
... part, or parts in different forms) it runs in the 8-bit form with its parts that have no exact
8-bit form **requantized** from their float values (gguf's dequantization, what the float32 copy
holds) as Q8_0 quantizes (:func:`requantize_q8`: per block of 32, d = amax / 127 in float16, q =
round(w / d), at the layer's group; each weight moves by at most amax / 254), ~1.06 bytes per
weight: the block kernels give a row the same bits whatever rows share the call, which float32's
matmuls (one row: gemv; several: gemm) do not, and speculative verification must give one-token
decoding's tokens. A layer stays on its float32 copy only where its rows are not a multiple of 16
(the rows of a tile of 16 are packed together), a part is missing or a value is not finite
(``float_layers`` says which and why; the loader logs it with the requantized ones). The Q and K
rows of llama-architecture files are in llama.cpp's interleaved rotary order and are put back in
the model's (rows only: every block stays whole); qwen2, qwen3 and gemma3 files store them in the
model's order.
"""
from __future__ import annotations

import functools
import math

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ...kernels import hugepages
from ...kernels.quant import QuantLinear

BLOCK = 32
# our fused layer -> its GGUF parts, in the order the float loader fuses them
FUSED = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "gate_up_proj": ("ffn_gate", "ffn_up"),
         "o_proj": ("attn_output",), "down_proj": ("ffn_down",)}
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")  # types with the 4-bit form w = d * q + m
EIGHT_BIT = ("Q8_0", "Q5_0", "Q4_0", "Q6_K")  # types with the 8-bit form w = d * q (Q6_K: group 16)
GROUP16 = ("Q6_K",)  # types whose 8-bit form has a scale per 16 values
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0", "Q6_K")
SUPPORTED = "Q4_0, Q4_1, Q4_K (4-bit blocks) and Q5_0, Q8_0, Q6_K (8-bit blocks)"  # for messages


def _split_f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block (``blocks [..., bytes]`` uint8) -> ``[...]`` float16."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0]


def _legacy_nibbles(qs: np.ndarray) -> np.ndarray:
    """``qs [..., 16]`` -> ``[..., 32]`` uint8 in 0..15: q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _rows(tensor) -> tuple[np.ndarray, str]:
    raw = np.asarray(tensor.data, dtype=np.uint8)
    return raw.reshape(raw.shape[0], -1), tensor.tensor_type.name


def _blocks(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [N, K]`` uint8 in 0..15 and ``d, m [N, K / 32]`` float16 (``w = d * q + m``) of a Q4_0,
    Q4_1 or Q4_K tensor (see the module's docstring); ValueError where a Q4_K's ``d'`` or ``m'``
    overflow float16."""
    raw, kind = _rows(tensor)
    n = raw.shape[0]
    if kind == "Q4_K":
        return _q4_k_blocks(raw)
    if kind not in ("Q4_0", "Q4_1"):
        raise ValueError(f"{kind} has no 4-bit form w = d * q + m")
    head = 2 if kind == "Q4_0" else 4  # bytes of d (and m) before the 16 bytes of nibbles
    blocks = raw.reshape(n, -1, head + 16)  # [N, K/32, bytes]
    d = _split_f16(blocks, 0)  # [N, K/32]
    m = _split_f16(blocks, 2) if kind == "Q4_1" else -8 * d  # exact in float16 (a power of two)
    q = _legacy_nibbles(blocks[..., head:]).reshape(n, -1)  # [N, K]
    return torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(m))


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``scales [..., 12]`` uint8 -> the 8 sub-blocks' 6-bit scales and mins, ``[..., 8]`` uint8 each."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _q4_k_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows ``[N, K / 256 * 144]`` uint8 -> the 4-bit form per sub-block of 32 (module docstring)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 144)  # [N, K/256, 144]
    d, dmin = _split_f16(blocks, 0).astype(np.float32), _split_f16(blocks, 2).astype(np.float32)
    sc, mn = _q4_k_scales(blocks[..., 4:16])  # [N, K/256, 8]
    with np.errstate(over="ignore"):  # overflow is checked below
        d32 = (d[..., None] * sc.astype(np.float32)).astype(np.float16)  # exact in float32, rounded once
        m32 = (-(dmin[..., None] * mn.astype(np.float32))).astype(np.float16)
    if not (np.isfinite(d32).all() and np.isfinite(m32).all()):
        raise ValueError("a Q4_K sub-block's scale d * sc or min dmin * m overflows float16")
    qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32)  # [N, K/256, chunk, 1, byte]
    q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, -1)  # [N, K]: chunk c = sub-blocks 2c, 2c + 1
    return (torch.from_numpy(q), torch.from_numpy(d32.reshape(n, -1)), torch.from_numpy(m32.reshape(n, -1)))


def _q6_k_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K rows ``[N, K / 256 * 210]`` uint8 -> the 8-bit form, group 16 (module docstring):
    ``q [N, K]`` int8 in -32..31, ``d [N, K / 16]`` float16; ValueError where a d * sc overflows."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 210)  # [N, K/256, 210]: ql[128], qh[64], scales[16] int8, d
    ql, qh = blocks[..., :128].reshape(n, -1, 2, 64), blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
    lo = np.concatenate([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    hi = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # [N, K/256, 2, 4, 32]: 2 bits per value
    q = (lo | (hi.reshape(n, -1, 2, 128) << 4)).astype(np.int8) - np.int8(32)  # per half of 128: 4 runs of 32
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, K/256, 16]
    d = _split_f16(blocks, 208).astype(np.float32)
    with np.errstate(over="ignore"):
        d16 = (d[..., None] * sc).astype(np.float16)  # exact in float32, rounded once
    if not np.isfinite(d16).all():
        raise ValueError("a Q6_K scale d * sc overflows float16")
    return torch.from_numpy(np.ascontiguousarray(q.reshape(n, -1))), torch.from_numpy(d16.reshape(n, -1))


def _q8_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, K]`` int8 and ``d [N, K / 32]`` float16 (``w = d * q``) of a Q8_0, Q5_0 or Q4_0
    tensor, ``d [N, K / 16]`` of a Q6_K one (see the module's docstring)."""
    raw, kind = _rows(tensor)
    n = raw.shape[0]
    if kind == "Q6_K":
        return _q6_k_blocks(raw)
    if kind == "Q8_0":  # d, then 32 int8
        blocks = raw.reshape(n, -1, 2 + BLOCK)
        q = blocks[..., 2:].copy().view(np.int8)
    elif kind == "Q5_0":  # d, qh[4], qs[16]
        blocks = raw.reshape(n, -1, 22)
        high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # [N, K/32, 32]: bit j of qh
        q = (_legacy_nibbles(blocks[..., 6:]) | (high << 4)).view(np.int8) - np.int8(16)
    elif kind == "Q4_0":  # d, qs[16]
        blocks = raw.reshape(n, -1, 18)
        q = _legacy_nibbles(blocks[..., 2:]).view(np.int8) - np.int8(8)
    else:
        raise ValueError(f"{kind} has no 8-bit form w = d * q")
    d = _split_f16(blocks, 0)
    return torch.from_numpy(np.ascontiguousarray(q.reshape(n, -1))), torch.from_numpy(np.ascontiguousarray(d))


def form_of(kinds) -> str | None:
    """The block form that tensors of the GGUF types ``kinds`` share: ``"4-bit"`` (preferred where
    both fit), ``"8-bit"``, or None."""
    kinds = set(kinds)
    if kinds and kinds <= set(FOUR_BIT):
        return "4-bit"
    if kinds and kinds <= set(EIGHT_BIT):
        return "8-bit"
    return None


def requantize_q8(w: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights ``w [N, K]`` -> the 8-bit form ``w ~ d * q`` (``q [N, K]`` int8 in -127..127,
    ``d [N, K / group]`` float16), as Q8_0 quantizes: per block of ``group``, ``d`` = amax / 127
    rounded to float16 (one float16 step up where that fell below amax / 127, so that no code
    passes 127), ``q = round(w / d)``. Each weight moves by at most half a step, ``d / 2``: at most
    amax / 254 (1 + 2^-10) of its block's largest |w| where ``d`` is a normal float16 (amax >= 127 *
    2^-14), amax / 254 + 2^-25 below. ValueError where a value is not finite or ``d`` overflows."""
    w = w.float()
    n, k = w.shape
    blocks = w.reshape(n, k // group, group)
    amax = blocks.abs().amax(-1)
    if not torch.isfinite(amax).all():
        raise ValueError("a weight is not finite")
    d = (amax / 127).half()
    low = d.float() * 127 < amax  # exact product (11 x 7 bits)
    d = torch.where(low, (d.view(torch.int16) + 1).view(torch.float16), d)  # the next float16 up
    if not torch.isfinite(d).all():
        raise ValueError("a block's scale amax / 127 overflows float16")
    df = d.float()[..., None]
    q = torch.where(df > 0, torch.round(blocks / torch.where(df > 0, df, 1.0)), 0.0).clamp(-127, 127)
    return q.to(torch.int8).reshape(n, k), d.contiguous()


REQUANTIZE_ROWS = 4096  # rows dequantized at a time (the scratch of a 262k-row head stays small)


def _requantized_blocks(tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, K]`` int8 and ``d [N, K / group]`` float16 of a tensor of any type, from its float
    values (gguf's dequantization, as the float32 copy has them): :func:`requantize_q8`."""
    from gguf.quants import dequantize

    data, qs, ds = tensor.data, [], []
    for r0 in range(0, data.shape[0], REQUANTIZE_ROWS):
        w = dequantize(np.asarray(data[r0:r0 + REQUANTIZE_ROWS]), tensor.tensor_type)
        q, d = requantize_q8(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), group)
        qs.append(q), ds.append(d)
    return torch.cat(qs), torch.cat(ds)


def _group16_runs() -> bool:
    """Whether the 8-bit kernel GGUF weights get (``eight_bit_kernel``) has a scale per 16 values
    (``q8``, ``q8a8``; not ``int4x2``, where hispec's kernels are not built)."""
    from ...kernels.quant import Q8_STORAGE, eight_bit_kernel

    return eight_bit_kernel() in Q8_STORAGE


def _requantize_mask(types, overflow: bool = False) -> list[bool]:
    """Which parts of a layer that has no common exact form go to the 8-bit form from their float
    values: those without an exact 8-bit form, and (``overflow``: a scale product overflowed
    float16) those whose scales are products (Q4_K, Q6_K)."""
    return [k not in EIGHT_BIT or overflow and k in ("Q4_K", "Q6_K") for k in types]


CHUNK_ROWS = 4096  # a layer is mapped this many rows of a part at a time (module docstring)


def _native(tensors, form: str, source: str, undo=None, requantize=None, kernel4: str | None = None) -> QuantLinear:
    """One QuantLinear of ``tensors`` (their rows stacked in order) in ``form``; ``undo(i, x)``
    reorders part ``i``'s rows (any per-row array; a part so reordered is mapped whole).
    ``requantize`` (8-bit form only): which parts are requantized from their float values
    (:func:`requantize_q8`) rather than mapped exactly; the layer's ``requantized`` names their
    types.

    Built a piece at a time (``CHUNK_ROWS`` rows of a part) into the layer's final tensors (in huge
    pages where there are), so that loading holds one piece's scratch (unpacked codes, scales), not
    several copies of a whole layer or a 128k-row head (an 8B-shaped file's load peaked 1.3 GB
    above its weights). The kernels' tiled layouts go by rows, 16 a tile, so pieces of whole tiles
    side by side are the whole's layout; PyTorch's int4 packing is not, and is built whole."""
    requantize = list(requantize or [False] * len(tensors))
    kinds = [t.tensor_type.name for t in tensors]
    group = BLOCK
    if form == "8-bit":
        if not _group16_runs():  # no kernel with a scale per 16 values here: Q6_K parts requantized
            requantize = [r or k in GROUP16 for r, k in zip(requantize, kinds)]
        # a scale per 16 values for every part where one part has it (a scale per 32 is two equal ones)
        group = 16 if any(k in GROUP16 and not r for k, r in zip(kinds, requantize)) else BLOCK
    else:
        assert not any(requantize)

    def blocks(i, t):  # part i's rows of ``t`` in the form: (q, d, m) or (q, d), rows as the model's
        fix = (lambda x: undo(i, x)) if undo is not None else (lambda x: x)
        if form == "4-bit":
            return [fix(x) for x in _blocks(t)]
        q, d = _requantized_blocks(t, group) if requantize[i] else _q8_blocks(t)
        return [fix(q), fix(d.repeat_interleave(q.shape[1] // group // d.shape[1], dim=1))]

    def make(xs):  # a QuantLinear of these blocks
        if form == "4-bit":
            return QuantLinear.from_blocks(*xs, source, kernel=kernel4)
        return QuantLinear.from_q8_blocks(*xs, source)

    layer = _assembled(tensors, blocks, make, whole=undo is not None)
    layer.requantized = tuple(sorted({k for k, r in zip(kinds, requantize) if r}))
    return layer


def _assembled(tensors, blocks, make, whole: bool) -> QuantLinear:
    """The layer ``make`` builds of ``blocks(i, rows of part i)`` for every part, made a piece at a
    time (``CHUNK_ROWS`` rows; each part whole where ``whole``) into the final tensors, or all at
    once where the pieces' layouts do not line up (a part not of whole 16-row tiles, int4's packing,
    data that is not a file's rows)."""
    from ...kernels.quant import Q4_STORAGE, Q8_STORAGE

    def at_once():
        layer = make([torch.cat(xs) for xs in zip(*(blocks(j, u) for j, u in enumerate(tensors)))])
        for u in tensors:
            forget_pages(u)
        return layer

    n = sum(t.data.shape[0] for t in tensors)
    if any(t.data.shape[0] % 16 for t in tensors):
        return at_once()
    step = n if whole or not all(hasattr(t, "_replace") for t in tensors) else CHUNK_ROWS  # (test doubles: whole)
    layer, at, pdim = None, 0, 0
    for i, t in enumerate(tensors):
        for r0 in range(0, t.data.shape[0], step):
            rows_of_t = t if step >= t.data.shape[0] else t._replace(data=t.data[r0:r0 + step])
            piece = make(blocks(i, rows_of_t))
            rows = piece.out_features
            forget_pages(t, r0, r0 + rows)
            if rows == n:
                return piece
            if layer is None:
                if piece.kernel not in Q4_STORAGE + Q8_STORAGE:  # int4's packing: not by rows
                    return at_once()
                pdim = 1 if piece.kernel in Q4_STORAGE else 0  # q4 storage: dm [2, N, K / 32]
                layer = QuantLinear(piece.kernel, piece.in_features, n, _rows_like(piece.qweight, 0, rows, n),
                                    _rows_like(piece.qparams, pdim, rows, n), piece.group, source=piece.source,
                                    exact={k: _rows_like(v, 0, rows, n) for k, v in piece._exact.items()})
            layer.qweight.narrow(0, at, rows).copy_(piece.qweight)
            layer.qparams.narrow(pdim, at, rows).copy_(piece.qparams)
            for k, v in piece._exact.items():
                layer._exact[k].narrow(0, at, rows).copy_(v)
            at += rows
    return layer


def _rows_like(x: torch.Tensor, dim: int, rows: int, n: int) -> torch.Tensor:
    """A zeroed tensor like ``x`` (which holds ``rows`` rows along ``dim``) for ``n`` rows: a large one
    in huge pages of its own, a smaller one where ``torch.zeros`` puts it (``native_linears`` gathers
    those with their neighbours: an arena of less than 2 MiB gets no huge page, and the default
    model's layers, ~1 MB each, decoded ~4% slower so)."""
    shape = list(x.shape)
    shape[dim] = shape[dim] // rows * n
    if math.prod(shape) * x.element_size() >= GATHER_BYTES // 2:
        return hugepages.zeros([tuple(shape)], x.dtype)[0]
    return torch.zeros(shape, dtype=x.dtype)


def gguf_tensors(gguf_path: str | Path) -> list:
    """The tensors of a GGUF file (what ``gguf.GGUFReader(...).tensors`` gives: memory-mapped,
    nothing is read yet), from its header alone (``gguf_index``: ~0.1 s where GGUFReader's parse of
    the default model's metadata took ~2.4 s), once per process and file version (loading a model
    asks three times)."""
    p = Path(gguf_path).resolve()
    st = p.stat()
    return _tensors(str(p), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _tensors(path: str, mtime_ns: int, size: int) -> list:
    from .gguf_index import read_tensors

    return read_tensors(path)


def _unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (see ``gguf_convert._reverse_permute``): rows only, so
    every block stays whole."""
    rows = t.shape[0]
    half = rows // n_head // 2
    return t.reshape(n_head, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


class FloatLayer(NamedTuple):
    """A decoder linear left on its float32 copy: why, and what that costs."""
    name: str  # e.g. "layers.3.down_proj"
    types: tuple[str, ...]  # its parts' GGUF types
    weights: int  # number of weights (float32: 4 bytes each)
    file_bytes: int  # what its parts take in the file
    why: str


def _layer_parts(by_name: dict, i: int, parts: tuple[str, ...]) -> list:
    return [by_name.get(f"blk.{i}.{p}.weight") for p in parts]


def native_linears(gguf_path: str | Path, num_heads: int, num_kv_heads: int,
                   permuted: bool = True) -> tuple[dict[str, QuantLinear], str]:
    """QuantLinears for the file's decoder linears, by module name (``layers.3.qkv_proj``), and
    the file's types of those tensors (e.g. ``Q4_K+Q8_0``): a layer whose GGUF parts all map to
    one block form (module docstring) runs on the file's blocks; otherwise (a type without an
    exact form: Q5_K, Q3_K, F16, ...; parts whose forms differ) it runs in the 8-bit form, its
    parts without an exact 8-bit form requantized from their float values (:func:`requantize_q8`;
    the layer's ``requantized`` names their types): the block kernels give each row the same
    bits whatever rows share the call, which float32's matmuls do not. ``permuted``: the file's Q
    and K rows are in llama.cpp's interleaved rotary order (the ``llama`` architecture's files;
    qwen2, qwen3 and gemma3 files are not) and are put back in the model's. :func:`float_layers`
    tells which layers are left on float32 (rows not a multiple of 16, a part missing, values
    that are not finite) and why."""
    by_name = {t.name: t for t in gguf_tensors(gguf_path)}
    out, kinds, pending = {}, set(), []
    kernel4 = _four_bit_kernel_beside_eight(by_name)
    for i, fused, tensors in _decoder_layers(by_name):
        if _why_float(tensors) is not None:
            continue
        types = [t.tensor_type.name for t in tensors]
        heads = [num_heads if p == "attn_q" else num_kv_heads if p == "attn_k" else 0 for p in FUSED[fused]]

        def undo(j, x, heads=heads):
            return _unpermute_rows(x, heads[j]) if heads[j] else x
        undo = undo if permuted and any(heads) else None  # None: no rows reordered (pieces of CHUNK_ROWS)
        source, form = "+".join(sorted(set(types))), form_of(types)
        try:
            try:
                layer = _native(tensors, form or "8-bit", source, undo, None if form else _requantize_mask(types),
                                kernel4)
            except ValueError:  # a Q4_K / Q6_K scale that overflows float16: those parts requantized
                if form is None:
                    raise
                layer = _native(tensors, "8-bit", source, undo, _requantize_mask(types, overflow=True))
        except ValueError:  # values that are not finite: float32 copy (float_layers says so)
            continue
        out[f"layers.{i}.{fused}"] = layer
        kinds.update(types)
        pending.append(layer)
        if sum(_nbytes(p) for p in pending) >= GATHER_BYTES:
            hugepages.gather(*pending)
            pending.clear()
    hugepages.gather(*pending)
    return out, "+".join(sorted(kinds))


# built layers are moved into huge pages (kernels/hugepages.py) this many bytes at a time: a model's
# weights are never held twice, and each arena is large enough for its huge pages
GATHER_BYTES = 64 << 20


def _nbytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in module.buffers())


def _four_bit_kernel_beside_eight(by_name: dict) -> str | None:
    """The kernel of the 4-bit layers where the file also has 8-bit ones: the timed 4-bit choice,
    except PyTorch's ``int4`` (bfloat16 activations) beside ``q8`` layers (float32 activations),
    where ``q4`` runs instead: one activation dtype through the model, as the fused path needs (a
    Gemma 3 Q4_K_M file on int4 + q8 ran at ~2 tokens/s, layer by layer). None: the timed choice."""
    from ...kernels.quant import eight_bit_kernel, four_bit_kernel

    eight = any(all(t is not None for t in ts) and form_of([t.tensor_type.name for t in ts]) != "4-bit"
                for _, _, ts in _decoder_layers(by_name))
    return "q4" if eight and four_bit_kernel()[0] == "int4" and eight_bit_kernel() == "q8" else None


def _decoder_layers(by_name: dict):
    """``(i, fused name, its parts' tensors or None)`` for every decoder layer of the file."""
    layers = sorted({int(n.split(".")[1]) for n in by_name if n.startswith("blk.")})
    for i in layers:
        for fused, parts in FUSED.items():
            tensors = _layer_parts(by_name, i, parts)
            if any(t is not None for t in tensors):
                yield i, fused, tensors


def _why_float(tensors) -> str | None:
    """Why a fused layer of these parts stays on its float32 copy (None: it runs on a block kernel,
    unless a value is not finite)."""
    if any(t is None for t in tensors):
        return "a part is missing"
    if sum(t.data.shape[0] for t in tensors) % 16:
        return "its rows are not a multiple of 16"  # the packed layout needs 16-row tiles
    if any(t.data.ndim != 2 or int(t.shape[0]) % BLOCK for t in tensors):
        return f"its inputs are not a multiple of {BLOCK}"
    return None


def float_layers(gguf_path: str | Path, native: dict[str, QuantLinear]) -> list[FloatLayer]:
    """The decoder linears of the file that ``native`` (``native_linears``' layers) leaves on their
    float32 copy, each with its types, size and the reason."""
    by_name = {t.name: t for t in gguf_tensors(gguf_path)}
    out = []
    for i, fused, tensors in _decoder_layers(by_name):
        name = f"layers.{i}.{fused}"
        if name in native:
            continue
        present = [t for t in tensors if t is not None]
        why = _why_float(tensors) or "a value is not finite"
        out.append(FloatLayer(name, tuple(t.tensor_type.name for t in present),
                              sum(int(np.prod(t.shape)) for t in present), sum(int(t.n_bytes) for t in present), why))
    return out


def _counts(items) -> str:
    """``[(why, layer name)]`` -> "why: down_proj in 9 layers, ...; other why: ..."."""
    groups: dict[str, dict[str, int]] = {}
    for why, name in items:
        fused = groups.setdefault(why, {})
        kind = name.rsplit(".", 1)[1]
        fused[kind] = fused.get(kind, 0) + 1
    return "; ".join(f"{w}: " + ", ".join(f"{k} in {n} layer{'s' * (n > 1)}" for k, n in fused.items())
                     for w, fused in groups.items())


def _why_requantized(kinds: tuple[str, ...]) -> str:
    if all(k not in NATIVE_TYPES for k in kinds):
        return f"{'+'.join(kinds)} has no exact native form"
    return f"{'+'.join(kinds)} requantized beside parts of another form"


def float_message(file: str, floats: list[FloatLayer], native: dict[str, QuantLinear],
                  head: QuantLinear | None = None) -> str | None:
    """One line for the log, or None where every linear runs on the file's own blocks: which
    decoder linears of ``file`` (and whether the output head) were requantized to the 8-bit form
    from their float values (``native_linears``: their types, how many, the bound of the added
    error), and which stay on their float32 copy (:func:`float_layers`: why, and what that costs
    beside the file's blocks)."""
    requantized = [(_why_requantized(layer.requantized), name)
                   for name, layer in native.items() if getattr(layer, "requantized", ())]
    head_req = head is not None and getattr(head, "requantized", ())
    total = len(floats) + len(native)
    said = []
    if requantized or head_req:
        groups = sorted({native[name].group for _, name in requantized} | ({head.group} if head_req else set()))
        what = f"{len(requantized)} of {total} decoder linears" if requantized else ""
        if head_req:
            what += (" and " if what else "") + f"the output head ({'+'.join(head.requantized)})"
        said.append(
            f"{what} run{'s' * (not requantized)} on 8-bit blocks requantized from their float values, not on the file's own "
            f"({_counts(requantized) or _why_requantized(head.requantized)}): per block of "
            f"{' or '.join(map(str, groups))} weights q = round(w / d), d = amax / 127 in float16, so each "
            f"weight moves by at most half a step, amax / 254 of its block's largest |w| (+ the float16 "
            f"rounding of d, <= 2^-10 of it); 1.06 bytes per weight, the same bits for a row whatever rows "
            f"share the call")
    if floats:
        f32 = sum(f.weights for f in floats) * 4
        stored = sum(f.file_bytes for f in floats)
        said.append(
            f"{len(floats)} of {total} decoder linears run on a float32 copy, not on the file's blocks "
            f"({_counts((f.why, f.name) for f in floats)}): {f32 / 2**20:.1f} MB as float32, "
            f"{f32 / max(stored, 1):.1f}x their {stored / 2**20:.1f} MB in the file")
    if not said:
        return None
    return f"{file}: " + "; ".join(said) + f"; the native kernels run {SUPPORTED} exactly"


def decoder_types(gguf_path: str | Path) -> dict[str, str]:
    """The types of the file's decoder linear tensors (``FUSED``'s parts), each with the first tensor
    of that type, e.g. ``{"Q5_K": "blk.0.attn_q.weight"}``: for messages."""
    parts = {p for ps in FUSED.values() for p in ps}
    out: dict[str, str] = {}
    for t in gguf_tensors(gguf_path):
        if t.name.startswith("blk.") and t.name.split(".")[2] in parts:
            out.setdefault(t.tensor_type.name, t.name)
    return out


def native_head(gguf_path: str | Path) -> QuantLinear | None:
    """The output head (or the tied embedding) on a block kernel: on the file's blocks where its type
    has a native form (Q4_0, Q4_1, Q4_K in the 4-bit form, Q8_0, Q5_0, Q6_K in the 8-bit one: module
    docstring), else requantized to the 8-bit form from its float values (:func:`requantize_q8`,
    ``requantized`` names its type); None where the file keeps it in F32 (its own precision), where
    its rows are not a multiple of 16 or its values are not finite."""
    by_name = {t.name: t for t in gguf_tensors(gguf_path)}
    t = by_name.get("output.weight") or by_name.get("token_embd.weight")
    if t is None or t.data.ndim != 2 or t.data.shape[0] % 16 or int(t.shape[0]) % BLOCK \
            or t.tensor_type.name == "F32":
        return None
    kind = t.tensor_type.name
    form = form_of([kind])
    try:
        try:
            head = _native([t], form or "8-bit", kind, requantize=[form is None])
        except ValueError:  # a Q4_K / Q6_K scale that overflows float16
            if form is None:
                raise
            head = _native([t], "8-bit", kind, requantize=[True])
    except ValueError:  # values that are not finite
        return None
    hugepages.gather(head)
    return head


def forget_pages(t, r0: int = 0, r1: int | None = None) -> None:
    """Take the file's pages of rows ``r0:r1`` of ``t`` out of this process's resident set once they
    have been read (``MADV_DONTNEED`` on the read-only mapping: the kernel's page cache keeps them,
    and a later read faults them back), so that loading a file of several GB does not count the
    whole file on top of the weights built from it (an 8B-shaped Q4_K_M file's load peaked at
    2.55x the file, 1.4x without its pages). Nothing where the data is not a file mapping."""
    import mmap

    mapping = getattr(t.data, "_mmap", None)
    if mapping is None or not hasattr(mapping, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    row_bytes = int(t.n_bytes) // max(int(t.data.shape[0]), 1)
    r1 = t.data.shape[0] if r1 is None else min(r1, t.data.shape[0])
    start, end = int(t.data_offset) + r0 * row_bytes, int(t.data_offset) + r1 * row_bytes
    start -= start % mmap.PAGESIZE
    if end > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def release() -> None:
    """Forget the files' tensor tables (``gguf_tensors``), and with them their mappings: a loaded
    model reads nothing more from them (an embedding kept in its file maps its rows itself), and
    the pages the load read stop counting as the process's."""
    _tensors.cache_clear()
