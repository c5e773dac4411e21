"""``hispec bench``: every strategy and its peers on the same prompts, one process, interleaved;
``hispec perplexity``: a model's perplexity over a text file (``perplexity.py``)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..paths import portable, portable_command
from ..settings import DEFAULT_STRATEGY, STRATEGIES

DEFAULT_STRATEGIES = ",".join((*STRATEGIES, "hf", "hf-early-exit"))

EPILOG = """\
data (--data, repeatable): a JSONL path (Spec-Bench {question_id, category, turns}, {id, prompt} or GSM8K
{question, answer}), or a named set from an installed package: humaneval, mtbench, sharegpt.

strategies (--strategies, comma-separated NAME[:OPTION...]):
  ar                      autoregressive (the reference for speedup and identical_to_ar)
  selfspec[:OPTS]         single exit; OPTS: a draft policy (fixed, svip, heuristic) and d=L_d, k=N_d, t=svip threshold
  hispec[:OPTS]           two exits; OPTS as selfspec plus i=L_i, w=N_i
  hf                      transformers generate() on the same model folder
  hf-early-exit[:L]       transformers generate(assistant_early_exit=L); bare: one run per --hf-exit-layers
  hf-lookup[:K]           transformers generate(prompt_lookup_num_tokens=K) (bare: K=4), also against hf
  e.g. ar,selfspec:d=4,selfspec:heuristic,hispec,hispec:svip,hf,hf-early-exit,hf-lookup

