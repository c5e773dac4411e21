"""Where a decode step's time goes: matmuls (decoder linears + output head) vs everything else.

    python scripts/profile-decode.py [--model default] [--quantize auto] [--strategies ar,selfspec,hispec]
                                     [--tokens 64] [--threads 2] [--repeats 3] [--no-fused]

Times every linear layer's call made from Python (``Linear.forward``, ``QuantLinear._mm``) with a
wall clock during generation; the rest of the wall time (norms, RoPE, attention, cache writes,
sampling, Python) is "outside the matmuls". Decode steps that run all layers in one C++ call
(``fused.decode_layers``) make their matmul calls out of Python's sight: for ``ar`` the decoder's
matmuls are then timed by replaying them alone (the same 1-row kernel calls on the same weights),
and that time is moved from "outside" to "in matmuls". Prints per strategy: tokens/s, ms per token
in and outside the matmuls, and the engine's per-phase seconds per token. Medians over
``--repeats`` runs after one warm-up.
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
    from hispec.model import matmul, quant

    gen = Generator.from_pretrained(args.model, quantize=args.quantize, progress=False)
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
    replay = replay_decoder_matmuls(gen.model)
    if replay is not None:
        print(f"decode steps run the layers in one C++ call: their {4 * gen.model.num_layers} matmuls, replayed "
              f"alone, take {replay * 1e3:.2f} ms per token")
    ids = gen.encode_prompt(args.prompt)
    print(f"{args.model} ({gen.model.weight_format} weights, {'eager' if args.no_fused else 'fused'} path, "
          f"{args.threads} threads), {len(ids)} prompt tokens, {args.tokens} new tokens")
    def run(strategy: str, tokens: int) -> tuple[float, float, dict]:
        in_mm[0] = 0.0
        t0 = time.perf_counter()
        out = gen.generate(ids, SamplingParams(max_new_tokens=tokens, ignore_eos=True), strategy)
        return time.perf_counter() - t0, in_mm[0], out.stats.phase_seconds

    n = args.tokens
    for strategy in args.strategies.split(","):
        run(strategy, n)  # warm-up
        runs = []
        for _ in range(args.repeats):  # the prompt plus one token, then the prompt plus n: the difference is decoding
            wall1, mm1, _ = run(strategy, 1)
            wall, mm, phases = run(strategy, n)
            runs.append(((wall - wall1) / (n - 1), (mm - mm1) / (n - 1), n / wall, phases))
        step, mm, tps, phases = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        if replay is not None and strategy == "ar":
            mm += replay
        print(f"  {strategy:9s} {tps:6.1f} tok/s   per decoded token: {step * 1e3:5.2f} ms = "
              f"{mm * 1e3:5.2f} in matmuls + {(step - mm) * 1e3:5.2f} outside")
        print("            phases ms/token: " + "  ".join(f"{k} {v / n * 1e3:.2f}" for k, v in phases.items() if v))
    print(f"(medians of {args.repeats} runs)")

def replay_decoder_matmuls(model, repeats: int = 20) -> float | None:
    """Seconds per 1-token pass of the decoder's matmuls called alone (the kernels the one-call
    layer op runs), or None when the model's layers are not run that way."""
    from hispec.model import fused
    from hispec.model.quant import ACT_DTYPE

    if fused.layers_op() is None or any(layer.layer_plan() is None for layer in model.layers):
        return None
    calls = []
    for layer in model.layers:
        dt = ACT_DTYPE if layer.act_dtype == ACT_DTYPE else torch.float32
        for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            calls.append((getattr(m, "_mm", m), torch.randn(1, m.in_features).to(dt)))
    times = []
    with torch.no_grad():
        for i in range(repeats + 3):
            t0 = time.perf_counter()
            for f, x in calls:
                f(x)
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
