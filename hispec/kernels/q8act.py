"""8-bit-activation integer kernels for GGUF block weights (``csrc/q8act.c``).

Each row of ``x [T, K]`` float32 is quantized per block of 32 inputs to int8 codes with a float32
scale ``dx = amax / 127`` and the block's code sum ``sx`` (``dxs = dx * sx`` feeds the 4-bit
formats' offset ``m``), then multiplied with integer dot products by weights as hispec stores them:

- 4-bit (GGUF Q4_0, Q4_1, ``--quantize int4``): ``qs [N, K / 2]`` uint8 nibbles as in the file,
  ``dm [2, N, K / 32]`` (``d``, ``m``): ``W = d * q + m`` (Q4_0: ``m = -8 d``).
- 8-bit (GGUF Q8_0): ``q [N, K]`` int8, ``d [N, K / 32]``: ``W = d * q``.
- 8-bit, group 16 (GGUF Q6_K, ``gguf_weights``): ``q [N, K]`` int8, ``d [N, K / 16]``: a scale per 16
  values. The activations stay in blocks of 32; each block's integer dot product is taken as two
  halves of 16, each times its own weight scale, the low half first:
  ``acc = fma(idot_lo, d_lo * dx, acc)``, ``acc = fma(idot_hi, d_hi * dx, acc)`` (VNNI's ``-128 * sx``
  correction of the 8-bit codes then uses each half's code sum, taken by the kernel from the codes).

The kernels read these **tiled** (:func:`tile4`, :func:`tile8`, once at load; :func:`untile4`,
:func:`untile8` give the rows back): the same bytes and shapes, reordered so that per tile of 16
output columns and per block, each 4-byte piece of the 16 columns' blocks lies side by side (one
512-bit load; the last ``N % 16`` columns stay rows). The kernel then reads its weights as plain
loads instead of gathering and transposing 16 columns' blocks at every call, which cost a one-row
step about as much as the products. The tiled scales are **float16**, as GGUF stores them (tiling
rounds other scales to float16; GGUF's are kept exactly), widened exactly to float32 in the kernel:
a one-row step streams the weights from memory, and float32 scales were a third of a 4-bit
weight's bytes beside its nibbles (one decode step's matmuls at one row on a Zen 4: 3.63 -> 3.07 ms).

Per output and block, the 32 products are summed exactly in int32 and added in block order:
``acc = fma(idot, d * dx, acc)``, ``macc = fma(m, dxs, macc)``, ``y = acc + macc`` (8-bit: ``acc``).
Every path (``ISAS``: plain C, AVX2 ``maddubs``, 256-bit VNNI, AVX-512 VNNI, AMX tiles for the
integer sums of many rows: :func:`use_amx_rows`) computes exactly these operations, so they agree bit
for bit, and a row's outputs depend on that row alone.
Against the float product with the dequantized weights, the error is the activations' rounding:
at most half a step, ``amax / 254``, per input.

``hs_q8a_q4_matmul`` / ``hs_q8a_q8_matmul`` take the arguments of ``gguf.c``'s ``hs_q4_matmul`` /
``hs_q8_matmul`` (the weight tensors tiled, float32 ``x``; bfloat16 too for 8-bit), so the torch op
runs them in their place (``HS_MM_Q8A4`` / ``HS_MM_Q8A8``) when QuantLinear's 4-bit kernel is
``q8a``; prompt chunks take ``q4``'s float32 panels (``hs_q8a_q4_panel_matmul``, the same bits).

Prompt chunks take another arithmetic where the CPU has AMX-BF16 (Sapphire Rapids and later):
:func:`tiles_matmul` (``csrc/bf16_tiles.c``) rounds the rows and the weights' exact values once to
bfloat16 and adds their products in float32 on the tile unit, the weights rebuilt 16 columns at a time
(no dense copy kept). Each row still depends on itself alone, so a prompt's K/V do not depend on its
chunking; its bits are not a decoded token's (prompts only, as the prompt attention's). On the default
model's matmuls at 256 rows it ran ~2x q8a's AMX path, and greedy text kept in step with float32
weights longer (thirty-first session: 54.5 against 36.5 tokens, 30 held-out prompts).

``csrc/q8act.c`` is part of the one C library (``build.py``, bound from ``hispec_kernels.h`` by
``binding.py``); every path is built into it (``#pragma GCC target``) and chosen at run time by what
the CPU has.
"""
from __future__ import annotations

import functools
import json
import logging
from typing import NamedTuple

import torch

from .. import envs
from . import binding

log = logging.getLogger(__name__)

