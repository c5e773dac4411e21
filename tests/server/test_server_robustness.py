"""``hispec serve`` under hostile input and long prompts: no 5xx from any body, one request
cannot hurt another, the queue limit counts only requests that wait for a batch slot, the
event loop and the gauges stay live while a huge prompt is tokenized or a long one prefilled.

One tiny-model server (batch 8, queue 2, prefill chunks of 32 tokens) on a free loopback port
serves the HTTP tests; the gauge test drives the engine bridge in-process.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

for _mod in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402

from hispec.config import SamplingParams  # noqa: E402
from hispec.server.metrics import parse_metrics  # noqa: E402

from tests.server.test_server import MODEL, ServerProcess, make_model_dir, one_thread  # noqa: E402

C, CH = "/v1/completions", "/v1/chat/completions"
BATCH, QUEUE = 8, 2


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return make_model_dir(tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("robust-logs") / "server.log"
    srv = ServerProcess(["--model", str(model_dir), "--threads", "1", "--max-batch-size", str(BATCH),
                         "--max-queue", str(QUEUE), "--kv-blocks", "600", "--prefill-chunk", "32"], log)
    yield srv.wait_ready()
    srv.stop()


@pytest.fixture(scope="module")
def greedy_text(model_dir):
    """The library's greedy ``ar`` text of a completion prompt (one request at a time)."""
    from hispec.generate import Generator

    gen = Generator.from_pretrained(str(model_dir), progress=False)

    def ref(prompt: str, max_tokens: int) -> str:
        with one_thread():
            return gen.generate(prompt, SamplingParams(max_new_tokens=max_tokens), "ar", chat=False).text

    return ref


def post(server, path: str, body, timeout: float = 60.0, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = kw.pop("headers", {"Content-Type": "application/json"})
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=timeout, trust_env=False)


def assert_openai_error(r: httpx.Response, status: int | None = None) -> dict:
    if status is not None:
        assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def metrics(server) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{server.url}/metrics", timeout=30, trust_env=False).text)


def wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m["hispec_requests_running"] == 0 and m["hispec_requests_waiting"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# ---- 1: one request's sampling parameters cannot fail another ------------------------------------------------
def test_extreme_sampling_values_beside_greedy_requests(server, greedy_text):
    """Legal but extreme temperature / top_p in the same batch as greedy requests: every request
    succeeds, the greedy ones with their normal output, the extreme ones behave as greedy."""
    prompts = ["Hello there", "The quick brown fox", "def add(a, b):", "Once upon a time"]
    extreme = [{"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1.0, "top_p": 1e-46},
               {"temperature": 2.0, "top_p": 5e-324, "seed": 3}]
    jobs = [(p, {"temperature": 0}) for p in prompts] + [(prompts[0], x) for x in extreme]

    def one(job):
        prompt, params = job
        for _ in range(50):  # the queue holds QUEUE: arrivals faster than the batch admits them are told to retry
            r = post(server, C, {"model": MODEL, "prompt": prompt, "max_tokens": 24, **params})
            if r.status_code != 429:
                return r
            time.sleep(0.1)
        return r

    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(pool.map(one, jobs))
    for (prompt, _), r in zip(jobs, responses):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy_text(prompt, 24)


# ---- 2: no 5xx from any body ----------------------------------------------------------------------------------
SURROGATES = [
    (C, b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 4}', "prompt"),
    (C, b'{"model": "tiny", "prompt": ["\\udfff"], "max_tokens": 4}', "prompt[0]"),
    (CH, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    (CH, b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "x\\udc00"}]}]}',
     "messages[0].content[0].text"),
    (C, b'{"model": "\\ud800", "prompt": "hi"}', "model"),
    (CH, b'{"model": "tiny\\udbff", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    (C, b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}', "stop[0]"),
]


