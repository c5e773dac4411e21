"""A GGUF file's own quantized blocks as :class:`~hispec.kernels.quant.QuantLinear` layers.

``gguf_convert`` writes a float32 copy of a GGUF model (the reference). This module reads the
same file's 4-bit tensors without dequantizing them and puts them on the int4 kernel, so the
decoder runs on the file's own ``q``, ``d`` and ``m`` (see ``quant.py`` for the rounding).

Block layouts (32 weights per block, ggml ``block_q4_0`` / ``block_q4_1``)::

    Q4_0: d (f16), qs[16]          w[j] = d * (q[j] - 8)
    Q4_1: d (f16), m (f16), qs[16] w[j] = d * q[j] + m
    q[j] = qs[j] & 15 and q[j + 16] = qs[j] >> 4, for j < 16

Other tensor types (F32, F16, Q8_0, the K-quants) have no kernel here and stay on the float
path (their float32 copy from the conversion).
"""
from __future__ import annotations

import functools

from pathlib import Path

import numpy as np
import torch

from ...kernels.quant import QuantLinear

BLOCK = 32
# our fused layer -> its GGUF parts, in the order the float loader fuses them
FUSED = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "gate_up_proj": ("ffn_gate", "ffn_up"),
         "o_proj": ("attn_output",), "down_proj": ("ffn_down",)}
FOUR_BIT = ("Q4_0", "Q4_1")


def _blocks(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [N, K]`` uint8 in 0..15 and ``d, m [N, K / 32]`` float16 of a Q4_0 / Q4_1 tensor."""
    kind = tensor.tensor_type.name
    raw = np.asarray(tensor.data, dtype=np.uint8)
    n = raw.shape[0]
    head = 2 if kind == "Q4_0" else 4  # bytes of d (and m) before the 16 bytes of nibbles
    blocks = raw.reshape(n, -1, head + 16)  # [N, K/32, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [N, K/32]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if kind == "Q4_1" else (-8 * d.astype(np.float32)).astype(np.float16)
    qs = blocks[..., head:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)  # [N, K]
    return torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(m))


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


def native_linears(gguf_path: str | Path, num_heads: int, num_kv_heads: int) -> tuple[dict[str, QuantLinear], str]:
    """QuantLinears for every decoder linear whose GGUF parts are all 4-bit, by module name
    (``layers.3.qkv_proj``), and the file's type of those tensors (e.g. ``Q4_1``)."""
    by_name = {t.name: t for t in gguf_tensors(gguf_path)}
    layers = sorted({int(n.split(".")[1]) for n in by_name if n.startswith("blk.")})
    out, kinds = {}, set()
    for i in layers:
        for fused, parts in FUSED.items():
            tensors = [by_name.get(f"blk.{i}.{p}.weight") for p in parts]
            if any(t is None or t.tensor_type.name not in FOUR_BIT for t in tensors) \
                    or sum(t.data.shape[0] for t in tensors) % 16:  # the packed layout needs 16-row tiles
                continue
            qs, ds, ms = [], [], []
            for p, t in zip(parts, tensors):
                q, d, m = _blocks(t)
                if p in ("attn_q", "attn_k"):
                    heads = num_heads if p == "attn_q" else num_kv_heads
                    q, d, m = (_unpermute_rows(x, heads) for x in (q, d, m))
                qs.append(q), ds.append(d), ms.append(m)
                kinds.add(t.tensor_type.name)
            out[f"layers.{i}.{fused}"] = QuantLinear.from_blocks(torch.cat(qs), torch.cat(ds), torch.cat(ms),
                                                                 "+".join(sorted({t.tensor_type.name for t in tensors})))
    return out, "+".join(sorted(kinds))


def decoder_types(gguf_path: str | Path) -> dict[str, str]:
    """The types of the file's decoder linear tensors (``FUSED``'s parts), each with the first tensor
    of that type, e.g. ``{"Q5_K": "blk.0.attn_q.weight"}``: for messages."""
    parts = {p for ps in FUSED.values() for p in ps}
    out: dict[str, str] = {}
    for t in gguf_tensors(gguf_path):
        if t.name.startswith("blk.") and t.name.split(".")[2] in parts:
            out.setdefault(t.tensor_type.name, t.name)
    return out


def _q8_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, K]`` int8 and ``d [N, K / 32]`` float16 of a Q8_0 tensor (``d`` f16, then 32 int8)."""
    raw = np.asarray(tensor.data, dtype=np.uint8)
    blocks = raw.reshape(raw.shape[0], -1, 2 + BLOCK)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    q = blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    return torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(d))


def native_head(gguf_path: str | Path) -> QuantLinear | None:
    """The output head on the int4 kernel, when the file stores it (or the tied embedding) as
    Q4_0 / Q4_1 / Q8_0; None otherwise."""
    by_name = {t.name: t for t in gguf_tensors(gguf_path)}
    t = by_name.get("output.weight") or by_name.get("token_embd.weight")
    kind = t.tensor_type.name if t is not None and t.data.shape[0] % 16 == 0 else None
    if kind in FOUR_BIT:
        return QuantLinear.from_blocks(*_blocks(t), kind)
    if kind == "Q8_0":
        return QuantLinear.from_q8_blocks(*_q8_blocks(t))
    return None
