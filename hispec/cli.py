"""The ``hispec`` command line. Each option maps onto a field of the config dataclasses.

Errors the user can fix (a bad file, an unknown model, an invalid value) print one line on
stderr and exit with status 2; nothing is half-written.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

from .config import DRAFT_POLICIES, ConfigError, SamplingParams, SpecConfig

# feature modules that add sub-commands: each defines register(subparsers)
COMMAND_MODULES = ("hispec.train.commands", "hispec.bench.commands", "hispec.server.commands")


class UsageError(ValueError):
    """A command-line usage mistake."""


def user_errors() -> tuple[type[BaseException], ...]:
    from .cache.block_manager import CacheFullError
    from .generate import PromptTooLongError
    from .model.loader import ModelLoadError
    from .model.registry import ModelNotFoundError
    from .prompts import PromptFileError

    errors = [ConfigError, UsageError, CacheFullError, PromptTooLongError, ModelLoadError,
              ModelNotFoundError, PromptFileError, FileNotFoundError, PermissionError]
    try:
        from .model.exits import ExitHeadError
        errors.append(ExitHeadError)
    except ImportError:
        pass
    return tuple(errors)


# ---- shared options ------------------------------------------------------------------------
def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a Hugging Face model folder or a .gguf file")
    g.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default: float32 on cpu, bfloat16 on cuda)")
    g.add_argument("--quantize", default="auto", choices=["auto", "none", "native", "int4", "int8"],
                   help="weight format on CPU: native = a GGUF file's own 4-bit blocks on the int4 kernel; "
                        "int4 / int8 = quantize float weights (int4: groups of 32, int8: per row); none = --dtype "
                        "weights. Default auto: native for 4-bit GGUF models (the default model) where the "
                        "kernels are faster on this CPU, else none; an explicit --dtype means none")
    g.add_argument("--allow-pickle", action="store_true",
                   help="allow loading pickle checkpoints (.bin/.pt): only for files you trust")
    g.add_argument("--exits", default=None, metavar="PATH",
                   help="trained exit heads (a folder with a manifest); default: the model's own, if any")
    g.add_argument("--no-exits", action="store_true", help="ignore trained exit heads; exit through the final head")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")


def add_parallel_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N processes started here, one per GPU with --device cuda "
                        "(NCCL), or on CPU (gloo); N may not exceed the model's KV heads (default: 1)")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same output)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def add_spec_options(p: argparse.ArgumentParser, strategies_help: str = "ar, selfspec or hispec") -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--draft-layer", type=int, default=None, help="L_d: the drafting exit (default: exit heads' or depth/8)")
    g.add_argument("--verify-layer", type=int, default=None, help="L_i: the intermediate exit (default: exit heads' or depth/4)")
    g.add_argument("--num-draft", type=int, default=None, help="N_d: tokens per draft round")
    g.add_argument("--window", type=int, default=None, help="N_i: tentatively accepted tokens per full verification")
    g.add_argument("--draft-policy", default=None, choices=DRAFT_POLICIES)
    g.add_argument("--svip-threshold", type=float, default=None, help="entropy (nats) above which svip stops drafting")
    g.add_argument("--confidence-threshold", type=float, default=None,
                   help="top-1 probability below which the confidence policy stops drafting")


def sampling_from_args(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def spec_from_args(args, generator) -> SpecConfig:
    """Command-line values over the exit heads' recommendations over depth-based defaults."""
    from .generate import default_spec

    num_layers = generator.model.num_layers
    per_strategy = generator.recommended_specs
    base = generator.spec_for(args.strategy) or default_spec(num_layers)
    values = {"draft_layer": args.draft_layer, "verify_layer": args.verify_layer, "num_draft": args.num_draft,
              "window": args.window, "draft_policy": args.draft_policy, "svip_threshold": args.svip_threshold,
              "confidence_threshold": getattr(args, "confidence_threshold", None)}
    fields = {k: getattr(base, k) for k in ("draft_layer", "verify_layer", "num_draft", "window", "draft_policy",
                                            "svip_threshold", "confidence_threshold", "max_draft")}
    fields.update({k: v for k, v in values.items() if v is not None})
    if args.strategy == "selfspec" and args.verify_layer is None and "selfspec" not in per_strategy:
        fields["verify_layer"] = num_layers
    return SpecConfig(**fields, num_layers=num_layers)


