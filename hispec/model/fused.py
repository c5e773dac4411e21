"""Fused CPU kernels for the work between a decoder layer's matmuls (norms, RoPE, the cache
write, paged attention, the gated activation).

Eager PyTorch spends ~10 ms per token of the default model outside its matmuls: ~40 small ops
per layer at a few microseconds each (dispatch, allocation, dtype casts), and attention that
gathers each sequence's context out of the paged pool. ``fused_cpu.c`` does each run of that
work in one call: ``rms_norm`` / ``add_rms_norm`` (residual add + norm + cast to the matmul
input dtype), ``rope_write`` (rotate q and k, write K/V to their slots), ``paged_attention``
(each query over its own context read through the block table, no gather), ``silu_mul``; and
matmuls whose every output row is computed alone: ``panel_matmul`` (float32 products on weights
packed in panels, which ``matmul.Linear`` takes where it times faster than MKL / oneDNN), and
``q4_matmul`` / ``q8_matmul`` on GGUF blocks as stored (``quant.py``).

The library is compiled on first use by the machine's C compiler for this CPU
(``-O3 -march=native``: the instructions the CPU has, AVX2 or AVX-512, chosen by the compiler),
cached under ``$HISPEC_HOME/kernels`` by a hash of the source, flags and CPU, and loaded with
ctypes. Without a compiler (or with ``HISPEC_FUSED=0``) the model runs its eager PyTorch path,
with the same results up to float rounding.

Exactness: each function computes every row with the same code whatever the number of rows in
the call (per query, attention reads exactly its own context), so a token's hidden states do
not depend on how many tokens share a forward pass: one-token decoding, speculative
verification and batches give bit-identical values, which is what keeps every strategy's output
identical to ``ar``'s.
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

SOURCE = Path(__file__).with_name("fused_cpu.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
PARALLEL_MIN_WORK = 1 << 15  # query-key multiply-adds of a call from which the threads share it (SmolLM2, one token: ~57 keys)

_f, _i64, _p, _i = ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "hs_rms_norm": [_p, _p, _i64, _i64, _f, _p, _i],
    "hs_add_rms_norm": [_p, _p, _i, _p, _i64, _i64, _f, _p, _p, _i],
    "hs_silu_mul": [_p, _i, _i64, _i64, _p, _i],
    "hs_rope_write": [_p, _i, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _p, _p, _i, _p],
    "hs_paged_attention": [_p, _p, _p, _i, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _f, _p, _i, _i],
    "hs_q8_matmul": [_p, _p, _p, _i, _i64, _i64, _i64, _p, _i],
    "hs_panel_pack": [_p, _i64, _i64, _p],
    "hs_panel_matmul": [_p, _i64, _i64, _p, _i64, _p, _i],
    "hs_q4_matmul": [_p, _p, _p, _p, _i64, _i64, _i64, _p, _i],
    "hs_q4_panel_matmul": [_p, _p, _p, _p, _i64, _i64, _i64, _p, _i],
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


def _build_dir() -> Path:
    from .load.registry import hispec_home

    return hispec_home() / "kernels"


def _compile(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp_out), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders leave one complete file


@functools.lru_cache(maxsize=1)
def library_key() -> str:
    """What identifies a build of the C kernels: their source, the compiler flags and this CPU."""
    return hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_key().encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no compiler, a failed build, ``HISPEC_FUSED=0``)."""
    if not envs.HISPEC_FUSED:
        return None
    path = _build_dir() / f"fused_cpu-{library_key()}.so"
    try:
        if not path.exists():
            _compile(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:
        log.warning("fused CPU kernels unavailable, using the eager PyTorch path: %s", e)
        return None
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    lib.hs_panel_width.argtypes, lib.hs_panel_width.restype = [], ctypes.c_int64
    return lib


def available() -> bool:
    return library() is not None


# ---- a range of layers in one call (fused_layers.cpp) ------------------------------------------
LAYERS_SOURCE = Path(__file__).with_name("fused_layers.cpp")
MM_FLOAT, MM_INT4, MM_INT8, MM_DENSE, MM_FLOAT_LINEAR, MM_Q4, MM_Q4_PANELS, MM_PANEL, MM_Q8, MM_DENSE_BF16 = range(10)  # as in fused_layers.cpp
MM_FLOAT_KINDS = (MM_FLOAT, MM_FLOAT_LINEAR, MM_PANEL)  # float32 weights: as matmul.small_route()
_KERNEL_ORDER = ("hs_rms_norm", "hs_add_rms_norm", "hs_silu_mul", "hs_rope_write", "hs_paged_attention", "hs_q4_matmul",
                 "hs_q4_panel_matmul", "hs_panel_matmul", "hs_q8_matmul")


def _cxx_command(out: Path) -> list[str]:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++/c++) on PATH")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, "-O2", "-std=c++20", "-fPIC", "-shared", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in cpp_extension.include_paths()), str(LAYERS_SOURCE), "-o", str(out),
            *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]


