"""Which weight format runs on this CPU: the quantized kernels, or the float32 path.

``torch.backends.cpu.get_cpu_capability()`` names the vector kernels ATen dispatches to
(``AVX512``, ``AVX2``, ``DEFAULT``, or an ARM name). With ``AVX512`` the 4-bit kernels are 3-4x
faster than float32 on decode-sized inputs (measured on the AMD EPYC Zen 5 machine, which has
AVX-512 BF16). Elsewhere it is not obvious (an AVX2 CPU without bfloat16 instructions, ARM), so
decode-sized products over weights larger than the cache are timed both ways at load time and
the quantized weights are used only if they win clearly: nothing gets slower than the float32
path. Which 4-bit kernel runs (PyTorch's ``int4`` on bfloat16 activations, hispec's ``q4`` on
float32 ones) or ``q8a`` (8-bit activations: on CPUs with integer dot products unless clearly
slower, elsewhere where it is no slower on one row and clearly faster on several) is timed too
(``quant.four_bit_kernel``).
"""
from __future__ import annotations

import functools

import torch

from . import build, fused, hugepages, layer_op, plan, q8act, quant
from .quant import QuantLinear

FAST_CAPABILITIES = ("AVX512",)
MARGIN = 0.8  # quantized must take at most this fraction of the float32 time


def cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


@functools.lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (x86 ``avx512_bf16`` / ``amx_bf16``, Arm
    ``bf16``): there bfloat16 products run 2-3x faster than float32; elsewhere they are emulated."""
    flags = set(build.cpu_key().split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def time_matmuls() -> tuple[float, float]:
    """``quant.format_timings`` (kept per machine) of (the 4-bit kernel ``quant.four_bit_kernel`` chose,
    float32)."""
    kind = quant.four_bit_kernel()[0]
    med = quant.machine_timings()
    if kind not in med:
        raise RuntimeError(f"no {kind} kernel on this build")
    return med[kind], med["float32"]


@functools.lru_cache(maxsize=1)
def quantized_kernels_pay() -> tuple[bool, str]:
    """(use the int4/int8 kernels?, why), decided once per process."""
    cap = cpu_capability()
    if cap in FAST_CAPABILITIES:
        return True, f"CPU capability {cap}"
    try:
        quantized, dense = time_matmuls()
    except RuntimeError as e:  # the kernel is missing on this build / CPU
        return False, f"CPU capability {cap}: int4 kernel unavailable ({e})"
    ok = quantized <= MARGIN * dense
    return ok, f"CPU capability {cap}: 4-bit {quantized * 1e6:.0f} us vs float32 {dense * 1e6:.0f} us per 12 matmuls"


def describe(model) -> str:
    """Which kernels the model's matmuls run on, e.g. for ``hispec generate --stats``."""
    kinds: dict[str, int] = {}
    for m in model.layers.modules():
        if isinstance(m, QuantLinear):
            kinds[m.describe()] = kinds.get(m.describe(), 0) + 1
        elif isinstance(m, torch.nn.Linear):
            key = f"{str(m.weight.dtype)[6:]} dense"
            kinds[key] = kinds.get(key, 0) + 1
    layers = ", ".join(f"{n} x {k}" for k, n in kinds.items())
    quantized = [m for m in model.layers.modules() if isinstance(m, QuantLinear)]
    if any(m.dense is not None for m in quantized):
        layers += " (prompt prefill on dense bfloat16 copies of the same weights)"
    elif any(m.kernel in ("q8a", "q8a8") for m in quantized) and q8act.bf16_tiles():
        layers += " (prompt prefill on bfloat16 AMX tiles of the same weights, rebuilt 16 columns at a time)"
    elif any(m.kernel == "q8a" for m in quantized) and quant.q8a_prefills_on_rows():
        rows = q8act.use_amx_rows()
        amx = f"; {rows} or more rows on AMX tiles" if rows else ""
        layers += f" (prompt prefill on the same kernel: its rows are cheap on this CPU's integer dot products{amx})"
    elif any(m.kernel in quant.Q4_STORAGE for m in quantized):
        layers += " (prompt prefill on float32 panels of the same weights)"
    head = model.lm_head
    head_kind = head.describe() if isinstance(head, QuantLinear) else f"{str(head.weight.dtype)[6:]} dense"
    between = ("fused CPU kernels (norms, RoPE + cache write, paged attention, SiLU gate)" if fused.available()
               else "eager PyTorch (fused kernels unavailable: no C compiler, or HISPEC_FUSED=0)")
    if fused.available():
        planned = all(plan.layer_plan(layer) is not None for layer in model.layers)
        whole = planned and plan.fast_path(model).step_head(False) is not None  # fast_path.decode_step applies
        between += ("; plain decode steps run the embedding, all layers, the final norm and the head in one C++ call"
                    " (several steps per call, each token chosen in C++: the argmax, or sampled)"
                    if whole else "; decode steps run all layers in one C++ call" if planned else
                    "; layers called one by one" + ("" if layer_op.layers_op() else
                                                     " (layer op unavailable: no C++ compiler, or HISPEC_FUSED_LAYERS=0)"))
    pages = f"; {hugepages.describe()}" if model.device.type == "cpu" else ""
    kv = str(model.kv_dtype)[6:]
    if (model.device.type == "cpu" and model.kv_dtype == torch.bfloat16 and fused.available()
            and fused.bf16_attention_products(model.cfg.head_dim)):
        kv += " (attention in bfloat16 products: AVX-512 BF16"
        if fused.prompt_attention_on_tiles():
            kv += ("; a prompt's on AMX tiles, a step's products on them too"
                   + (" in its layers without a window" if model.cfg.sliding_window else ""))
        kv += ")"
    return (f"weights {model.weight_format}: decoder linears {layers}; output head {head_kind}; "
            f"between the matmuls: {between}; KV cache {kv}; CPU capability {cpu_capability()}{pages}")
