"""Weight-only quantized linear layers on PyTorch's CPU int4 / int8 kernels.

Two kernels ship with PyTorch (no extra package):

- ``int4``: ``aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)`` computes
  ``x @ W.T`` with ``W[n, k] = (q[n, k] - 8) * s[g, n] + z[g, n]`` for ``q`` in 0..15 and one
  scale/zero pair per ``group`` consecutive inputs (``g = k // group``).
- ``int8``: ``aten._weight_int8pack_mm(x, q, s)`` with ``W[n, k] = q[n, k] * s[n]`` (``q`` int8,
  one scale per output row).

Two more are hispec's own (``csrc/gguf.c``, compiled for the machine's CPU like the other fused
kernels), both on a GGUF file's blocks as stored, with float32 activations:

- ``q4``: ``W[n, k] = d[n, b] * q[n, k] + m[n, b]`` (Q4_0 / Q4_1, or ``--quantize int4`` of a float
  model): the file's nibbles and its exact ``d``, ``m``. Each activation row is put in 16-bit
  integers per block of 32 (error <= 1.5e-5 of the block's largest value, where bfloat16 keeps
  2^-9 of each value), block sums exact in integers. Prompt chunks instead rebuild the weights in
  float32 panels (the file's values) for hispec's panel kernel: float32 products run ~2.4x faster
  than 16-bit ones there (AVX2, 256 rows); on CPUs with bfloat16 hardware they run on a dense
  bfloat16 copy (``dense``, 1.7-1.8x faster than the panels on a Zen 4). Which of ``q4`` and ``int4`` runs the 4-bit
  weights is decided by timing both at load (:func:`four_bit_kernel`): on CPUs without
  bfloat16 hardware (AVX2) ``q4`` is the faster.
- ``q8a``: the ``q4`` weights (the same nibbles, ``d`` and ``m`` in float16 as GGUF has them, tiled for its
  kernel: ``q8act.tile4``; :meth:`QuantLinear.blocks` gives them in row order) times activations rounded to 8 bits
  per block of 32 (``q8act.py``: integer dot products, ``amax / 254`` error per input where ``q4``
  keeps 1.5e-5 of the block's largest value). Faster than ``q4`` on more than one row (AVX2, a
  decode step's matmuls timed in C: 1.41x one row's time at 4 rows where ``q4`` takes 1.74x, 3.03x
  at 16 where ``q4`` takes 5.74x), ~10% slower on one there (its Q8_0 head most); its tokens differ from ``q4``'s (logits move by ~0.1:
  greedy ``ar`` on the default model, 16 held-out Spec-Bench prompts, 64 tokens: ``q4`` gave
  float32's tokens on 16 of 16, ``q8a`` on 10 of 16; llama.cpp's Q4_1 on 7 of 16,
  ``scripts/numerics.py``). The timed choice takes it only where it is no slower on one row and
  clearly faster on four (:func:`four_bit_kernel`: a CPU with integer dot products, VNNI);
  ``HISPEC_Q4_KERNEL=q8a`` asks for it anywhere. With it the Q8_0 output head runs on 8-bit
  activations too (``q8a8``, tiled too). Prompt chunks run on bfloat16 AMX tiles where the CPU has them
  (``q8act.tiles_matmul``), else on q8a's own rows where it has integer dot products, else as ``q4``'s (the
  same panels).
- ``q8``: a GGUF Q8_0 weight ``W[n, k] = d[n, k / 32] * q[n, k]`` as stored in the file, times
  float32 activations; also with a scale per 16 values, ``d[n, k / 16]`` (GGUF Q6_K, exactly:
  ``gguf_weights``), each block's two halves summed apart and multiplied by their own scales (``q8a8``
  likewise, ``q8act.py``). It runs the default model's output head (49,152 x 576) in ~1.7 ms per
  token instead of ~2.8 ms for the same values as two int4 halves (``int4x2``, used where no C
  compiler is found), and uses the file's exact scales and unrounded activations.

Per row, the results of every kernel here do not depend on how many rows share the call (checked
in the tests), which keeps batched verification and one-token decoding bit-identical.

The int4 and int8 kernels want bfloat16 activations (``ACT_DTYPE``): with float32 or float16 activations they are
7-30x slower on the 2-core test machine. Scales, zeros and outputs are bfloat16 too.

GGUF blocks map onto the int4 form exactly in ``q``; where rounding happens (``q4`` has none of this):

- Q4_0 (``w = d * (q - 8)``): ``s = d``, ``z = 0``.
- Q4_1 (``w = d * q + m``):   ``s = d``, ``z = m + 8 d`` (computed exactly in float32).
- ``s`` and ``z`` are rounded once from float32 to bfloat16 when the layer is built
  (:func:`scales_zeros`); ``d`` and ``m`` are float16 in the file, so this drops 3 of their 11
  significant bits (relative error <= 2^-9 per block). That is the only change to the weights:
  the file's ``q`` are used as they are. Activations are rounded to bfloat16 on entry to each
  layer and the kernel's output is bfloat16. The measured effect is in BENCHMARKS.md.

``QuantLinear.source_weight()`` gives the file's exact values (``d``, ``m`` are kept in float16
beside the kernel's copy), so fingerprints and reference paths see what is in the file.
"""
from __future__ import annotations