def _layers_path() -> Path:
    """Where the layer op for this source, torch version and CPU is built."""
    key = hashlib.sha256(LAYERS_SOURCE.read_bytes() + torch.__version__.encode() + _cpu_key().encode()).hexdigest()[:16]
    return _build_dir() / f"fused_layers-{key}.so"


@functools.lru_cache(maxsize=1)
def layers_op():
    """``torch.ops.hispec_fused.decode_layers`` (a range of decoder layers in one call, on the
    same kernels as the per-layer path), or None: no C kernels, no C++ compiler or torch headers,
    or ``HISPEC_FUSED_LAYERS=0``. Built once per source, torch version and CPU (~15 s)."""
    lib = library()
    if lib is None or not envs.HISPEC_FUSED_LAYERS:
        return None
    path = _layers_path()
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                tmp_out = Path(tmp) / path.name
                proc = subprocess.run(_cxx_command(tmp_out), capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"C++ build failed: {proc.stderr.strip()[-2000:]}")
                os.replace(tmp_out, path)
        torch.ops.load_library(str(path))
        ops = torch.ops.hispec_fused
        ops.bind([ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _KERNEL_ORDER])
    except (OSError, RuntimeError) as e:
        log.warning("fused layer op unavailable, running the fused kernels layer by layer: %s", e)
        return None
    return ops.decode_layers


def prebuild(say=None) -> None:
    """Build (or load) the kernels now rather than in the first decode step, so the first
    generation's time is not a compiler's. ``say(msg)`` is told when a build is about to run."""
    if not envs.HISPEC_FUSED:
        return
    if say is not None and library() is not None and not _layers_path().exists():
        say("building hispec's CPU kernels for this CPU (once, ~15 s)")
    layers_op()


class LayerPlans(NamedTuple):
    """The plans of a range of layers (``DecoderLayer.layer_plan``), flattened as the C++ op takes them."""

    norms: list
    weights: list
    kinds: list
    groups: list

    @classmethod
    def of(cls, plans: list) -> "LayerPlans":
        flat = cls([], [], [], [])
        for p in plans:
            for part, values in zip(flat, p):
                part += values
        return flat


RANGES_PER_POOL = 16  # op ranges a pool keeps (layer ranges x prompt/decode/batched plans); more: made anew


def op_range(plans: LayerPlans, pool: "KVPool", start: int, end: int, cfg, bf16_acts: bool):
    """``torch.classes.hispec_fused.Range``: ``plans`` and the pool's cache layers ``[start, end)``
    as the op holds them between calls. Kept by the pool (it goes with the pool), per plans object:
    plans made anew (new weights) get a new one (the entry holds its plans, so their id stays theirs)."""
    key = (id(plans), start, end, bf16_acts)
    hit = pool.op_ranges.get(key)
    if hit is None:
        if len(pool.op_ranges) >= RANGES_PER_POOL:
            pool.op_ranges.clear()
        made = torch.classes.hispec_fused.Range(pool.k[start:end], pool.v[start:end], plans.norms, plans.weights,
                                                plans.kinds, plans.groups, cfg.num_heads, cfg.num_kv_heads,
                                                cfg.norm_eps, bf16_acts)
        hit = pool.op_ranges[key] = (plans, made)
    return hit[1]


def decode_layers(h: torch.Tensor, plans: LayerPlans, rope, batch: "AttentionBatch", pool: "KVPool", start: int,
                  end: int, cfg, bf16_acts: bool) -> torch.Tensor:
    """Run layers ``[start, end)``, whose ``plans`` are given, on ``h [T, H]`` float32 in one call
    (writing their K/V into ``pool``); bit-identical to running them one by one on the fused kernels."""
    meta = batch.kernel()
    cos, ssin = (r.view(r.shape[0], r.shape[-1]) for r in rope)  # [T, D]
    parallel = meta.keys * cfg.num_heads * cfg.head_dim >= PARALLEL_MIN_WORK
    return layers_op()(h.contiguous(), cos.contiguous(), ssin.contiguous(), batch.write_slots, meta.tables, meta.seq,
                       meta.lengths, meta.block_size, parallel, op_range(plans, pool, start, end, cfg, bf16_acts))


