"""The OpenAI API surface evaluators and frameworks use, against a real ``hispec serve``
(hispec strategy, tiny model, loopback): logprobs and echo (the requests lm-evaluation-harness
sends), prompt lists, ``n`` and ``best_of``, penalties and ``logit_bias``.

Log-probabilities are checked against a plain full forward pass of the same weights.
"""
from __future__ import annotations

import json
import math
import os

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402

from hispec.model.load.checkpoint import load_model  # noqa: E402
from hispec.server.metrics import parse_metrics  # noqa: E402

from tests.sampling.test_logprobs_penalties import full_logits  # noqa: E402
from tests.server.test_server import MODEL, ServerProcess, make_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return make_model_dir(tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """The tests' settings (conftest's ``_free_rounds_ungated``) given to the server's own process: the
    module's server starts before that function-scoped fixture sets them, and with the free-round
    gate on, whether it drafts at all depends on the machine's timing (the metrics test saw 0 drafts)."""
    log = tmp_path_factory.mktemp("api-server") / "server.log"
    env = {**os.environ, "HISPEC_FREE_ROUND_GATE": "0", "HISPEC_POLICY_MEMORY": "0"}
    proc = ServerProcess(["--model", str(model_dir), "--threads", "1", "--max-batch-size", "8", "--kv-blocks", "256"],
                         log, env=env)
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, trust_env=False, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    http = httpx.Client(trust_env=False, timeout=120)
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, http_client=http)
    http.close()


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


def post(http, path: str, body: dict) -> dict:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def ids_of(text: str) -> list[int]:
    """The character tokenizer of the test model: printable ASCII from id 3."""
    return [ord(ch) - 32 + 3 for ch in text]


# ---- logprobs and echo -----------------------------------------------------------------------------------
def test_lm_eval_loglikelihood_requests(http, model):
    """The exact request lm-eval's ``local-completions`` sends for log-likelihoods (a batch of
    token-id prompts, echo, logprobs=1, max_tokens=1), read back as lm-eval reads it."""
    context, continuations = ids_of("The sky is"), [ids_of(" blue"), ids_of(" green")]
    prompts = [context + c for c in continuations]
    out = post(http, "/v1/completions", {"prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
                                         "seed": 1234, "echo": True})
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for prompt, cont, choice in zip(prompts, continuations, choices):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        ctxlen = len(context)
        got = sum(lp["token_logprobs"][ctxlen:-1])  # lm-eval's parse_logprobs
        is_greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][ctxlen:-1],
                                                                 lp["top_logprobs"][ctxlen:-1]))
        ref = torch.log_softmax(full_logits(model, prompt)[:-1].double(), -1)
        targets = torch.tensor(prompt[1:])
        want = ref.gather(1, targets[:, None]).squeeze(1)
        assert math.isclose(got, float(want[ctxlen - 1:].sum()), abs_tol=1e-3)
        assert is_greedy == bool((ref[ctxlen - 1:].argmax(-1) == targets[ctxlen - 1:]).all())
        assert choice["text"].startswith("The sky is")
        assert "".join(lp["tokens"][:len(prompt)]) == "The sky is" + ("".join(chr(t - 3 + 32) for t in cont))


def test_completion_logprobs_match_a_plain_forward(client, model):
    prompt = ids_of("Hello there")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    out_ids = ids_of("".join(lp.tokens))
    assert "".join(lp.tokens) == r.choices[0].text and len(out_ids) == 12
    ref = torch.log_softmax(full_logits(model, prompt + out_ids)[len(prompt) - 1:-1].double(), -1)
    for j, (t, v, top) in enumerate(zip(out_ids, lp.token_logprobs, lp.top_logprobs)):
        assert math.isclose(v, float(ref[j, t]), abs_tol=1e-4)
        assert 1 <= len(top) <= 3 and max(top.values()) == v  # greedy: the chosen token is the best one
    assert lp.text_offset == list(range(12))


def test_max_tokens_zero_with_echo_scores_the_prompt(http):
    out = post(http, "/v1/completions", {"prompt": "abc d", "max_tokens": 0, "echo": True, "logprobs": 0})
    choice = out["choices"][0]
    assert choice["text"] == "abc d" and len(choice["logprobs"]["tokens"]) == 5


def test_chat_logprobs(client):
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob
        assert bytes(c.bytes).decode() == c.token
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for ch in chunks for c in ((ch.choices[0].logprobs.content or []) if ch.choices and
                                               ch.choices[0].logprobs else [])]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


# ---- several prompts, n, best_of ---------------------------------------------------------------------------
def test_prompt_lists_and_n_equal_separate_requests(http):
    prompts = ["Hello", "Once upon"]
    for temperature, seed in ((0, None), (1.0, 5)):
        common = {"max_tokens": 10, "temperature": temperature, "seed": seed, "ignore_eos": True}
        batch = post(http, "/v1/completions", {"prompt": prompts, "n": 2, **common})
        texts = {c["index"]: c["text"] for c in batch["choices"]}
        assert sorted(texts) == [0, 1, 2, 3]
        for i, p in enumerate(prompts):
            for j in range(2):
                one = post(http, "/v1/completions", {"prompt": p, **common, "seed": None if seed is None else seed + j})
                assert texts[i * 2 + j] == one["choices"][0]["text"], (temperature, i, j)
        assert batch["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
        assert batch["usage"]["completion_tokens"] == 40
        if seed is not None:  # reproducible, and the two samples differ
            assert post(http, "/v1/completions", {"prompt": prompts, "n": 2, **common})["choices"] == batch["choices"]
            assert texts[0] != texts[1]


def test_n_streams_every_choice(client):
    kw = dict(model=MODEL, prompt=["Hello", "Once upon"], max_tokens=10, temperature=0.8, seed=3, n=2)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    texts: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in full.choices}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0.8, seed=3, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]