import copy
import functools
import json
import logging
from pathlib import Path

import torch
from torch import nn

from .. import envs
from . import build, fused, q8act
from .matmul import linear
from .timing import interleaved_medians

log = logging.getLogger(__name__)

ACT_DTYPE = torch.bfloat16
GROUP = 32  # GGUF's block size, and the default group of --quantize int4
INNER_K_TILES = 2
SCHEMES = ("int4", "int8")
KERNELS = ("int4", "int8", "int4x2", "q8", "q4", "q8a", "q8a8")
FLOAT_INPUT = ("q8", "q4", "q8a", "q8a8")  # kernels that read float32 activations (the others: ACT_DTYPE)
# kernels of GGUF 4-bit blocks as stored: qweight nibbles, qparams [2, N, K / 32] d, m
# (q8a: tiled, float16, q8act.tile4)
Q4_STORAGE = ("q4", "q8a")
# kernels of GGUF Q8_0 blocks as stored: qweight q [N, K] int8, qparams d [N, K / 32]
# (q8a8: tiled, float16, q8act.tile8)
Q8_STORAGE = ("q8", "q8a8")
EIGHT_BIT_ACTS = ("q8a", "q8a8")  # kernels that round activations to 8 bits per block (q8act.py)


def scales_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The int4 kernel's ``[K / group, N, 2]`` table from per-block ``scale, zero [N, K / group]``
    (float32): the one place where they are rounded to the activation dtype."""
    return torch.stack([scale.float().T, zero.float().T], dim=-1).to(ACT_DTYPE).contiguous()


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` integers in 0..15 -> ``[N, K / 2]`` uint8 in GGUF's block layout (per block of
    32: byte j holds q[j] in its low nibble and q[j + 16] in its high one), as the q4 kernel reads."""
    n, k = q.shape
    b = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: ``[N, K / 2]`` uint8 -> ``q [N, K]`` uint8."""
    n = qs.shape[0]
    b = qs.view(n, -1, 16)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(n, -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` integers in 0..15 -> the CPU kernel's packed layout (N a multiple of 16)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INNER_K_TILES)


class QuantLinear(nn.Module):
    """A linear layer ``y = x @ W.T (+ bias)`` whose weight is stored for the int4 or int8 kernel.

    ``forward`` takes any float input and returns the same dtype (the kernel runs in bfloat16).
    ``source`` holds what the weights were made from (GGUF ``d``/``m`` blocks or nothing), for
    :meth:`source_weight`.
    """

    def __init__(self, kernel: str, in_features: int, out_features: int, qweight: torch.Tensor,
                 qparams: torch.Tensor, group: int = 0, bias: torch.Tensor | None = None,
                 source: str = "", exact: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        assert kernel in KERNELS, kernel
        self.kernel, self.in_features, self.out_features, self.group = kernel, in_features, out_features, group
        self.source = source  # e.g. "Q4_1", "float32"
        self.register_buffer("qweight", qweight)  # int4: packed uint8; int8, q8: [N, K] int8; int4x2: 2 x int4
        self.register_buffer("qparams", qparams)  # int4: [K/group, N, 2] bf16; int8: [N] bf16; int4x2: 2 x int4;
        #                                           q8: [N, K/group] float32 block scales
        self.register_buffer("bias", bias)
        # GGUF blocks on PyTorch's int4 kernels (scales rounded to bfloat16 there): the file's {"d", "m":
        # [N, K / group] float16} with w = d * q + m; the other kernels keep the file's scales themselves
        self._exact = exact or {}
        # GGUF types whose float values were requantized to this form (gguf_weights.requantize_q8),
        # not mapped from the file's blocks; empty for exact forms
        self.requantized: tuple[str, ...] = ()
        # prefill weights: the same values as one dense bfloat16 matrix [N, K] (set by the loader for
        # GGUF files, see loader.apply_quantization), or None. Prompt chunks are compute-bound, and this
        # CPU kernel for int4 is built for decode-sized inputs: at 512 rows the dense bfloat16 product is
        # ~2.4x faster. Not a buffer: not saved, not moved.
        self.dense: torch.Tensor | None = None
        if kernel in ("q8a", "q8a8"):
            q8act.use_amx_rows()  # (once per process: whether its many-row products take the AMX path)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_int4(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group: int,
                  bias: torch.Tensor | None = None, source: str = "", kernel: str | None = None) -> "QuantLinear":
        """``W = d * q + m`` with ``q [N, K]`` in 0..15 and ``d, m [N, K / group]`` float32, on the
        ``kernel`` given (``q4``, ``q8a``, ``int4``) or else :func:`four_bit_kernel`'s. ``int4`` gets
        ``scale = d``, ``zero = m + 8 d`` rounded to bfloat16; ``q4`` (groups of 32) keeps ``d`` and ``m``
        in float32, ``q8a`` in float16 (rounded to nearest; GGUF's are float16 already)."""
        n, k = q.shape
        kernel = _four_bit_kernel_for(group) if kernel is None else kernel
        if kernel in Q4_STORAGE:
            qs, dm = pack_nibbles(q), torch.stack([d.float(), m.float()]).contiguous()
            if kernel == "q8a":  # its kernels read the blocks tiled, scales in float16
                qs, dm = q8act.tile4(qs, dm)
            return cls(kernel, k, n, qs, dm, group, bias, source)
        return cls("int4", k, n, pack_int4(q), scales_zeros(d, m.float() + 8 * d.float()), group, bias, source)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, source: str,
                    kernel: str | None = None) -> "QuantLinear":
        """GGUF 4-bit blocks ``w = d * q + m`` (``q [N, K]`` in 0..15, ``d, m [N, K / 32]`` float16;
        Q4_0 is ``m = -8 d``) on ``kernel`` (see :meth:`from_int4`); ``d, m`` are kept as given."""
        group = q.shape[1] // d.shape[1]
        layer = cls.from_int4(q, d.float(), m.float(), group, source=source, kernel=kernel)
        if layer.kernel not in FLOAT_INPUT:  # int4 rounds the scales to bfloat16: keep the file's
            layer._exact = {"d": d.half(), "m": m.half()}
        return layer

    @classmethod
    def from_q8_blocks(cls, q: torch.Tensor, d: torch.Tensor, source: str = "Q8_0", kernel: str = "auto") -> "QuantLinear":
        """GGUF Q8_0 blocks ``w = d * q`` (``q [N, K]`` int8, ``d [N, K / 32]`` float16), or the
        "8-bit form, group 16" (``d [N, K / 16]``: a scale per 16 values, GGUF Q6_K's; ``q8`` and
        ``q8a8`` only: PyTorch's int4 kernel has no group of 16, ValueError).

        ``kernel="q8"``: the blocks as they are, on the ``q8`` kernel (float32 activations);
        ``"q8a8"``: the same blocks on 8-bit activations (``q8act.py``). ``"int4x2"``: two int4
        halves on the int4 kernel, exact in ``q``: ``q = 16 hi + lo`` with ``hi`` in -8..7 and ``lo``
        in 0..15, so ``w = (hi + 8 - 8) * 16 d + (lo - 8) * d + 8 d``; twice the int4 work (scales
        rounded to bfloat16). ``"auto"``: :func:`eight_bit_kernel`."""
        n, k = q.shape
        group = k // d.shape[1]
        if kernel == "auto":
            kernel = eight_bit_kernel()
        if group not in (16, 32) or d.shape[0] != n:
            raise ValueError(f"8-bit blocks: d {tuple(d.shape)} must be [N, K / 32] or [N, K / 16] for q {tuple(q.shape)}")
        if group == 16 and kernel not in Q8_STORAGE:
            raise ValueError(f"8-bit blocks with a scale per 16 values run on {' or '.join(Q8_STORAGE)}, not {kernel}")
        if kernel in Q8_STORAGE:
            q8, d8 = q.to(torch.int8).contiguous(), d.float().contiguous()
            if kernel == "q8a8":  # its kernels read the blocks tiled, scales in float16
                q8, d8 = q8act.tile8(q8, d8)
            return cls(kernel, k, n, q8, d8, group, source=source)  # d kept as given (float16 or float32)
        q = q.to(torch.int32)
        hi, lo = torch.div(q, 16, rounding_mode="floor"), q.remainder(16)
        d32 = d.float()
        packed = torch.stack([pack_int4(hi + 8), pack_int4(lo)])
        params = torch.stack([scales_zeros(16 * d32, torch.zeros_like(d32)), scales_zeros(d32, 8 * d32)])
        layer = cls("int4x2", k, n, packed, params, group, source=source)
        layer._exact = {"d": d.half(), "m": torch.zeros_like(d, dtype=torch.float16)}
        return layer

    @classmethod
    def from_float(cls, weight: torch.Tensor, scheme: str, group: int = GROUP,
                   bias: torch.Tensor | None = None, kernel: str | None = None) -> "QuantLinear":
        """Quantize a float weight ``[N, K]``: int4 asymmetric per group of ``group`` inputs
        (min/max, as gpt-fast and torchao do; on ``kernel``, see :meth:`from_int4`), or int8
        symmetric per output row."""
        w = weight.detach().float()
        b = None if bias is None else bias.detach().float()
        if scheme == "int8":
            s = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [N]
            q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
            return cls("int8", w.shape[1], w.shape[0], q.contiguous(), s.to(ACT_DTYPE), 0, b, str(weight.dtype)[6:])
        if scheme != "int4":
            raise ValueError(f"unknown quantization {scheme!r}; choose from {', '.join(SCHEMES)}")
        n, k = w.shape
        kernel = _four_bit_kernel_for(group) if kernel is None else kernel
        blocks = w.view(n, k // group, group)
        lo, hi = blocks.amin(-1), blocks.amax(-1)  # [N, K/group]
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        if kernel == "q8a":  # its scales are float16 (GGUF Q4_1's): the codes fit the rounded ones
            lo = lo.half().float()
            scale = scale.clamp(min=2.0 ** -14).half().float()  # float16's smallest normal
        q = torch.round((blocks - lo[..., None]) / scale[..., None]).clamp(0, 15).view(n, k)
        return cls.from_int4(q, scale, lo, group, b, str(weight.dtype)[6:], kernel)

    # ---- use -----------------------------------------------------------------------------------
    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype the kernel reads its input in (others are converted first)."""
        return torch.float32 if self.kernel in FLOAT_INPUT else ACT_DTYPE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N] in x's dtype (int4x2, q8: float32 for float32 input)
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # [T, K]
        want = self.input_dtype
        out = self.mm(rows if rows.dtype == want or (want == torch.float32 and rows.dtype == ACT_DTYPE)
                       else rows.to(want))
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def prefill_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [T, K]`` (in ``input_dtype``) of prompt tokens: on the dense bfloat16 prefill
        weights where the layer has them (int4; q4, and q8a without integer dot products, on CPUs
        with bfloat16 hardware, their float32 rows cast to bfloat16, output bfloat16), else q8a's and
        q8a8's weights on bfloat16 AMX tiles where the CPU has them (``q8act.bf16_tiles``), else q8a's own
        rows where the CPU has integer dot products (``q8a_prefills_on_rows``), else the q4 kernel's
        float32 panels (q4, q8a), else as ``mm``."""
        if self.kernel in Q4_STORAGE and self.dense is not None:
            return torch.nn.functional.linear(rows.to(torch.bfloat16), self.dense)
        if self.kernel in ("q8a", "q8a8") and q8act.bf16_tiles():
            return q8act.tiles_matmul(rows.float() if rows.dtype != torch.float32 else rows, self.qweight, self.qparams)
        if self.kernel == "q8a" and q8a_prefills_on_rows():
            return self.mm(rows.float() if rows.dtype != torch.float32 else rows)
        if self.kernel in Q4_STORAGE:
            rows = rows.float() if rows.dtype != torch.float32 else rows
            if self.kernel == "q8a":
                return q8act.q4_panel_matmul(rows, self.qweight, self.qparams)
            return fused.q4_matmul(rows, self.qweight, self.qparams, panels=True)
        if self.dense is None:
            return self.mm(rows)
        return torch.nn.functional.linear(rows, self.dense)

    def mm(self, rows: torch.Tensor) -> torch.Tensor:
        """The kernel on ``rows [T, K]`` already in ``input_dtype`` -> ``[T, N]`` (no bias, no casts:
        what ``forward`` wraps, and what the fused layer path calls directly)."""
        if self.kernel == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, self.group, self.qparams)
        if self.kernel == "int8":
            return torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.qparams)
        if self.kernel == "q8":
            return fused.q8_matmul(rows.contiguous(), self.qweight, self.qparams)
        if self.kernel == "q4":
            return fused.q4_matmul(rows.float() if rows.dtype != torch.float32 else rows, self.qweight, self.qparams)
        if self.kernel == "q8a":
            return q8act.q4_matmul(rows.float() if rows.dtype != torch.float32 else rows, self.qweight, self.qparams)
        if self.kernel == "q8a8":  # bfloat16 rows widened exactly, as hs_q8a_q8_matmul does
            return q8act.q8_matmul(rows.float() if rows.dtype != torch.float32 else rows, self.qweight, self.qparams)
        int4 = torch.ops.aten._weight_int4pack_mm_for_cpu  # int4x2: the two halves summed in float32
        out = int4(rows, self.qweight[0], self.group, self.qparams[0]).float()
        return out.add_(int4(rows, self.qweight[1], self.group, self.qparams[1]))

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(qweight, qparams) with the blocks in the file's row order (``q8a``, ``q8a8`` store them
        tiled for their kernels; the others as they are)."""
        if self.kernel == "q8a":
            return q8act.untile4(self.qweight, self.qparams)
        if self.kernel == "q8a8":
            return q8act.untile8(self.qweight, self.qparams)
        return self.qweight, self.qparams

    def _int4_codes(self, part: int | None = None) -> torch.Tensor:
        """The stored ``q [N, K]`` (0..15, float32), read back through the kernel itself (identity
        input, scale 1, zero 8), so no assumption about the packed layout is needed. ``int4x2``:
        the signed ``16 hi + lo`` (or one half, ``part`` 0 / 1)."""
        if self.kernel == "int4x2" and part is None:
            return 16 * (self._int4_codes(0) - 8) + self._int4_codes(1)
        if self.kernel in Q4_STORAGE:
            return unpack_nibbles(self.blocks()[0]).float()
        packed, params = (self.qweight, self.qparams) if part is None else (self.qweight[part], self.qparams[part])
        eye = torch.eye(self.in_features, dtype=ACT_DTYPE)
        s = params[..., 0]
        ones = torch.stack([torch.ones_like(s), torch.full_like(s, 8.0)], -1)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, self.group, ones).float().T

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[N, K]`` float32 (bfloat16 scales applied)."""
        if self.kernel == "int8":
            return self.qweight.float() * self.qparams.float()[:, None]
        if self.kernel in Q8_STORAGE:  # exact: the file's d (float16) times q
            q, d = self.blocks()
            return q.float() * d.repeat_interleave(self.group, dim=1)
        if self.kernel == "int4x2":
            d = self.qparams[1][..., 0].float().T.repeat_interleave(self.group, dim=1)
            return self._int4_codes() * d
        if self.kernel in Q4_STORAGE:  # exact: d * q is exact in float32, + m rounded once
            d, m = (p.repeat_interleave(self.group, dim=1) for p in self.blocks()[1])
            return self._int4_codes() * d + m
        s, z = (self.qparams[..., i].float().T.repeat_interleave(self.group, dim=1) for i in (0, 1))
        return (self._int4_codes() - 8) * s + z

    def source_weight(self) -> torch.Tensor:
        """The weight as given (a GGUF file's exact ``d * q + m``), else :meth:`dequantize`."""
        if "d" not in self._exact or self.kernel in FLOAT_INPUT:
            return self.dequantize()
        d, m = (self._exact[k].float().repeat_interleave(self.group, dim=1) for k in ("d", "m"))
        return self._int4_codes() * d + m

    @property
    def weight(self) -> torch.Tensor:
        """Float32 ``[N, K]`` view of the weights (computed; for fingerprints and reference code)."""
        return self.source_weight()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"
                + (f", group={self.group}" if self.group else "") + (f", from={self.source}" if self.source else ""))

    def describe(self) -> str:
        what = f"{self.kernel} per row" if self.kernel == "int8" else f"{self.kernel} group {self.group}"
        acts = "8-bit activations per block of 32" if self.kernel in EIGHT_BIT_ACTS else \
            f"{str(self.input_dtype)[6:]} activations"
        return f"{what} ({self.source} weights, {acts})"