peers (--peers, comma-separated ENGINE[:OPTION]): run in their own processes on the same prompt token ids,
interleaved with the strategies; their token ids are compared with ar's (whole output and first --agree-first).
  llama.cpp[:W][:lookup]  llama-cpp-python on the GGUF file hispec loads, any architecture and type, W its type
                          (q4_1 for the default model, q4_k_m for gemma3-270m...; gguf: the file whatever its type)
                          or F16/F32 GGUFs of the same weights (f16, f32; written once under
                          $HISPEC_HOME/peers/gguf); bare: all three; :lookup with its prompt lookup decoding
                          (measured against the same peer without it)
  vllm[:DTYPE][:ngram]    vLLM (CPU) on the converted model folder; float32 (bare) or bfloat16; :ngram with its
                          n-gram speculative decoding (measured against the same peer without it)
  ar:OPT=VALUE[:...]      hispec ar with other model options in a second process, e.g. ar:dtype=bfloat16;
                          kernel=q4|int4|q8a: 4-bit weights on that kernel (ar:kernel=int4)
  hispec:OPT=VALUE[:...]  the same for hispec, selfspec or lookup (with the run's --adaptive), e.g.
                          hispec:kernel=int4 against this process's hispec on the timed kernel
  install: scripts/install-peers.sh [llama.cpp] [vllm] (venvs under $HISPEC_PEERS, default $HISPEC_HOME/peers);
           llama.cpp-tools: llama.cpp's own llama-bench, llama-perplexity, llama-quantize... in llamacpp-tools/bin

example:
  hispec bench --data /path/spec_bench/question.jsonl --limit 2 --per-category --max-new-tokens 64 --out bench-out

summary (--summary FILE, nothing benchmarked): the text between <!-- summary:start --> and <!-- summary:end -->
in FILE becomes the newest run of each comparison (machine, batch size, engines) in the result files:
  cp bench-out/results.json docs/benchmarks/results/2026-12-03-zen4-batch1.json
  hispec bench --summary BENCHMARKS.md            # --results PATH: other files or folders
"""


def register(subparsers) -> None:
    from ..options import add_model_options, add_parallel_options, add_sampling_options, add_spec_options

    p = subparsers.add_parser("bench", help="benchmark strategies and peers side by side",
                              description="Benchmark ar, selfspec, hispec and transformers' generate (plain and "
                                          "early-exit) on the same prompts, interleaved, in one process; write "
                                          "results.json, report.md and PNG plots.",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("benchmark")
    g.add_argument("--data", action="append", metavar="PATH|NAME",
                   help="prompt set: a JSONL file or humaneval, mtbench, sharegpt (repeatable; required unless --summary)")
    g.add_argument("--categories", default=None, metavar="A,B", help="only these categories")
    g.add_argument("--limit", type=int, default=None, metavar="N", help="at most N prompts per data set")
    g.add_argument("--per-category", action="store_true", help="apply --limit to each category")
    g.add_argument("--strategies", default=DEFAULT_STRATEGIES, help=f"(default: {DEFAULT_STRATEGIES})")
    g.add_argument("--hf-exit-layers", default=None, metavar="L,L",
                   help="exit layers to try for a bare hf-early-exit (default: the draft layer)")
    g.add_argument("--warmup", type=int, default=1, metavar="N", help="warm-up prompts per strategy (default 1)")
    g.add_argument("--out", default="bench-out", metavar="DIR", help="output folder (default: bench-out)")
    g.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="wrap prompts in the model's chat template (default when the model has one)")
    g.add_argument("--no-chat", dest="chat", action="store_false")
    g.add_argument("--batch-sizes", default=None, metavar="B,B",
                   help="instead: throughput of ar/selfspec/hispec in the batched engine at these batch sizes")
    g.add_argument("--rounds", type=int, default=3, metavar="N",
                   help="with --batch-sizes: runs per engine and batch size, interleaved; the median is reported (default 3)")
    g.add_argument("--no-adaptive", action="store_true", help="with --batch-sizes: always speculate")
    g.add_argument("--adaptive", action="store_true",
                   help="without --batch-sizes: decode each prompt adaptively, as hispec generate does (one "
                        "controller per strategy, learning across the prompts; default: always speculate)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    peers = p.add_argument_group("peer engines (each in its own process and venv; greedy; see PEERS below)")
    peers.add_argument("--peers", default=None, metavar="P,P",
                       help="also run llama.cpp[:TYPE|gguf|f16|f32], vllm[:float32|bfloat16], ar:OPT=VALUE")
    peers.add_argument("--peer-python", action="append", default=[], metavar="ENGINE=PYTHON",
                       help="the Python of a peer's venv (repeatable; default $HISPEC_PEERS/<llamacpp|vllm>/bin/python, "
                            "$HISPEC_PEERS defaulting to $HISPEC_HOME/peers)")
    peers.add_argument("--agree-first", type=int, default=32, metavar="N",
                       help="also report agreement with ar on the first N tokens (default 32)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    s = p.add_argument_group("summary (instead of a benchmark run)")
    s.add_argument("--summary", metavar="FILE", default=None,
                   help="rewrite FILE's summary, the text between <!-- summary:start --> and <!-- summary:end -->, "
                        "with the newest run of each comparison in the result files; the rest of FILE is kept")
    s.add_argument("--results", action="append", default=[], metavar="PATH",
                   help="with --summary: a results.json / batch_results.json or a folder of result files "
                        "(repeatable; default: docs/benchmarks/results beside FILE)")
    add_model_options(p)
    add_parallel_options(p)
    add_sampling_options(p)
    add_spec_options(p)
    p.set_defaults(func=cmd_bench)
    # hispec bench serve / soak: servers measured over HTTP (their options are their own)
    from .serving.commands import register_serve
    from .serving.soak import register_soak
    modes = p.add_subparsers(dest="bench_mode", metavar="{serve,soak}",
                             title="serving (hispec bench serve --help, hispec bench soak --help)")
    register_serve(modes)
    register_soak(modes)
    register_perplexity(subparsers)


def register_perplexity(subparsers) -> None:
    from ..options import add_model_options
    from .perplexity import DEFAULT_CONTEXT

    p = subparsers.add_parser(
        "perplexity", help="a model's perplexity over a text file (as llama-perplexity)",
        description="The perplexity of the model over a text file, tokenized whole (no chat template), on the "
                    "weights and kernels the model options choose. Default: llama-perplexity's method, "
                    "consecutive windows of --context tokens each scored on its second half (comparable to "
                    "llama-perplexity -c N's final estimate); --stride S: Hugging Face's sliding windows.")
    g = p.add_argument_group("perplexity")
    g.add_argument("--data", required=True, metavar="FILE", help="a UTF-8 text file")
    g.add_argument("--context", type=int, default=DEFAULT_CONTEXT, metavar="N",
                   help=f"tokens per window (default {DEFAULT_CONTEXT})")
    g.add_argument("--stride", type=int, default=None, metavar="S",
                   help="sliding windows of --context tokens every S tokens (S <= N), each scoring the tokens no "
                        "earlier window scored (Hugging Face's method); default: non-overlapping windows, each "
                        "scored on its second half (llama-perplexity's)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_options(p)
    p.set_defaults(func=cmd_perplexity)


def cmd_perplexity(args) -> int:
    from ..kernels.select import describe
    from ..options import UsageError, load_generator
    from .perplexity import check_window_options, perplexity, text_tokens

    check_window_options(args.context, args.stride)
    if args.exits:
        raise UsageError("--exits: perplexity is scored on the model's own final head (exit heads do not apply)")
    try:
        text = Path(args.data).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        from ..data import DataError
        raise DataError(f"{args.data}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        from ..data import DataError
        raise DataError(f"{args.data}: the file is empty")
    args.no_exits = True
    gen = load_generator(args, progress=not args.json)
    if gen.tokenizer is None:
        raise UsageError(f"{args.model}: the model has no tokenizer, so it cannot read a text")
    tokens, bos = text_tokens(gen.tokenizer, text)
    result = perplexity(gen.model, tokens, context=args.context, stride=args.stride, bos=bos,
                        progress=not args.no_progress)
    model = gen.model
    record = {"model": args.model if args.model == "default" else portable(args.model), "data": portable(args.data),
              **result.to_dict(), "quantize": args.quantize, "weights": model.weight_format,
              "dtype": str(model.dtype).removeprefix("torch."),
              "kv_cache_dtype": str(model.kv_dtype).removeprefix("torch."),
              "device": str(model.device), "kernels": describe(model) if model.device.type == "cpu" else None}
    if args.json:
        print(json.dumps(record))
        return 0
    print(result.summary())
    print(f"  {result.tokens_evaluated} tokens through the model in {result.seconds:.2f} s = "
          f"{result.tokens_per_second:.1f} tokens/s; weights {model.weight_format} (--quantize {args.quantize}), "
          f"KV cache {record['kv_cache_dtype']}")
    if record["kernels"]:
        print(f"  kernels: {record['kernels']}")
    return 0


def _int_list(text: str | None, option: str) -> list[int] | None:
    if text is None:
        return None
    from ..options import UsageError

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{option} needs comma-separated integers, got {text!r}") from None
    if not values:
        raise UsageError(f"{option} is empty")
    return values


def cmd_summary(args) -> int:
    """``--summary FILE``: the summary section rewritten from result files, nothing benchmarked."""
    from .summary import write_summary

    target = Path(args.summary)
    sources = [Path(r) for r in args.results] or [target.parent / "docs" / "benchmarks" / "results"]
    shown = write_summary(target, sources)
    print(f"hispec bench: wrote the summary of {target}: {len(shown)} comparison(s)", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from ..distributed import generator_from_args
    from ..options import UsageError, sampling_from_args
    from ..data import load_prompts
    from .peers import build_peers, model_gguf_type, parse_peer_python, parse_peers
    from .results import load_average
    from .strategies import parse_strategies

    if args.summary is not None:
        return cmd_summary(args)
    if args.results:
        raise UsageError("--results goes with --summary FILE")
    if not args.data:
        raise UsageError("--data is required (a prompt file or set), unless --summary FILE")
    started, load_at_start = time.perf_counter(), load_average()
    if args.warmup < 0:
        raise UsageError("--warmup must be >= 0")
    params = sampling_from_args(args)
    strategies = parse_strategies(args.strategies)  # names checked before anything is loaded
    exit_layers = _int_list(args.hf_exit_layers, "--hf-exit-layers")
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    prompts = load_prompts(args.data, categories, args.limit, args.per_category)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # llama.cpp runs the GGUF file hispec loads: its peers are labelled by the file's type (q4_1, q4_k_m...)
    peer_specs = parse_peers(args.peers, model_gguf_type(args.model) if "llama.cpp" in (args.peers or "") else None)
    parse_peer_python(args.peer_python)
    if peer_specs and not params.greedy:
        raise UsageError("--peers compares token ids: use greedy decoding (--temperature 0)")
    if args.agree_first < 1:
        raise UsageError("--agree-first must be >= 1")
    gen = generator_from_args(args, progress=not args.no_progress)
    peers = build_peers(peer_specs, args, gen, out)
    if peers:  # SIGTERM (e.g. timeout) runs the finally below, which stops the peer processes
        import signal
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _bench(args, gen, strategies, exit_layers, categories, prompts, params, out, peers, started,
                      load_at_start)
    finally:
        for peer in peers:
            peer.close()


def _bench(args, gen, strategies, exit_layers, categories, prompts, params, out, peers, started,
           load_at_start) -> int:
    from .runner import run_bench
    from .strategies import build_runners, expand_early_exit, spec_for

    batch_sizes = _int_list(args.batch_sizes, "--batch-sizes")
    if batch_sizes:
        return _bench_batch_sizes(args, gen, strategies, prompts, params, batch_sizes, out, peers)
    if exit_layers is None:
        from .strategies import StrategySpec
        exit_layers = [spec_for(StrategySpec(DEFAULT_STRATEGY, DEFAULT_STRATEGY), args, gen).draft_layer]
    strategies = expand_early_exit(strategies, exit_layers)
    runners = build_runners(strategies, args, gen) + peers
    for peer in peers:
        if peer.unavailable:
            print(f"hispec bench: note: peer {peer.label} will not run: {peer.unavailable}", file=sys.stderr)
    chat = args.chat if args.chat is not None else gen.has_chat_template()
    print(f"hispec bench: {len(prompts)} prompts x {len(runners)} strategies "
          f"({', '.join(r.label for r in runners)}), max {params.max_new_tokens} new tokens", file=sys.stderr)
    run = run_bench(gen, runners, prompts, params, chat=chat, warmup=args.warmup, progress=not args.no_progress,
                    agree_first=args.agree_first)

    from .results import build_results
    config = {
        "command": "hispec " + portable_command(sys.argv[1:]) if sys.argv[1:2] == ["bench"]
        else "hispec bench",
        "data": [portable(d) for d in args.data], "categories": categories, "limit": args.limit, "per_category": args.per_category,
        "num_prompts": len(prompts), "prompt_ids": [p.id for p in prompts],
        "prompt_tokens": [len(ids) for ids in run.prompt_ids],
        "strategies": [r.label for r in runners if r.kind != "peer"], "peers": [p.label for p in peers],
        "agree_first": args.agree_first, "hf_exit_layers": exit_layers,
        "max_new_tokens": params.max_new_tokens, "adaptive": args.adaptive,
        "sampling": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                     "seed": params.seed, "stop": list(params.stop), "ignore_eos": params.ignore_eos},
        "chat": chat, "warmup": args.warmup, "batch_size": 1, "out": portable(out),
    }
    results = build_results(run, gen, model_name=args.model, config=config, started=started,
                            load_at_start=load_at_start)
    return write_outputs(results, out, plots=not args.no_plots)


def _bench_batch_sizes(args, gen, strategies, prompts, params, batch_sizes, out: Path, peers=()) -> int:
    from ..options import UsageError
    from .batched import run_batch_sizes, write_batch_outputs
    from .results import git_commit, load_average, machine_info, weight_kernels
    from .runner import encode_prompts
    from .strategies import spec_for

    if min(batch_sizes) < 1:
        raise UsageError("--batch-sizes must be >= 1")
    if args.rounds < 1:
        raise UsageError("--rounds must be >= 1")
    own = {s.label: (s.kind, spec_for(s, args, gen)) for s in strategies if s.kind in STRATEGIES}
    if not own:
        raise UsageError(f"--batch-sizes measures {', '.join(STRATEGIES)}: name at least one in --strategies")
    chat = args.chat if args.chat is not None else gen.has_chat_template()
    prompt_ids = encode_prompts(gen, prompts, chat)
    created, load_at_start = time.strftime("%Y-%m-%dT%H:%M:%S%z"), load_average()
    print(f"hispec bench: {len(prompts)} prompts, batch sizes {batch_sizes}, strategies {', '.join(own)}",
          file=sys.stderr)
    results = run_batch_sizes(gen, own, prompt_ids, params, batch_sizes, adaptive=not args.no_adaptive,
                              peers=[p for p in peers if p.unavailable is None], agree_first=args.agree_first,
                              rounds=args.rounds)
    for p in peers:
        if p.unavailable:
            print(f"hispec bench: note: peer {p.label} did not run: {p.unavailable}", file=sys.stderr)
    machine = machine_info(gen.model.device) | {"load_average_at_start": load_at_start,
                                                 "load_average_at_end": load_average()}
    meta = {"machine": machine, "model": args.model, "num_prompts": len(prompts), "created": created,
            "weights": _weights(gen.model), "kernels": weight_kernels(gen.model),
            "peers": {p.label: p.describe() | {"available": p.unavailable is None, "reason": p.unavailable}
                      for p in peers},
            "max_new_tokens": params.max_new_tokens, "adaptive": not args.no_adaptive, "rounds": args.rounds,
            "sampling": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                         "seed": params.seed, "stop": list(params.stop), "ignore_eos": params.ignore_eos},
            "commit": git_commit(),
            "command": "hispec " + portable_command(sys.argv[1:])}
    return write_batch_outputs(results, meta, out, plots=not args.no_plots)


def _weights(model) -> str:
    """What the hispec rows ran on: the quantized format, else the dtype."""
    fmt = getattr(model, "weight_format", "none")
    return fmt if fmt != "none" else str(model.dtype).replace("torch.", "")


def write_outputs(results: dict, out: Path, plots: bool = True) -> int:
    """results.json, the PNGs and report.md into ``out``; the overall table on stdout."""
    from .report import overall_table, render

    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    names: list[str] = []
    if plots:
        from .plots import PlotsUnavailable, write_plots
        try:
            names = write_plots(results, out)
        except PlotsUnavailable as e:
            print(f"hispec bench: no plots: {e}", file=sys.stderr)
    (out / "report.md").write_text(render(results, names), encoding="utf-8")
    print("\n".join(overall_table(results["strategies"])))
    print(f"\nwrote {out / 'results.json'}, {out / 'report.md'}" + "".join(f", {out / n}" for n in names),
          file=sys.stderr)
    return _exit_status(results["strategies"])


def _exit_status(strategies: dict) -> int:
    """1 when one of hispec's own strategies failed or (greedy) changed the output; peers only warn."""
    status = 0
    for label, e in strategies.items():
        own = e["kind"] in STRATEGIES
        if not e["available"]:
            print(f"hispec bench: {'error' if own else 'note'}: {label} did not run: {e['reason']}", file=sys.stderr)
            status |= own
        elif e["identical_to_ar"] is False:
            print(f"hispec bench: {'error' if own else 'warning'}: {label}'s output differs from ar's on "
                  f"{len(e.get('mismatched_prompts', []))} prompt(s)", file=sys.stderr)
            status |= own
    return int(status)
