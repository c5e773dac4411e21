"""The ``hispec`` command line: the entry point (``main``), ``hispec generate`` and ``hispec models``.

A thin shell: option groups and their conversion to library objects are in ``options.py``,
settings resolution in ``settings.py``; feature modules register their own sub-commands.
Each option maps onto a field of the config dataclasses.

Errors the user can fix (a bad file, an unknown model, an invalid value) print one line on
stderr and exit with status 2; nothing is half-written.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

from .config import ConfigError
from .options import (UsageError, add_model_options, add_parallel_options, add_prefill_option, add_sampling_options,
                      add_spec_options, add_strategy_option, add_suffix_option, check_engine_args, sampling_from_args,
                      spec_from_args)

# feature modules that add sub-commands: each defines register(subparsers)
COMMAND_MODULES = ("hispec.train.commands", "hispec.bench.commands", "hispec.server.commands")


def user_errors() -> tuple[type[BaseException], ...]:
    from .cache.block_manager import CacheFullError
    from .generate import PromptTooLongError
    from .model.load.checkpoint import ModelLoadError
    from .model.load.registry import ModelNotFoundError
    from .data import DataError

    errors = [ConfigError, UsageError, CacheFullError, PromptTooLongError, ModelLoadError,
              ModelNotFoundError, DataError, FileNotFoundError, PermissionError]
    try:
        from .model.exits import ExitHeadError
        errors.append(ExitHeadError)
    except ImportError:
        pass
    return tuple(errors)


# ---- hispec generate ----------------------------------------------------------------------
def register_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text (streams to stdout)",
                       description="Generate a continuation; output is identical across strategies at "
                                   "temperature 0.")
    p.add_argument("prompt", nargs="?", help="the prompt (or use --prompt TEXT, or --prompts FILE)")
    # (without it argparse took --prompt as short for --prompts and read the text as a file name)
    p.add_argument("-p", "--prompt", dest="prompt_text", metavar="TEXT", help="the prompt, as an option")
    p.add_argument("--prompts", metavar="FILE",
                   help="JSONL prompts: Spec-Bench form, {'id', 'prompt'}, GSM8K {'question'} or {'prompt_ids'}")
    add_strategy_option(p)
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
    b.add_argument("--kv-blocks", type=int, default=None,
                   help="KV-cache blocks of 16 tokens (default: enough for a full batch)")
    b.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="size the KV pool as this fraction of free memory")
    add_prefill_option(b)
    add_suffix_option(b)
    add_model_options(p)
    add_parallel_options(p)
    add_sampling_options(p)
    add_spec_options(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    if args.prompt is not None and args.prompt_text is not None:
        raise UsageError("give the prompt once: as PROMPT or as --prompt TEXT")
    if args.prompt_text is not None:
        args.prompt = args.prompt_text
    if (args.prompt is None) == (args.prompts is None):
        raise UsageError("give either a PROMPT (or --prompt TEXT) or --prompts FILE")
    params = sampling_from_args(args)
    check_engine_args(args, max_batch_size="batch_size")
    prompts = None
    if args.prompts:
        from .data import read_prompts
        prompts = read_prompts(args.prompts)  # validate the whole file before any work
    from .distributed import generator_from_args

    gen = generator_from_args(args)
    spec = spec_from_args(args, gen)
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

    from .config import DEFAULT_SUFFIX_SCOPES
    from .spec.proposers.suffix import SuffixStore
    from .decode.stats import DecodeStats

    total, seconds, tokens = DecodeStats(args.strategy), 0.0, 0
    suffix = SuffixStore.for_spec(spec, args.suffix_cache_entries, DEFAULT_SUFFIX_SCOPES)  # one scope: this run's
    for p in tqdm(prompts, desc=f"{args.strategy}", unit="prompt", file=sys.stderr, disable=None):
        out = gen.generate(_prompt_of(p), params, args.strategy, chat=args.chat, spec=spec,
                           adaptive=not args.no_adaptive, suffix=suffix)
        total.merge(out.stats)
        seconds, tokens = seconds + out.seconds, tokens + out.new_tokens
        if args.json:
            print(json.dumps(output_record(p.id, out, args.strategy)), flush=True)
        else:
            print(f"### {p.id}\n{out.text}\n", flush=True)
    if args.stats:
        print_stats_table(total, tokens, seconds, sys.stderr, kernels_of(gen))
    return 0


def _generate_batched(gen, args, params, spec, prompts) -> int:
    from tqdm import tqdm

    from .decode.stats import DecodeStats
    from .llm import LLM

    llm = LLM(gen, args.strategy, spec=spec, max_batch_size=args.batch_size, kv_blocks=args.kv_blocks,
              kv_memory_fraction=args.kv_memory_fraction, adaptive=not args.no_adaptive,
              prefill_chunk=args.prefill_chunk, suffix_cache_entries=args.suffix_cache_entries,
              prefix_caching=not args.no_prefix_caching)
    total = DecodeStats(args.strategy)
    with tqdm(total=len(prompts), desc=f"{args.strategy} batch {args.batch_size}", unit="prompt", file=sys.stderr,
              disable=None) as bar:
        outputs = llm.generate([_prompt_of(p) for p in prompts], params, chat=args.chat,
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
        engine = llm.engine.stats()
        queried, hit = engine["prefix_cache_queries"], engine["prefix_cache_hits"]
        print(f"  prefix cache: {hit} of {queried} prompt tokens found ({hit / max(queried, 1):.0%})", file=sys.stderr)
        print(f"  engine: {json.dumps(engine)}", file=sys.stderr)
    return 0


def _prompt_of(record):
    """What the model is given for a prompt-file record: its token ids, or its text."""
    return list(record.prompt_ids) if record.prompt_ids else record.prompt


def output_record(pid: str, out, strategy: str) -> dict:
    rate = out.new_tokens / out.seconds if out.seconds > 0 else 0.0
    return {"id": pid, "text": out.text, "token_ids": out.token_ids, "new_tokens": out.new_tokens,
            "seconds": round(out.seconds, 4), "tokens_per_second": round(rate, 3),
            "finish_reason": out.finish_reason, "strategy": strategy, "stats": out.stats.to_dict()}


def print_stats(out, file, kernels: str | None = None) -> None:
    print_stats_table(out.stats, out.new_tokens, out.seconds, file, kernels)


def kernels_of(gen) -> str | None:
    """Which kernels the generator's model runs on (None for a model this cannot inspect)."""
    from .kernels.select import describe

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
    if d["rounds"]:
        lines.append("  rounds: " + ", ".join(f"{kind} {n}" for kind, n in sorted(d["rounds"].items()))
                     + (f" (plain runs cut where a lookup match's drafts would pay: {d['lookup_stops']})"
                        if d.get("lookup_stops") else ""))
    if d["modes"]:
        rates = ", ".join(f"{m} {r:.1f}" for m, r in d["mode_rates"].items())
        lines.append("  adaptive rounds: " + ", ".join(f"{m} {n}" for m, n in d["modes"].items())
                     + f" (the controller's measured tokens/s per mode at this batch size: {rates}; "
                       "--no-adaptive to always speculate)")
    if d.get("free_gain") is not None or d.get("free_skips"):
        gain = f"{d['free_gain']:.2f}x" if d.get("free_gain") is not None else "not measured"
        lines.append(f"  free-draft rounds: {gain} a plain step's tokens/s at this batch size (measured); skipped on "
                     f"{d.get('free_skips', 0)} steps where they measured slower")
    if d["verification_wall"] is not None:
        lines.append(f"  verification wall: {d['verification_wall']:.2f} (full-verify s/token / draft s/token)")
    print("\n".join(lines), file=file)


# ---- hispec models -----------------------------------------------------------------------
def register_models(sub) -> None:
    p = sub.add_parser("models", help="list the known and the cached models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)


def cmd_models(args) -> int:
    from .model.load.registry import hispec_home, list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"models in {hispec_home() / 'models'}:")
    for r in rows:
        state = ("cached" if r["cached"] else "not converted yet (converted on first use)"
                 if r.get("installed", True) else "not installed")
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
