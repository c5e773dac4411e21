"""8-bit-activation integer kernels for GGUF block weights (``csrc/q8act.c``).

Each row of ``x [T, K]`` float32 is quantized per block of 32 inputs to int8 codes with a float32
scale ``dx = amax / 127`` and the block's code sum ``sx`` (``dxs = dx * sx`` feeds the 4-bit
formats' offset ``m``), then multiplied with integer dot products by weights as hispec stores them:

- 4-bit (GGUF Q4_0, Q4_1, ``--quantize int4``): ``qs [N, K / 2]`` uint8 nibbles as in the file,
  ``dm [2, N, K / 32]`` float32 (``d``, ``m``): ``W = d * q + m`` (Q4_0: ``m = -8 d``).
- 8-bit (GGUF Q8_0): ``q [N, K]`` int8, ``d [N, K / 32]`` float32: ``W = d * q``.

Per output and block, the 32 products are summed exactly in int32 and added in block order:
``acc = fma(idot, d * dx, acc)``, ``macc = fma(m, dxs, macc)``, ``y = acc + macc`` (8-bit: ``acc``).
Every path (``ISAS``: plain C, AVX2 ``maddubs``, 256-bit VNNI, AVX-512 VNNI) computes exactly
these operations, so they agree bit for bit, and a row's outputs depend on that row alone.
Against the float product with the dequantized weights, the error is the activations' rounding:
at most half a step, ``amax / 254``, per input.

``hs_q8a_q4_matmul`` / ``hs_q8a_q8_matmul`` in the library take the arguments of ``fused_cpu.c``'s
``hs_q4_matmul`` / ``hs_q8_matmul`` (same weight tensors, float32 ``x``; bfloat16 too for 8-bit), so
the C++ layer op can call them in their place.

The library is compiled on first use by the machine's C compiler (``-O3 -march=native``), cached
under ``$HISPEC_HOME/kernels`` by a hash of the source, flags and CPU, and loaded with ctypes;
every path is built into it (``#pragma GCC target``) and chosen at run time by what the CPU has.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from .. import envs

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "q8act.c"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
BLOCK = 32
# the paths, slowest first (ids 1.. in the C source); "vnni-emulated" runs the 256-bit VNNI kernel
# with dpbusd made of AVX2 instructions, for tests on CPUs without VNNI (never chosen by itself)
ISAS = ("scalar", "avx2", "vnni256", "avx512vnni", "vnni-emulated")
FMT_Q4, FMT_Q8 = 0, 1

_p, _i64, _i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "hs_q8a_quantize": ([_p, _i64, _i64, _p, _p, _p, _p], None),
    "hs_q8a_matmul": ([_i, _p, _p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _p, _i, _i], _i),
    "hs_q8a_matmul_f32": ([_i, _p, _p, _p, _p, _i64, _i64, _i64, _p, _i, _i], _i),
    "hs_q8a_q4_matmul": ([_p, _p, _p, _p, _i64, _i64, _i64, _p, _i], None),  # = fused_cpu.c's hs_q4_matmul
    "hs_q8a_q8_matmul": ([_p, _p, _p, _i, _i64, _i64, _i64, _p, _i], None),  # = fused_cpu.c's hs_q8_matmul
    "hs_q8a_isa_supported": ([_i], _i),
    "hs_q8a_best_isa": ([], _i),
}


def _cpu_key() -> str:
    """What identifies this CPU's instruction set (a library built for another CPU is not reused)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def library_key() -> str:
    """What identifies a build: the source, the compiler flags and this CPU."""
    return hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_key().encode()).hexdigest()[:16]


