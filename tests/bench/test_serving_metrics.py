"""``hispec bench serve``'s measurements without a server: percentiles, TPOT / ITL from synthetic
timestamps, goodput under an SLO, seeded Poisson arrivals, the datasets and the streaming client."""
from __future__ import annotations

import asyncio
import json
import math

import pytest

from hispec.bench.serving import datasets as ds
from hispec.bench.serving.metrics import (Outcome, arrival_times, compute_metrics, meets_slo, parse_percentiles,
                                          parse_slo, percentile)


def stream(start: float, chunk_times: list[float], tokens: int, input_tokens: int = 10) -> Outcome:
    """An outcome whose chunks arrived at ``start + t`` for each t (the last one ends the request)."""
    return Outcome(True, start=start, ttft=chunk_times[0], latency=chunk_times[-1],
                   itl=[b - a for a, b in zip(chunk_times, chunk_times[1:])], output_tokens=tokens,
                   input_tokens=input_tokens)


def test_percentile_interpolates_linearly_as_numpy():
    np = pytest.importorskip("numpy")
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 7.5]
    for q in (0.1, 25, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 99) == 0.0 and percentile([3.0], 50) == 3.0


def test_ttft_tpot_itl_e2el_from_timestamps():
    a = stream(0.0, [0.1, 0.2, 0.3, 0.5], tokens=4)  # 4 chunks of one token
    b = stream(0.0, [0.3, 0.7], tokens=5)  # 2 chunks, 5 tokens (a speculative server's multi-token chunk)
    c = Outcome(True, ttft=0.2, latency=0.2, output_tokens=1, input_tokens=3)  # one token: no TPOT, no ITL
    failed = Outcome(False, error="HTTP 500: boom")
    m = compute_metrics([a, b, c, failed], duration=2.0, percentiles=[50, 99])
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 23 and m["total_output_tokens"] == 10
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(5.0) and m["total_token_throughput"] == pytest.approx(16.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT: (0.5 - 0.1) / 3 and (0.7 - 0.3) / 4
    assert m["mean_tpot_ms"] == pytest.approx((400 / 3 + 100) / 2)
    # ITL: per chunk, 0.1, 0.1, 0.2 and 0.4
    assert m["mean_itl_ms"] == pytest.approx(200.0) and m["p50_itl_ms"] == pytest.approx(150.0)
    assert m["p99_itl_ms"] == pytest.approx(200 + 0.97 * 200)  # sorted 100, 100, 200, 400: rank 2.97
    assert m["mean_e2el_ms"] == pytest.approx((500 + 700 + 200) / 3)
    assert m["std_e2el_ms"] == pytest.approx(math.sqrt(((500 - 466.667) ** 2 + (700 - 466.667) ** 2
                                                        + (200 - 466.667) ** 2) / 3), rel=1e-4)
    assert m["request_goodput"] is None  # no SLO


def test_goodput_counts_requests_meeting_every_slo():
    fast = stream(0.0, [0.1, 0.15, 0.2], tokens=3)  # ttft 100 ms, tpot 50 ms
    slow_start = stream(0.0, [0.9, 0.95], tokens=2)  # ttft 900 ms
    slow_tokens = stream(0.0, [0.1, 0.5], tokens=2)  # tpot 400 ms
    one = Outcome(True, ttft=0.3, latency=0.3, output_tokens=1)  # tpot counts as 0
    outcomes = [fast, slow_start, slow_tokens, one, Outcome(False, error="x")]
    slo = parse_slo("ttft:500,tpot:100")
    assert [meets_slo(o, slo) for o in outcomes] == [True, False, False, True, False]
    m = compute_metrics(outcomes, duration=4.0, slo=slo)
    assert m["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics(outcomes, 4.0, slo=parse_slo(["e2el:250"]))["request_goodput"] == pytest.approx(0.25)


def test_slo_and_percentile_parsing():
    assert parse_slo(["ttft:500", "tpot:50"]) == parse_slo("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo(None) == {}
    for bad in ("ttft", "itl:5", "ttft:abc", "tpot:0"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    for bad in ("", "0", "101", "p99"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


def test_poisson_arrivals_are_seeded_with_the_rate_as_mean():
    a = arrival_times(2000, 4.0, seed=7)
    assert a == arrival_times(2000, 4.0, seed=7) and a != arrival_times(2000, 4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.25, rel=0.1)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert cv == pytest.approx(1.0, abs=0.1)  # exponential gaps: std = mean
    bursty = [y - x for x, y in zip(*(lambda t: (t, t[1:]))(arrival_times(2000, 4.0, burstiness=0.25, seed=7)))]
    bmean = sum(bursty) / len(bursty)
    assert bmean == pytest.approx(0.25, rel=0.15)
    assert math.sqrt(sum((g - bmean) ** 2 for g in bursty) / len(bursty)) / bmean > 1.5  # gamma(0.25): cv 2
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0] and arrival_times(0, 1.0) == []
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_prefix_cache_hit_rate_over_a_run():
    from hispec.bench.serving.commands import prefix_cache

    before = {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 20.0}
    after = {"vllm:prefix_cache_queries_total": 300.0, "vllm:prefix_cache_hits_total": 170.0}
    assert prefix_cache(before, after) == {"prefix_cache_queries": 200.0, "prefix_cache_hits": 150.0,
                                           "prefix_cache_hit_rate": 0.75}
    assert prefix_cache({}, {}) == {}  # a server without the counters (llama.cpp; hispec before prefix caching)


def test_server_cpu_cores_over_a_run():
    from hispec.bench.serving.commands import result_lines, server_cpu

    assert server_cpu({"process_cpu_seconds_total": 10.0}, {"process_cpu_seconds_total": 25.0}, 10.0) == \
        {"server_cpu_cores": 1.5}
    assert server_cpu({}, {}, 10.0) == {}  # a server without the counter (llama.cpp)
    m = compute_metrics([], 1.0, [99.0], {}) | {"server_cpu_cores": 1.5}
    lines = result_lines("x", m, [99.0], [], math.inf, 4)
    assert [line.split() for line in lines if line.startswith("Server CPU")] == [["Server", "CPU", "(cores", "busy):", "1.50"]]


def test_server_metrics_have_the_process_series():
    from hispec.server.metrics import Metrics, parse_metrics

    values = parse_metrics(Metrics("m", "ar").render())
    assert values["process_cpu_seconds_total"] > 0
    if __import__("os").path.exists("/proc/self/statm"):
        assert values["process_resident_memory_bytes"] > 1e6


# ---- datasets ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def char_tokenizer(tiny_text_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_text_model_dir))


def test_random_prompts_have_their_lengths(char_tokenizer):
    reqs = ds.random_lengths(char_tokenizer, 6, input_len=40, output_len=8, range_ratio=0.25, seed=3)
    assert len(reqs) == 6 and all(r.ignore_eos for r in reqs)
    assert all(30 <= r.input_len <= 50 and 6 <= r.output_len <= 10 for r in reqs)
    assert all(r.messages == [{"role": "user", "content": r.prompt}] for r in reqs)
    assert [r.prompt for r in reqs] == [r.prompt for r in ds.random_lengths(char_tokenizer, 6, 40, 8, 0.25, seed=3)]
    fixed = ds.random_lengths(char_tokenizer, 3, input_len=20, output_len=5, seed=0)
    assert [(r.input_len, r.output_len) for r in fixed] == [(20, 5)] * 3


def test_synthetic_prefix_shares_system_prompts(char_tokenizer):
    reqs = ds.synthetic_prefix(char_tokenizer, 12, num_prefixes=3, prefix_len=50, output_len=7, seed=1)
    systems = [r.messages[0]["content"] for r in reqs]
    assert len(set(systems)) == 3 and all(systems.count(s) == 4 for s in set(systems))
    assert all(len(char_tokenizer.encode(s, add_special_tokens=False)) == 50 for s in set(systems))
    assert len({r.messages[1]["content"] for r in reqs}) == 12  # the questions differ
    assert all(r.prompt.startswith(r.messages[0]["content"]) and r.output_len == 7 for r in reqs)


def test_spec_bench_first_turns_oversampled(tmp_path):
    f = tmp_path / "question.jsonl"
    f.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"question {i}?", "more"]}) + "\n"
                         for i in range(3)))
    reqs = ds.spec_bench(f, 5, seed=0)
    assert len(reqs) == 5 and {r.prompt for r in reqs} == {"question 0?", "question 1?", "question 2?"}
    assert all(r.output_len == ds.DEFAULT_OUTPUT_LEN["spec-bench"] for r in reqs)
    assert [r.prompt for r in ds.spec_bench(f, 3, 9, shuffle=False)] == ["question 0?", "question 1?", "question 2?"]


