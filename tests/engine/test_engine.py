"""The batched engine: each sequence's greedy output equals its own batch-of-one ``ar`` output,
whatever the batch size, the mix of prompt lengths and where EOS falls; preemption under a
small pool changes nothing; every block is free again afterwards."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch

from hispec.config import SamplingParams, SpecConfig
from hispec.decode.autoregressive import Autoregressive
from hispec.decode.base import Strategy
from hispec.engine import Engine
from hispec.generate import Generator, make_strategy
from hispec.kernels import fused
from hispec.llm import LLM
from hispec.model.load.checkpoint import load_model

STRATEGIES = {
    "ar": None,
    "selfspec": SpecConfig(2, 6, num_draft=3),
    "hispec": SpecConfig(1, 3, num_draft=3, window=4),
    "hispec-svip": SpecConfig(2, 4, draft_policy="svip", svip_threshold=3.0),
    "hispec-heuristic": SpecConfig(1, 4, draft_policy="heuristic"),
    "lookup": SpecConfig(1, 3),
}



@pytest.fixture(scope="module")
def model(tiny_model_dir):
    m = load_model(tiny_model_dir("llama"))
    for layer in m.layers[2:]:  # upper layers barely change the residual: early exits agree often
        layer.o_proj.weight.mul_(0.1)
        layer.down_proj.weight.mul_(0.1)
    return m


@pytest.fixture(scope="module")
def workload(model):
    rng = random.Random(3)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 40))] for _ in range(16)]
    limits = [rng.randint(1, 30) for _ in prompts]
    gen = Generator(model)
    free = [gen.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True), "ar").token_ids
            for p, n in zip(prompts, limits)]
    # end-of-sequence: a token that some sequences produce at different steps and others never
    counts = Counter(t for ids in free for t in set(ids[1:]))
    eos = next(t for t, c in counts.most_common() if c < len(prompts) // 2)
    gen.eos_ids = frozenset({eos})
    reference = [gen.generate(p, SamplingParams(max_new_tokens=n), "ar") for p, n in zip(prompts, limits)]
    assert {"eos", "length"} <= {r.finish_reason for r in reference}
    return prompts, limits, [r.token_ids for r in reference], eos


def run_engine(model, name, prompts, limits, eos, batch_size, kv_blocks, adaptive=True):
    engine = Engine(model, make_strategy(name.split("-")[0], STRATEGIES[name], model.num_layers), eos_ids={eos},
                    kv_blocks=kv_blocks, block_size=4, max_batch_size=batch_size, adaptive=adaptive)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, limits)]
    final = engine.run_to_completion()
    return engine, [final[i].token_ids for i in ids]


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("batch_size", [1, 2, 5, 16])
def test_batched_outputs_equal_batch_of_one_ar(model, workload, name, batch_size):
    prompts, limits, expected, eos = workload
    engine, got = run_engine(model, name, prompts, limits, eos, batch_size, kv_blocks=400)
    assert got == expected
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # no leak


def test_rounds_of_several_greedy_tokens_equal_one_token_rounds(model, workload, monkeypatch, tiny_text_model_dir):
    """``ar`` taking up to ``run_steps`` greedy tokens per round in one op call gives the ids of
    one-token rounds: alone, batched, with EOS and token limits falling inside a round, under a pool
    small enough to preempt; and the text of one-token rounds with stop strings."""
    from hispec.kernels import layer_op

    if layer_op.layers_op() is None:
        pytest.skip("no C++ compiler or torch headers: no op to run several steps in")
    prompts, limits, _, eos = workload
    monkeypatch.setattr(Autoregressive, "run_steps", 1)
    monkeypatch.setattr(Autoregressive, "batched_run_steps", 1)
    _, single = run_engine(model, "ar", prompts, limits, eos, 5, kv_blocks=400)
    calls = []
    runs = layer_op.decode_steps
    monkeypatch.setattr(layer_op, "decode_steps", lambda *a: calls.append(a[8]) or runs(*a))  # a[8]: steps
    for steps, batch_size, kv_blocks in ((4, 1, 400), (4, 5, 400), (3, 16, 60), (8, 16, 400)):
        monkeypatch.setattr(Autoregressive, "run_steps", steps)
        monkeypatch.setattr(Autoregressive, "batched_run_steps", steps)
        engine, got = run_engine(model, "ar", prompts, limits, eos, batch_size, kv_blocks=kv_blocks)
        assert got == single, (steps, batch_size)
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        assert kv_blocks > 60 or engine.scheduler.num_preemptions > 0
    assert calls and max(calls) > 6  # the rounds ran in the op, with room reserved for more than 4 steps

    gen = Generator.from_pretrained(str(tiny_text_model_dir), exits=False, progress=False)
    texts = {}
    for steps in (1, 8):
        monkeypatch.setattr(Autoregressive, "run_steps", steps)
        outs = [gen.generate(p, SamplingParams(max_new_tokens=40, stop=stop), "ar")
                for p in ("Hello there", "abc") for stop in ((), ("e",), ("xy", "o"))]
        texts[steps] = [(o.text, o.token_ids, o.finish_reason) for o in outs]
    assert texts[1] == texts[8]


def test_rounds_of_several_sampled_tokens_equal_one_token_rounds(model, workload, monkeypatch):
    """Seeded sampled requests (temperature, top-k, top-p; greedy ones beside them) take several
    tokens per op call with the ids of one-token rounds (each position's own number): alone, batched, with
    EOS and token limits inside a round, under a pool small enough to preempt; and sampled, not the
    argmax (the runs differ from greedy ones)."""
    from hispec.kernels import layer_op

    if layer_op.layers_op() is None:
        pytest.skip("no C++ compiler or torch headers: no op to run several steps in")
    prompts, limits, greedy, eos = workload
    kinds = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0),
             SamplingParams(temperature=1.2, top_k=5), SamplingParams(), SamplingParams(temperature=0.6, top_k=20,
                                                                                         top_p=0.7)]

    def run(batch_size, kv_blocks):
        engine = Engine(model, make_strategy("ar", None, model.num_layers), eos_ids={eos}, kv_blocks=kv_blocks,
                        block_size=4, max_batch_size=batch_size)
        ids = [engine.add_request(p, dataclasses.replace(kinds[i % 5], max_new_tokens=n, seed=i))
               for i, (p, n) in enumerate(zip(prompts, limits))]
        final = engine.run_to_completion()
        return engine, [final[i].token_ids for i in ids]

    monkeypatch.setattr(Autoregressive, "run_steps", 1)
    monkeypatch.setattr(Autoregressive, "batched_run_steps", 1)
    _, single = run(5, 400)
    assert sum(a != b for a, b in zip(single, greedy)) >= 8  # sampled: most differ from the argmax
    calls = []
    runs = layer_op.decode_steps
    monkeypatch.setattr(layer_op, "decode_steps", lambda *a: calls.append(a[11]) or runs(*a))  # a[11]: sampling
    for steps, batch_size, kv_blocks in ((4, 1, 400), (4, 5, 400), (3, 16, 60), (8, 16, 400)):
        monkeypatch.setattr(Autoregressive, "run_steps", steps)
        monkeypatch.setattr(Autoregressive, "batched_run_steps", steps)
        engine, got = run(batch_size, kv_blocks)
        assert got == single, (steps, batch_size)
        assert kv_blocks > 60 or engine.scheduler.num_preemptions > 0
    assert any(s is not None and max(s.temperature) > 0 for s in calls)  # sampled rows ran in the op


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_preemption_under_a_small_pool_gives_the_same_outputs(model, workload, name):
    prompts, limits, expected, eos = workload
    engine, got = run_engine(model, name, prompts, limits, eos, batch_size=16, kv_blocks=20)
    assert engine.scheduler.num_preemptions > 0  # the pool really was too small
    assert got == expected
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_always_speculating_without_the_cost_model(model, workload):
    prompts, limits, expected, eos = workload
    engine, got = run_engine(model, "hispec", prompts, limits, eos, batch_size=5, kv_blocks=400, adaptive=False)
    assert got == expected


def test_adaptive_decisions_show_in_the_stats(model, workload, monkeypatch):
    """Both modes are measured and counted. Without free drafts: with them, how many rounds reach
    the controller depends on timing (a round with lookup drafts worth their rows is a free one),
    and in a CI run too few did for the plain mode's turn."""
    import dataclasses

    monkeypatch.setitem(STRATEGIES, "hispec", dataclasses.replace(STRATEGIES["hispec"], lookup_max_draft=0))
    prompts, limits, expected, eos = workload
    engine, got = run_engine(model, "hispec", prompts, limits, eos, batch_size=4, kv_blocks=400)
    assert got == expected
    steps = engine.stats()["adaptive"]["steps"]
    assert steps["speculate"] > 0 and steps["plain"] > 0, steps  # both were measured


def test_single_request_adaptive_generation(model, workload):
    """Generator.generate(adaptive=True): one controller per strategy learns across calls; plain
    steps are counted in the request's stats and the output is still ar's."""
    prompts, limits, expected, eos = workload
    gen = Generator(model)
    gen.eos_ids = frozenset({eos})
    strategy = make_strategy("hispec", STRATEGIES["hispec"], model.num_layers)
    outs = [gen.generate(p, SamplingParams(max_new_tokens=n), strategy, adaptive=True) for p, n in zip(prompts, limits)]
    assert [o.token_ids for o in outs] == expected
    plain = sum(o.stats.plain_steps for o in outs)
    assert 0 < plain < sum(o.stats.full_passes for o in outs)  # both modes were measured
    assert sum(o.stats.modes.get("plain", 0) for o in outs) == plain  # rounds by mode, and why
    assert all(sum(o.stats.modes.values()) > 0 for o in outs)
    assert set(outs[-1].stats.to_dict()["mode_rates"]) == {"speculate", "plain"}
    always = gen.generate(prompts[0], SamplingParams(max_new_tokens=limits[0]), strategy).stats
    assert always.plain_steps == 0 and not always.modes


def test_adaptive_engines_measure_sampled_requests_too(model, workload):
    """Every mode gives a seeded request ``ar``'s tokens (each position's token is drawn with its own
    number), so an adaptive engine speculates on batches with sampled requests as on greedy ones,
    and the output is the same whatever its controller has measured meanwhile, alone or beside
    greedy requests, adaptive or not."""
    import dataclasses

    prompts, limits, expected, eos = workload
    gen = Generator(model)
    gen.eos_ids = frozenset({eos})
    no_lookup = dataclasses.replace(STRATEGIES["hispec"], lookup_max_draft=0)
    strategy = make_strategy("hispec", no_lookup, model.num_layers)
    p = SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    want = gen.generate(prompts[0], p, "ar").token_ids
    first = gen.generate(prompts[0], p, strategy, adaptive=True)
    assert first.token_ids == want and first.stats.modes.get("speculate", 0) > 0
    greedy = [gen.generate(q, SamplingParams(max_new_tokens=n), strategy, adaptive=True)
              for q, n in zip(prompts, limits)]
    assert [o.token_ids for o in greedy] == expected and sum(o.stats.modes.get("speculate", 0) for o in greedy)
    assert gen.generate(prompts[0], p, strategy, adaptive=True).token_ids == want
    always = gen.generate(prompts[0], p, strategy)  # not adaptive: every round drafts at the exits
    assert always.stats.plain_steps == 0 and always.stats.rounds.get("exits", 0) > 0 and always.token_ids == want
    engine = Engine(model, strategy, eos_ids={eos}, kv_blocks=400, block_size=4, max_batch_size=4)
    ids = [engine.add_request(q, SamplingParams(max_new_tokens=n)) for q, n in zip(prompts[1:4], limits[1:4])]
    mine = engine.add_request(prompts[0], p)
    final = engine.run_to_completion()
    assert final[mine].token_ids == want and [final[i].token_ids for i in ids] == expected[1:4]


def test_abort_frees_blocks(model):
    engine = Engine(model, make_strategy("hispec", STRATEGIES["hispec"], 6), kv_blocks=50, block_size=4)
    rid = engine.add_request(list(range(20)), SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.add_request(list(range(5)), SamplingParams(max_new_tokens=5, ignore_eos=True))
    engine.step()
    assert engine.blocks.num_used_blocks > 0
    assert engine.abort(rid)
    engine.run_to_completion()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_request_larger_than_the_pool_is_a_clear_error(model):
    from hispec.cache.block_manager import CacheFullError

    engine = Engine(model, make_strategy("ar"), kv_blocks=2, block_size=4)
    engine.add_request(list(range(30)), SamplingParams(max_new_tokens=5))
    with pytest.raises(CacheFullError, match="kv-blocks"):
        engine.step()


def test_llm_api_keeps_prompt_order(model, workload):
    prompts, limits, expected, eos = workload
    gen = Generator(model)
    gen.eos_ids = frozenset({eos})
    llm = LLM(gen, "hispec", spec=STRATEGIES["hispec"], max_batch_size=4)
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=n) for n in limits])
    assert [o.token_ids for o in outs] == expected