BLOCK = 32
# the paths, slowest first (the header's enum hs_q8a_isa: HS_Q8A_SCALAR = 1, ...); "vnni-emulated" runs
# the 256-bit VNNI kernel with dpbusd made of AVX2 instructions, for tests on CPUs without VNNI (never
# chosen by itself); "amx": Intel's tile unit, for products of many rows (``amx_rows``)
ISAS = ("scalar", "avx2", "vnni256", "avx512vnni", "vnni-emulated", "amx")
_ISA_MEMBERS = ("HS_Q8A_SCALAR", "HS_Q8A_AVX2", "HS_Q8A_VNNI256", "HS_Q8A_AVX512VNNI", "HS_Q8A_EMULATED",
                "HS_Q8A_AMX")


@functools.lru_cache(maxsize=1)
def _isa_ids() -> dict[str, int]:
    """``ISAS`` name -> the C source's id, from the header."""
    enum = binding.enum("hs_q8a_isa")
    return {name: enum[member] for name, member in zip(ISAS, _ISA_MEMBERS)}


@functools.lru_cache(maxsize=1)
def _formats() -> tuple[int, int, int]:
    """The header's ``HS_Q8A_Q4``, ``HS_Q8A_Q8``, ``HS_Q8A_Q8G16``."""
    enum = binding.enum("hs_q8a_format")
    return enum["HS_Q8A_Q4"], enum["HS_Q8A_Q8"], enum["HS_Q8A_Q8G16"]


def library():
    """The kernels' C library (``binding.library``), or None (no compiler, a failed build, ``HISPEC_FUSED=0``)."""
    return binding.library()


def available() -> bool:
    return library() is not None


def supported_isas() -> list[str]:
    """The paths this CPU can run, slowest first (``scalar`` always)."""
    lib = library()
    return [] if lib is None else [name for name, i in _isa_ids().items() if lib.hs_q8a_isa_supported(i)]


@functools.lru_cache(maxsize=1)
def best_isa() -> str:
    """The fastest path this CPU has; says once (a log line) when it is not AVX-512 VNNI, and why: a
    warning for the plain C path (no AVX2: slow, the same bits), else an info line."""
    best = _lib().hs_q8a_best_isa()
    name = next(n for n, i in _isa_ids().items() if i == best)
    if name != "avx512vnni":
        lacking = {"scalar": "no AVX2", "avx2": "no AVX-512 VNNI or AVX-VNNI", "vnni256": "no AVX-512 VNNI"}[name]
        (log.warning if name == "scalar" else log.info)(
            "8-bit-activation kernels: the %s path (%s on this CPU)%s", name, lacking,
            ": same results, several times slower" if name == "scalar" else "")
    return name


def _isa_id(isa: str | None) -> int:
    """``isa`` (None: the best this CPU has) as the C source's id; an unknown or unsupported one raises."""
    if isa is None:
        return _isa_ids()[best_isa()]
    if isa not in ISAS:
        raise ValueError(f"q8act: unknown path {isa!r}; choose from {', '.join(ISAS)}")
    if isa not in supported_isas():
        raise ValueError(f"q8act: this CPU cannot run the {isa} path (it has {', '.join(supported_isas())})")
    return _isa_ids()[isa]


class QActs(NamedTuple):
    """Activations quantized per block of 32 (``quantize``): ``codes [T, K]`` int8, ``dx [T, K/32]``
    float32 (``amax / 127``), ``sx [T, K/32]`` int32 (the codes' sum), ``dxs [T, K/32]`` float32 (``dx * sx``)."""

    codes: torch.Tensor
    dx: torch.Tensor
    sx: torch.Tensor
    dxs: torch.Tensor


def _lib():
    lib = library()
    if lib is None:
        raise RuntimeError("q8act: the 8-bit-activation kernels are not built (no C compiler, or HISPEC_FUSED=0)")
    return lib