def act_dtype_of(module: nn.Module) -> torch.dtype | None:
    """The dtype a layer passes between its kernels: ``ACT_DTYPE`` when any of its quantized
    linears reads bfloat16 (int4, int8), else None (the model's own dtype; q4 and q8 read float32)."""
    return ACT_DTYPE if any(isinstance(m, QuantLinear) and m.input_dtype == ACT_DTYPE
                            for m in module.modules()) else None


def quantizable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.in_features % GROUP == 0 and module.out_features % 16 == 0


def quantize_linears(module: nn.Module, scheme: str, group: int = GROUP, skip: tuple[str, ...] = ()) -> int:
    """Replace every ``nn.Linear`` under ``module`` (any module: decoder layers, exit layers) by a
    :class:`QuantLinear`; ``skip`` names children to leave alone. Returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if name in skip:
            continue
        if quantizable(child) and child.weight.device.type == "cpu":
            setattr(module, name, QuantLinear.from_float(child.weight, scheme, group, child.bias))
            count += 1
        elif not isinstance(child, QuantLinear):
            count += quantize_linears(child, scheme, group, skip)
    return count


def float_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every QuantLinear given as ``nn.Linear`` keys (``weight``: its
    source values in float32, ``bias``), e.g. to copy a quantized layer into a float one."""
    state = {}
    quant = {name: m for name, m in module.named_modules() if isinstance(m, QuantLinear)}
    for key, value in module.state_dict().items():
        owner = key.rsplit(".", 1)[0] if "." in key else ""
        if owner not in quant:
            state[key] = value
    for name, m in quant.items():
        prefix = f"{name}." if name else ""
        state[prefix + "weight"] = m.weight
        if m.bias is not None:
            state[prefix + "bias"] = m.bias
    return state


