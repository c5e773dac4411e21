"""Where a decode step's time goes: matmuls (decoder linears + output head) vs everything else.

    python scripts/profile-decode.py [--model default] [--quantize auto] [--kv-cache-dtype auto|float32|bfloat16]
                                     [--strategies ar,selfspec,hispec]
                                     [--tokens 64] [--threads 2] [--repeats 3] [--no-fused]
                                     [--adaptive] [--data prompts.jsonl --limit N] [--batch-size B]

Times every matmul with a wall clock during generation: the linear layers called from Python
(``Linear.forward``, ``QuantLinear.mm``: exit heads, the eager path) and, inside the C++ op that
runs a decode step or a range of layers in one call, each matmul kernel call it makes
(``layer_op.profile``: decoder linears and the output head). The rest of the wall time is "outside
the matmuls": the op's other kernels, timed the same way (attention, RoPE and the cache write,
norms, the gated activation, the residual add, the step's setup), the op's own overhead
(``op_other``: its calls' wall time less those parts: tensor allocation, checks, argument
conversion, its Python glue), and the rest (the engine's Python, sampling). Prints per strategy: tokens/s, ms per decoded token in and outside the
matmuls, the outside part by part, and the engine's per-phase ms per token. Medians over
``--repeats`` runs after one warm-up. ``--data``: every prompt of a JSONL file (up to ``--limit``),
each timed as above and summed, so the figures are per token over the whole set. ``--batch-size B``:
the prompts (the first B of ``--data``, or B copies of ``--prompt``) decoded together as one batch of
the engine (``LLM``, no prefix caching), and the figures per batched step (B tokens).
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
    ap.add_argument("--adaptive", action="store_true", help="adaptive speculation, as `hispec bench --adaptive`")
    ap.add_argument("--data", help="a JSONL prompt file (any form `hispec bench --data` reads) instead of --prompt")
    ap.add_argument("--limit", type=int, default=8, help="with --data: the first N prompts")
    ap.add_argument("--batch-size", type=int, default=1, help="decode the prompts together, B at a time; "
                                                               "figures per batched step")
    args = ap.parse_args()
    if args.no_fused:
        os.environ["HISPEC_FUSED"] = "0"
    torch.set_num_threads(args.threads)

    from hispec.config import SamplingParams
    from hispec.generate import Generator
    from hispec.kernels import layer_op, matmul, quant

    gen = Generator.from_pretrained(args.model, quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype,
                                    progress=False)
    in_mm, in_op = [0.0], [0.0]

    def timed(fn, into):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            into[0] += time.perf_counter() - t0
            return out
        return wrapper

    # the kernel call itself: the fused layers call QuantLinear.mm directly
    matmul.Linear.forward = timed(matmul.Linear.forward, in_mm)
    quant.QuantLinear.mm = timed(quant.QuantLinear.mm, in_mm)
    # the C++ op's calls as a whole (with their Python glue): what its parts leave is its own overhead
    layer_op.decode_step = timed(layer_op.decode_step, in_op)
    layer_op.decode_steps = timed(layer_op.decode_steps, in_op)
    layer_op.decode_layers = timed(layer_op.decode_layers, in_op)
    if args.data:
        from hispec.data.readers import read_prompts
        prompts = [gen.encode_prompt(r.prompt) for r in read_prompts(args.data)[:args.limit]]
    else:
        prompts = [gen.encode_prompt(args.prompt)] * args.batch_size
    batch = args.batch_size
    if batch > 1:
        from hispec.llm import LLM

        prompts = (prompts * batch)[:batch]
        llms = {}
    print(f"{args.model} ({gen.model.weight_format} weights, KV cache {str(gen.model.kv_dtype)[6:]}, "
          f"{'eager' if args.no_fused else 'fused'} path, {args.threads} threads), {len(prompts)} prompt(s) of "
          f"{sum(map(len, prompts)) / len(prompts):.0f} tokens on average, {args.tokens} new tokens"
          f"{', adaptive' if args.adaptive else ''}")

    def run(strategy: str, tokens: int) -> tuple[float, dict, dict]:
        """Every prompt once: wall seconds, op parts and engine phases summed over the prompts."""
        wall, parts, phases = 0.0, {}, {}
        for ids in ([prompts] if batch > 1 else prompts):
            in_mm[0] = in_op[0] = 0.0
            layer_op.profile(True)
            t0 = time.perf_counter()
            params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
            if batch > 1:
                llm = llms.get(strategy) or llms.setdefault(strategy, LLM(
                    gen, strategy, max_batch_size=batch, adaptive=args.adaptive, prefix_caching=False))
                outs = llm.generate(ids, params)
                out = outs[0]
                for o in outs[1:]:
                    out.stats.merge(o.stats)
            else:
                out = gen.generate(ids, params, strategy, adaptive=args.adaptive)
            wall += time.perf_counter() - t0
            op = {part: seconds for part, (seconds, _) in layer_op.profile(False).items()}
            in_op_parts = sum(op.values())
            op["matmul"] = op.get("matmul", 0.0) + in_mm[0]
            op["op_other"] = in_op[0] - in_op_parts
            for into, add in ((parts, op), (phases, out.stats.phase_seconds)):
                for k, v in add.items():
                    into[k] = into.get(k, 0.0) + v
        return wall, parts, phases

    n = args.tokens
    for strategy in args.strategies.split(","):
        run(strategy, n)  # warm-up
        runs = []
        for _ in range(args.repeats):  # the prompt plus one token, then the prompt plus n: the difference is decoding
            wall1, parts1, _ = run(strategy, 1)
            wall, parts, phases = run(strategy, n)
            decoded = (n - 1) * (1 if batch > 1 else len(prompts))  # decode steps (of B tokens each)
            per_token = {k: (v - parts1.get(k, 0.0)) / decoded for k, v in parts.items()}
            runs.append(((wall - wall1) / decoded, per_token, n * len(prompts) / wall, phases))
        step, parts, tps, phases = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        mm = parts.pop("matmul")
        unit = f"batch-{batch} step" if batch > 1 else "decoded token"
        print(f"  {strategy:9s} {tps:6.1f} tok/s   per {unit}: {step * 1e3:5.2f} ms = "
              f"{mm * 1e3:5.2f} in matmuls + {(step - mm) * 1e3:5.2f} outside")
        rest = step - mm - sum(parts.values())
        print(f"            outside, ms/{'step' if batch > 1 else 'token'}: " + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in parts.items())
              + f"  rest (engine, sampling) {rest * 1e3:.2f}")
        per = n * len(prompts)  # batched: every sequence records each step it shared
        print(f"            phases ms/{'step' if batch > 1 else 'token'}: "
              + "  ".join(f"{k} {v / per * 1e3:.2f}" for k, v in phases.items() if v))
    print(f"(medians of {args.repeats} runs)")

if __name__ == "__main__":
    main()
