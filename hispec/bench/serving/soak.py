"""``hispec bench soak``: hispec's server under a long mixed load, checked for what it must not lose.

The command starts ``hispec serve`` on loopback and keeps ``--concurrency`` clients busy for
``--duration`` seconds with mixed requests: prompts of 3-400 words, ``max_tokens`` 1-96, half
streamed, half chat, temperatures 0-1 (some seeded), and a share of streams that disconnect after
their first chunks. It samples the server process's resident memory (RSS) and its ``/metrics``
meanwhile. Then it waits for the server to go idle and reads the KV blocks still held by requests
(``hispec_kv_blocks_in_use``: blocks a prefix cache keeps for reuse are not held by requests, so they
do not count), and ends with one drain: ``--concurrency`` requests in flight, SIGTERM, and every one
of them must still finish (not ``abort``) and the server exit with status 0.

Reported: requests sent, completed, disconnected on purpose, errors (an HTTP error, an error event or
``finish_reason: error``, a reply longer than its ``max_tokens``), lost requests (a stream that ended
without a finish reason, a connection that broke, a request the server's
``hispec_requests_finished_total`` never counted), RSS at the start, peak and end and its growth from
the first quarter of the run to the last, KV blocks leaked, and the drain. The exit status is 1
on any error, lost request, leaked block, failed drain or RSS growth over ``--max-rss-growth`` MB.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .datasets import mixed_prompt, mixed_temperature

DESCRIPTION = ("Start hispec serve on loopback, keep --concurrency clients busy for --duration seconds with "
               "mixed requests (client disconnects included), then check that the KV blocks come back when "
               "idle and that a SIGTERM drain finishes every in-flight request; reports errors, lost requests "
               "and RSS growth; exit status 1 on any of them.")
KV_IN_USE = "hispec_kv_blocks_in_use"  # blocks held by sequences (not blocks a prefix cache keeps)
KV_TOTAL = "hispec_kv_blocks_total"
KV_FREE = "hispec_kv_blocks_free"  # (with prefix caching: cached blocks nobody holds included)
KV_CACHED = "hispec_kv_blocks_cached"  # blocks holding a cached prompt prefix (where the server caches them)
RUNNING = "hispec_requests_running"
WAITING = "hispec_requests_waiting"
FINISHED = "hispec_requests_finished_total"
ERROR_PREFIXES = ("HTTP", "error event", "finish_reason")


def register_soak(sub) -> None:
    from .commands import add_server_options

    p = sub.add_parser("soak", help="hispec's server under a long mixed load: errors, lost requests, memory, "
                                    "KV blocks leaked, a SIGTERM drain",
                       description=DESCRIPTION, prog="hispec bench soak")
    g = p.add_argument_group("soak")
    g.add_argument("--duration", type=float, default=600.0, metavar="S", help="seconds of load (default: 600)")
    g.add_argument("--concurrency", type=int, default=16, metavar="N", help="clients (default: 16)")
    g.add_argument("--max-tokens", type=int, default=96, metavar="N", help="max_tokens from 1 to N (default: 96)")
    g.add_argument("--max-words", type=int, default=400, metavar="N", help="prompts of 3 to N words (default: 400)")
    g.add_argument("--disconnect-fraction", type=float, default=0.1, metavar="F",
                   help="streams that disconnect after their first 1-3 chunks (default: 0.1)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--sample-interval", type=float, default=2.0, metavar="S",
                   help="seconds between RSS and /metrics samples (default: 2)")
    g.add_argument("--idle-timeout", type=float, default=30.0, metavar="S",
                   help="seconds the server gets to release every KV block once idle (default: 30)")
    g.add_argument("--max-rss-growth", type=float, default=128.0, metavar="MB",
                   help="RSS growth (first quarter of the run to the last) that fails the soak (default: 128)")
    g.add_argument("--shutdown-timeout", type=float, default=60.0, metavar="S",
                   help="the server's --shutdown-timeout: the drain's in-flight requests must end within it "
                        "(default: 60)")
    g.add_argument("--max-batch-size", type=int, default=16, metavar="N", help="the server's (default: 16)")
    g.add_argument("--result-file", default=None, metavar="FILE", help="write the report as JSON")
    add_server_options(g, peers=False)
    p.set_defaults(func=cmd_soak)


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    disconnected: int = 0
    errors: int = 0
    lost: int = 0
    streamed: int = 0
    output_tokens: int = 0
    first_errors: list[str] = field(default_factory=list)

    def add(self, o, max_tokens: int) -> None:
        self.sent += 1
        if o.ok and o.error == "disconnected":
            self.disconnected += 1
            return
        problem = None
        if not o.ok:
            problem = o.error or "failed"
        elif o.finish_reason not in ("stop", "length"):
            problem = f"finish_reason {o.finish_reason}"
        elif o.output_tokens > max_tokens:
            problem = f"{o.output_tokens} tokens for max_tokens {max_tokens}"
        if problem is None:
            self.completed += 1
            self.output_tokens += o.output_tokens
            return
        if problem.startswith(ERROR_PREFIXES) or o.ok:
            self.errors += 1
        else:
            self.lost += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(problem)


def mixed_request(rng: random.Random, max_words: int, max_tokens: int, disconnect_fraction: float) -> dict:
    """One request of the mix: (messages/prompt, max_tokens, stream, chat, sampling, disconnect_after)."""
    text = mixed_prompt(rng, max_words)
    stream, chat = rng.random() < 0.5, rng.random() < 0.5
    temperature = mixed_temperature(rng)
    seed = rng.randrange(1 << 30) if temperature > 0 and rng.random() < 0.5 else None
    disconnect = rng.randint(1, 3) if stream and rng.random() < disconnect_fraction else None
    return {"text": text, "max_tokens": rng.randint(1, max_tokens), "stream": stream, "chat": chat,
            "temperature": temperature, "seed": seed, "disconnect_after": disconnect}


def _body(req: dict, model: str, ignore_eos: bool = False) -> dict:
    body = {"model": model, "max_tokens": req["max_tokens"], "temperature": req["temperature"],
            "stream": req["stream"]}
    if req["stream"]:
        body["stream_options"] = {"include_usage": True}
    if req["seed"] is not None:
        body["seed"] = req["seed"]
    if ignore_eos:
        body["ignore_eos"] = True
    if req["chat"]:
        body["messages"] = [{"role": "user", "content": req["text"]}]
    else:
        body["prompt"] = req["text"]
    return body


async def _one(client, base: str, req: dict, model: str, ignore_eos: bool = False):
    from .client import send, send_plain

    url = base + ("/v1/chat/completions" if req["chat"] else "/v1/completions")
    body = _body(req, model, ignore_eos)
    if req["stream"]:
        return await send(client, url, body, req["chat"], timeout=300.0, disconnect_after=req["disconnect_after"])
    return await send_plain(client, url, body, req["chat"], timeout=300.0)


async def scrape(client, base: str) -> dict[str, float]:
    from ...server.metrics import parse_metrics

    r = await client.get(f"{base}/metrics", timeout=10.0)
    r.raise_for_status()
    return parse_metrics(r.text)


def server_finished(metrics: dict[str, float]) -> dict[str, float]:
    """``hispec_requests_finished_total`` by reason (stop, length, abort, error)."""
    out = {}
    for key, value in metrics.items():
        if key.startswith(FINISHED + "{"):
            found = re.search(r'reason="([^"]*)"', key)
            if found:
                out[found.group(1)] = out.get(found.group(1), 0.0) + value
    return out


def _mb(b: float | None) -> float | None:
    return None if b is None else round(b / 2**20, 1)


async def soak(server, args) -> dict:
    from .client import first_model, make_client
    from .servers import rss_bytes

    base, pid = server.base_url, server.pid
    rng = random.Random(args.seed)
    tally = Tally()
    samples: list[dict] = []
    async with make_client(args.concurrency + 2) as client:
        model = await first_model(client, base)
        warmups = min(4, args.concurrency)
        for i in range(warmups):  # warm-up, not counted
            await _one(client, base, mixed_request(rng, args.max_words, args.max_tokens, 0.0), model)
        t0 = time.monotonic()
        deadline = t0 + args.duration
        stop_sampling = asyncio.Event()

        async def sampler() -> None:
            while True:
                m = {}
                try:
                    m = await scrape(client, base)
                except Exception:
                    pass
                samples.append({"t": round(time.monotonic() - t0, 2), "rss": rss_bytes(pid),
                                "kv_in_use": m.get(KV_IN_USE), "running": m.get(RUNNING), "waiting": m.get(WAITING)})
                try:
                    await asyncio.wait_for(stop_sampling.wait(), args.sample_interval)
                    return
                except asyncio.TimeoutError:
                    pass

        async def worker(w: int) -> None:
            wrng = random.Random(args.seed * 1000 + w)
            while time.monotonic() < deadline:
                req = mixed_request(wrng, args.max_words, args.max_tokens, args.disconnect_fraction)
                tally.streamed += req["stream"]
                tally.add(await _one(client, base, req, model), req["max_tokens"])

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
        load_seconds = time.monotonic() - t0
        stop_sampling.set()
        await sampling

        # idle: every block held by a request must come back
        idle_deadline = time.monotonic() + args.idle_timeout
        idle = {}
        while True:
            try:
                idle = await scrape(client, base)
            except Exception as e:
                idle = {"error": str(e)}
            busy = idle.get(KV_IN_USE, 1) or idle.get(RUNNING, 0) or idle.get(WAITING, 0)
            if not busy or time.monotonic() > idle_deadline:
                break
            await asyncio.sleep(0.5)
        rss_idle = rss_bytes(pid)

        # the drain: requests in flight, SIGTERM, every one must finish
        n_drain = args.concurrency
        drain_reqs = [dict(mixed_request(rng, 40, 1, 0.0), max_tokens=rng.randint(16, max(16, args.max_tokens)))
                      for _ in range(n_drain)]
        tasks = [asyncio.create_task(_one(client, base, r, model, ignore_eos=True)) for r in drain_reqs]
        started = time.monotonic()  # SIGTERM once they are all in the server (or as many as it runs at once)
        while time.monotonic() - started < 5 and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
            try:
                m = await scrape(client, base)
            except Exception:
                break
            if m.get(RUNNING, 0) + m.get(WAITING, 0) >= min(n_drain, args.max_batch_size):
                break
        in_flight = sum(not t.done() for t in tasks)
        import signal as _signal

        server.signal(_signal.SIGTERM)
        drained = await asyncio.gather(*tasks)
    loop = asyncio.get_running_loop()
    status = await loop.run_in_executor(None, server.wait, args.shutdown_timeout + 30)
    drain = Tally()
    for r, o in zip(drain_reqs, drained):
        drain.add(o, r["max_tokens"])

    # the server's own count: every request sent must have ended there (abort: a client that left)
    finished = server_finished(idle)
    unfinished = warmups + tally.sent - sum(finished.values()) if finished else None
    rss = [s["rss"] for s in samples if s["rss"]]
    quarter = max(1, len(rss) // 4)
    growth = (max(rss[-quarter:]) - max(rss[:quarter])) if rss else None
    leaked = idle.get(KV_IN_USE)
    # blocks neither held nor free: lost by the accounting itself
    unaccounted = (idle[KV_TOTAL] - idle[KV_IN_USE] - idle[KV_FREE]
                   if all(k in idle for k in (KV_TOTAL, KV_IN_USE, KV_FREE)) else None)
    report = {
        "duration_s": round(load_seconds, 1), "concurrency": args.concurrency,
        "requests": {"sent": tally.sent, "completed": tally.completed, "disconnected": tally.disconnected,
                     "streamed": tally.streamed, "errors": tally.errors, "lost": tally.lost,
                     "output_tokens": tally.output_tokens, "first_errors": tally.first_errors},
        "requests_per_second": round(tally.sent / load_seconds, 2) if load_seconds else None,
        "server": {"finished": finished, "unfinished": unfinished},
        "rss_mb": {"start": _mb(rss[0]) if rss else None, "peak": _mb(max(rss)) if rss else None,
                   "end": _mb(rss[-1]) if rss else None, "idle": _mb(rss_idle),
                   "growth_first_to_last_quarter": _mb(growth)},
        "kv_blocks": {"leaked": leaked, "unaccounted": unaccounted, "total": idle.get(KV_TOTAL),
                      "cached": idle.get(KV_CACHED),
                      "metrics_after_idle": {k: v for k, v in idle.items() if "kv" in k and "{" not in k}},
        "drain": {"requests": n_drain, "in_flight_at_sigterm": in_flight, "completed": drain.completed, "errors": drain.errors, "lost": drain.lost,
                  "first_errors": drain.first_errors, "server_exit_status": status},
        "samples": samples,
    }
    problems = []
    if tally.errors or tally.lost:
        problems.append(f"{tally.errors} errors, {tally.lost} lost requests")
    if leaked is None:
        problems.append(f"no {KV_IN_USE} in /metrics after the load")
    elif leaked:
        problems.append(f"{leaked:g} KV blocks still held by requests after {args.idle_timeout:g} s idle")
    if finished.get("error"):
        problems.append(f"the server ended {finished['error']:g} requests with an error")
    if unfinished:
        problems.append(f"the server ended {sum(finished.values()):g} requests of the {warmups + tally.sent} sent")
    if unaccounted:
        problems.append(f"{unaccounted:g} KV blocks neither held nor free after idle")
    if drain.completed != n_drain:
        problems.append(f"the drain finished {drain.completed} of {n_drain} in-flight requests")
    if status != 0:
        problems.append(f"the server exited with status {status} after SIGTERM")
    if growth is not None and growth > args.max_rss_growth * 2**20:
        problems.append(f"RSS grew {_mb(growth)} MB (limit {args.max_rss_growth:g})")
    report["problems"] = problems
    return report


def report_lines(r: dict) -> list[str]:
    q, rss, d = r["requests"], r["rss_mb"], r["drain"]
    lines = [f"soak: {r['duration_s']} s at concurrency {r['concurrency']}: {q['sent']} requests "
             f"({r['requests_per_second']}/s, {q['streamed']} streamed)",
             f"  completed {q['completed']}, disconnected on purpose {q['disconnected']}, errors {q['errors']}, "
             f"lost {q['lost']}, output tokens {q['output_tokens']}",
             f"  server RSS (MB): start {rss['start']}, peak {rss['peak']}, end {rss['end']}, idle {rss['idle']}; "
             f"growth first -> last quarter {rss['growth_first_to_last_quarter']}",
             f"  the server's count of ended requests by reason: "
             f"{', '.join(f'{k} {v:g}' for k, v in sorted(r['server']['finished'].items())) or 'n/a'}"
             + (f" ({r['server']['unfinished']:g} sent but not ended)" if r['server']['unfinished'] else ""),
             f"  KV blocks held by requests after idle: {r['kv_blocks']['leaked']} of {r['kv_blocks']['total']}"
             + (f" ({r['kv_blocks']['cached']:g} holding cached prefixes)" if r['kv_blocks']['cached'] else "")
             + (f"; {r['kv_blocks']['unaccounted']:g} neither held nor free" if r['kv_blocks']['unaccounted'] else ""),
             f"  SIGTERM drain: {d['completed']} of {d['requests']} in-flight requests finished "
             f"({d['in_flight_at_sigterm']} in flight at SIGTERM; errors {d['errors']}, lost {d['lost']}); "
             f"server exit status {d['server_exit_status']}"]
    lines += [f"  error: {e}" for e in q["first_errors"] + d["first_errors"]]
    lines.append("soak: " + ("FAILED: " + "; ".join(r["problems"]) if r["problems"] else "ok"))
    return lines


def cmd_soak(args) -> int:
    from ...options import UsageError
    from . import servers

    if args.duration <= 0 or args.concurrency < 1 or args.max_tokens < 1 or args.max_words < 3:
        raise UsageError("--duration must be > 0, --concurrency and --max-tokens >= 1, --max-words >= 3")
    if not 0 <= args.disconnect_fraction <= 1:
        raise UsageError("--disconnect-fraction is between 0 and 1")
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise UsageError("hispec bench soak needs httpx: pip install 'hispec[server]'") from None
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="hispec-soak-"))
    extra = ["--shutdown-timeout", str(args.shutdown_timeout), *shlex.split(args.server_args)]
    spec = servers.hispec_spec(args.model, threads=args.threads, max_batch=args.max_batch_size,
                               port=servers.free_port(), extra=extra)
    server = servers.ManagedServer(spec, int(spec.argv[spec.argv.index("--port") + 1]), log_dir / "hispec.log")
    servers.terminate_on_sigterm()
    print(f"hispec bench soak: starting {spec.describe} (log {server.log})", file=sys.stderr, flush=True)
    try:
        server.start(args.ready_timeout)
        report = asyncio.run(soak(server, args))
    except servers.ServerError as e:
        raise UsageError(str(e)) from None
    finally:
        server.stop()
    print("\n".join(report_lines(report)), flush=True)
    if not args.log_dir and not report["problems"]:
        shutil.rmtree(log_dir, ignore_errors=True)  # (kept when something failed: the log says why)
    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"hispec bench soak: wrote {path}", file=sys.stderr)
    return 1 if report["problems"] else 0