# ---- which 4-bit kernel runs on this CPU ------------------------------------------------------
TIMED_ROWS = (1, 4)  # rows per product timed: a decode step, and a verification window or small batch


STREAM_BYTES = 64 << 20  # 4-bit weights timed per kernel: more than a CPU's last-level cache holds
STEP_WEIGHTS = 5  # a decode step of the default model: ~5 x 12 such weights (106 M) beside its head (28 M)
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K): a SmolLM2-135M layer's matmuls


@functools.lru_cache(maxsize=1)
def format_timings(reps: int = 5) -> dict[str, float]:
    """Median seconds of ``rows`` rows times 12 weights of a SmolLM2 MLP's shape, read from memory as
    in a decode step, for each weight format this machine runs, timed once per process, interleaved:
    ``float32`` (12 weights, 85 MB); per 4-bit kernel, a stream of ~``STREAM_BYTES`` of copies of
    one SmolLM2-135M layer's matmuls (``LAYER_SHAPES``; its time scaled to 12 MLP weights' worth)
    and, as ``name.head``, a Q8_0 output head (49,152 x 576) on the kernel :func:`eight_bit_kernel`
    gives beside it: ``q4`` (``q8``) and ``q8a`` (``q8a8``) where hispec's kernels are built,
    ``int4`` (``q8``, or ``int4x2`` without them) where PyTorch has its kernel. One row: ``name``;
    four: ``name@4``. :func:`four_bit_kernel` and ``select.quantized_kernels_pay`` read these."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(3072, 576, generator=g) * 0.02 for _ in range(12)]
    layer = [weights[0][:n, :k] if k == 576 else torch.randn(n, k, generator=g) * 0.02 for n, k in LAYER_SHAPES]
    head_q = torch.randint(-127, 128, (49152, 576), generator=g, dtype=torch.int8)
    head_d = (torch.rand((49152, 18), generator=g) * 0.01 + 1e-3).half()
    xs = {(t, k): torch.randn(t, k, generator=g) for t in TIMED_ROWS for k in (576, 1536)}
    fns = {"float32": lambda: [linear(xs[(1, 576)], w) for w in weights]}
    kernels = {"q4": "q8", "q8a": "q8a8"} if fused.available() else {}
    kernels["int4"] = "q8" if fused.available() else "int4x2"  # the head eight_bit_kernel() gives it
    share = {}
    for name, head_kernel in kernels.items():
        try:
            one = [QuantLinear.from_float(w.contiguous(), "int4", kernel=name) for w in layer]
            head = QuantLinear.from_q8_blocks(head_q, head_d, kernel=head_kernel)
        except RuntimeError:  # PyTorch's int4 kernel is missing on this build / CPU
            continue
        size = sum(t.numel() * t.element_size() for q in one for t in (q.qweight, q.qparams) if t is not None)
        copies = max(1, STREAM_BYTES // max(1, size))
        stream = one + [copy.deepcopy(q) for _ in range(copies - 1) for q in one]
        share[name] = 12 * 3072 * 576 / (copies * sum(n * k for n, k in LAYER_SHAPES))
        for t in TIMED_ROWS:
            dt = torch.bfloat16 if name == "int4" else torch.float32
            x = {k: xs[(t, k)].to(dt) for k in (576, 1536)}
            key = name if t == 1 else f"{name}@{t}"
            fns[key] = lambda stream=stream, x=x: [q(x[q.in_features]) for q in stream]
            fns[key.replace(name, name + ".head", 1)] = lambda head=head, x=x: head(x[576])
    with torch.no_grad():
        med = interleaved_medians(fns, reps, warmup=1)
    return {k: v * share.get(k.split("@")[0], 1.0) for k, v in med.items()}


def step_seconds(med: dict[str, float], name: str, rows: int = 1) -> float:
    """A decode step's matmuls on kernel ``name`` from :func:`format_timings`: ``STEP_WEIGHTS`` x 12
    weights and the output head (on ``rows`` rows, 1 or 4)."""
    suffix = "" if rows == 1 else f"@{rows}"
    return STEP_WEIGHTS * med[name + suffix] + med.get(f"{name}.head{suffix}", 0.0)


FOUR_BIT = ("q4", "int4")  # the float-activation candidates of the timed choice
TIMED_FOUR_BIT = (*FOUR_BIT, "q8a")  # what the timed choice may pick
INT8_DOT_PATHS = ("avx512vnni", "vnni256")  # q8act's paths on integer dot-product instructions
FORCED_FOUR_BIT = TIMED_FOUR_BIT  # what HISPEC_Q4_KERNEL may name
INT4_MARGIN = 0.85  # int4 must take at most this fraction of q4's time
# q8a without integer dot products (the AVX2 path): at most this fraction of the other's step time
# on one row, and on four. On the 2-core AVX2 Zen 2 the timing put its one-row step level with
# q4's (12.5-12.8 ms vs 12.4-12.7, Python calls included) and its four-row step at 0.88-0.93 of
# q4's, while end to end its `ar` ran ~4% slower: q4 stays there.
Q8A_ONE_ROW = 1.0
Q8A_FOUR_ROWS = 0.8
# q8a with integer dot products (AVX-512 VNNI, AVX-VNNI): taken unless a plain step plus a four-row
# pass cost more than this multiple of the float kernel's. Rows are nearly free there (8 rows
# ~1.5x one), which speculation and batches live on; a one-row step within a few percent of the
# others' is noise on a shared machine. On a 2-core Zen 4 four timings put q8a's one-row step at
# 0.97-1.34x int4's and its one-plus-four cost at 0.92-1.23x (a cascade of margins there took q4,
# the slowest of the three on both counts, at one load), while end to end the default strategy ran
# level on q8a and int4 (95.9 vs 94.9 tokens/s) and batch 16 ran 1.21x faster on q8a.
Q8A_DOT_SLACK = 1.25
CHOICE_RULE = 2  # in the kept choice's file name: a change of rule times again


def _rows_cost(med: dict[str, float], name: str) -> float:
    """A plain step plus a four-row pass (a verification window, a small batch) on ``name``."""
    return step_seconds(med, name) + step_seconds(med, name, 4)


def timed_choice(med: dict[str, float], int8_dots: bool = False) -> tuple[str, str]:
    """(kernel, why) from :func:`format_timings`: ``q4`` unless ``int4`` wins clearly on a decode
    step's matmuls (``INT4_MARGIN``: ``q4`` reads float32 activations, its tokens equal float32
    ``ar``'s where ``int4``'s bfloat16 ones drift); then ``q8a``, whose 8-bit activations move the
    tokens further from float32's: on a CPU with integer dot products (``int8_dots``) unless a plain
    step plus a four-row pass cost clearly more than on the other (``Q8A_DOT_SLACK``); elsewhere
    only where its step is no slower on one row (``Q8A_ONE_ROW``) and clearly faster on four
    (``Q8A_FOUR_ROWS``)."""
    ms = lambda name, rows=1: f"{step_seconds(med, name, rows) * 1e3:.2f} ms"  # noqa: E731
    if "int4" not in med:
        best, why = "q4", "PyTorch's int4 kernel unavailable"
    else:
        best = "int4" if step_seconds(med, "int4") < INT4_MARGIN * step_seconds(med, "q4") else "q4"
        why = f"a decode step's matmuls: q4 {ms('q4')} vs int4 {ms('int4')}"
    if "q8a" in med and f"{best}@4" in med:
        why += f"; q8a {ms('q8a')}, and on 4 rows {ms('q8a', 4)} vs {best} {ms(best, 4)}"
        if int8_dots:
            why += " (integer dot products: q8a unless clearly slower)"
            take = _rows_cost(med, "q8a") <= Q8A_DOT_SLACK * _rows_cost(med, best)
        else:
            take = (step_seconds(med, "q8a") <= Q8A_ONE_ROW * step_seconds(med, best)
                    and step_seconds(med, "q8a", 4) <= Q8A_FOUR_ROWS * step_seconds(med, best, 4))
        best = "q8a" if take else best
    return best, why


@functools.lru_cache(maxsize=1)
def four_bit_kernel() -> tuple[str, str]:
    """(the kernel 4-bit weights run on, why), decided once per process: ``HISPEC_Q4_KERNEL=q4|int4|q8a``
    if set (``q4``/``q8a`` need hispec's compiled kernels, without them ``int4`` runs); ``int4``
    (PyTorch's) when hispec's compiled kernels are unavailable; else :func:`timed_choice`. The timed
    choice is kept on disk (``_four_bit_choice_file``) and reused by later loads on this machine:
    a coin-flip between near-equal timings made the kernel, and with it the text of the same
    command, change from one load to the next on a busy machine (seen on a Zen 4). On CPUs without
    bfloat16 hardware or integer dot products (AVX2) ``q4`` wins; with them it depends on the CPU."""
    forced = envs.HISPEC_Q4_KERNEL
    if forced is not None and forced not in FORCED_FOUR_BIT:
        raise ValueError(f"HISPEC_Q4_KERNEL={forced!r}: choose from {', '.join(FORCED_FOUR_BIT)}")
    if forced is not None and (forced == "int4" or fused.available()):
        if forced == "q8a":
            q8act.best_isa()  # says once which path runs where the CPU lacks VNNI (or AVX2)
        return forced, f"HISPEC_Q4_KERNEL={forced}"
    if not fused.available():
        if forced:
            log.warning("HISPEC_Q4_KERNEL=%s: hispec's compiled kernels are unavailable; 4-bit weights run on "
                        "PyTorch's int4 kernel", forced)
        return "int4", "hispec's compiled kernels unavailable" + (f" (HISPEC_Q4_KERNEL={forced})" if forced else "")
    path = _four_bit_choice_file()
    try:
        saved = json.loads(path.read_text())
        if saved.get("kernel") in TIMED_FOUR_BIT:
            return saved["kernel"], f"{saved.get('why', '')} (timed at an earlier load; delete {path.name} in {path.parent} to time again)"
    except (OSError, ValueError, AttributeError):
        pass
    med = format_timings()
    best, why = timed_choice(med, cpu_has_int8_dots())
    if best == "q8a":
        q8act.best_isa()  # says once which path runs where the CPU lacks VNNI
    build.keep_json(path, {"kernel": best, "why": why, "timings": med})
    return best, why


def _four_bit_kernel_for(group: int) -> str:
    """The kernel of a 4-bit weight in groups of ``group`` when none is asked for: the timed choice
    for GGUF-sized groups of 32, PyTorch's int4 (any group) otherwise."""
    return four_bit_kernel()[0] if group == 32 else "int4"


@functools.lru_cache(maxsize=1)
def cpu_has_int8_dots() -> bool:
    """Whether q8a has a path on integer dot-product instructions here (AVX-512 VNNI, AVX-VNNI)."""
    return fused.available() and bool(set(q8act.supported_isas()) & set(INT8_DOT_PATHS))


def q8a_prefills_on_rows() -> bool:
    """Whether ``q8a`` layers run prompt chunks on their own kernel (8-bit activations, each row
    alone, as decode steps do) rather than on float weights: where the CPU has integer dot products.
    There the kernel's many-row products run faster than the dense bfloat16 ones (the four decoder
    matmuls of a layer on a Zen 4, 2 threads: 1.7x at 16 rows, 1.5x at 64, 1.4x at 256) and no
    dense copy of the weights is kept (2 bytes per weight). Where the CPU also has AMX-BF16, prompt
    chunks take ``q8act.tiles_matmul`` instead (``QuantLinear.prefill_mm``; no dense copy either)."""
    return cpu_has_int8_dots()


def machine_timings() -> dict[str, float]:
    """:func:`format_timings` as kept beside :func:`four_bit_kernel`'s timed choice on this machine
    (timed now where none is kept: the stream of 4-bit weights costs ~1 s and ~250 MB at load)."""
    try:
        saved = json.loads(_four_bit_choice_file().read_text())["timings"]
        return {str(k): float(v) for k, v in saved.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return format_timings()


def eight_bit_kernel() -> str:
    """The kernel GGUF Q8_0 weights (an output head) run on by default: ``q8a8`` where the 4-bit
    kernel is ``q8a`` (one activation rounding for the whole model), ``q8`` where hispec's compiled
    kernels are built (and ``HISPEC_Q8=0`` is not set), else ``int4x2``."""
    if not (fused.available() and envs.HISPEC_Q8):
        return "int4x2"
    return "q8a8" if four_bit_kernel()[0] == "q8a" else "q8"


def _four_bit_choice_file() -> Path:
    """Where :func:`four_bit_kernel`'s timed choice is kept, per build of the C kernels (source,
    flags, CPU) and torch version: timed once per machine, so that the same command gives the same text from one load to the next
    (the kernels' bfloat16 and float32 activations round differently)."""
    return build.build_dir() / f"four_bit-{build.library_key()}-torch{torch.__version__}-rule{CHOICE_RULE}.json"