def test_a_seeded_sampled_request_gives_the_same_output_in_any_batch(model, workload):
    prompts, limits, _, eos = workload
    sampled = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    outputs = []
    for others in (0, 3, 7):
        engine = Engine(model, make_strategy("hispec", STRATEGIES["hispec"], model.num_layers), kv_blocks=400,
                        block_size=4, max_batch_size=8)
        rid = engine.add_request(prompts[0], sampled)
        for p in prompts[1:1 + others]:
            engine.add_request(p, SamplingParams(max_new_tokens=25))
        outputs.append(engine.run_to_completion()[rid].token_ids)
    assert outputs[0] == outputs[1] == outputs[2]


MIXED = [SamplingParams(max_new_tokens=14, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
         SamplingParams(max_new_tokens=14, ignore_eos=True),
         SamplingParams(max_new_tokens=14, temperature=0.7, top_k=5, seed=12, ignore_eos=True),
         SamplingParams(max_new_tokens=14, temperature=1.3, top_k=20, top_p=0.8, seed=13, ignore_eos=True),
         SamplingParams(max_new_tokens=14, temperature=1.0, seed=14, presence_penalty=0.5, ignore_eos=True),
         SamplingParams(max_new_tokens=9, ignore_eos=True),
         SamplingParams(max_new_tokens=14, temperature=0.5, seed=15, logit_bias=((3, 2.0),), ignore_eos=True)]


@pytest.mark.parametrize("name", ["ar", "selfspec", "hispec", "hispec-svip", "lookup"])
@pytest.mark.parametrize("cpu_block", ["whole batch", "a few rows"])
def test_a_batch_mixing_greedy_and_sampled_requests_gives_each_its_batch_of_one_output(model, workload, name,
                                                                                      cpu_block, monkeypatch):
    """The batched samplers and accept rules: per-row temperature, top-k, top-p and processors,
    each request on its own random stream, token for token what it gives alone; with the CPU's
    cache-sized blocks of rows taking the whole batch or a few rows at a time."""
    import hispec.sampling.sampler as sampler

    if cpu_block == "a few rows":
        monkeypatch.setattr(sampler, "CPU_BLOCK_BYTES", 4 * model.cfg.vocab_size * 7)
    prompts = workload[0]

    def run(indices):
        engine = Engine(model, make_strategy(name.split("-")[0], STRATEGIES[name], model.num_layers), kv_blocks=400,
                        block_size=4, max_batch_size=8, adaptive=False)
        ids = {i: engine.add_request(prompts[i], MIXED[i]) for i in indices}
        final = engine.run_to_completion()
        return {i: final[r].token_ids for i, r in ids.items()}

    together = run(range(len(MIXED)))
    assert together == {i: run([i])[i] for i in range(len(MIXED))}


# ---- one request cannot hurt another ------------------------------------------------------------
EXTREME = [SamplingParams(max_new_tokens=12, temperature=1e-40, seed=1),  # 1/T overflows float32
           SamplingParams(max_new_tokens=12, temperature=1e-46, seed=2),  # T itself underflows to 0
           SamplingParams(max_new_tokens=12, temperature=1.0, top_p=1e-46, seed=3),  # top_p rounds to 0
           SamplingParams(max_new_tokens=12, temperature=2.0, top_k=1, top_p=1e-30, seed=4)]


@pytest.mark.parametrize("name", ["ar", "selfspec", "hispec", "hispec-svip", "lookup"])
def test_extreme_sampling_values_behave_as_greedy_in_a_greedy_batch(model, workload, name):
    """A temperature that underflows is greedy, a top_p that keeps nothing keeps the top token:
    every one of these requests gives the greedy output, and so do the greedy ones beside them."""
    prompts, limits, expected, eos = workload
    engine = Engine(model, make_strategy(name.split("-")[0], STRATEGIES[name], model.num_layers), eos_ids={eos},
                    kv_blocks=400, block_size=4, max_batch_size=16)
    greedy = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts[:6], limits)]
    extreme = [engine.add_request(prompts[0], sp) for sp in EXTREME]
    final = engine.run_to_completion()
    assert [final[r].token_ids for r in greedy] == expected[:6]
    want = Generator(model)
    want.eos_ids = frozenset({eos})
    ref = want.generate(prompts[0], SamplingParams(max_new_tokens=12), "ar").token_ids
    for r in extreme:
        assert final[r].finish_reason != "error" and final[r].token_ids == ref


