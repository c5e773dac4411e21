"""The streaming client of ``hispec bench serve`` and ``hispec bench soak`` (httpx, asyncio).

``send`` times one request against an OpenAI-compatible server (``/v1/chat/completions`` or
``/v1/completions``); ``run_benchmark`` sends a list of requests at a request rate (Poisson
arrivals) with at most ``max_concurrency`` in flight, a chat's turns each after the one before.
Output tokens are the server's ``usage.completion_tokens`` where it sends usage, else counted by
the tokenizer on the streamed text; input tokens likewise (``usage.prompt_tokens``, else the
dataset's count).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from .datasets import ServeRequest
from .metrics import Outcome, arrival_times

FAILED = ("error", "abort")  # finish reasons of a request the server gave up (hispec's names)
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False


def request_body(req: ServeRequest, model: str, chat: bool, sampling: Sampling, stream: bool = True) -> dict:
    temperature = req.temperature if req.temperature is not None else sampling.temperature
    body = {"model": model, "max_tokens": req.output_len, "temperature": temperature, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if sampling.top_p is not None:
        body["top_p"] = sampling.top_p
    if sampling.top_k is not None:
        body["top_k"] = sampling.top_k
    if sampling.ignore_eos or req.ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    return body


async def send(client, url: str, body: dict, chat: bool, *, timeout: float = 600.0, tokenizer=None,
               input_len: int | None = None, disconnect_after: int | None = None) -> Outcome:
    """One streaming request: TTFT, the gaps between chunks with text, E2E, tokens, finish reason.

    ``disconnect_after=k`` closes the connection after ``k`` chunks with text (a client that goes
    away mid-stream); such an outcome is ``ok`` with ``error='disconnected'``."""
    start = time.perf_counter()
    o = Outcome(False, start=start, input_tokens=input_len or 0)
    last, chunks, parts, usage = None, 0, [], None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                o.error = f"HTTP {r.status_code}: {text[:200]}"
                return o
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    o.error = f"error event: {str(event['error'])[:200]}"
                    return o
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            o.ttft = now - start
                        else:
                            o.itl.append(now - last)
                        last, chunks = now, chunks + 1
                        parts.append(text)
                    if choice.get("finish_reason"):
                        o.finish_reason = choice["finish_reason"]
                if event.get("usage"):
                    usage = event["usage"]
                if disconnect_after is not None and chunks >= disconnect_after:
                    o.ok, o.error, o.latency, o.text = True, "disconnected", time.perf_counter() - start, "".join(parts)
                    return o  # leaving the block closes the connection mid-stream
    except Exception as e:  # connection errors, timeouts, malformed events: counted, the run goes on
        o.error = f"{type(e).__name__}: {e}"[:300]
        o.latency = time.perf_counter() - start
        return o
    o.latency = time.perf_counter() - start
    o.text = "".join(parts)
    if o.finish_reason is None:
        o.error = "the stream ended without a finish_reason"
        return o
    if o.finish_reason in FAILED:
        o.error = f"finish_reason {o.finish_reason}"
        return o
    o.ok = True
    if usage and usage.get("completion_tokens") is not None:
        o.output_tokens = int(usage["completion_tokens"])
    elif tokenizer is not None:
        o.output_tokens = len(tokenizer.encode(o.text, add_special_tokens=False))
    else:
        o.output_tokens = chunks
    if usage and usage.get("prompt_tokens") is not None:
        o.input_tokens = int(usage["prompt_tokens"])
    return o


async def send_plain(client, url: str, body: dict, chat: bool, *, timeout: float = 600.0) -> Outcome:
    """One non-streamed request (the soak's other half): E2E, tokens, finish reason."""
    start = time.perf_counter()
    o = Outcome(False, start=start)
    try:
        r = await client.post(url, json=body, timeout=timeout)
        o.latency = time.perf_counter() - start
        if r.status_code != 200:
            o.error = f"HTTP {r.status_code}: {r.text[:200]}"
            return o
        data = r.json()
        choice = data["choices"][0]
        o.finish_reason = choice.get("finish_reason")
        o.text = (choice.get("message") or {}).get("content") or "" if chat else choice.get("text") or ""
        usage = data.get("usage") or {}
        o.output_tokens = int(usage.get("completion_tokens") or 0)
        o.input_tokens = int(usage.get("prompt_tokens") or 0)
        o.ok = o.finish_reason is not None and o.finish_reason not in FAILED
        if not o.ok:
            o.error = f"finish_reason {o.finish_reason}"
    except Exception as e:
        o.latency = time.perf_counter() - start
        o.error = f"{type(e).__name__}: {e}"[:300]
    return o


async def first_model(client, base_url: str) -> str:
    """The id of the first model ``GET /v1/models`` lists."""
    r = await client.get(f"{base_url}/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def make_client(concurrency: int, api_key: str | None = None, timeout: float = 600.0):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    # trust_env=False: loopback and explicit URLs only, never a proxy from the environment
    return httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout, trust_env=False)


async def run_benchmark(base_url: str, requests: list[ServeRequest], *, backend: str = "openai-chat",
                        model: str | None = None, request_rate: float = float("inf"), burstiness: float = 1.0,
                        max_concurrency: int | None = None, seed: int = 0, sampling: Sampling | None = None,
                        tokenizer=None, api_key: str | None = None, warmup: int = 1, timeout: float = 600.0,
                        progress=None) -> tuple[list[Outcome], float, str]:
    """Every request once: (outcomes in request order, wall seconds from the first send to the last
    end, the model id used). ``warmup`` requests (the first ones, not measured) go first, one at a time."""
    sampling = sampling or Sampling()
    chat = backend == "openai-chat"
    base = base_url.rstrip("/").removesuffix("/v1")
    url = base + BACKENDS[backend]
    n = len(requests)
    limit = max_concurrency or n or 1
    async with make_client(limit, api_key, timeout) as client:
        model = model or await first_model(client, base)
        for req in requests[:warmup]:
            await send(client, url, request_body(req, model, chat, sampling), chat, timeout=timeout,
                       tokenizer=tokenizer)
        times = arrival_times(n, request_rate, burstiness, seed)
        done = [asyncio.Event() for _ in range(n)]
        gate = asyncio.Semaphore(limit)
        outcomes: list[Outcome | None] = [None] * n
        t0 = time.perf_counter()

        async def one(i: int, req: ServeRequest) -> None:
            try:
                delay = t0 + times[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if req.after is not None:
                    await done[req.after].wait()
                async with gate:
                    outcomes[i] = await send(client, url, request_body(req, model, chat, sampling), chat,
                                             timeout=timeout, tokenizer=tokenizer, input_len=req.input_len)
                if progress is not None:
                    progress()
            finally:
                done[i].set()

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        end = max((o.start + o.latency for o in outcomes if o is not None), default=t0)
    return [o or Outcome(False, error="not sent") for o in outcomes], max(end - t0, 1e-9), model