def test_best_of_returns_the_most_likely_samples(http):
    common = {"prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    best = post(http, "/v1/completions", {**common, "seed": 11, "best_of": 3, "n": 1, "logprobs": 0})["choices"]
    samples = [post(http, "/v1/completions", {**common, "seed": 11 + j, "logprobs": 0})["choices"][0]
               for j in range(3)]
    top = max(samples, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    assert len(best) == 1 and best[0]["text"] == top["text"] and best[0]["index"] == 0


# ---- penalties and logit_bias --------------------------------------------------------------------------------
def test_logit_bias_and_penalties(http):
    forced = post(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 6, "temperature": 0,
                                            "logit_bias": {str(ids_of("z")[0]): 100}, "ignore_eos": True})
    assert forced["choices"][0]["text"] == "zzzzzz"
    plain = post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24,
                                               "temperature": 0, "ignore_eos": True})
    penalised = post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                    "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                                    "frequency_penalty": 2.0, "presence_penalty": 2.0})
    text = penalised["choices"][0]["message"]["content"]
    assert text != plain["choices"][0]["message"]["content"]
    assert len(set(text)) > len(set(plain["choices"][0]["message"]["content"]))


# ---- metrics under vLLM's names --------------------------------------------------------------------------------
def test_vllm_metrics_parse_with_prometheus_client(server, http):
    parser = pytest.importorskip("prometheus_client.parser")
    post(http, "/v1/completions", {"prompt": "Hello there", "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics", trust_env=False, timeout=30).text
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                 "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos",
                 "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert name in families, name
        assert all(s.labels.get("model_name") == MODEL for s in families[name].samples), name

    def value(family: str, sample: str, **labels) -> float:
        return next(s.value for s in families[family].samples if s.name == sample
                    and all(s.labels.get(k) == v for k, v in labels.items()))

    assert families["vllm:prompt_tokens"].type == "counter"
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") >= 16
    assert value("vllm:request_success", "vllm:request_success_total", finished_reason="length") >= 1
    finished = value("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count")
    assert value("vllm:request_generation_tokens", "vllm:request_generation_tokens_count") == finished
    assert value("vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count") == finished
    drafted = value("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total")
    accepted = value("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [s.value for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples]
    assert drafted > 0 and 0 <= accepted <= drafted and sum(per_pos) == accepted
    assert 0.0 <= value("vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") <= 1.0


# ---- structured output -------------------------------------------------------------------------------------
def test_response_format_json_schema(client):
    pytest.importorskip("llguidance")
    from tests.sampling.test_structured_output import SCHEMA, valid

    msgs = [{"role": "user", "content": "A JSON object please"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    for temperature in (0, 1.0):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=temperature,
                                           seed=1, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        assert valid(json.loads(r.choices[0].message.content))
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # a random model may not close its object within the budget
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}})
    assert e.value.body["param"] == "response_format"


# ---- tools ------------------------------------------------------------------------------------------------
def test_tool_call_round_trip_with_the_openai_client(client):
    """A forced call parses and validates; the result goes back in the history and the model answers;
    the stream delivers the same call as ``delta.tool_calls``; a bad tool is an OpenAI-shaped 400."""
    pytest.importorskip("llguidance")
    from tests.server.test_server_tools import TOOLS, valid_call

    msgs = [{"role": "user", "content": "Weather in Rome?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice,
                                           max_tokens=120, temperature=0)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id and valid_call(call.model_dump())
    stream = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice,
                                            max_tokens=120, temperature=0, stream=True)
    chunks = list(stream)
    streamed = [t for ch in chunks for t in (ch.choices[0].delta.tool_calls or [])]
    assert [t.function.model_dump() for t in streamed] == [call.function.model_dump()]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    history = msgs + [c.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5,
                                       tools=[{"type": "function", "function": {"name": "bad name"}}])
    assert e.value.body["param"] == "tools[0].function.name"


# ---- prefix caching ----------------------------------------------------------------------------------------
def test_a_repeated_prompt_prefix_is_served_from_the_prefix_cache(http):
    """The second request with the same long start takes its cached blocks (``usage.prompt_tokens_details
    .cached_tokens``, vLLM's counters in /metrics) and answers with the same tokens; another
    ``cache_salt`` shares nothing."""
    def hits() -> float:
        return parse_metrics(http.get("/metrics").text)['vllm:prefix_cache_hits_total{model_name="%s"}' % MODEL]

    system = ids_of("You are a careful assistant who answers in one short line. " * 3)
    body = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    before = hits()
    first = post(http, "/v1/completions", {"prompt": system + ids_of("Q: one?"), **body})
    second = post(http, "/v1/completions", {"prompt": system + ids_of("Q: one?"), **body})
    other = post(http, "/v1/completions", {"prompt": system + ids_of("Q: one?"), "cache_salt": "tenant-2", **body})
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == other["choices"][0]["text"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(system) - 16 and cached % 16 == 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert hits() - before >= cached


def test_per_key_prefix_cache_scopes():
    from hispec.server.state import ServerState

    state = ServerState(None, None, (MODEL,), 64, 10, "ar", api_key="k", prefix_cache_per_key=True)
    assert state.cache_scope(None, None) == ""
    assert state.cache_scope("Bearer a", None) != state.cache_scope("Bearer b", None)
    assert state.cache_scope("Bearer a", None) == state.cache_scope("bearer  a", None)
    assert state.cache_scope("Bearer a", "s") != state.cache_scope("Bearer a", None)
    shared = ServerState(None, None, (MODEL,), 64, 10, "ar", api_key="k")
    assert shared.cache_scope("Bearer a", None) == shared.cache_scope("Bearer b", None) == ""
