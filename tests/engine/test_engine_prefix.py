"""Prefix caching in the engine: a request that takes cached prompt blocks gets exactly the tokens
it gets without them (every strategy, greedy and seeded sampling, batched, under a pool small
enough to preempt and evict), and scopes, prompt log-probabilities and aborts behave."""
from __future__ import annotations

import dataclasses
import random

import pytest

from hispec.config import SamplingParams, SpecConfig
from hispec.engine import Engine
from hispec.generate import make_strategy

from tests.engine.test_engine import STRATEGIES as ALL_STRATEGIES
from tests.engine.test_engine import model  # noqa: F401 (the fixture: a tiny llama whose exits agree often)

STRATEGIES = {name: ALL_STRATEGIES[name] for name in ("ar", "selfspec", "hispec", "lookup")}


@pytest.fixture(scope="module")
def prompts():
    """Requests that share system prompts (some exactly a block long, some ending inside one)."""
    rng = random.Random(5)
    systems = [[rng.randrange(128) for _ in range(n)] for n in (8, 13, 30)]
    out = [rng.choice(systems) + [rng.randrange(128) for _ in range(rng.randint(0, 9))] for _ in range(14)]
    return out + [systems[0][:5], systems[2] + systems[2]]


def run(model, name, prompts, *, prefix_caching, batch_size=1, kv_blocks=200, params=None, adaptive=False):
    engine = Engine(model, make_strategy(name, STRATEGIES[name], model.num_layers), block_size=4,
                    kv_blocks=kv_blocks, max_batch_size=batch_size, adaptive=adaptive, prefix_caching=prefix_caching)
    params = params or [SamplingParams(max_new_tokens=12, ignore_eos=True)] * len(prompts)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    final = engine.run_to_completion()
    engine.blocks.check_invariants()
    assert engine.blocks.num_used_blocks == 0  # cached blocks are evictable, none held
    return engine, [final[i].token_ids for i in ids], [final[i].num_cached_tokens for i in ids]


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("batch_size, kv_blocks", [(1, 200), (5, 200), (5, 40)])
def test_cached_prefixes_change_no_token(model, prompts, name, batch_size, kv_blocks):
    _, expected, _ = run(model, name, prompts, prefix_caching=False, batch_size=batch_size, kv_blocks=kv_blocks)
    engine, got, cached = run(model, name, prompts, prefix_caching=True, batch_size=batch_size, kv_blocks=kv_blocks)
    assert got == expected
    assert sum(cached) > 0 and engine.blocks.prefix.hits == sum(cached) or kv_blocks < 200
    if kv_blocks < 200:
        assert engine.scheduler.num_preemptions > 0 or engine.blocks.num_cached_blocks < 40


@pytest.mark.parametrize("name", ["ar", "hispec"])
def test_seeded_sampled_requests_with_cached_prefixes_keep_their_tokens(model, prompts, name):
    params = [SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    _, expected, _ = run(model, name, prompts, prefix_caching=False, batch_size=3, params=params)
    _, got, cached = run(model, name, prompts, prefix_caching=True, batch_size=3, params=params)
    assert got == expected and sum(cached) > 0


def test_adaptive_engine_with_cached_prefixes_equals_ar(model, prompts):
    _, expected, _ = run(model, "ar", prompts, prefix_caching=False)
    _, got, cached = run(model, "hispec", prompts, prefix_caching=True, batch_size=4, adaptive=True)
    assert got == expected and sum(cached) > 0


def test_scopes_never_share_blocks(model, prompts):
    engine = Engine(model, make_strategy("ar", None, model.num_layers), block_size=4, kv_blocks=100)
    params = SamplingParams(max_new_tokens=2)
    first = engine.add_request(prompts[0], params, cache_scope="key-a")
    engine.run_to_completion()
    other = engine.add_request(prompts[0], params, cache_scope="key-b")
    same = engine.add_request(prompts[0], params, cache_scope="key-a")
    final = engine.run_to_completion()
    assert final[other].num_cached_tokens == 0
    assert final[same].num_cached_tokens == (len(prompts[0]) - 1) // 4 * 4 > 0
    assert first not in final


def test_prompt_logprobs_requests_prefill_their_whole_prompt(model, prompts):
    engine = Engine(model, make_strategy("ar", None, model.num_layers), block_size=4, kv_blocks=100)
    engine.add_request(prompts[0], SamplingParams(max_new_tokens=2))
    engine.run_to_completion()
    asked = dataclasses.replace(SamplingParams(max_new_tokens=2), prompt_logprobs=1)
    rid = engine.add_request(prompts[0], asked)
    out = engine.run_to_completion()[rid]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompts[0])


def test_an_aborted_request_releases_its_shared_blocks(model, prompts):
    engine = Engine(model, make_strategy("ar", None, model.num_layers), block_size=4, kv_blocks=100)
    engine.add_request(prompts[15], SamplingParams(max_new_tokens=1))
    engine.run_to_completion()
    rid = engine.add_request(prompts[15], SamplingParams(max_new_tokens=50))
    engine.step()
    assert engine.sequence(rid).num_cached_tokens > 0 and engine.blocks.num_used_blocks > 0
    assert engine.abort(rid)
    engine.blocks.check_invariants()
    assert engine.blocks.num_used_blocks == 0