def load_generator(args, progress: bool = True):
    import torch

    from .generate import Generator

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available on this machine")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {device!r}")
    dtype_name = args.dtype or (None if device == "cpu" else "bfloat16")  # cpu: float32 unless quantized
    dtype = getattr(torch, dtype_name) if dtype_name else None
    if getattr(args, "no_exits", False) and args.exits:
        raise UsageError("--exits and --no-exits exclude each other")
    exits = False if getattr(args, "no_exits", False) else (args.exits or True)
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp != 1:
        return _load_tensor_parallel(args, tp, device, dtype or torch.float32, exits, progress)
    gen = Generator.from_pretrained(args.model, device=device, dtype=dtype, allow_pickle=args.allow_pickle,
                                    exits=exits, progress=progress, quantize=getattr(args, "quantize", "none"))
    return gen


def _load_tensor_parallel(args, tp: int, device: str, dtype, exits, progress: bool):
    import torch

    from .distributed import tp_generator

    if tp < 1:
        raise UsageError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if device.startswith("cuda") and torch.cuda.device_count() < tp:
        raise UsageError(f"--tensor-parallel-size {tp}: only {torch.cuda.device_count()} CUDA device(s) here")
    if args.allow_pickle:
        raise UsageError("--tensor-parallel-size reads safetensors only (each rank reads its slices); "
                         "convert pickle checkpoints first")
    return tp_generator(args.model, tp, device=device, dtype=dtype, exits=exits, threads=args.threads,
                        progress=progress, exit_on_failure=True)


# ---- hispec generate ----------------------------------------------------------------------
def register_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text (streams to stdout)",
                       description="Generate a continuation with ar, selfspec or hispec; output is identical "
                                   "across strategies at temperature 0.")
    p.add_argument("prompt", nargs="?", help="the prompt (or use --prompts FILE)")
    p.add_argument("--prompts", metavar="FILE", help="JSONL prompts: Spec-Bench form or {'id', 'prompt'}")
    p.add_argument("--strategy", default="hispec", choices=["ar", "selfspec", "hispec"],
                   help="decoding strategy (default: hispec)")
    p.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="wrap the prompt in the model's chat template (default when the model has one)")
    p.add_argument("--no-chat", dest="chat", action="store_false")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--stats", action="store_true", help="print speculation statistics after generation (stderr)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="always speculate; by default (greedy) steps where measured speculation does not pay "
                        "are decoded plainly, with the same output")
    b = p.add_argument_group("batching (with --prompts)")
    b.add_argument("--batch-size", type=int, default=1, help="sequences decoded together (continuous batching)")
    b.add_argument("--kv-blocks", type=int, default=None, help="KV-cache blocks of 16 tokens (default: enough for a full batch)")
    b.add_argument("--kv-memory-fraction", type=float, default=None, help="size the KV pool as this fraction of free memory")
    add_prefill_option(b)
    add_model_options(p)
    add_parallel_options(p)
    add_sampling_options(p)
    add_spec_options(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    if (args.prompt is None) == (args.prompts is None):
        raise UsageError("give either a PROMPT or --prompts FILE")
    params = sampling_from_args(args)
    prompts = None
    if args.prompts:
        from .prompts import read_prompts
        prompts = read_prompts(args.prompts)  # validate the whole file before any work
    gen = load_generator(args)
    spec = spec_from_args(args, gen) if args.strategy != "ar" else None
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if prompts is None:
        return _generate_one(gen, args, params, spec)
    if args.batch_size > 1:
        return _generate_batched(gen, args, params, spec, prompts)
    return _generate_many(gen, args, params, spec, prompts)


def _generate_one(gen, args, params, spec) -> int:
    stream = None if args.json else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    out = gen.generate(args.prompt, params, args.strategy, chat=args.chat, spec=spec, on_text=stream,
                       adaptive=not args.no_adaptive)
    if args.json:
        print(json.dumps(output_record("0", out, args.strategy)))
    else:
        sys.stdout.write("\n")
    if args.stats:
        print_stats(out, sys.stderr, kernels_of(gen))
    return 0


def _generate_many(gen, args, params, spec, prompts) -> int:
    from tqdm import tqdm

    from .decode.stats import DecodeStats

    total, seconds, tokens = DecodeStats(args.strategy), 0.0, 0
    for p in tqdm(prompts, desc=f"{args.strategy}", unit="prompt", file=sys.stderr, disable=None):
        out = gen.generate(p.prompt, params, args.strategy, chat=args.chat, spec=spec, adaptive=not args.no_adaptive)
        total.merge(out.stats)
        seconds, tokens = seconds + out.seconds, tokens + out.new_tokens
        if args.json:
            print(json.dumps(output_record(p.id, out, args.strategy)), flush=True)
        else:
            print(f"### {p.id}\n{out.text}\n", flush=True)
    if args.stats:
        print_stats_table(total, tokens, seconds, sys.stderr, kernels_of(gen))
    return 0


def add_prefill_option(group) -> None:
    from .config import DEFAULT_PREFILL_CHUNK

    group.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                       help="chunked prefill: prompt tokens prefilled per engine step, all sequences together; "
                            "running sequences decode between a long prompt's chunks (as SGLang's "
                            f"--chunked-prefill-size; 0 = whole prompts in one step; default: {DEFAULT_PREFILL_CHUNK})")