@pytest.mark.parametrize("path,body,param", SURROGATES, ids=[s[2] for s in SURROGATES])
def test_lone_surrogates_are_a_400(server, path, body, param):
    err = assert_openai_error(post(server, path, body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == "invalid_unicode"


def test_a_surrogate_pair_is_text(server):
    r = post(server, C, b'{"model": "tiny", "prompt": "\\ud83d\\ude00 hi", "max_tokens": 2}')
    assert r.status_code == 200, r.text  # an emoji: outside the char tokenizer's vocabulary, still text


# ---- 3: the queue limit counts only requests that wait for a batch slot ---------------------------------------
def test_queue_counts_only_requests_waiting_for_a_slot(server):
    """Batch 8, queue 2, idle: 8 simultaneous requests all run, 2 more wait, the 11th gets a 429
    with Retry-After."""
    assert wait_idle(server)["hispec_requests_running"] == 0
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1900, "ignore_eos": True, "temperature": 0,
                       "stream": True}).encode()
    clients = [httpx.Client(trust_env=False, timeout=60) for _ in range(BATCH + QUEUE + 1)]
    barrier = threading.Barrier(BATCH)

    def open_stream(c: httpx.Client, wait: bool) -> httpx.Response:
        request = c.build_request("POST", f"{server.url}{C}", content=body,
                                  headers={"Content-Type": "application/json"})
        if wait:
            barrier.wait(10)
        return c.send(request, stream=True)

    try:
        with ThreadPoolExecutor(BATCH) as pool:
            first = list(pool.map(lambda c: open_stream(c, True), clients[:BATCH]))
        assert [r.status_code for r in first] == [200] * BATCH
        more = [open_stream(c, False) for c in clients[BATCH:BATCH + QUEUE]]
        assert [r.status_code for r in more] == [200] * QUEUE
        full = open_stream(clients[-1], False)
        full.read()
        err = assert_openai_error(full, 429)
        assert err["code"] == "queue_full" and full.headers["Retry-After"] == "1"
        m = metrics(server)
        assert m["hispec_requests_running"] == BATCH and m["hispec_requests_waiting"] == QUEUE, m
    finally:
        for c in clients:
            c.close()  # disconnects: the server aborts them all
    m = wait_idle(server)
    assert m["hispec_requests_running"] == 0 and m["hispec_kv_blocks_in_use"] == 0, m


# ---- 4: chunked prefill ------------------------------------------------------------------------------------------
def test_a_long_prompt_arriving_while_streams_run(server, greedy_text):
    """A 1,500-token prompt (47 chunks of 32) arrives while three greedy streams run: the streams
    go on producing text while it is prefilled, and every output equals its one-request output."""
    long_prompt = "".join(chr(33 + (7 * i) % 90) for i in range(1500))
    short = ["Hello there", "The quick brown fox", "Once upon a time"]
    events: dict[int, list[float]] = {i: [] for i in range(len(short))}
    texts: dict[int, str] = {}

    def stream(i: int) -> None:
        body = {"model": MODEL, "prompt": short[i], "max_tokens": 400, "temperature": 0, "stream": True}
        parts = []
        with httpx.Client(trust_env=False, timeout=120) as c, c.stream("POST", f"{server.url}{C}", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text = json.loads(line[6:])["choices"][0]["text"]
                    if text:
                        events[i].append(time.perf_counter())
                    parts.append(text)
        texts[i] = "".join(parts)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(short))]
    for t in threads:
        t.start()
    while not all(events.values()):
        time.sleep(0.01)
    sent = time.perf_counter()
    r = post(server, C, {"model": MODEL, "prompt": long_prompt, "max_tokens": 8, "temperature": 0}, timeout=120)
    done = time.perf_counter()
    for t in threads:
        t.join()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy_text(long_prompt, 8)
    for i, prompt in enumerate(short):
        assert texts[i] == greedy_text(prompt, 400)
    during = [sum(sent < e < done for e in events[i]) for i in events]
    assert min(during) >= 2, during  # text arrived while the long prompt was being prefilled


# ---- 5: the event loop stays live while a huge prompt is tokenized ---------------------------------------------
def test_health_answers_while_huge_prompts_are_tokenized(server):
    huge = "ab " * 3_500_000  # ~10 MB
    bodies = [(C, {"model": MODEL, "prompt": huge, "max_tokens": 4}),
              (CH, {"model": MODEL, "messages": [{"role": "user", "content": huge}], "max_tokens": 4})]
    results: list[httpx.Response] = []

    def send(job):
        results.append(post(server, *job, timeout=120))

    threads = [threading.Thread(target=send, args=(job,)) for job in bodies]
    for t in threads:
        t.start()
    worst = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.perf_counter()
        assert httpx.get(f"{server.url}/health", timeout=30, trust_env=False).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.02)
    for t in threads:
        t.join()
    for r in results:
        assert assert_openai_error(r, 400)["code"] == "context_length_exceeded"
    assert worst < 1.5, f"/health took {worst:.2f} s while huge prompts were processed"