def _need(t: torch.Tensor, what: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` as the kernel reads it (CPU, ``dtype``, ``shape``, contiguous), or a clear error."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != shape or t.device.type != "cpu":
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"q8act: {what} must be a CPU {dtype} tensor of shape {shape}, got {got}")
    return t if t.is_contiguous() else t.contiguous()


def _rows(x: torch.Tensor) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise TypeError(f"q8act: x must be a 2-D tensor [T, K], got {getattr(x, 'shape', type(x).__name__)}")
    t, k = x.shape
    if k % BLOCK or k == 0:
        raise ValueError(f"q8act: K = {k} must be a positive multiple of {BLOCK}")
    return t, k


def quantize(x: torch.Tensor) -> QActs:
    """``x [T, K]`` float32 -> its codes and block scales (see :class:`QActs`); each row alone."""
    t, k = _rows(x)
    x = _need(x, "x", torch.float32, (t, k))
    nb = k // BLOCK
    out = QActs(torch.empty((t, k), dtype=torch.int8), torch.empty((t, nb), dtype=torch.float32),
                torch.empty((t, nb), dtype=torch.int32), torch.empty((t, nb), dtype=torch.float32))
    _lib().hs_q8a_quantize(x.data_ptr(), t, k, *(a.data_ptr() for a in out))
    return out


def _matmul(fmt: int, w: torch.Tensor, d: int, m: int | None, x: torch.Tensor | QActs, n: int, k: int,
            isa: str | None) -> torch.Tensor:
    """``y [T, N]`` for the checked weight ``w`` with scales at address ``d`` (and offsets at ``m``)."""
    if isinstance(x, QActs):
        t = x.codes.shape[0] if isinstance(x.codes, torch.Tensor) and x.codes.dim() == 2 else -1
        acts = QActs(_need(x.codes, "codes", torch.int8, (t, k)), _need(x.dx, "dx", torch.float32, (t, k // BLOCK)),
                     _need(x.sx, "sx", torch.int32, (t, k // BLOCK)), _need(x.dxs, "dxs", torch.float32, (t, k // BLOCK)))
    else:
        t, kx = _rows(x)
        if kx != k:
            raise ValueError(f"q8act: x has K = {kx} inputs, the weight {k}")
        x = _need(x, "x", torch.float32, (t, k))
        acts = None
    y = torch.empty((t, n), dtype=torch.float32)
    if t == 0 or n == 0:
        return y
    lib, isa_id = _lib(), _isa_id(isa)
    if acts is None:
        ran = lib.hs_q8a_matmul_f32(fmt, w.data_ptr(), d, m, x.data_ptr(), t, n, k, y.data_ptr(), isa_id, 1)
    else:
        ran = lib.hs_q8a_matmul(fmt, w.data_ptr(), d, m, *(a.data_ptr() for a in acts), t, n, k, y.data_ptr(),
                                isa_id, 1)
    if ran != isa_id:
        raise RuntimeError(f"q8act: the {isa or best_isa()} path did not run (out of memory, or the CPU lacks it)")
    return y


def _q4_weight(qs: torch.Tensor, dm: torch.Tensor,
               dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(qs, dm, N, K) checked: ``qs [N, K / 2]`` uint8, ``dm [2, N, K / 32]`` of ``dtype``."""
    if not isinstance(qs, torch.Tensor) or qs.dim() != 2:
        raise TypeError(f"q8act: qs must be a 2-D tensor [N, K / 2], got {getattr(qs, 'shape', type(qs).__name__)}")
    n, k = qs.shape[0], qs.shape[1] * 2
    if k % BLOCK:
        raise ValueError(f"q8act: qs [N, K / 2] gives K = {k}, not a multiple of {BLOCK}")
    return _need(qs, "qs", torch.uint8, (n, k // 2)), _need(dm, "dm", dtype, (2, n, k // BLOCK)), n, k


GROUPS = (32, 16)  # the 8-bit form's scale groups (16: GGUF Q6_K)


def _q8_weight(q: torch.Tensor, d: torch.Tensor,
               dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(q, d, N, K) checked: ``q [N, K]`` int8, ``d [N, K / group]`` of ``dtype``, group 32 or 16."""
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        raise TypeError(f"q8act: q must be a 2-D tensor [N, K], got {getattr(q, 'shape', type(q).__name__)}")
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"q8act: K = {k} must be a multiple of {BLOCK}")
    group = 16 if isinstance(d, torch.Tensor) and d.dim() == 2 and d.shape[1] == k // 16 else BLOCK
    return _need(q, "q", torch.int8, (n, k)), _need(d, "d", dtype, (n, k // group)), n, k


def _q8_format(d: torch.Tensor, k: int) -> int:
    """The 8-bit format of checked scales ``d``: ``HS_Q8A_Q8G16`` for ``[N, K / 16]``, else ``HS_Q8A_Q8``."""
    return _formats()[2] if d.shape[1] == k // 16 else _formats()[1]


def _tile(fmt: int, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, n: int, k: int,
          untile: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    w_out, d_out, m_out = torch.empty_like(w), torch.empty_like(d), None if m is None else torch.empty_like(m)
    _lib().hs_q8a_tile(fmt, w.data_ptr(), d.data_ptr(), None if m is None else m.data_ptr(), n, k, w_out.data_ptr(),
                       d_out.data_ptr(), None if m_out is None else m_out.data_ptr(), int(untile))
    return w_out, d_out, m_out


# ---- AMX for many rows ------------------------------------------------------------------------
AMX_TIMED_ROWS = (64, 256)  # the row counts the tile path is timed at (prompt chunks)
AMX_MARGIN = 0.95  # taken from the fewest of them where it takes at most this fraction of the time
AMX_RULE = 1  # in the kept choice's file name: a change of rule times again
_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K): a SmolLM2-135M layer's matmuls


def time_amx_rows(reps: int = 5) -> dict[str, float]:
    """Median seconds of a SmolLM2 layer's four matmuls on ``AMX_TIMED_ROWS`` rows, 4-bit and 8-bit
    weights summed, on the tile path (``amx@T``) and on the best vector path (``vector@T``),
    interleaved; the activations quantized once beforehand (as a prompt chunk's are, per matmul)."""
    from .timing import interleaved_medians

    g = torch.Generator().manual_seed(0)
    weights = []
    for n, k in _LAYER:
        qs = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        dm = torch.stack([torch.rand(n, k // BLOCK, generator=g) * 0.01, -torch.rand(n, k // BLOCK, generator=g) * 0.1])
        q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        weights.append((tile4(qs, dm), tile8(q8, torch.rand(n, k // BLOCK, generator=g) * 0.01)))
    fns = {}
    for t in AMX_TIMED_ROWS:
        acts = {k: quantize(torch.randn(t, k, generator=g)) for k in {k for _, k in _LAYER}}
        for path in ("amx", best_isa()):
            def run(path=path, acts=acts):
                for (w4, w8), (_, k) in zip(weights, _LAYER):
                    q4_matmul(acts[k], *w4, isa=path)
                    q8_matmul(acts[k], *w8, isa=path)
            fns[f"{'amx' if path == 'amx' else 'vector'}@{t}"] = run
    return interleaved_medians(fns, reps, warmup=1)


def amx_rows_choice(med: dict[str, float]) -> int:
    """The fewest of ``AMX_TIMED_ROWS`` where the tile path took at most ``AMX_MARGIN`` of the vector
    path's time (:func:`time_amx_rows`), else 0 (never)."""
    return next((t for t in AMX_TIMED_ROWS if med[f"amx@{t}"] <= AMX_MARGIN * med[f"vector@{t}"]), 0)


@functools.lru_cache(maxsize=1)
def use_amx_rows() -> int:
    """Set, once per process, from how many rows q8a's products take the AMX path (``HS_Q8A_AUTO``:
    prompt chunks; the same bits as every path), and return it (0: never). Where the CPU has AMX the
    count is timed (:func:`time_amx_rows`, ~0.5 s) once per machine and kept beside the build, as
    ``quant.four_bit_kernel``'s choice is. On a 2-core Xeon (AVX-512, AMX; the thirtieth session) the tile
    path ran a layer's matmuls 1.1-1.2x as fast on 64-256 rows and slower on 16 (its per-block
    float steps are the vector path's; the mixed serving load stepped offline took 0.97x the time
    from 64 rows, 0.99x from 16)."""
    lib = library()
    if lib is None or "amx" not in supported_isas():
        return 0
    from . import build

    path = build.build_dir() / f"q8a_amx_rows-{build.library_key()}-rule{AMX_RULE}.json"
    try:
        rows = int(json.loads(path.read_text())["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        med = time_amx_rows()
        rows = amx_rows_choice(med)
        build.keep_json(path, {"rows": rows, "timings": med})
    lib.hs_q8a_set_amx_rows(rows)
    return rows


def tile4(qs: torch.Tensor, dm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 4-bit weight (``qs [N, K / 2]`` as in the file, ``dm [2, N, K / 32]`` float) in the kernels'
    tiled layout: the same shapes, ``dm`` in float16 (rounded to nearest; exact for GGUF's scales)."""
    qs, dm, n, k = _q4_weight(qs, dm.to(torch.float16))
    w, d, m = _tile(_formats()[0], qs, dm[0].contiguous(), dm[1].contiguous(), n, k, False)
    return w, torch.stack([d, m])


def untile4(qs: torch.Tensor, dm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tile4`'s output back in row order, ``dm`` widened to float32."""
    qs, dm, n, k = _q4_weight(qs, dm)
    w, d, m = _tile(_formats()[0], qs, dm[0].contiguous(), dm[1].contiguous(), n, k, True)
    return w, torch.stack([d, m]).float()


def tile8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit weight (``q [N, K]``, ``d [N, K / 32]`` float, or ``[N, K / 16]``: group 16) in the
    kernels' tiled layout, ``d`` in float16 (as :func:`tile4`; a group-16 tile's scales lie as
    ``K / 16`` blocks of scales of its 16 columns)."""
    q, d, n, k = _q8_weight(q, d.to(torch.float16))
    w, d, _ = _tile(_q8_format(d, k), q, d, None, n, k, False)
    return w, d


def untile8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tile8`'s output back in row order, ``d`` widened to float32."""
    q, d, n, k = _q8_weight(q, d)
    w, d, _ = _tile(_q8_format(d, k), q, d, None, n, k, True)
    return w, d.float()