class FailsFor(Strategy):
    """A strategy that raises, after running (and so touching the cache), whenever its batch
    holds a request with ``top_k == 7``: a stand-in for a bug that one request's input triggers."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.spec, self.lookahead = inner, inner.name, inner.spec, inner.lookahead

    def step(self, batch):
        commits = self.inner.step(batch)
        if any(c.params.top_k == 7 for c in batch):
            raise RuntimeError("boom")
        return commits


@pytest.mark.parametrize("name", ["ar", "hispec"])
def test_a_failing_request_fails_alone(model, workload, name):
    prompts, limits, expected, eos = workload
    strategy = FailsFor(make_strategy(name, STRATEGIES[name], model.num_layers))
    engine = Engine(model, strategy, eos_ids={eos}, kv_blocks=400, block_size=4, max_batch_size=16, adaptive=False)
    greedy = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts[:5], limits)]
    sampled = engine.add_request(prompts[5], SamplingParams(max_new_tokens=30, temperature=0.8, seed=5))
    bad = engine.add_request(prompts[6], SamplingParams(max_new_tokens=30, temperature=0.8, top_k=7))
    final = engine.run_to_completion()
    assert [final[r].token_ids for r in greedy] == expected[:5]
    assert final[bad].finish_reason == "error" and "boom" in str(final[bad].error)
    alone = Engine(model, FailsFor(make_strategy(name, STRATEGIES[name], model.num_layers)), eos_ids={eos},
                   kv_blocks=400, block_size=4, adaptive=False)
    rid = alone.add_request(prompts[5], SamplingParams(max_new_tokens=30, temperature=0.8, seed=5))
    assert final[sampled].token_ids == alone.run_to_completion()[rid].token_ids  # its random stream was restored
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    with pytest.raises(RuntimeError, match="boom"):  # a single request in the library still raises
        g = Generator(model)
        g.generate(prompts[6], SamplingParams(max_new_tokens=5, temperature=0.8, top_k=7), strategy)


# ---- chunked prefill ----------------------------------------------------------------------------------------
def prompt_kv(engine: Engine, request_id: str, length: int) -> list[torch.Tensor]:
    """Every layer's K and V of a sequence's first ``length`` positions."""
    from hispec.cache.kv_cache import slots_for

    seq = engine.sequence(request_id)
    slots = slots_for(engine.blocks.block_table(seq.seq_id), 0, length, engine.block_size, "cpu")
    return [t for layer in range(engine.model.num_layers) for t in engine.pool.read(layer, slots)]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_chunked_prefill_gives_the_unchunked_output_and_kv(model, workload, name):
    """Long prompts prefilled in chunks of 7 tokens (shared by the sequences, oldest first), with
    short ones decoding between the chunks: every output equals batch-of-one ``ar``, and a long
    prompt's K/V equal its one-piece prefill."""
    prompts, limits, expected, eos = workload
    rng = random.Random(5)
    long_prompts = [[rng.randrange(128) for _ in range(n)] for n in (90, 61)]
    gen = Generator(model)
    gen.eos_ids = frozenset({eos})
    long_expected = [gen.generate(p, SamplingParams(max_new_tokens=12), "ar").token_ids for p in long_prompts]
    kv = {}
    for chunk in (0, 7):
        engine = Engine(model, make_strategy(name.split("-")[0], STRATEGIES[name], model.num_layers), eos_ids={eos},
                        kv_blocks=400, block_size=4, max_batch_size=16, prefill_chunk=chunk)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts[:6], limits)]
        final = {o.request_id: o for o in engine.step()}  # the short ones run when the long ones arrive
        long_ids = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in long_prompts]
        while not engine.sequence(long_ids[0]).prefilled:
            final.update((o.request_id, o) for o in engine.step())
        kv[chunk] = prompt_kv(engine, long_ids[0], len(long_prompts[0]) - 1)
        final.update(engine.run_to_completion())
        assert [final[i].token_ids for i in ids] == expected[:6]
        assert [final[i].token_ids for i in long_ids] == long_expected
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    for a, b in zip(kv[0], kv[7]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.skipif(not fused.available(), reason="the fused paged attention kernel (a C compiler)")
def test_long_prompt_kv_does_not_depend_on_its_chunks(tiny_model_dir):
    """A prompt longer than SDPA_MIN_QUERIES prefilled in one chunk or in chunks of 64: the same K/V
    bit for bit and the same tokens (every chunk takes the paged kernel; SDPA's fused kernel gave
    long chunks other bits, so a request's greedy tokens depended on the batch it was admitted with)."""
    from hispec.model.decoder import SDPA_MIN_QUERIES

    model = load_model(tiny_model_dir("llama", max_position_embeddings=1024))
    prompt = [random.Random(9).randrange(128) for _ in range(SDPA_MIN_QUERIES + 45)]
    kv, out = {}, {}
    for chunk in (0, 64):
        engine = Engine(model, make_strategy("ar", None, model.num_layers), kv_blocks=200, block_size=4,
                        max_batch_size=2, prefill_chunk=chunk)
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))  # > 1 + a round's
        while not engine.sequence(rid).prefilled:
            engine.step()
        kv[chunk] = prompt_kv(engine, rid, len(prompt) - 1)
        out[chunk] = engine.run_to_completion()[rid].token_ids
    assert all(torch.equal(a, b) for a, b in zip(kv[0], kv[64]))
    assert out[0] == out[64]


