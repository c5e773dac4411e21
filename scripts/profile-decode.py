"""Where a decode step's time goes: matmuls (decoder linears + output head) vs everything else.

    python scripts/profile-decode.py [--model default] [--quantize auto] [--kv-cache-dtype auto|float32|bfloat16]
                                     [--strategies ar,selfspec,hispec]
                                     [--tokens 64] [--threads 2] [--repeats 3] [--no-fused]

Times every matmul with a wall clock during generation: the linear layers called from Python
(``Linear.forward``, ``QuantLinear._mm``: exit heads, the eager path) and, inside the C++ op that
runs a decode step or a range of layers in one call, each matmul kernel call it makes
(``fused.profile_matmuls``: decoder linears and the output head). The rest of the wall time (norms,
RoPE, attention, cache writes, sampling, the engine's Python) is "outside the matmuls". Prints per
strategy: tokens/s, ms per decoded token in and outside the matmuls, and the engine's per-phase
ms per token. Medians over ``--repeats`` runs after one warm-up.
"""
from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--strategies", default="ar,selfspec,hispec")
    ap.add_argument("--prompt", default="Explain speculative decoding in two sentences.")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-fused", action="store_true", help="the eager PyTorch path (HISPEC_FUSED=0)")
    args = ap.parse_args()
    if args.no_fused:
        os.environ["HISPEC_FUSED"] = "0"
    torch.set_num_threads(args.threads)

    from hispec.config import SamplingParams
    from hispec.generate import Generator
    from hispec.model import fused, matmul, quant

    gen = Generator.from_pretrained(args.model, quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype,
                                    progress=False)
    in_mm = [0.0]

    def timed(method):
        def wrapper(self, x):
            t0 = time.perf_counter()
            out = method(self, x)
            in_mm[0] += time.perf_counter() - t0
            return out
        return wrapper

    # the kernel call itself: the fused layers call QuantLinear._mm directly
    matmul.Linear.forward = timed(matmul.Linear.forward)
    quant.QuantLinear._mm = timed(quant.QuantLinear._mm)
    ids = gen.encode_prompt(args.prompt)
    print(f"{args.model} ({gen.model.weight_format} weights, KV cache {str(gen.model.kv_dtype)[6:]}, "
          f"{'eager' if args.no_fused else 'fused'} path, {args.threads} threads), {len(ids)} prompt tokens, "
          f"{args.tokens} new tokens")
    def run(strategy: str, tokens: int) -> tuple[float, float, dict]:
        in_mm[0] = 0.0
        fused.profile_matmuls(True)
        t0 = time.perf_counter()
        out = gen.generate(ids, SamplingParams(max_new_tokens=tokens, ignore_eos=True), strategy)
        wall = time.perf_counter() - t0
        in_op, _ = fused.profile_matmuls(False)
        return wall, in_mm[0] + in_op, out.stats.phase_seconds

    n = args.tokens
    for strategy in args.strategies.split(","):
        run(strategy, n)  # warm-up
        runs = []
        for _ in range(args.repeats):  # the prompt plus one token, then the prompt plus n: the difference is decoding
            wall1, mm1, _ = run(strategy, 1)
            wall, mm, phases = run(strategy, n)
            runs.append(((wall - wall1) / (n - 1), (mm - mm1) / (n - 1), n / wall, phases))
        step, mm, tps, phases = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        print(f"  {strategy:9s} {tps:6.1f} tok/s   per decoded token: {step * 1e3:5.2f} ms = "
              f"{mm * 1e3:5.2f} in matmuls + {(step - mm) * 1e3:5.2f} outside")
        print("            phases ms/token: " + "  ".join(f"{k} {v / n * 1e3:.2f}" for k, v in phases.items() if v))
    print(f"(medians of {args.repeats} runs)")

if __name__ == "__main__":
    main()