def q4_matmul(x: torch.Tensor | QActs, qs: torch.Tensor, dm: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """``x [T, K]`` (float32, or already :func:`quantize`-d) times the transpose of a 4-bit block weight
    ``W = d * q + m`` (``qs [N, K / 2]`` uint8 nibbles, ``dm [2, N, K / 32]`` float16, both tiled:
    :func:`tile4`) -> ``[T, N]`` float32. ``isa``: one of ``ISAS`` (default: the best this CPU has)."""
    qs, dm, n, k = _q4_weight(qs, dm)
    return _matmul(_formats()[0], qs, dm.data_ptr(), dm.data_ptr() + 2 * n * (k // BLOCK), x, n, k, isa)


def q4_panel_matmul(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """Prompt chunks on tiled 4-bit weights: ``fused.q4_matmul(x, *untile4(qs, dm), panels=True)``'s
    bits (float32 activations and panels), without keeping the rows."""
    qs, dm, n, k = _q4_weight(qs, dm)
    t, kx = _rows(x)
    if kx != k:
        raise ValueError(f"q8act: x has K = {kx} inputs, the weight {k}")
    x = _need(x, "x", torch.float32, (t, k))
    y = torch.empty((t, n), dtype=torch.float32)
    if t and n:
        _lib().hs_q8a_q4_panel_matmul(qs.data_ptr(), dm.data_ptr(), dm.data_ptr() + 2 * n * (k // BLOCK), x.data_ptr(),
                                      t, n, k, y.data_ptr(), 1)
    return y


def q8_matmul(x: torch.Tensor | QActs, q: torch.Tensor, d: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """``x [T, K]`` (float32, or already :func:`quantize`-d) times the transpose of an 8-bit weight
    ``W = d * q`` (``q [N, K]`` int8, ``d [N, K / 32]`` float16, or ``[N, K / 16]``: a scale per 16
    values, both tiled: :func:`tile8`) -> ``[T, N]`` float32."""
    q, d, n, k = _q8_weight(q, d)
    return _matmul(_q8_format(d, k), q, d.data_ptr(), None, x, n, k, isa)


# ---- prompt chunks on bfloat16 tiles (csrc/bf16_tiles.c) ------------------------------------------
@functools.lru_cache(maxsize=1)
def bf16_tiles() -> bool:
    """Whether prompt chunks' products run on bfloat16 AMX tiles here (:func:`tiles_matmul`): a CPU with
    AMX-BF16 whose tiles Linux lets the process use, and ``HISPEC_BF16_TILES`` not 0."""
    return available() and envs.HISPEC_BF16_TILES and bool(library().hs_bf16_tiles())


def tiles_matmul(x: torch.Tensor, w: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Prompt rows ``x [T, K]`` float32 times a tiled q8a weight's exact values (4-bit: ``w`` the nibbles,
    ``params`` ``dm``; 8-bit: ``w`` int8, ``params`` ``d``), both rounded to bfloat16, products added in
    float32 on the tile unit (``csrc/bf16_tiles.c``) -> ``[T, N]`` float32. Each row's outputs depend on
    that row alone. RuntimeError where the CPU cannot (:func:`bf16_tiles`)."""
    four = w.dtype == torch.uint8
    if four:
        w, params, n, k = _q4_weight(w, params)
        fmt, d, m = _formats()[0], params.data_ptr(), params.data_ptr() + 2 * n * (k // BLOCK)
    else:
        w, params, n, k = _q8_weight(w, params)
        fmt, d, m = _q8_format(params, k), params.data_ptr(), None
    t, kx = _rows(x)
    if kx != k:
        raise ValueError(f"q8act: x has K = {kx} inputs, the weight {k}")
    x = _need(x, "x", torch.float32, (t, k))
    y = torch.empty((t, n), dtype=torch.float32)
    if t and n and not _lib().hs_bf16_tiles_matmul(fmt, w.data_ptr(), d, m, x.data_ptr(), t, n, k, y.data_ptr(), 1):
        raise RuntimeError("q8act: the bfloat16 tiles did not run (no AMX-BF16 here, or out of memory)")
    return y