# ---- 6: the gauges are right in the middle of a long step -------------------------------------------------------
def test_gauges_during_a_long_prefill(tiny_model_dir):
    from hispec.engine import Engine
    from hispec.generate import make_strategy
    from hispec.model.load.checkpoint import load_model
    from hispec.server.async_engine import AsyncEngine

    engine = Engine(load_model(tiny_model_dir("llama")), make_strategy("ar"), kv_blocks=64, block_size=4)
    bridge = AsyncEngine(engine)
    inside, release = threading.Event(), threading.Event()
    prefill = engine._prefill

    def slow_prefill(*args, **kwargs):  # a prefill that lasts until the test has scraped
        inside.set()
        release.wait(30)
        return prefill(*args, **kwargs)

    engine._prefill = slow_prefill

    async def run():
        bridge.start()
        stream = bridge.submit(list(range(3, 60)), SamplingParams(max_new_tokens=3))
        assert await asyncio.to_thread(inside.wait, 30)
        during = parse_metrics(bridge.metrics.render())
        release.set()
        while not (await stream.get()).finished:
            pass
        after = parse_metrics(bridge.metrics.render())
        await asyncio.to_thread(bridge.stop)
        return during, after

    during, after = asyncio.run(run())
    assert during["hispec_requests_running"] == 1 and during["hispec_requests_waiting"] == 0, during
    assert during["hispec_kv_blocks_in_use"] >= 57 // 4, during
    assert after["hispec_requests_running"] == 0 and after["hispec_kv_blocks_in_use"] == 0, after


# ---- a bounded fuzzer over every request field -------------------------------------------------------------------
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "seed", "stop", "stream", "stream_options", "ignore_eos", "presence_penalty", "frequency_penalty",
          "logit_bias", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "user", "tools", "tool_choice",
          "functions", "response_format", "unknown_field"]


def hostile_values(rng: random.Random) -> list:
    deep = []
    for _ in range(60):
        deep = [deep]
    return [None, True, False, 0, 1, -1, 2, 7, 0.5, -0.5, 1e-40, 5e-324, 1e308, -1e308, 10 ** 30, -(10 ** 30),
            2 ** 63, 2 ** 64, math.nan, math.inf, -math.inf, "", "x", "5", "tiny", "\ud800", "\udfff\ud800",
            "z" * 20_000, "\x00\x7f\u2028", [], [1, 2], [-5], [10 ** 12], ["a"], ["a", "b"], [None], [[1, 2]],
            {}, {"a": 1}, {"type": "text"}, {"type": "json_object"}, {"include_usage": "yes"},
            [{"role": "user", "content": "hi"}], [{"role": "user"}], [{"role": "user", "content": [{"type": "x"}]}],
            [{"role": "tool", "content": 5}], {"role": "user", "content": "hi"}, deep,
            [rng.randrange(-3, 200) for _ in range(rng.randrange(1, 50))]]


def fuzz_body(rng: random.Random) -> tuple[str, bytes, str]:
    values = hostile_values(rng)
    chat = rng.random() < 0.5
    body: object = {"model": MODEL, "max_tokens": 4}
    body["messages" if chat else "prompt"] = [{"role": "user", "content": "hi"}] if chat else "hi"
    for name in rng.sample(FIELDS, rng.randint(1, 4)):
        value = rng.choice(values)
        if name in ("max_tokens", "max_completion_tokens") and (value is None or (isinstance(value, int) and
                                                                               value > 8)):
            value = rng.choice([-1, 0, 10 ** 30, "4", 2.5, math.nan])  # bounded: never a long generation
        if rng.random() < 0.1:
            body.pop(name, None)
        else:
            body[name] = value
    if rng.random() < 0.05:
        body = rng.choice(values)
    raw = json.dumps(body, ensure_ascii=rng.random() < 0.5, allow_nan=True).encode("utf-8", "surrogatepass")
    r = rng.random()
    if r < 0.1 and raw:
        cut = rng.randrange(len(raw))
        raw = raw[:cut] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"]) + raw[cut:]
    elif r < 0.15:
        raw = raw[:rng.randrange(len(raw) + 1)]
    content_type = rng.choice(["application/json"] * 4 + ["text/plain", "application/x-www-form-urlencoded", ""])
    return (CH if chat else C), raw, content_type


def test_fuzzed_bodies_never_get_a_5xx(server):
    rng = random.Random(13)
    jobs = [fuzz_body(rng) for _ in range(200)]

    def send(job) -> tuple[int, str]:
        path, raw, content_type = job
        headers = {"Content-Type": content_type} if content_type else {}
        with httpx.Client(trust_env=False, timeout=60) as c:
            r = c.post(f"{server.url}{path}", content=raw, headers=headers)
        return r.status_code, r.text

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, jobs))
    failures = [(job, status, text[:300]) for job, (status, text) in zip(jobs, answers)
                if status >= 500 or "server_error" in text]
    assert not failures, failures[:3]
    assert {s for s, _ in answers} >= {200, 400}
    for status, text in answers:
        if status != 200:
            assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/health", trust_env=False).status_code == 200
    m = wait_idle(server)
    assert m["hispec_kv_blocks_in_use"] == 0, m
