"""Which weight format runs on this CPU: the quantized kernels, or the float32 path.

``torch.backends.cpu.get_cpu_capability()`` names the vector kernels ATen dispatches to
(``AVX512``, ``AVX2``, ``DEFAULT``, or an ARM name). With ``AVX512`` the 4-bit kernels are 3-4x
faster than float32 on decode-sized inputs (measured on the AMD EPYC Zen 5 machine, which has
AVX-512 BF16). Elsewhere it is not obvious (an AVX2 CPU without bfloat16 instructions, ARM), so
decode-sized products over weights larger than the cache are timed both ways at load time and
the quantized weights are used only if they win clearly: nothing gets slower than the float32
path. Which 4-bit kernel runs (PyTorch's ``int4`` on bfloat16 activations, hispec's ``q4`` on
float32 ones) is timed too (:func:`four_bit_kernel`).
"""
from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import torch

from .. import envs

FAST_CAPABILITIES = ("AVX512",)
MARGIN = 0.8  # quantized must take at most this fraction of the float32 time


def cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


@functools.lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (x86 ``avx512_bf16`` / ``amx_bf16``, Arm
    ``bf16``): there bfloat16 products run 2-3x faster than float32; elsewhere they are emulated."""
    from .fused import _cpu_key

    flags = set(_cpu_key().split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


@functools.lru_cache(maxsize=1)
def format_timings(reps: int = 5) -> dict[str, float]:
    """Median seconds of one row times 12 weights of a SmolLM2 MLP's size (85 MB, more than a cache
    holds, so they are read from memory as in a decode step) for each weight format this machine
    runs, timed once per process, interleaved: ``float32``, ``q4`` (where hispec's kernels are
    built) and ``int4`` (where PyTorch has its kernel). Both choices below read these."""
    from . import fused
    from .matmul import linear
    from .quant import QuantLinear

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(3072, 576, generator=g) * 0.02 for _ in range(12)]
    x = torch.randn(1, 576, generator=g)
    xb = x.to(torch.bfloat16)
    fns = {"float32": lambda: [linear(x, w) for w in weights]}
    if fused.available():
        q4 = [QuantLinear.from_float(w, "int4", kernel="q4") for w in weights]
        fns["q4"] = lambda: [q(x) for q in q4]
    try:
        int4 = [QuantLinear.from_float(w, "int4", kernel="int4") for w in weights]
        fns["int4"] = lambda: [q(xb) for q in int4]
    except RuntimeError:  # PyTorch's int4 kernel is missing on this build / CPU
        pass
    with torch.no_grad():
        return interleaved_medians(fns, reps, warmup=1)


def time_matmuls() -> tuple[float, float]:
    """:func:`format_timings` of (the 4-bit kernel :func:`four_bit_kernel` chose, float32)."""
    med, kind = format_timings(), four_bit_kernel()[0]
    if kind not in med:
        raise RuntimeError(f"no {kind} kernel on this build")
    return med[kind], med["float32"]


FOUR_BIT = ("q4", "int4")
INT4_MARGIN = 0.85  # int4 must take at most this fraction of q4's time


@functools.lru_cache(maxsize=1)
def four_bit_kernel() -> tuple[str, str]:
    """(the kernel 4-bit weights run on, why), decided once per process: ``HISPEC_Q4_KERNEL=q4|int4``
    if set; ``int4`` (PyTorch's) when hispec's compiled kernels are unavailable; else the faster
    in :func:`format_timings`, ``int4`` only if it wins clearly (``INT4_MARGIN``): ``q4`` reads float32
    activations (its tokens equal float32 ``ar``'s where ``int4``'s bfloat16 ones drift), and a
    coin-flip between near-equal timings made the kernel change from one load to the next on a
    busy machine. The timed choice is kept on disk (``_four_bit_choice_file``) and reused by later
    loads on this machine: even past the margin, a noisy machine chose differently from one run
    to the next (seen on a Zen 4), and with it the text of the same command. On CPUs without
    bfloat16 hardware (AVX2) ``q4`` wins; with it (AVX-512 BF16) it depends on the CPU."""
    from . import fused

    forced = envs.HISPEC_Q4_KERNEL
    if forced in FOUR_BIT:
        return forced, f"HISPEC_Q4_KERNEL={forced}"
    if not fused.available():
        return "int4", "hispec's compiled kernels unavailable"
    path = _four_bit_choice_file()
    try:
        saved = json.loads(path.read_text())
        if saved.get("kernel") in FOUR_BIT:
            return saved["kernel"], f"{saved.get('why', '')} (timed at an earlier load; delete {path.name} in {path.parent} to time again)"
    except (OSError, ValueError, AttributeError):
        pass
    med = format_timings()
    if "int4" not in med:
        best, why = "q4", "PyTorch's int4 kernel unavailable"
    else:
        best = "int4" if med["int4"] < INT4_MARGIN * med["q4"] else "q4"
        why = f"q4 {med['q4'] * 1e6 / 12:.0f} us vs int4 {med['int4'] * 1e6 / 12:.0f} us per matmul"
    try:  # written whole or not at all (concurrent loads)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"kernel": best, "why": why}))
        os.replace(tmp, path)
    except OSError:
        pass
    return best, why


def _four_bit_choice_file() -> Path:
    """Where :func:`four_bit_kernel`'s timed choice is kept, per build of the C kernels (source,
    flags, CPU) and torch version: timed once per machine, so that the same command gives the same text from one load to the next
    (the kernels' bfloat16 and float32 activations round differently)."""
    from . import fused
    from .load.registry import hispec_home

    return hispec_home() / "kernels" / f"four_bit-{fused.library_key()}-torch{torch.__version__}.json"


def interleaved_medians(fns: dict, reps: int, warmup: int = 0) -> dict:
    """Median seconds of each call in ``fns`` (name -> function), the calls interleaved so a busy
    moment of the machine hits every one alike; the first ``warmup`` rounds are not counted."""
    times: dict = {name: [] for name in fns}
    for r in range(warmup + reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: sorted(v)[len(v) // 2] for name, v in times.items()}


@functools.lru_cache(maxsize=1)
def quantized_kernels_pay() -> tuple[bool, str]:
    """(use the int4/int8 kernels?, why), decided once per process."""
    cap = cpu_capability()
    if cap in FAST_CAPABILITIES:
        return True, f"CPU capability {cap}"
    try:
        quant, dense = time_matmuls()
    except RuntimeError as e:  # the kernel is missing on this build / CPU
        return False, f"CPU capability {cap}: int4 kernel unavailable ({e})"
    ok = quant <= MARGIN * dense
    return ok, f"CPU capability {cap}: 4-bit {quant * 1e6:.0f} us vs float32 {dense * 1e6:.0f} us per 12 matmuls"


def describe(model) -> str:
    """Which kernels the model's matmuls run on, e.g. for ``hispec generate --stats``."""
    from .quant import QuantLinear

    kinds: dict[str, int] = {}
    for m in model.layers.modules():
        if isinstance(m, QuantLinear):
            kinds[m.describe()] = kinds.get(m.describe(), 0) + 1
        elif isinstance(m, torch.nn.Linear):
            key = f"{str(m.weight.dtype)[6:]} dense"
            kinds[key] = kinds.get(key, 0) + 1
    layers = ", ".join(f"{n} x {k}" for k, n in kinds.items())
    if any(getattr(m, "dense", None) is not None for m in model.layers.modules() if isinstance(m, QuantLinear)):
        layers += " (prompt prefill on dense bfloat16 copies of the same weights)"
    elif any(isinstance(m, QuantLinear) and m.kernel == "q4" for m in model.layers.modules()):
        layers += " (prompt prefill on float32 panels of the same weights)"
    head = model.lm_head
    head_kind = head.describe() if isinstance(head, QuantLinear) else f"{str(head.weight.dtype)[6:]} dense"
    from . import fused

    between = ("fused CPU kernels (norms, RoPE + cache write, paged attention, SiLU gate)" if fused.available()
               else "eager PyTorch (fused kernels unavailable: no C compiler, or HISPEC_FUSED=0)")
    if fused.available():
        planned = all(layer.layer_plan() is not None for layer in model.layers)
        whole = planned and model._step_head(False) is not None  # DecoderModel.decode_step applies
        between += ("; plain decode steps run the embedding, all layers, the final norm and the head in one C++ call"
                    " (greedy `ar`: several steps and their argmax per call)"
                    if whole else "; decode steps run all layers in one C++ call" if planned else
                    "; layers called one by one" + ("" if fused.layers_op() else
                                                     " (layer op unavailable: no C++ compiler, or HISPEC_FUSED_LAYERS=0)"))
    return (f"weights {model.weight_format}: decoder linears {layers}; output head {head_kind}; "
            f"between the matmuls: {between}; KV cache {str(model.kv_dtype)[6:]}; CPU capability {cpu_capability()}")