def op_head(embed: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, params: torch.Tensor, kind: int,
            group: int, eps: float):
    """``torch.classes.hispec_fused.Head``: what ``decode_step`` runs besides the layers, the token
    embeddings ``[V, H]`` and final RMSNorm weight ``[H]`` (float32) and the output head (a matmul
    of ``kind`` on ``weight`` and ``params``, as in a layer plan)."""
    return torch.classes.hispec_fused.Head(embed, norm, weight, params, kind, group, eps)


def _flat_tables(tables: list[list[int]]) -> list[int]:
    """Block tables as one row-major list, each padded with block 0 to the longest."""
    width = max(len(t) for t in tables)
    return [b for t in tables for b in (t + [0] * (width - len(t)) if len(t) < width else t)]


def _parallel_min_keys(cfg) -> int:
    """Keys (the sequences' positions + 1, summed) from which a decode step's attention shares the
    threads: ``keys * num_heads * head_dim >= PARALLEL_MIN_WORK``, as ``decode_layers`` decides it."""
    return -(-PARALLEL_MIN_WORK // (cfg.num_heads * cfg.head_dim))


def decode_step(tokens: list[int], positions: list[int], tables: list[list[int]], rope_table, plans: LayerPlans,
                head, pool: "KVPool", cfg, bf16_acts: bool) -> torch.Tensor:
    """One decoding step of B sequences in one call: ``tokens[b]`` at ``positions[b]`` (sequence b's
    block table ``tables[b]``) through every layer (``plans``), the final norm and the output head
    (``head = op_head(...)``) -> logits ``[B, V]`` float32. ``rope_table``: ``(cos, signed sin)``
    ``[P, D]`` float32 with ``P > max(positions)``. The same bits as the step taken call by call
    (embedding, ``decode_layers``, the norm and the head's kernel)."""
    return torch.ops.hispec_fused.decode_step(tokens, positions, _flat_tables(tables), pool.block_size, rope_table[0],
                                              rope_table[1], _parallel_min_keys(cfg),
                                              op_range(plans, pool, 0, cfg.num_layers, cfg, bf16_acts), head)


def decode_steps(tokens: list[int], positions: list[int], tables: list[list[int]], rope_table, plans: LayerPlans,
                 head, pool: "KVPool", cfg, bf16_acts: bool, steps: int, eos: list[int]) -> torch.Tensor:
    """Up to ``steps`` greedy steps in one call: ``decode_step``, the argmax of each row (as
    ``torch.argmax``), those tokens at the next positions, ... -> the chosen tokens ``[B, s]``
    int64, ``s <= steps`` (it stops once every row has chosen one of ``eos``). The same tokens as
    ``s`` calls of ``decode_step`` with an argmax between them. ``tables[b]`` and ``rope_table``
    must cover ``positions[b] + steps - 1``."""
    return torch.ops.hispec_fused.decode_steps(tokens, positions, _flat_tables(tables), pool.block_size, rope_table[0],
                                               rope_table[1], steps, eos, _parallel_min_keys(cfg),
                                               op_range(plans, pool, 0, cfg.num_layers, cfg, bf16_acts), head)


PROFILE_PARTS = ("matmul", "attention", "rope_cache", "norm", "silu_mul", "residual", "setup")


def profile(on: bool) -> dict[str, tuple[float, int]]:
    """Time the C++ op's calls per part (wall clock around each call) while ``on``; returns each
    part's ``(seconds, calls)`` summed since the previous call and starts again from zero. The
    parts (PROFILE_PARTS): the matmuls (decoder linears, output head), paged attention, RoPE with
    the cache write, the RMSNorms (with their residual adds), the gated activation, the residual add
    after the MLP, and a decode step's setup (embeddings, RoPE rows, block tables). Empty when the
    op is unavailable."""
    if layers_op() is None:
        return {}
    seconds, calls = torch.ops.hispec_fused.profile(on)
    return {part: (s, c) for part, s, c in zip(PROFILE_PARTS, seconds, calls)}


def _bf(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def _check(t: torch.Tensor, *dtypes: torch.dtype) -> torch.Tensor:
    """``t`` as the kernels read it (contiguous, on the CPU, one of ``dtypes``): a wrong tensor
    raises here instead of being read out of bounds."""
    if t.device.type != "cpu" or t.dtype not in dtypes:
        raise TypeError(f"fused kernel: expected a CPU tensor of {dtypes}, got {t.dtype} on {t.device}")
    return t.contiguous()


F32, BF16 = torch.float32, torch.bfloat16
KV_DTYPES = (F32, BF16)  # what a KV pool may hold for the kernels


def _check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K and V pools as the kernels read them: ``[Hkv, S, D]``, contiguous, on the CPU, one
    dtype of KV_DTYPES."""
    if k_pool.dim() != 3 or k_pool.shape != v_pool.shape:
        raise TypeError(f"fused kernel: K and V pools [Hkv, S, D], got {tuple(k_pool.shape)} "
                        f"and {tuple(v_pool.shape)}")
    if k_pool.dtype != v_pool.dtype:
        raise TypeError(f"fused kernel: K and V pools of one dtype, got {k_pool.dtype} and {v_pool.dtype}")
    return _check(k_pool, *KV_DTYPES), _check(v_pool, *KV_DTYPES)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``x [T, D]`` float32 -> normalised and scaled ``[T, D]`` in ``out_dtype`` (float32/bfloat16)."""
    x, weight = _check(x, F32), _check(weight, F32)
    out = torch.empty(x.shape, dtype=out_dtype)
    library().hs_rms_norm(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr(),
                          int(out_dtype == BF16))
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``h + delta`` (float32 ``[T, D]``; ``delta`` float32 or bfloat16) and its norm in ``out_dtype``."""
    h, delta, weight = _check(h, F32), _check(delta, F32, BF16), _check(weight, F32)
    h_out = torch.empty_like(h)
    out = torch.empty(h.shape, dtype=out_dtype)
    library().hs_add_rms_norm(h.data_ptr(), delta.data_ptr(), _bf(delta), weight.data_ptr(), h.shape[0], h.shape[1],
                              eps, h_out.data_ptr(), out.data_ptr(), int(out_dtype == BF16))
    return h_out, out


def silu_mul(gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2I] = [gate | up]`` -> ``[T, I]``."""
    gate_up = _check(gate_up, F32, BF16)
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, i), dtype=out_dtype)
    library().hs_silu_mul(gate_up.data_ptr(), _bf(gate_up), t, i, out.data_ptr(), int(out_dtype == BF16))
    return out


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor, slots: torch.Tensor, num_heads: int,
               num_kv_heads: int, k_pool: torch.Tensor, v_pool: torch.Tensor, queries: bool = True) -> torch.Tensor | None:
    """Rotate q and k of ``qkv [T, (Hq + 2 Hkv) D]`` (``cos, ssin [T, D]`` float32), write K/V at
    ``slots [T]`` of the pools ``[Hkv, S, D]`` (float32, or bfloat16: rounded as ``.to()`` rounds);
    return the rotated queries ``[T, Hq, D]`` float32 (None when ``queries`` is False)."""
    qkv, cos, ssin, slots = _check(qkv, F32, BF16), _check(cos, F32), _check(ssin, F32), _check(slots, torch.int64)
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise TypeError("fused kernel: the pools must be contiguous (they are written in place)")
    _check_pools(k_pool, v_pool)
    t, s, d = qkv.shape[0], k_pool.shape[1], k_pool.shape[-1]
    q = torch.empty((t, num_heads, d), dtype=F32) if queries else None
    library().hs_rope_write(qkv.data_ptr(), _bf(qkv), cos.data_ptr(), ssin.data_ptr(), slots.data_ptr(), t, num_heads,
                            num_kv_heads, d, s, k_pool.data_ptr(), v_pool.data_ptr(), _bf(k_pool),
                            q.data_ptr() if queries else None)
    return q


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: "KernelBatch",
                    out_dtype: torch.dtype) -> torch.Tensor:
    """Attention of ``q [T, Hq, D]`` (float32) over the pools ``[Hkv, S, D]`` (float32 or bfloat16):
    query ``t`` attends to the first ``meta.lengths[t]`` positions of its sequence, read through
    that sequence's block table. Returns ``[T, Hq * D]`` in ``out_dtype``."""
    q, (k_pool, v_pool) = _check(q, F32), _check_pools(k_pool, v_pool)
    t, hq, d = q.shape
    out = torch.empty((t, hq * d), dtype=out_dtype)
    library().hs_paged_attention(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), _bf(k_pool), meta.tables.data_ptr(),
                                 meta.tables.shape[1], meta.seq.data_ptr(), meta.lengths.data_ptr(), t, hq,
                                 k_pool.shape[0], k_pool.shape[1], d, meta.block_size, d ** -0.5, out.data_ptr(),
                                 int(out_dtype == BF16), int(meta.keys * hq * d >= PARALLEL_MIN_WORK))
    return out


