"""Command-line option groups shared by the sub-commands, and the glue that turns them into
library objects (a loaded ``Generator``, ``SamplingParams``, speculation overrides).

Every sub-command module (``cli``, ``train.commands``, ``bench.commands``, ``server.commands``)
builds its parser from these groups; nothing imports ``hispec.cli``, which is only the entry
point. ``--tensor-parallel-size`` is only declared here: a group of processes is loaded by
``hispec.distributed.generator_from_args``.
"""
from __future__ import annotations

import argparse

from .config import (DRAFT_POLICIES, ENGINE_OPTIONS, KV_CACHE_DTYPES, QUANTIZE, SPEC_FIELDS, SamplingParams,
                     SpecConfig, check_engine_options)
from .settings import DEFAULT_STRATEGY, STRATEGIES, strategies_help


class UsageError(ValueError):
    """A command-line usage mistake."""


# ---- option groups -------------------------------------------------------------------------
def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a Hugging Face model folder or a .gguf file")
    g.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default: float32 on cpu, bfloat16 on cuda)")
    g.add_argument("--quantize", default="auto", choices=QUANTIZE,
                   help="weight format on CPU: native = a GGUF file's own 4-bit blocks on the int4 kernel; "
                        "int4 / int8 = quantize float weights (int4: groups of 32, int8: per row); none = --dtype "
                        "weights. Default auto: native for 4-bit GGUF models (the default model) where the "
                        "kernels are faster on this CPU, else none; an explicit --dtype means none")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="what the KV cache holds: auto = bfloat16 for quantized weights on cpu (the default "
                        "model), else the model's dtype (float32 weights: float32); bfloat16 halves the cache's "
                        "memory and the bytes attention reads per token, and on CPUs with AVX-512 BF16 attention "
                        "multiplies in bfloat16 pairs (K/V rounded once when written; every strategy reads the "
                        "same values, so outputs stay identical across strategies)")
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


def add_strategy_option(group) -> None:
    # choices as plain text: argparse's error message shows them with repr()
    group.add_argument("--strategy", default=DEFAULT_STRATEGY.value, choices=[s.value for s in STRATEGIES],
                       help=f"decoding strategy (default: {DEFAULT_STRATEGY}); {strategies_help()}")


def add_spec_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--draft-layer", type=int, default=None, help="L_d: the draft exit (default: exit heads' or depth/8)")
    g.add_argument("--verify-layer", type=int, default=None, help="L_i: the intermediate exit (default: exit heads' or depth/4)")
    g.add_argument("--num-draft", type=int, default=None, help="N_d: tokens per draft round")
    g.add_argument("--window", type=int, default=None, help="N_i: tentatively accepted tokens per full verification")
    g.add_argument("--draft-policy", default=None, choices=[p.value for p in DRAFT_POLICIES])
    g.add_argument("--svip-threshold", type=float, default=None, help="entropy (nats) above which svip stops drafting")
    g.add_argument("--confidence-threshold", type=float, default=None,
                   help="top-1 probability below which the confidence policy stops drafting")
    g.add_argument("--lookup-max-draft", type=int, default=None, metavar="K",
                   help="free drafts per round from prompt lookup (lookup and hispec; 0 = none; default 4)")
    g.add_argument("--lookup-ngram", type=int, default=None, metavar="N",
                   help="the longest suffix of the text looked up for free drafts (default 3)")
    g.add_argument("--lookup-branches", type=int, default=None, metavar="B",
                   help="prompt-lookup matches verified together as one token tree's branches (default 1)")
    g.add_argument("--tree-width", type=int, default=None, metavar="M",
                   help="selfspec/hispec: the exit's top-M candidates at each draft position, verified as a "
                        "token tree (1 = a chain; default 1)")
    g.add_argument("--tree-min-prob", type=float, default=None, metavar="P",
                   help="with --tree-width: a runner-up joins the tree only if the exit gives its branch at least "
                        "probability P (its own times the drafts' before it; default: the measured cost of a "
                        "verification row relative to a plain step; 0: every runner-up)")


def add_suffix_option(group) -> None:
    from .config import DEFAULT_SUFFIX_ENTRIES

    group.add_argument("--suffix-cache-entries", type=int, default=DEFAULT_SUFFIX_ENTRIES, metavar="N",
                       help="free drafts from earlier outputs (lookup and hispec, greedy requests): n-grams of "
                            "finished requests' outputs kept per scope, least recently used out (SuffixDecoding's "
                            f"cache; 0 = off; default: {DEFAULT_SUFFIX_ENTRIES})")


def add_prefill_option(group) -> None:
    from .config import DEFAULT_PREFILL_CHUNK, IDLE_PREFILL_CHUNKS

    group.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                       help="chunked prefill: prompt tokens prefilled per engine step, all sequences together; "
                            "running sequences decode between a long prompt's chunks (as SGLang's "
                            "--chunked-prefill-size); a step in which nothing decodes takes up to "
                            f"{IDLE_PREFILL_CHUNKS}x as many; 0 = whole prompts in one step; default: {DEFAULT_PREFILL_CHUNK})")
    group.add_argument("--no-prefix-caching", action="store_true",
                       help="prefill every prompt whole (default: a prompt that starts as an earlier one did -- a "
                            "system prompt, a conversation so far -- reuses that prompt's KV blocks)")



# ---- options -> library objects ------------------------------------------------------------
def sampling_from_args(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def spec_overrides(args) -> dict:
    """The speculation settings given on the command line (None: not given, or no such option)."""
    return {k: getattr(args, k, None) for k in SPEC_FIELDS}


def spec_from_args(args, generator) -> SpecConfig | None:
    """``args.strategy``'s settings: command-line values over the exit heads' over the defaults
    (``settings.resolve_spec``; None for a strategy that does not speculate)."""
    return generator.resolve_spec(args.strategy, **spec_overrides(args))


def check_engine_args(args, **dest_of: str) -> None:
    """The engine and load options on the command line, through the one set of checks
    (``config.check_engine_options``), an error naming the flag. ``dest_of``: option -> the
    attribute of ``args`` that holds it, where they differ (``generate --batch-size``)."""
    dests = {o: dest_of.get(o, o) for o in ENGINE_OPTIONS if hasattr(args, dest_of.get(o, o))}
    check_engine_options({o: getattr(args, d) for o, d in dests.items()},
                         {o: "--" + d.replace("_", "-") for o, d in dests.items()})


def load_options(args) -> dict:
    """The model options as ``Generator.from_pretrained`` keywords, checked; sets torch's threads."""
    import torch

    check_engine_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available on this machine")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {device!r}")
    dtype_name = args.dtype or (None if device == "cpu" else "bfloat16")  # cpu: float32 unless quantized
    if getattr(args, "no_exits", False) and args.exits:
        raise UsageError("--exits and --no-exits exclude each other")
    exits = False if getattr(args, "no_exits", False) else (args.exits or True)
    return {"device": device, "dtype": getattr(torch, dtype_name) if dtype_name else None,
            "allow_pickle": args.allow_pickle, "exits": exits,
            "quantize": getattr(args, "quantize", "none"), "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto")}


def load_generator(args, progress: bool = True):
    """The ``Generator`` the model options describe, in this process (``--tensor-parallel-size N``:
    ``hispec.distributed.generator_from_args``)."""
    from .generate import Generator

    options = load_options(args)
    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise UsageError("--tensor-parallel-size: this command loads the model in one process")
    return Generator.from_pretrained(args.model, progress=progress, **options)
