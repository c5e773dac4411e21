"""Free drafts (prompt lookup) on every path of the engine: ``lookup`` and ``hispec`` (whose free
rounds verify lookup drafts) give batch-of-one ``ar``'s token ids with requests arriving while
others decode and with long prompts prefilled in chunks between decode steps; a seeded sampled
request gives the output it gives alone. Every test asserts that lookup rounds ran (prompts
that repeat themselves), so that it can fail."""
from __future__ import annotations

import random

import pytest

from hispec.config import IDLE_PREFILL_CHUNKS, EngineConfig, SamplingParams, SpecConfig
from hispec.engine import Engine
from hispec.generate import Generator, make_strategy
from hispec.model.load.checkpoint import load_model

SPEC = SpecConfig(1, 3, num_draft=3, window=4)
STRATEGIES = ["lookup", "hispec"]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    m = load_model(tiny_model_dir("llama"))
    for layer in m.layers[2:]:  # early exits agree often: hispec's exit rounds accept drafts too
        layer.o_proj.weight.mul_(0.1)
        layer.down_proj.weight.mul_(0.1)
    return m


def repeating(rng: random.Random, period: int, length: int) -> list[int]:
    """A prompt that repeats a random ``period``-token phrase: lookup finds matches at once."""
    phrase = [rng.randrange(3, 128) for _ in range(period)]
    return (phrase * (length // period + 1))[:length]


def engine_for(model, strategy: str, adaptive: bool, eos_ids=frozenset(), **config) -> Engine:
    cfg = {**dict(kv_blocks=400, block_size=4, max_batch_size=4, adaptive=adaptive), **config}
    return Engine(model, make_strategy(strategy, SPEC, model.num_layers), EngineConfig(**cfg), eos_ids=eos_ids)


def lookup_rounds(outputs) -> int:
    return sum(o.stats.rounds.get("lookup", 0) for o in outputs)


def run_staggered(engine: Engine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> list:
    """Add each ``(step, prompt, params)`` at that engine step (while earlier ones decode), run to
    the end; the final outputs in the order of ``arrivals``."""
    ids, final, step = {}, {}, 0
    while len(ids) < len(arrivals) or engine.has_unfinished():
        for a, (at, prompt, params) in enumerate(arrivals):
            if at == step:
                ids[a] = engine.add_request(prompt, params)
        final.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
    return [final[ids[a]] for a in range(len(arrivals))]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("adaptive", [False, True])
def test_staggered_arrivals_equal_batch_of_one_ar(model, strategy, adaptive, pinned_row_cost):
    """Eight requests (seven greedy, one seeded sampled) arrive over eleven steps into a batch of
    at most four (some wait for a slot): repeating and random prompts, token limits and EOS.
    Each greedy output equals its own ``ar`` output; the sampled one equals itself run alone."""
    rng = random.Random(11)
    prompts = [repeating(rng, p, n) for p, n in ((5, 23), (3, 10), (9, 40), (4, 4))]
    prompts += [[rng.randrange(3, 128) for _ in range(n)] for n in (1, 12, 30)]
    limits = [40, 17, 29, 3, 25, 33, 12]
    gen = Generator(model)
    free = [gen.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True), "ar").token_ids
            for p, n in zip(prompts, limits)]
    eos = free[2][len(free[2]) // 2]  # a token of a repeating sequence's output: it ends there
    gen.eos_ids = frozenset({eos})
    want = [gen.generate(p, SamplingParams(max_new_tokens=n), "ar").token_ids for p, n in zip(prompts, limits)]
    assert len(want[2]) < limits[2]
    params = [SamplingParams(max_new_tokens=n) for n in limits]
    sampled = SamplingParams(max_new_tokens=24, temperature=0.9, seed=7, ignore_eos=True)
    arrivals = list(zip([0, 0, 1, 3, 4, 4, 10], prompts, params)) + [(2, prompts[0], sampled)]

    engine = engine_for(model, strategy, adaptive, eos_ids={eos})
    outs = run_staggered(engine, arrivals)
    assert [o.token_ids for o in outs[:-1]] == want, (strategy, adaptive)
    assert lookup_rounds(outs[:-1]) > 0
    alone = engine_for(model, strategy, adaptive, eos_ids={eos})
    rid = alone.add_request(prompts[0], sampled)
    assert outs[-1].token_ids == alone.run_to_completion()[rid].token_ids
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.blocks.check_invariants()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_chunked_prefill_of_repeating_prompts_equals_ar(model, strategy):
    """Long repeating prompts (lookup matches everywhere in them) prefilled in chunks of 7
    tokens while short requests decode between the chunks: every output equals ``ar``'s, and
    the long ones ran lookup rounds once their prefill was done."""
    rng = random.Random(4)
    shorts = [repeating(rng, 3, 9), [rng.randrange(3, 128) for _ in range(6)]]
    longs = [repeating(rng, 11, 95), repeating(rng, 6, 61)]
    gen = Generator(model)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = [gen.generate(p, params, "ar").token_ids for p in shorts + longs]
    engine = engine_for(model, strategy, False, prefill_chunk=7, max_batch_size=8)
    short_ids = [engine.add_request(p, params) for p in shorts]
    final = {o.request_id: o for o in engine.step()}
    long_ids = [engine.add_request(p, params) for p in longs]
    chunks = 0
    def cached() -> int:  # the long prompts' tokens prefilled so far (a finished one: all of its prompt)
        return sum(len(p) - 1 if r in final and final[r].finished else engine.sequence(r).num_cached
                   for r, p in zip(long_ids, longs))

    while not engine.sequence(long_ids[1]).prefilled:
        decoding, before = [r for r in short_ids if r not in final or not final[r].finished], cached()
        outs = {o.request_id: o for o in engine.step()}
        final.update(outs)
        chunks += 1
        assert all(r in outs for r in decoding)  # they decode meanwhile
        assert cached() - before <= 7 * (1 if decoding else IDLE_PREFILL_CHUNKS)
    assert chunks >= 2
    final.update(engine.run_to_completion())
    outs = [final[i] for i in short_ids + long_ids]
    assert [o.token_ids for o in outs] == want
    assert lookup_rounds(outs[2:]) > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("strategy", ["hispec", "lookup"])
def test_sampled_requests_without_drafts_ride_along_in_the_lookup_pass(model, strategy, pinned_row_cost):
    """Under the adaptive rule (and with the lookup strategy) a sampled sequence's own round is a plain
    one, so in a step where others verify drafts it takes its token in their pass: every seeded output
    equals itself run alone, and the request that seldom drafts rode along (plain rounds beyond the
    engine's plain steps)."""
    rng = random.Random(5)
    prompts = [repeating(rng, 4, 30), repeating(rng, 6, 36), [rng.randrange(3, 128) for _ in range(9)]]
    params = [SamplingParams(max_new_tokens=20, temperature=0.7, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    engine = engine_for(model, strategy, True)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs = engine.run_to_completion()
    for p, sp, i in zip(prompts, params, ids):
        alone = engine_for(model, strategy, True)
        rid = alone.add_request(p, sp)
        assert outs[i].token_ids == alone.run_to_completion()[rid].token_ids
    assert lookup_rounds([outs[i] for i in ids[:2]]) > 0
    if strategy == "hispec":
        rode = outs[ids[2]].stats
        assert rode.rounds.get("plain", 0) > rode.plain_steps, (rode.rounds, rode.plain_steps)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_free_rounds_the_gate_finds_slower_are_skipped_and_the_output_stays(model, strategy, monkeypatch,
                                                                            pinned_row_cost):
    """With free rounds measured slower than plain steps at a batch size (``FreeRoundGate``), the engine
    skips them until the gate's next try: no lookup rounds, no plain run cut short for drafts, the
    skips counted in the statistics, and every output still ``ar``'s. Measured faster, they run."""
    rng = random.Random(6)
    prompts = [repeating(rng, 5, 30), repeating(rng, 7, 35), [rng.randrange(3, 128) for _ in range(8)]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    gen = Generator(model)
    want = [gen.generate(p, params, "ar").token_ids for p in prompts]
    monkeypatch.setenv("HISPEC_FREE_ROUND_GATE", "1")
    engine = engine_for(model, strategy, True)
    gate = engine.adaptive.free
    for b in range(4):  # every batch size up to the engine's four: measured, and slower than plain
        for _ in range(gate.warmup):
            gate.record(2 ** b, tokens=1, seconds=1.0, plain_seconds=0.01)
    gate.explore_every = 10 ** 6
    ids = [engine.add_request(p, params) for p in prompts]
    outs = engine.run_to_completion()
    assert [outs[i].token_ids for i in ids] == want
    assert lookup_rounds(outs.values()) == 0 and all(o.stats.free_skips > 0 for o in outs.values())
    assert sum(o.stats.lookup_stops for o in outs.values()) == 0
    monkeypatch.setenv("HISPEC_FREE_ROUND_GATE", "0")  # (a fresh gate could measure these rounds slower)
    fresh = engine_for(model, strategy, True)
    ids = [fresh.add_request(p, params) for p in prompts]
    outs = fresh.run_to_completion()
    assert [outs[i].token_ids for i in ids] == want and lookup_rounds(outs.values()) > 0