def q8_matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``x [T, K]`` (float32 or bfloat16) times the transpose of the GGUF Q8_0 weight
    ``W = d * q`` (``q [N, K]`` int8, ``d [N, K / 32]`` float32) -> ``[T, N]`` float32, each
    output computed alone (the same for any T); the threads share W's rows."""
    x, q, d = _check(x, F32, BF16), _check(q, torch.int8), _check(d, F32)
    t, k = x.shape
    out = torch.empty((t, q.shape[0]), dtype=F32)
    library().hs_q8_matmul(q.data_ptr(), d.data_ptr(), x.data_ptr(), _bf(x), t, q.shape[0], k, out.data_ptr(), 1)
    return out


def q4_matmul(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor, panels: bool = False) -> torch.Tensor:
    """``x [T, K]`` float32 times the transpose of a GGUF 4-bit weight ``W = d * q + m`` given as
    the file's nibbles ``qs [N, K / 2]`` uint8 (each block's 16 bytes as stored) and
    ``dm [2, N, K / 32]`` float32 (``d``, ``m``) -> ``[T, N]`` float32; each output computed alone
    (the same for any T); the threads share W's rows. ``panels``: on the panel kernel (W rebuilt
    in float32 panels, float32 products: prompt chunks), else 16-bit activations (decode steps)."""
    x, qs, dm = _check(x, F32), _check(qs, torch.uint8), _check(dm, F32)
    t, k = x.shape
    n = qs.shape[0]
    out = torch.empty((t, n), dtype=F32)
    fn = library().hs_q4_panel_matmul if panels else library().hs_q4_matmul
    fn(qs.data_ptr(), dm[0].data_ptr(), dm[1].data_ptr(), x.data_ptr(), t, n, k, out.data_ptr(), 1)
    return out