def _compile(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        # the absolute path: the source includes itself once per instruction set (#include __FILE__)
        proc = subprocess.run([cc, *FLAGS, str(SOURCE.resolve()), "-o", str(tmp_out), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders leave one complete file


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no compiler, a failed build, ``HISPEC_FUSED=0``)."""
    if not envs.HISPEC_FUSED:
        return None
    path = envs.HISPEC_HOME / "kernels" / f"q8act-{library_key()}.so"
    try:
        if not path.exists():
            _compile(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:
        log.warning("8-bit-activation kernels unavailable: %s", e)
        return None
    for name, (args, res) in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = res
    return lib


def available() -> bool:
    return library() is not None


def supported_isas() -> list[str]:
    """The paths this CPU can run, slowest first (``scalar`` always)."""
    lib = library()
    return [] if lib is None else [name for i, name in enumerate(ISAS, 1) if lib.hs_q8a_isa_supported(i)]


@functools.lru_cache(maxsize=1)
def best_isa() -> str:
    """The fastest path this CPU has; says once (a log line) when it is not AVX-512 VNNI, and why."""
    name = ISAS[library().hs_q8a_best_isa() - 1]
    if name != "avx512vnni":
        lacking = {"scalar": "no AVX2", "avx2": "no AVX-512 VNNI or AVX-VNNI", "vnni256": "no AVX-512 VNNI"}[name]
        log.info("8-bit-activation kernels: the %s path (%s on this CPU)", name, lacking)
    return name


def _isa_id(isa: str | None) -> int:
    """``isa`` (None: the best this CPU has) as the C source's id; an unknown or unsupported one raises."""
    if isa is None:
        return ISAS.index(best_isa()) + 1
    if isa not in ISAS:
        raise ValueError(f"q8act: unknown path {isa!r}; choose from {', '.join(ISAS)}")
    if isa not in supported_isas():
        raise ValueError(f"q8act: this CPU cannot run the {isa} path (it has {', '.join(supported_isas())})")
    return ISAS.index(isa) + 1


class QActs(NamedTuple):
    """Activations quantized per block of 32 (``quantize``): ``codes [T, K]`` int8, ``dx [T, K/32]``
    float32 (``amax / 127``), ``sx [T, K/32]`` int32 (the codes' sum), ``dxs [T, K/32]`` float32 (``dx * sx``)."""

    codes: torch.Tensor
    dx: torch.Tensor
    sx: torch.Tensor
    dxs: torch.Tensor


def _lib() -> ctypes.CDLL:
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
        raise RuntimeError(f"q8act: the {ISAS[isa_id - 1]} path did not run (out of memory, or the CPU lacks it)")
    return y


def q4_matmul(x: torch.Tensor | QActs, qs: torch.Tensor, dm: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """``x [T, K]`` (float32, or already :func:`quantize`-d) times the transpose of a 4-bit block weight
    ``W = d * q + m`` (``qs [N, K / 2]`` uint8 nibbles as in the file, ``dm [2, N, K / 32]`` float32)
    -> ``[T, N]`` float32. ``isa``: one of ``ISAS`` (default: the best this CPU has)."""
    if not isinstance(qs, torch.Tensor) or qs.dim() != 2:
        raise TypeError(f"q8act: qs must be a 2-D tensor [N, K / 2], got {getattr(qs, 'shape', type(qs).__name__)}")
    n, k = qs.shape[0], qs.shape[1] * 2
    if k % BLOCK:
        raise ValueError(f"q8act: qs [N, K / 2] gives K = {k}, not a multiple of {BLOCK}")
    qs = _need(qs, "qs", torch.uint8, (n, k // 2))
    dm = _need(dm, "dm", torch.float32, (2, n, k // BLOCK))
    return _matmul(FMT_Q4, qs, dm.data_ptr(), dm.data_ptr() + 4 * n * (k // BLOCK), x, n, k, isa)


def q8_matmul(x: torch.Tensor | QActs, q: torch.Tensor, d: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """``x [T, K]`` (float32, or already :func:`quantize`-d) times the transpose of a Q8_0 weight
    ``W = d * q`` (``q [N, K]`` int8, ``d [N, K / 32]`` float32) -> ``[T, N]`` float32."""
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        raise TypeError(f"q8act: q must be a 2-D tensor [N, K], got {getattr(q, 'shape', type(q).__name__)}")
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"q8act: K = {k} must be a multiple of {BLOCK}")
    q = _need(q, "q", torch.int8, (n, k))
    d = _need(d, "d", torch.float32, (n, k // BLOCK))
    return _matmul(FMT_Q8, q, d.data_ptr(), None, x, n, k, isa)