def test_a_prompt_alone_is_prefilled_in_bigger_chunks(model):
    """With no sequence decoding, a step prefills up to IDLE_PREFILL_CHUNKS chunks' tokens; once one
    decodes, one chunk a step again (the latency bound the chunks are for)."""
    from hispec.config import IDLE_PREFILL_CHUNKS

    engine = Engine(model, make_strategy("ar", None, model.num_layers), kv_blocks=400, block_size=4,
                    max_batch_size=8, prefill_chunk=16)
    first = engine.add_request(list(range(1, 120)) * 2, SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()
    assert engine.sequence(first).num_cached == 16 * IDLE_PREFILL_CHUNKS
    while not engine.sequence(first).prefilled:
        engine.step()
    second = engine.add_request(list(range(2, 121)), SamplingParams(max_new_tokens=4))  # no prefix of the first
    engine.step()
    assert engine.sequence(second).num_cached == 16  # the first one decodes meanwhile
    engine.run_to_completion()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_running_sequences_decode_between_prefill_chunks_and_an_abort_stops_the_prefill(model):
    engine = Engine(model, make_strategy("hispec", STRATEGIES["hispec"], model.num_layers), kv_blocks=400,
                    block_size=4, max_batch_size=8, prefill_chunk=16)
    short = [engine.add_request([5 + i, 6, 7], SamplingParams(max_new_tokens=200, ignore_eos=True)) for i in range(3)]
    engine.step()
    long = engine.add_request(list(range(1, 120)) * 2, SamplingParams(max_new_tokens=4))  # 238 tokens
    seq = engine.sequence(long)
    for step in range(1, 6):
        outputs = {o.request_id: o for o in engine.step()}
        assert all(outputs[r].new_token_ids for r in short)  # every stream moved on in this step
        assert long not in outputs and seq.num_cached == 16 * step and not seq.prefilled
    used = engine.blocks.num_used_blocks
    assert engine.abort(long)  # between two chunks: its blocks come back at once
    assert engine.blocks.num_used_blocks < used
    for r in short:
        engine.abort(r)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_half_precision_on_cuda_warns_once_that_rows_can_interact(monkeypatch, caplog):
    """The GPU's matrix kernels are not row-invariant in bfloat16 (measured on an H200): say so, once,
    where a pass holds several rows (speculation, batches); never on the CPU or for ar alone."""
    from types import SimpleNamespace

    from hispec.engine import engine as eng

    def model(device, dtype):
        return SimpleNamespace(device=torch.device(device), dtype=dtype)

    ar, spec = SimpleNamespace(name="ar"), SimpleNamespace(name="hispec")
    monkeypatch.setattr(eng, "_warned_rows", False)
    with caplog.at_level("WARNING", logger="hispec.engine"):
        eng._warn_if_rows_interact(model("cpu", torch.bfloat16), spec, 8)
        eng._warn_if_rows_interact(model("cuda", torch.float32), spec, 8)
        eng._warn_if_rows_interact(model("cuda", torch.bfloat16), ar, 1)
        assert not caplog.records
        eng._warn_if_rows_interact(model("cuda", torch.bfloat16), spec, 1)
        eng._warn_if_rows_interact(model("cuda", torch.float16), ar, 8)
    assert len(caplog.records) == 1 and "--dtype float32" in caplog.records[0].getMessage()
