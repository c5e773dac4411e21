"""One engine config, one sizing rule, and the scheduler as the only allocator: it reserves
each step's slots from the strategy's declared look-ahead; the runner never allocates."""
from __future__ import annotations

import pytest

from hispec.cache.block_manager import BlockManager
from hispec.config import ConfigError, EngineConfig, SamplingParams, SpecConfig
from hispec.engine import Engine
from hispec.generate import Generator, make_strategy
from hispec.model.load.checkpoint import load_model

SPECS = {"selfspec": SpecConfig(2, 6, num_draft=3), "hispec": SpecConfig(1, 3, num_draft=2, window=3),
         "hispec-heuristic": SpecConfig(1, 4, draft_policy="heuristic", max_draft=6)}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir("llama"))


def test_each_strategy_declares_its_lookahead():
    ar = make_strategy("ar")
    assert ar.lookahead == ar.run_steps + 1  # a round of run_steps tokens (1: the pending token, one spare)
    for name, spec in SPECS.items():
        s = make_strategy(name.split("-")[0], spec, 6)
        assert s.lookahead == spec.lookahead == spec.window + max(spec.num_draft, spec.max_draft
                                                                  if spec.draft_policy == "heuristic" else 0) + 3


@pytest.mark.parametrize("name", ["ar", *SPECS])
def test_only_the_scheduler_allocates(model, name, monkeypatch):
    """Blocks are handed out only while scheduling; each step writes inside its reservation."""
    spec = SPECS.get(name)
    engine = Engine(model, make_strategy(name.split("-")[0], spec, 6), EngineConfig(block_size=4, max_batch_size=3,
                                                                                  kv_blocks=200, adaptive=False))
    scheduling = {"now": False}
    real_schedule, real_ensure = engine.scheduler.schedule, BlockManager.ensure_capacity

    def schedule():
        scheduling["now"] = True
        try:
            return real_schedule()
        finally:
            scheduling["now"] = False

    def ensure_capacity(blocks, seq_id, num_tokens):
        assert scheduling["now"], "a block was allocated outside the scheduler"
        return real_ensure(blocks, seq_id, num_tokens)

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    monkeypatch.setattr(BlockManager, "ensure_capacity", ensure_capacity)
    for n, prompt in enumerate([[5, 6, 7], list(range(1, 20)), [9], [3, 4]]):
        engine.add_request(prompt, SamplingParams(max_new_tokens=10 + n, ignore_eos=True,
                                                  temperature=0.0 if n % 2 else 0.9, seed=n))
    finals = engine.run_to_completion()
    assert sorted(len(o.token_ids) for o in finals.values()) == [10, 11, 12, 13]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_lookahead_too_small_is_caught(model):
    """The runner reads the reservation and refuses to write past it."""
    strategy = make_strategy("hispec", SPECS["hispec"], 6)
    strategy.lookahead = 1
    engine = Engine(model, strategy, kv_blocks=100, block_size=4, adaptive=False)
    rid = engine.add_request(list(range(1, 8)), SamplingParams(max_new_tokens=8))
    out = engine.run_to_completion()[rid]  # the engine fails the request alone, with the reason
    assert out.finish_reason == "error" and isinstance(out.error, AssertionError)
    assert "reserved slots" in str(out.error)


def test_generator_engines_share_one_pool_and_are_not_mutated(model):
    gen = Generator(model)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    gen.generate([1, 2, 3], params, "hispec", spec=SPECS["hispec"])
    pool = gen.pool
    gen.generate([1, 2, 3], params, "selfspec", spec=SPECS["selfspec"], adaptive=True)
    assert gen.pool is pool  # big enough: reused
    gen.generate(list(range(1, 120)), params, "ar")
    assert gen.pool is not pool and gen.blocks.num_used_blocks == 0  # grown for a longer request


def test_pool_sizing_follows_the_config(model):
    strategy = make_strategy("ar")
    ahead = strategy.lookahead
    e = Engine(model, strategy, EngineConfig(block_size=4, max_batch_size=3))
    assert e.blocks.num_blocks == 3 * (-(-(min(256, 1024) + ahead) // 4) + 1)  # a full batch of context-long sequences
    pool = e.pool
    e.fit_pool(10, 2)
    assert e.pool is pool  # big enough: kept, not re-allocated
    small = Engine(model, strategy, EngineConfig(block_size=4, max_batch_size=3), seq_tokens=1, num_seqs=1)
    assert small.blocks.num_blocks == -(-(1 + ahead) // 4) + 1
    small.fit_pool(10, 2)
    assert small.blocks.num_blocks == 2 * (-(-(10 + ahead) // 4) + 1)  # grown to what the requests need
    fixed = Engine(model, strategy, EngineConfig(block_size=4, kv_blocks=7))
    fixed.fit_pool(100, 3)
    assert fixed.blocks.num_blocks == 7
    with pytest.raises(ConfigError, match="kv_blocks"):
        EngineConfig(kv_blocks=0)
    with pytest.raises(ConfigError, match="max_batch_size must be >= 1, got 0"):
        Engine(model, strategy, max_batch_size=0)