def _generate_batched(gen, args, params, spec, prompts) -> int:
    from tqdm import tqdm

    from .decode.stats import DecodeStats
    from .llm import LLM

    llm = LLM(gen, args.strategy, spec=spec, max_batch_size=args.batch_size, kv_blocks=args.kv_blocks,
              kv_memory_fraction=args.kv_memory_fraction, adaptive=not args.no_adaptive,
              prefill_chunk=args.prefill_chunk)
    total = DecodeStats(args.strategy)
    with tqdm(total=len(prompts), desc=f"{args.strategy} batch {args.batch_size}", unit="prompt", file=sys.stderr,
              disable=None) as bar:
        outputs = llm.generate([p.prompt for p in prompts], params, chat=args.chat,
                               on_output=lambda o: o.finished and bar.update(1))
    for p, out in zip(prompts, outputs):
        total.merge(out.stats)
        if args.json:
            print(json.dumps(output_record(p.id, out, args.strategy)), flush=True)
        else:
            print(f"### {p.id}\n{out.text}\n", flush=True)
    if args.stats:
        tokens = sum(o.new_tokens for o in outputs)
        print_stats_table(total, tokens, llm.seconds, sys.stderr, kernels_of(gen))
        print(f"  engine: {json.dumps(llm.engine.stats())}", file=sys.stderr)
    return 0


def output_record(pid: str, out, strategy: str) -> dict:
    rate = out.new_tokens / out.seconds if out.seconds > 0 else 0.0
    return {"id": pid, "text": out.text, "token_ids": out.token_ids, "new_tokens": out.new_tokens,
            "seconds": round(out.seconds, 4), "tokens_per_second": round(rate, 3),
            "finish_reason": out.finish_reason, "strategy": strategy, "stats": out.stats.to_dict()}


def print_stats(out, file, kernels: str | None = None) -> None:
    print_stats_table(out.stats, out.new_tokens, out.seconds, file, kernels)


def kernels_of(gen) -> str | None:
    """Which kernels the generator's model runs on (None for a model this cannot inspect)."""
    from .model.kernels import describe

    model = getattr(gen, "model", None)
    return describe(model) if hasattr(model, "layers") and hasattr(model, "weight_format") else None


def print_stats_table(stats, tokens: int, seconds: float, file, kernels: str | None = None) -> None:
    d = stats.to_dict()
    rate = tokens / seconds if seconds else 0.0
    lines = [f"strategy {d['strategy']}: {tokens} tokens in {seconds:.2f} s = {rate:.1f} tokens/s; "
             f"{d['full_passes']} full-model passes, mean accepted length {d['mean_accepted_length']:.2f}"]
    for name, lv in d["levels"].items():
        per_pos = " ".join(f"{a:.2f}" for a in lv["acceptance_per_position"][:8])
        lines.append(f"  {name:<22} draft tokens {lv['draft_tokens']:>6}  accepted {lv['accepted_tokens']:>6}  "
                     f"rate {lv['acceptance_rate']:.3f}  per position [{per_pos}]")
    phases = "  ".join(f"{k} {v:.2f}s" for k, v in d["phase_seconds"].items() if v)
    if kernels:
        lines.append(f"  kernels: {kernels}")
    lines.append(f"  seconds per phase: {phases}")
    if d["plain_steps"]:
        lines.append(f"  adaptive: {d['plain_steps']} of {d['full_passes']} steps decoded plainly (measured "
                     f"speculation did not pay there; --no-adaptive to always speculate)")
    if d["verification_wall"] is not None:
        lines.append(f"  verification wall: {d['verification_wall']:.2f} (full-verify s/token / draft s/token)")
    print("\n".join(lines), file=file)


# ---- hispec models -----------------------------------------------------------------------
def register_models(sub) -> None:
    p = sub.add_parser("models", help="list the known and the cached models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)


def cmd_models(args) -> int:
    from .model.registry import hispec_home, list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"models in {hispec_home() / 'models'}:")
    for r in rows:
        state = "cached" if r["cached"] else "not converted yet (converted on first use)"
        print(f"  {r['name']:<28} {state}\n      {r['description']}; from: {r['source']}")
    return 0


# ---- entry point -------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hispec", description="Lossless hierarchical self-speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    register_generate(sub)
    register_models(sub)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):  # the feature is not installed
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        return args.func(args) or 0
    except user_errors() as e:
        print(f"hispec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nhispec: interrupted after {time.perf_counter() - started:.1f} s", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