def test_sharegpt_turns_follow_their_history(tmp_path, char_tokenizer):
    convs = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"},
                                           {"from": "human", "value": "how are you"}, {"from": "gpt", "value": "fine"},
                                           {"from": "human", "value": "bye"}, {"from": "gpt", "value": "ciao"}]},
             {"id": "b", "conversations": [{"from": "gpt", "value": "no human first"}]},
             {"id": "c", "conversations": [{"from": "human", "value": "x" * 500}, {"from": "gpt", "value": "y"}]},
             {"id": "d", "conversations": [{"from": "human", "value": "one"}, {"from": "gpt", "value": "two!"}]}]
    f = tmp_path / "sharegpt.json"
    f.write_text(json.dumps(convs)[:-40])  # truncated, as the package's file: the cut item is dropped
    reqs = ds.sharegpt(f, 3, tokenizer=char_tokenizer, shuffle=False, max_input_len=200)
    assert [len(r.messages) for r in reqs] == [1, 3, 5]
    assert [r.after for r in reqs] == [None, 0, 1]
    assert reqs[2].messages[:4] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                                    {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine"}]
    assert [r.output_len for r in reqs] == [11, 4, 4]  # the replies' lengths (at least 4)
    assert "User: hi" in reqs[1].prompt and reqs[1].prompt.endswith("Assistant:")
    two_turns = ds.sharegpt(f, 4, 16, tokenizer=char_tokenizer, shuffle=False, max_turns=2, max_input_len=200)
    assert [r.id for r in two_turns] == ["conv0-turn0", "conv0-turn1", "conv0-turn0", "conv0-turn1"]
    assert all(r.output_len == 16 for r in two_turns)
    with pytest.raises(ValueError):
        ds.dataset_name("nope")
    assert ds.dataset_name("prefix_repetition") == "synthetic-prefix" and ds.dataset_name("spec_bench") == "spec-bench"


# ---- the client, against a scripted stream ------------------------------------------------------------------
def test_client_times_chunks_and_takes_usage():
    httpx = pytest.importorskip("httpx")
    from hispec.bench.serving.client import send

    def events(chat: bool):
        def chunk(text, finish=None):
            choice = {"index": 0, "finish_reason": finish}
            choice.update({"delta": {"content": text}} if chat else {"text": text})
            return {"choices": [choice]}

        body = [chunk("a"), chunk(""), chunk("bc"), chunk("d", "length"),
                {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}]
        return "".join(f"data: {json.dumps(e)}\n\n" for e in body) + "data: [DONE]\n\n"

    def handler(request):
        chat = request.url.path.endswith("chat/completions")
        return httpx.Response(200, text=events(chat), headers={"content-type": "text/event-stream"})

    async def go(url, chat, **kw):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send(client, url, {}, chat, **kw)

    for chat in (False, True):
        o = asyncio.run(go("http://x/v1/chat/completions" if chat else "http://x/v1/completions", chat))
        assert o.ok and o.text == "abcd" and o.finish_reason == "length"
        assert o.output_tokens == 5 and o.input_tokens == 7 and len(o.itl) == 2 and o.ttft is not None
    cut = asyncio.run(go("http://x/v1/completions", False, disconnect_after=1))
    assert cut.ok and cut.error == "disconnected" and cut.text == "a"

    def failing(request):
        return httpx.Response(429, json={"error": {"message": "busy"}})

    async def go_fail():
        async with httpx.AsyncClient(transport=httpx.MockTransport(failing)) as client:
            return await send(client, "http://x/v1/completions", {}, False)

    bad = asyncio.run(go_fail())
    assert not bad.ok and bad.error.startswith("HTTP 429")


# ---- the peers' servers: what would run (nothing is started) --------------------------------------------------
def test_peer_servers_argv_and_missing_peers(tmp_path, monkeypatch):
    from hispec.bench.serving import servers

    monkeypatch.setenv("HISPEC_PEERS", str(tmp_path / "none"))  # no peer is installed there
    monkeypatch.setattr(servers.shutil, "which", lambda name: None)  # nor on the PATH
    assert servers.parse_peer_list("vllm, llama.cpp,vllm:bfloat16") == [("vllm", None), ("llama.cpp", None),
                                                                       ("vllm", "bfloat16")]
    for bad in ("sglang", "vllm:int8", "llama.cpp:q4_1"):
        with pytest.raises(ValueError):
            servers.parse_peer_list(bad)
    missing = servers.llama_cpp_spec("default", threads=2, max_batch=16, port=1234)
    assert missing.unavailable and "install-peers.sh llama.cpp-tools" in missing.unavailable
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    spec = servers.llama_cpp_spec("default", threads=2, max_batch=16, port=1234, binary=str(fake))
    if spec.unavailable is None:  # (the default model's GGUF file is installed)
        a = spec.argv
        assert a[0] == str(fake) and a[a.index("-np") + 1] == "16" and a[a.index("-t") + 1] == "2"
        assert a[a.index("--host") + 1] == "127.0.0.1" and a[a.index("--port") + 1] == "1234"
        assert "--cont-batching" in a and a[a.index("-c") + 1] == str(16 * servers.CONTEXT_PER_SEQUENCE)
    vllm = servers.vllm_spec("default", threads=2, max_batch=16, port=1, python=str(tmp_path / "nope" / "python"))
    assert vllm.unavailable and "does not exist" in vllm.unavailable
    own = servers.hispec_spec("default", threads=1, max_batch=4, port=99, extra=["--strategy", "ar"])
    assert own.argv[-2:] == ["--strategy", "ar"] and own.argv[own.argv.index("--host") + 1] == "127.0.0.1"


def test_mixed_load_lengths_and_temperatures():
    from hispec.bench.serving.client import Sampling, request_body

    reqs = ds.mixed(400, seed=5)
    assert [r.prompt for r in reqs] == [r.prompt for r in ds.mixed(400, seed=5)]
    words = [len(r.prompt.split()) for r in reqs]
    assert min(words) <= 12 and max(words) >= 200 and max(words) <= 400 + 20
    assert {r.output_len for r in reqs} <= set(range(1, 97)) and max(r.output_len for r in reqs) > 80
    temps = [r.temperature for r in reqs]
    assert all(0 <= t <= 1 for t in temps) and 0.15 < temps.count(0.0) / len(temps) < 0.4
    body = request_body(reqs[0], "m", chat=True, sampling=Sampling(temperature=0.5))
    assert body["temperature"] == reqs[0].temperature and body["messages"][0]["content"] == reqs[0].prompt
    assert "seed" not in body
