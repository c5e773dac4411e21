"""``hispec loadtest``: N concurrent streaming clients against a running ``hispec serve``.

Each client sends ``--requests`` streaming requests one after another (a bounded run); the
report gives requests/s and generated tokens/s over the wall time of the run, and the p50/p95
of time to first token and of per-token latency (per request: seconds after the first token
divided by the tokens after the first) and of inter-token latency (the gaps between a stream's
consecutive text events). With ``--long-prompt N`` one extra request with an N-token prompt
arrives ``--long-delay`` seconds into the run; the report then also gives the inter-token
latency of the running streams while that prompt is prefilled, and its time to first token.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field

PROMPTS = [
    "Explain speculative decoding in two sentences.",
    "Write a haiku about the sea.",
    "What is the capital of France, and why is it famous?",
    "List three uses of a paper clip.",
    "Summarize the plot of Romeo and Juliet.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What does a CPU cache do?",
    "Describe a cat to someone who has never seen one.",
    "Translate 'good morning' into French and Spanish.",
    "What are the benefits of regular exercise?",
    "Write a short story opening about a lighthouse keeper.",
    "Explain recursion to a child.",
    "What is the difference between weather and climate?",
    "Name five planets of the solar system.",
]


def register_loadtest(subparsers) -> None:
    p = subparsers.add_parser("loadtest", help="measure a running hispec server under N concurrent clients",
                              description="N concurrent clients, each sending --requests streaming requests in "
                                          "turn to a running server (hispec serve); prints requests/s, generated "
                                          "tokens/s and p50/p95 time to first token and per-token latency. "
                                          "Datasets, request rates, concurrency sweeps, goodput and other "
                                          "servers: hispec bench serve.")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients (default: 32)")
    p.add_argument("--requests", type=int, default=4, help="requests per client (default: 4)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default: 32)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens per request")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions (default: /v1/completions)")
    p.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--warmup", type=int, default=1, help="requests sent before the measured run (default: 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    p.add_argument("--long-prompt", type=int, default=0, metavar="N",
                   help="also send one request with an N-token prompt while the clients stream (default: off)")
    p.add_argument("--long-delay", type=float, default=2.0, metavar="S",
                   help="seconds into the run the long prompt arrives (default: 2)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(func=cmd_loadtest)


@dataclass
class Result:
    ok: bool
    seconds: float = 0.0
    ttft: float | None = None
    tokens: int = 0
    mean_accepted_length: float | None = None
    error: str | None = None
    events: list[float] = field(default_factory=list)  # perf_counter() of each text event


@dataclass
class Report:
    clients: int
    requests: int
    errors: int
    wall_seconds: float
    requests_per_second: float
    generated_tokens: int
    tokens_per_second: float
    ttft_p50: float | None
    ttft_p95: float | None
    tpot_p50: float | None
    tpot_p95: float | None
    mean_accepted_length: float | None
    itl_p50: float | None = None
    itl_p95: float | None = None
    itl_max: float | None = None
    long_prompt_tokens: int = 0
    long_ttft: float | None = None  # the long request's time to first token
    long_itl_p95: float | None = None  # the streams' inter-token latency while it was prefilled
    long_itl_max: float | None = None
    first_errors: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        def ms(v):
            return "n/a" if v is None else f"{v * 1000:.1f} ms"

        out = [f"{self.clients} clients x {self.requests // max(self.clients, 1)} requests: {self.requests} "
               f"requests, {self.errors} errors, {self.wall_seconds:.1f} s",
               f"  requests/s        {self.requests_per_second:.2f}",
               f"  generated tok/s   {self.tokens_per_second:.1f}  ({self.generated_tokens} tokens)",
               f"  TTFT              p50 {ms(self.ttft_p50)}   p95 {ms(self.ttft_p95)}",
               f"  per-token latency p50 {ms(self.tpot_p50)}   p95 {ms(self.tpot_p95)}",
               f"  inter-token lat.  p50 {ms(self.itl_p50)}   p95 {ms(self.itl_p95)}   max {ms(self.itl_max)}"]
        if self.long_prompt_tokens:
            out += [f"  long prompt ({self.long_prompt_tokens} tokens): TTFT {ms(self.long_ttft)}; streams' "
                    f"inter-token latency meanwhile p95 {ms(self.long_itl_p95)}   max {ms(self.long_itl_max)}"]
        if self.mean_accepted_length is not None:
            out.append(f"  mean accepted length (server's hispec_stats) {self.mean_accepted_length:.2f}")
        out += [f"  error: {e}" for e in self.first_errors]
        return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def one_request(client, url: str, body: dict, chat: bool, timeout: float) -> Result:
    t0 = time.perf_counter()
    ttft, tokens, mal, events = None, 0, None, []
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return Result(False, error=f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return Result(False, error=str(event["error"])[:200])
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                    if text:
                        events.append(time.perf_counter())
                        if ttft is None:
                            ttft = events[-1] - t0
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                stats = event.get("hispec_stats")
                if stats:
                    mal = stats.get("mean_accepted_length")
    except Exception as e:  # connection errors, timeouts: count them, keep going
        return Result(False, error=f"{type(e).__name__}: {e}")
    return Result(True, time.perf_counter() - t0, ttft, tokens, mal, events=events)


def gaps(results: list[Result], start: float = -math.inf, end: float = math.inf) -> list[float]:
    """Seconds between consecutive text events of each stream, for gaps that end in [start, end]."""
    return [b - a for r in results for a, b in zip(r.events, r.events[1:]) if start <= b <= end]


def long_prompt_ids(n: int) -> list[int]:
    """A deterministic n-token prompt (ids 100..1099: inside any real model's vocabulary)."""
    return [100 + (37 * i) % 1000 for i in range(n)]


async def run_load(url: str, *, clients: int, requests: int, max_tokens: int, chat: bool = False,
                   temperature: float = 0.0, ignore_eos: bool = False, model: str | None = None,
                   api_key: str | None = None, warmup: int = 1, timeout: float = 600.0, long_prompt: int = 0,
                   long_delay: float = 2.0) -> Report:
    import httpx

    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        if model is None:
            r = await client.get(f"{base}/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        endpoint = f"{base}/chat/completions" if chat else f"{base}/completions"

        def body(i: int) -> dict:
            prompt = PROMPTS[i % len(PROMPTS)]
            b = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                 "stream_options": {"include_usage": True}}
            if ignore_eos:
                b["ignore_eos"] = True
            if chat:
                b["messages"] = [{"role": "user", "content": prompt}]
            else:
                b["prompt"] = prompt
            return b

        for i in range(warmup):
            await one_request(client, endpoint, body(i), chat, timeout)

        async def worker(c: int) -> list[Result]:
            return [await one_request(client, endpoint, body(c * requests + j), chat, timeout)
                    for j in range(requests)]

        async def long_request() -> tuple[float, Result]:
            await asyncio.sleep(long_delay)
            b = {**body(0), "prompt": long_prompt_ids(long_prompt), "max_tokens": 1}
            b.pop("messages", None)
            sent = time.perf_counter()
            return sent, await one_request(client, f"{base}/completions", b, False, timeout)

        t0 = time.perf_counter()
        jobs = [worker(c) for c in range(clients)] + ([long_request()] if long_prompt else [])
        done = await asyncio.gather(*jobs)
        wall = time.perf_counter() - t0
    per_client = done[:clients]
    results = [r for rs in per_client for r in rs]
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [(r.seconds - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1]
    tokens = sum(r.tokens for r in ok)
    mals = [r.mean_accepted_length for r in ok if r.mean_accepted_length]
    itls = gaps(ok)
    report = Report(clients, len(results), len(results) - len(ok), wall, len(ok) / wall if wall else 0.0, tokens,
                    tokens / wall if wall else 0.0, percentile(ttfts, 0.5), percentile(ttfts, 0.95),
                    percentile(tpots, 0.5), percentile(tpots, 0.95),
                    sum(mals) / len(mals) if mals else None, percentile(itls, 0.5), percentile(itls, 0.95),
                    max(itls, default=None), first_errors=[r.error for r in results if not r.ok][:3])
    if long_prompt:
        sent, long = done[clients]
        report.long_prompt_tokens = long_prompt
        if not long.ok:
            report.errors += 1
            report.first_errors.append(f"long prompt: {long.error}")
        else:
            report.long_ttft = long.ttft
            during = gaps(ok, sent, sent + long.seconds)
            report.long_itl_p95, report.long_itl_max = percentile(during, 0.95), max(during, default=None)
    return report


def cmd_loadtest(args) -> int:
    from ..options import UsageError

    if args.long_prompt < 0 or args.long_delay < 0:
        raise UsageError("--long-prompt and --long-delay must be >= 0")
    for name in ("clients", "requests", "max_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        import httpx
    except ImportError:
        raise UsageError("hispec loadtest needs httpx: pip install 'hispec[server]'") from None
    try:
        report = asyncio.run(run_load(args.url, clients=args.clients, requests=args.requests,
                                      max_tokens=args.max_tokens, chat=args.chat, temperature=args.temperature,
                                      ignore_eos=args.ignore_eos, model=args.model, api_key=args.api_key,
                                      warmup=args.warmup, timeout=args.timeout, long_prompt=args.long_prompt,
                                      long_delay=args.long_delay))
    except httpx.HTTPError as e:
        raise UsageError(f"cannot reach the server at {args.url}: {e}") from None
    if args.json:
        print(json.dumps(report.__dict__))
    else:
        print("\n".join(report.lines()))
    return 1 if report.errors else 0


if __name__ == "__main__":  # python -m hispec.server.loadtest ... (same as hispec loadtest ...)
    import argparse

    from ..options import UsageError

    parser = argparse.ArgumentParser(prog="hispec")
    register_loadtest(parser.add_subparsers(dest="command", required=True))
    cli_args = parser.parse_args(["loadtest", *sys.argv[1:]])
    try:
        sys.exit(cli_args.func(cli_args))
    except UsageError as e:
        print(f"hispec: error: {e}", file=sys.stderr)
        sys.exit(2)