def panel_width() -> int:
    """Output columns per panel of ``panel_pack``'s layout on this build: 48 with AVX-512, 16 with
    AVX2 (a tile of 6 rows x 16 columns fills its 16 registers)."""
    return library().hs_panel_width()


def panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` float32 in ``panel_matmul``'s layout: ``[ceil(N / P), K, P]`` for the panel
    width ``P = panel_width()``, zero-padded."""
    w = _check(weight, F32)
    n, k = w.shape
    p = panel_width()
    out = torch.empty((-(-n // p), k, p), dtype=F32)
    library().hs_panel_pack(w.data_ptr(), n, k, out.data_ptr())
    return out


def panel_matmul(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """``x [T, K] @ W.T`` -> ``[T, N]`` float32 for ``packed = panel_pack(W)``: each output one
    fused multiply-add chain over K in order, so a row's values do not depend on T (the threads
    share the panels)."""
    x = _check(x, F32)
    t, k = x.shape
    out = torch.empty((t, n), dtype=F32)
    library().hs_panel_matmul(x.data_ptr(), t, k, packed.data_ptr(), n, out.data_ptr(), 1)
    return out


class KernelBatch:
    """A forward call's attention metadata in the kernels' form (built once, read by every layer):
    ``tables [B, max_blocks]`` int32 block tables, and per query token ``seq [T]`` (its row in
    ``tables``) and ``lengths [T]`` (how many positions it sees, itself included)."""

    def __init__(self, tables: list[list[int]], starts: list[int], counts: list[int], block_size: int) -> None:
        width = max(len(t) for t in tables)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        seq, lengths = [], []
        for i, (start, n) in enumerate(zip(starts, counts)):
            seq += [i] * n
            lengths += range(start + 1, start + n + 1)
        self.seq = torch.tensor(seq, dtype=torch.int32)
        self.lengths = torch.tensor(lengths, dtype=torch.int32)
        self.keys = sum(lengths)  # query-key pairs of the call
        self.block_size = block_size
