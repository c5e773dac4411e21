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
import os
import time

import torch

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


def _weights(count: int = 12, n: int = 3072, k: int = 576) -> list[torch.Tensor]:
    """``count`` float32 weights of a SmolLM2 MLP's size: 85 MB, more than a cache holds, so timings
    read them from memory as a model's decode step does."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=g) * 0.02 for _ in range(count)]


def time_matmuls(reps: int = 5) -> tuple[float, float]:
    """Median seconds of one row times 12 MLP-sized weights: (the 4-bit kernel that
    :func:`four_bit_kernel` chose, the float32 path)."""
    from .matmul import linear
    from .quant import QuantLinear

    weights = _weights()
    quant = [QuantLinear.from_float(w, "int4") for w in weights]
    x = torch.randn(1, weights[0].shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        med = interleaved_medians({"quant": lambda: [q(x) for q in quant],
                                   "float32": lambda: [linear(x, w) for w in weights]}, reps, warmup=1)
    return med["quant"], med["float32"]


FOUR_BIT = ("q4", "int4")


@functools.lru_cache(maxsize=1)
def four_bit_kernel() -> tuple[str, str]:
    """(the kernel 4-bit weights run on, why), decided once per process: ``HISPEC_Q4_KERNEL=q4|int4``
    if set; ``int4`` (PyTorch's) when hispec's compiled kernels are unavailable; else both timed on
    one row against 12 MLP-sized weights (interleaved, medians of 5) and the faster taken. ``q4``
    reads float32 activations, ``int4`` bfloat16 ones: on CPUs without bfloat16 hardware (AVX2)
    ``q4`` wins; with it (AVX-512 BF16) it depends on the CPU."""
    from . import fused
    from .quant import QuantLinear

    forced = os.environ.get("HISPEC_Q4_KERNEL")
    if forced in FOUR_BIT:
        return forced, f"HISPEC_Q4_KERNEL={forced}"
    if not fused.available():
        return "int4", "hispec's compiled kernels unavailable"
    weights = _weights()
    try:
        layers = {kind: [QuantLinear.from_float(w, "int4", kernel=kind) for w in weights] for kind in FOUR_BIT}
    except RuntimeError as e:  # PyTorch's int4 kernel is missing on this build / CPU
        return "q4", f"int4 kernel unavailable ({e})"
    x = torch.randn(1, weights[0].shape[1], generator=torch.Generator().manual_seed(1))
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        med = interleaved_medians({"q4": lambda: [q(x) for q in layers["q4"]],
                                   "int4": lambda: [q(xb) for q in layers["int4"]]}, reps=5, warmup=1)
    best = min(med, key=med.get)
    return best, f"q4 {med['q4'] * 1e6 / len(weights):.0f} us vs int4 {med['int4'] * 1e6 / len(weights):.0f} us per matmul"


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
        between += ("; decode steps run all layers in one C++ call" if planned else
                    "; layers called one by one" + ("" if fused.layers_op() else
                                                     " (layer op unavailable: no C++ compiler, or HISPEC_FUSED_LAYERS=0)"))
    return (f"weights {model.weight_format}: decoder linears {layers}; output head {head_kind}; "
            f"between the matmuls: {between}; CPU capability {cpu_capability()}")
