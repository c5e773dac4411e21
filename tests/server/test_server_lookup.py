"""``hispec serve --strategy lookup`` (tiny model, loopback): concurrent requests share the engine's
passes (continuous batching) and each one's sampling parameters work on lookup rows as on plain
rows: a greedy completion under penalties and ``logit_bias`` with logprobs, and a JSON-schema
completion, give in-process ``ar``'s tokens and log-probabilities. The prompts repeat themselves
and the responses' ``hispec_stats`` show lookup rounds, so the tests can fail."""
from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

for _mod in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402

from hispec.config import SamplingParams  # noqa: E402
from hispec.generate import Generator  # noqa: E402

from tests.server.test_server import MODEL, ServerProcess  # noqa: E402
from tests.server.test_server_api import ids_of, model_dir  # noqa: E402,F401 (a fixture)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("lookup-server") / "server.log"
    proc = ServerProcess(["--model", str(model_dir), "--threads", "1", "--max-batch-size", "4", "--kv-blocks", "256",
                          "--no-exits", "--strategy", "lookup", "--no-adaptive"], log)
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="module")
def reference(model_dir) -> Generator:
    return Generator.from_pretrained(str(model_dir), progress=False)


def ar_output(gen: Generator, prompt: list[int], params: SamplingParams) -> tuple[str, list]:
    """In-process ``ar``: the completion's text and its per-token log-probabilities."""
    from hispec.decode.autoregressive import Autoregressive
    from hispec.engine import Engine

    engine = Engine(gen.model, Autoregressive(), tokenizer=gen.tokenizer, eos_ids=gen.eos_ids, kv_blocks=64)
    rid = engine.add_request(prompt, params)
    text, logprobs = "", []
    while engine.has_unfinished():
        for out in engine.step():
            text += out.text_delta
            logprobs += out.new_logprobs or []
    assert rid
    return text, logprobs


def complete(url: str, body: dict) -> dict:
    with httpx.Client(base_url=url, trust_env=False, timeout=300) as http:
        r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_requests_with_penalties_logprobs_and_a_schema_equal_ar(server, reference):
    pytest.importorskip("llguidance")
    from hispec.sampling.grammar import Grammar, llguidance_tokenizer
    from tests.sampling.test_structured_output import EXAMPLE, SCHEMA, valid

    prompt = ids_of("the cat sat on the mat; the cat sat on the mat; the cat")
    penalised = dict(presence_penalty=-1.0, frequency_penalty=0.2, logit_bias={str(ids_of("t")[0]): 1.5})
    bodies = [dict(prompt=prompt, max_tokens=24, temperature=0, logprobs=2, ignore_eos=True, **penalised),
              dict(prompt=prompt, max_tokens=24, temperature=0, logprobs=2, ignore_eos=True),
              dict(prompt=ids_of(EXAMPLE), max_tokens=60, temperature=0,
                   response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})]
    with ThreadPoolExecutor(len(bodies)) as pool:  # together: they share the engine's passes
        outs = list(pool.map(lambda b: complete(server.url, b), bodies))

    grammar = Grammar.json_schema(SCHEMA, llguidance_tokenizer(reference.tokenizer, reference.model.cfg.vocab_size))
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2, presence_penalty=-1.0,
                             frequency_penalty=0.2, logit_bias=((ids_of("t")[0], 1.5),)),
              SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(max_new_tokens=60, grammar=grammar)]
    rounds = 0
    for body, out, p in zip(bodies, outs, params):
        text, logprobs = ar_output(reference, body["prompt"], p)
        choice = out["choices"][0]
        assert choice["text"] == text, (body, choice["text"], text)
        rounds += out["hispec_stats"]["rounds"].get("lookup", 0)
        if p.logprobs is not None:
            got = choice["logprobs"]["token_logprobs"]
            assert len(got) == len(logprobs) == p.max_new_tokens
            assert all(math.isclose(a, b.logprob, abs_tol=1e-4) for a, b in zip(got, logprobs))
    assert valid(json.loads(outs[2]["choices"][0]["text"]))
    assert outs[0]["choices"][0]["text"] != outs[1]["choices"][0]["text"]  # the penalties changed the output
    assert rounds > 0
