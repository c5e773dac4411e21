"""Free drafts from prompt lookup (``spec/proposers/``, ``spec/cost.py``) and the strategies that verify them:
``lookup`` and ``hispec`` give ``ar``'s token ids exactly (greedy), follow the target
distribution (sampling), under continuous batching and at every end condition."""
from __future__ import annotations

import math

import pytest
import torch

from hispec.config import ConfigError, EngineConfig, SamplingParams, SpecConfig
from hispec.spec.cost import LOOKUP_PRIORS, DraftLength, RowCost, choose_drafts, lookup_prior
from hispec.spec.proposers.lookup import LookupState
from hispec.spec.proposers.ngram import NgramIndex, continuation
from hispec.spec.proposers.suffix import SuffixCache
from hispec.engine.engine import Engine
from hispec.generate import Generator, make_strategy
from hispec.model.load.checkpoint import load_model
from hispec.settings import resolve_spec

from tests.decode.test_speculative_sampling import SETTINGS, _copy, exact_joint, fit, report  # noqa: F401 (fixtures below)
from tests.decode.test_speculative_sampling import PROMPT, TINY, hf_model, model_dir  # noqa: F401 (fixtures)

SPEC = SpecConfig(draft_layer=1, verify_layer=3, num_draft=3, window=3)
# A repetitive prompt: the tiny random models also fall into loops of their own, so drafts are accepted.
PROMPTS = [[5, 17, 99, 3, 5, 17, 99, 3, 5, 17], list(range(40, 60)) * 2, [1, 2, 3, 4, 5, 1, 2, 3], [7]]


# ---- the matcher --------------------------------------------------------------------------

def test_longest_most_recent_match_and_its_continuation():
    index = NgramIndex(3)
    tokens = [1, 2, 3, 9, 4, 2, 3, 8, 7, 2, 3]
    assert index.propose(tokens, 2) == (2, [8, 7])  # "2 3" last occurred before 8 7 (not before 9 4)
    tokens += [8]
    assert index.propose(tokens, 3) == (3, [7, 2, 3])  # "2 3 8" now: the longest match wins
    assert index.branches_of([1, 2, 3, 9, 4, 2, 3, 8, 7, 2, 3], 2) == [[8, 7], [9, 4]]


def test_no_match_and_limits():
    assert NgramIndex(3).propose([1, 2, 3, 4], 4) == (0, [])
    assert NgramIndex(3).propose([1], 4) == (0, [])
    assert NgramIndex(3).propose([1, 2, 1], 0) == (0, [])
    assert NgramIndex(1).propose([5, 6, 7, 5], 2) == (1, [6, 7])


def test_a_loop_is_continued_past_the_last_token():
    """A match one period back: the drafts repeat the period instead of stopping at the end."""
    assert NgramIndex(3).propose([9, 7, 7, 7], 4) == (2, [7, 7, 7, 7])
    assert NgramIndex(3).propose([4, 1, 2, 1, 2], 5) == (2, [1, 2, 1, 2, 1])
    assert continuation([3, 1, 2], 0, 4) == [1, 2, 1, 2]


def test_the_index_grows_with_the_tokens():
    tokens, index, rng = [], NgramIndex(3), torch.Generator().manual_seed(0)
    for _ in range(200):
        tokens.append(int(torch.randint(0, 6, (1,), generator=rng)))
        n, drafts = index.propose(tokens, 3)
        fresh = NgramIndex(3).propose(tokens, 3)
        assert (n, drafts) == fresh
        if n:  # the match is real: the last n tokens occurred earlier, followed by the first draft
            suffix = tokens[-n:]
            assert any(tokens[e - n + 1:e + 1] == suffix and tokens[e + 1] == drafts[0]
                       for e in range(n - 1, len(tokens) - 1))


def test_suffix_cache_is_bounded_and_finds_earlier_outputs():
    cache = SuffixCache(max_ngram=2, k=3, capacity=8)
    cache.add([10, 11, 12, 13, 14])
    assert cache.propose([99, 11, 12], 3) == (2, [13, 14])
    cache.add(list(range(20, 40)))
    assert len(cache.table) == 8 and cache.propose([99, 11, 12], 3) == (0, [])


def test_draft_length_follows_acceptance_and_cost():
    d = DraftLength.flat(4, 3, prior=0.6)
    assert d.choose(3, 4, row_cost=0.0) == 4  # free rows: draft all
    for _ in range(8):
        d.record(3, 4, 4)
    assert d.choose(3, 4, row_cost=0.25) == 4
    for _ in range(8):
        d.record(1, 4, 0)
    assert d.choose(1, 4, row_cost=0.25) == 0  # rejected drafts are not worth their rows
    assert d.choose(3, 2, row_cost=0.25) == 2  # never more than the room left
    tried = 0
    for _ in range(100):  # still rejected whenever tried: it tries now and then, not often
        k = d.choose(1, 4, row_cost=0.25)
        if k:
            tried += 1
            d.record(1, k, 0)
    assert 0 < tried <= 8, tried


def test_a_fresh_sequence_starts_from_the_measured_priors():
    """Before any round of its own, a sequence drafts long from a three-token match (85% of first
    drafts right where measured) and not from a one-token match (29%), at a row cost of a quarter
    of a step; longer matches take the three-token row, drafts past the table its last value."""
    state = LookupState(max_draft=4, max_ngram=4)
    assert state.length.choose(state.row("lookup", 3), 4, row_cost=0.25, overhead=0.1) == 4
    assert state.length.choose(state.row("lookup", 1), 4, row_cost=0.25, overhead=0.1) == 0
    assert state.length.rates[4] == state.length.rates[3] == list(LOOKUP_PRIORS[2][:4])
    assert lookup_prior(2, 10)[-2:] == [LOOKUP_PRIORS[1][-1]] * 2
    assert state.length.rates[state.row("suffix", 2)] == [0.6] * 4  # another request's text: the flat guess
    state.length.rates[1] = [0.0] * 4  # drifting back (while declining) goes towards the row's own prior
    state.length.choose(1, 4, row_cost=0.25)
    assert state.length.rates[1] == pytest.approx([0.01 * p for p in LOOKUP_PRIORS[0][:4]])


def test_one_sequence_takes_the_drafts_that_maximise_tokens_per_cost():
    """Alone, ``choose_drafts`` is the best ``k`` of (1 + sum of the first k gains) / (1 + o + c k)."""
    import random
    rng = random.Random(0)
    for _ in range(500):
        rates = [rng.random() for _ in range(rng.randint(1, 6))]
        gains = [math.prod(rates[:j + 1]) for j in range(len(rates))]
        c, o = rng.choice([0.0, 0.05, 0.2, 0.5, 1.0]), rng.choice([0.0, 0.1, 0.4])
        ratios = [(1 + sum(gains[:k])) / (1 + o + c * k) for k in range(len(gains) + 1)]
        best = max(range(len(ratios)), key=lambda k: (ratios[k] > 1 + 1e-9, ratios[k]))
        assert choose_drafts([gains], 1, c, o) == [best if ratios[best] > 1 + 1e-9 else 0]


def test_a_pass_pays_its_overhead_once_for_the_whole_batch():
    """At batch 8 a pass takes all 8 sequences through a step 1 + o long: one sequence's good
    drafts do not pay for that (though alone they would), four sequences' together do."""
    good = [0.95, 0.9, 0.86, 0.81]
    c, o = 0.66, 0.35  # measured at batch 8 on the default model (2 Zen 4 cores)
    assert choose_drafts([good], 1, c, o) == [4]  # alone: worth it
    assert choose_drafts([good] + [[]] * 7, 8, c, o) == [0] * 8  # one in eight: the others pay its overhead
    assert choose_drafts([good] * 4 + [[]] * 4, 8, c, o) == [4] * 4 + [0] * 4
    weak = [0.5, 0.2]
    assert choose_drafts([good] * 4 + [weak] * 4, 8, c, o) == [4] * 4 + [0] * 4  # the weak ones lower R: not taken
    assert choose_drafts([good, weak], 2, 0.0, 0.0) == [4, 2]  # free rows: every draft


def test_row_cost_measures_the_slope():
    cost = RowCost()
    assert cost.relative(1) == cost.prior
    for _ in range(40):  # 10 ms a pass + 5 ms a row
        for rows in (1, 3, 5):
            cost.record(rows, 0.010 + 0.005 * rows)
    assert abs(cost.relative(1) - 0.005 / 0.015) < 0.01
    assert abs(cost.relative(4) - 0.020 / 0.030) < 0.01
    assert cost.overhead(1) == 0.0  # no plain step measured yet


def test_row_cost_keeps_plain_steps_apart():
    """Plain steps (several per op call) cost less than a one-row verification pass; that gap is a
    pass's overhead, not a steep row cost."""
    cost = RowCost()
    for _ in range(60):
        for rows in (2, 3, 5):  # verification passes: 6 ms + 0.5 ms a row
            cost.record(rows, 0.006 + 0.0005 * rows)
        cost.record_plain(1, 0.0045)  # a plain step: 4.5 ms
        cost.record_plain(4, 0.007)
    assert cost.relative(1) == pytest.approx(0.0005 / 0.0045, rel=0.1)  # (the slope drawn a little to the prior)
    assert cost.overhead(1) == pytest.approx((0.0065 - 0.0045) / 0.0045, rel=0.2)  # (and the overhead towards 0)
    assert cost.relative(4) == pytest.approx(4 * 0.0005 / 0.007, rel=0.1)
    assert cost.overhead(4) == pytest.approx((0.008 - 0.007) / 0.007, rel=0.25)
    assert cost.overhead(2) == 0.0  # no plain step at this batch size
    for _ in range(200):  # plain steps only, for a long while: the passes' cost goes back to the prior
        cost.record_plain(1, 0.0045)
    assert cost.overhead(1) < 0.01 and cost.relative(1) == pytest.approx(cost.prior_b / 0.0045, rel=0.01)
    same = RowCost()  # every pass with the same rows: the slope stays the prior's
    for _ in range(60):
        same.record(5, 0.008)
        same.record_plain(1, 0.0045)
    assert same.relative(1) == pytest.approx(0.008 * 0.25 / 2.0 / 0.0045, rel=0.01)


def test_row_cost_is_fitted_per_batch_size():
    """Rows nearly free at batch 1 and dear beyond 8: each batch size reads its own passes (those of
    its bucket), not one line through both; a batch size with none reads all of them."""
    cost = RowCost()
    for _ in range(60):
        for rows in (2, 3, 5):  # batch 1: 4 ms + 0.2 ms a row
            cost.record(rows, 0.004 + 0.0002 * rows, batch_size=1)
        for rows in (10, 14, 20):  # batch 8: 6.5 ms + 0.8 ms a row (a pass of 9 rows: 1.5x a plain step)
            cost.record(rows, 0.0065 + 0.0008 * rows, batch_size=8)
        cost.record_plain(1, 0.0042)
        cost.record_plain(8, 0.0093)
    assert cost.relative(1) == pytest.approx(0.0002 / 0.0042, rel=0.2)  # (the slope drawn a little to the prior)
    assert cost.relative(8) == pytest.approx(8 * 0.0008 / 0.0093, rel=0.1)
    assert cost.overhead(8) == pytest.approx((0.0065 + 0.0064 - 0.0093) / 0.0093, rel=0.1)
    # 7 shares 8's bucket; no plain step measured there: a pass without drafts stands in for it
    assert cost.relative(7) == pytest.approx(7 * 0.0008 / (0.0065 + 7 * 0.0008), rel=0.1) and cost.overhead(7) == 0.0
    both = RowCost()  # the same passes with no batch size: one line through all of them
    for _ in range(60):
        for rows in (2, 3, 5):
            both.record(rows, 0.004 + 0.0002 * rows)
        for rows in (10, 14, 20):
            both.record(rows, 0.0065 + 0.0008 * rows)
        both.record_plain(8, 0.0093)
    assert both.overhead(8) < 0.6 * cost.overhead(8)
    assert cost.relative(16) == pytest.approx(both.relative(16), rel=1e-3)  # no pass at 9-16: all of them


def test_draft_length_pays_the_overhead_once():
    """With a pass's fixed overhead, drafts accepted nine times in ten are worth a long chain,
    and drafts that are mostly rejected are not worth the pass."""
    d = DraftLength.flat(4, 3, prior=0.6)
    for _ in range(12):
        d.record(3, 4, 4 if _ % 10 else 3)
        d.record(1, 1, 0)
    assert d.choose(3, 4, row_cost=0.11, overhead=0.45) == 4
    assert d.choose(3, 4, row_cost=0.4) == 4
    assert d.choose(1, 4, row_cost=0.11, overhead=0.45) == 0


def test_settings_are_validated_with_the_flag_named():
    with pytest.raises(ConfigError, match="--lookup-max-draft"):
        SpecConfig(draft_layer=1, verify_layer=2, lookup_max_draft=-1)
    with pytest.raises(ConfigError, match="--lookup-max-draft"):
        SpecConfig(draft_layer=1, verify_layer=2, lookup_max_draft=33)
    with pytest.raises(ConfigError, match="--lookup-ngram"):
        SpecConfig(draft_layer=1, verify_layer=2, lookup_ngram=0)
    with pytest.raises(ConfigError, match="--lookup-max-draft"):
        make_strategy("lookup", SpecConfig(draft_layer=1, verify_layer=2, lookup_max_draft=0))
    spec = resolve_spec("lookup", 6, lookup_max_draft=6, lookup_ngram=2)
    assert (spec.lookup_max_draft, spec.lookup_ngram) == (6, 2) and spec.lookahead >= 8


def test_library_refuses_what_is_not_a_count():
    for field, value in (("lookup_max_draft", 2.5), ("lookup_ngram", True), ("lookup_ngram", "3")):
        with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')} must be an integer"):
            SpecConfig(draft_layer=1, verify_layer=2, **{field: value})
    with pytest.raises(ConfigError, match="--lookup-max-draft >= 1"):  # before a model or engine is made
        resolve_spec("lookup", 6, lookup_max_draft=0)
    assert resolve_spec("hispec", 6, lookup_max_draft=0).lookup_max_draft == 0  # hispec: exits only


BAD_LOOKUP = [("--lookup-max-draft", "-1", "--lookup-max-draft must be between 0 and 32"),
              ("--lookup-max-draft", "33", "--lookup-max-draft must be between 0 and 32"),
              ("--lookup-max-draft", "0", "the lookup strategy needs --lookup-max-draft >= 1"),
              ("--lookup-ngram", "0", "--lookup-ngram must be between 1 and 8"),
              ("--lookup-ngram", "9", "--lookup-ngram must be between 1 and 8"),
              ("--lookup-ngram", "two", "argument --lookup-ngram: invalid int value")]


@pytest.mark.parametrize("flag,value,needle", BAD_LOOKUP)
def test_generate_and_bench_refuse_an_out_of_range_flag(tiny_text_model_dir, tmp_path, flag, value, needle):
    """Refused before any generation, one line naming the flag: ``generate`` (one prompt, a
    prompt file, batched) and ``bench`` (nothing is written)."""
    from tests.test_cli import run_cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abcabc"}\n')
    model = ["--model", str(tiny_text_model_dir), "--no-exits", "--max-new-tokens", "4"]
    for args in (["generate", "abcabc", "--strategy", "lookup"],
                 ["generate", "--prompts", str(prompts), "--batch-size", "2", "--strategy", "lookup"],
                 ["bench", "--data", str(prompts), "--strategies", "ar,lookup", "--out", str(tmp_path / "out")]):
        proc = run_cli(*args, *model, flag, value)
        assert proc.returncode == 2 and needle in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and not proc.stdout, (args, proc.stdout)
    assert not list(tmp_path.glob("out/*"))  # no results written


@pytest.mark.parametrize("flag,value,needle", [BAD_LOOKUP[1], BAD_LOOKUP[2], BAD_LOOKUP[4]])
def test_serve_refuses_an_out_of_range_flag_at_start(tiny_text_model_dir, flag, value, needle):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "hispec.cli", "serve", "--model", str(tiny_text_model_dir),
                           "--no-exits", "--strategy", "lookup", "--port", "0", flag, value],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr.strip().splitlines()[-1], proc.stderr


# ---- greedy: the same ids as ar ---------------------------------------------------------------

@pytest.fixture(scope="module")
def gen(tiny_model_dir) -> Generator:
    return Generator(load_model(tiny_model_dir("llama")))


@pytest.mark.parametrize("strategy", ["lookup", "hispec"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_equals_ar_and_drafts_are_accepted(gen, strategy, adaptive):
    accepted = rejected = 0
    for prompt in PROMPTS:
        for max_new in (1, 2, 7, 40):
            params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
            want = gen.generate(prompt, params, "ar")
            out = gen.generate(prompt, params, strategy, spec=SPEC, adaptive=adaptive)
            assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason), (prompt, max_new)
            lv = out.stats.levels.get("lookup->final")
            if lv is not None:
                accepted += lv.accepted_tokens
                rejected += lv.draft_tokens - lv.accepted_tokens
            assert gen.blocks.num_used_blocks == 0
            gen.blocks.check_invariants()
    if not adaptive:  # always speculating: drafts were verified, some kept, some not
        assert accepted > 20 and rejected > 0, (accepted, rejected)


def lookup_runs(gen, params: list[SamplingParams]):
    """``PROMPTS`` with ``params`` through ``lookup``, one at a time and batched: each one-at-a-time
    output's tokens with its lookup drafts and their accepted ones, and the batched outputs' tokens."""
    alone = [gen.generate(p, q, "lookup", spec=SPEC) for p, q in zip(PROMPTS, params)]
    engine = Engine(gen.model, make_strategy("lookup", SPEC, gen.model.num_layers),
                    EngineConfig(max_batch_size=3, kv_blocks=64), eos_ids=gen.eos_ids)
    ids = [engine.add_request(p, q) for p, q in zip(PROMPTS, params)]
    final = engine.run_to_completion()
    level = lambda o: (o.stats.levels["lookup->final"].draft_tokens,  # noqa: E731
                       o.stats.levels["lookup->final"].accepted_tokens)
    return [(o.token_ids, level(o)) for o in alone], [final[r].token_ids for r in ids]


@pytest.mark.parametrize("sampled", [False, True])
def test_rounds_in_one_op_call_match_the_general_path(gen, monkeypatch, sampled):
    """Free-draft rounds run as rows of one fused step (``greedy_rows``: layers, head and each row's
    token in C++, the argmax or a sample with the row's number); forced onto the general path
    (forward_many, exit_logits, ``choose``) the same prompts give the same tokens and the same
    acceptance, batched and alone (greedy, or sampled with two seeds and a greedy request beside them)."""
    from hispec.decode import speculative
    from hispec.model.runner import LayerRunner

    fused_calls = []
    real = LayerRunner.greedy_rows

    def counted(self, items, sampling=None):
        out = real(self, items, sampling)
        fused_calls.append(out is not None)
        return out

    def run():
        params = [SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8 * sampled, seed=s)
                  for s in (1, 2)] + [SamplingParams(max_new_tokens=30, ignore_eos=True)]
        return lookup_runs(gen, params)

    monkeypatch.setattr(LayerRunner, "greedy_rows", counted)
    fused = run()
    assert fused_calls and all(fused_calls)  # the op ran every round
    assert sum(level[0] for level in (o[1] for o in fused[0])) > 0  # drafts were verified
    monkeypatch.setattr(speculative, "_verify_free_op", lambda *a: None)
    monkeypatch.setattr(LayerRunner, "rows_logits", lambda self, items: None)
    fused_calls.clear()
    assert run() == fused and not fused_calls


def test_rounds_with_a_processor_take_their_logits_from_one_op_call_with_the_general_paths_bits(gen, monkeypatch):
    """Free-draft rounds with a logits processor (beside sampled requests) take every row's logits from
    one fused step (``rows_logits``: layers and head in C++); forced onto forward_many and exit_logits
    the same seeded prompts give the same tokens and acceptance, batched and alone: the same bits."""
    from hispec.model.runner import LayerRunner

    calls = []
    real = LayerRunner.rows_logits

    def counted(self, items):
        out = real(self, items)
        calls.append(out is not None)
        return out

    def run():
        params = [SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=s) for s in (1, 2)] + \
                 [SamplingParams(max_new_tokens=30, ignore_eos=True, presence_penalty=0.5)]
        return lookup_runs(gen, params)

    monkeypatch.setattr(LayerRunner, "rows_logits", counted)
    fused = run()
    assert calls and all(calls)  # the op ran every sampled round
    assert sum(level[0] for level in (o[1] for o in fused[0])) > 0  # drafts were verified
    monkeypatch.setattr(LayerRunner, "rows_logits", lambda self, items: None)
    assert run() == fused


def test_eos_inside_a_round(tiny_model_dir):
    """An EOS among accepted drafts ends the sequence where ar ends it."""
    g = Generator(load_model(tiny_model_dir("llama")))
    prompt = [5, 17, 99, 3, 5, 17, 99, 3, 5, 17]
    free = g.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True), "ar").token_ids
    # make a token the model repeats an EOS: the loop then ends inside a lookup round
    g.eos_ids = frozenset({free[6]})
    want = g.generate(prompt, SamplingParams(max_new_tokens=30), "ar")
    assert want.finish_reason == "eos"
    for strategy in ("lookup", "hispec"):
        out = g.generate(prompt, SamplingParams(max_new_tokens=30), strategy, spec=SPEC)
        assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason)


def test_batched_engine_with_different_lengths_and_end_conditions(gen, pinned_row_cost):
    """Continuous batching: sequences with and without matches share passes; max tokens and
    EOS fall inside rounds; batched plain runs stop at matches; each output equals its own
    batch-of-one ar output."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (40, 3, 17, 29)]
    params.append(SamplingParams(max_new_tokens=25))
    prompts = PROMPTS + [[9, 8, 7, 9, 8, 7, 9]]
    want = [gen.generate(p, sp, "ar").token_ids for p, sp in zip(prompts, params)]
    for strategy in ("lookup", "hispec"):
        for adaptive in (False, True):
            engine = Engine(gen.model, make_strategy(strategy, SPEC, gen.model.num_layers),
                            EngineConfig(max_batch_size=3, adaptive=adaptive, kv_blocks=64), eos_ids=gen.eos_ids)
            ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            final = engine.run_to_completion()
            assert [final[r].token_ids for r in ids] == want, (strategy, adaptive)
            if strategy == "lookup":  # batched plain runs stopped at matches, too
                assert sum(final[r].stats.lookup_stops for r in ids) > 0
            if not adaptive:
                assert sum(final[r].stats.rounds.get("lookup", 0) for r in ids) > 0
            assert engine.blocks.num_used_blocks == 0


def test_stop_string_inside_a_round(tiny_text_model_dir):
    g = Generator(load_model(tiny_text_model_dir))
    from hispec.generate import load_tokenizer

    g.tokenizer = load_tokenizer(tiny_text_model_dir)
    prompt = "abcabcabcabc"
    free = g.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True), "ar", chat=False)
    stop = free.text[5:7]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(stop,))
    want = g.generate(prompt, params, "ar", chat=False)
    for strategy in ("lookup", "hispec"):
        out = g.generate(prompt, params, strategy, spec=SPEC, chat=False)
        assert (out.token_ids, out.text, out.finish_reason) == (want.token_ids, want.text, want.finish_reason)


# ---- sampling: the target distribution --------------------------------------------------------

@pytest.fixture(scope="module")
def sampling_gen(model_dir) -> Generator:
    g = Generator(load_model(model_dir))
    g.eos_ids = frozenset()
    return g


LOOKUP_SPEC = SpecConfig(draft_layer=1, verify_layer=2, num_draft=2, window=2, lookup_max_draft=3, lookup_ngram=1)


def empirical(gen, strategy, params, num_seeds, prompt):
    from collections import Counter

    counts, drafted = Counter(), 0
    for seed in range(num_seeds):
        params.seed = seed
        out = gen.generate(prompt, params, strategy, spec=LOOKUP_SPEC)
        counts[tuple(out.token_ids)] += 1
        lv = out.stats.levels.get("lookup->final")
        drafted += lv.draft_tokens if lv else 0
    return counts, drafted


@pytest.mark.parametrize("setting", ["T1", "T1-penalties", "T0.8-topk3", "T1.3-topp0.8"])
@pytest.mark.parametrize("strategy", ["lookup", "hispec"])
def test_sampling_follows_the_target(sampling_gen, hf_model, monkeypatch, strategy, setting):
    """PROMPT's last token occurs earlier in it (an 8-token vocabulary repeats often), so the
    first round verifies a lookup draft: accepted with probability p(x), else drawn from p
    without x."""
    import tests.decode.test_speculative_sampling as ref

    prompt = PROMPT + PROMPT[:2]
    monkeypatch.setattr(ref, "PROMPT", prompt)
    params = _copy(SETTINGS[setting])
    counts, drafted = empirical(sampling_gen, strategy, params, 600, prompt)
    assert drafted > 300  # lookup drafts were really verified
    result = fit(counts, exact_joint(hf_model, params))
    report(f"{strategy}-lookup/{setting}", result)
    assert result["stat"] <= result["bound"], result


@pytest.mark.parametrize("strategy", ["lookup", "hispec"])
def test_batched_sampling_follows_the_target(sampling_gen, hf_model, monkeypatch, strategy):
    """Under continuous batching: six seeded requests at a time share each lookup pass (the
    batched acceptance rule, one-hot draft distributions), joined by one more whenever one ends."""
    from collections import Counter

    import tests.decode.test_speculative_sampling as ref

    prompt = PROMPT + PROMPT[:2]
    monkeypatch.setattr(ref, "PROMPT", prompt)
    params = _copy(SETTINGS["T1"])
    engine = Engine(sampling_gen.model, make_strategy(strategy, LOOKUP_SPEC, sampling_gen.model.num_layers),
                    EngineConfig(max_batch_size=6, kv_blocks=128, block_size=4, adaptive=False))
    counts, drafted, seeds, batched = Counter(), 0, iter(range(600)), 0
    while True:
        while engine.num_running + engine.num_waiting < 6 and (seed := next(seeds, None)) is not None:
            engine.add_request(prompt, SamplingParams(temperature=params.temperature, seed=seed,
                                                      max_new_tokens=params.max_new_tokens))
        if not engine.has_unfinished():
            break
        outs = engine.step()
        batched = max(batched, len(outs))  # sequences in one round
        for out in outs:
            if out.finished:
                counts[tuple(out.token_ids)] += 1
                lv = out.stats.levels.get("lookup->final")
                drafted += lv.draft_tokens if lv else 0
    assert sum(counts.values()) == 600 and drafted > 300 and batched == 6
    result = fit(counts, exact_joint(hf_model, params))
    report(f"{strategy}-lookup-batched/T1", result)
    assert result["stat"] <= result["bound"], result


def test_the_statistic_rejects_a_sampler_that_keeps_every_lookup_draft(sampling_gen, hf_model, monkeypatch):
    import hispec.decode.speculative as spec_mod
    import tests.decode.test_speculative_sampling as ref

    prompt = PROMPT + PROMPT[:2]
    monkeypatch.setattr(ref, "PROMPT", prompt)
    monkeypatch.setattr(spec_mod, "num_kept", lambda drafts, chosen: len(drafts))  # WRONG: keep every draft
    params = _copy(SETTINGS["T1"])
    counts, _ = empirical(sampling_gen, "lookup", params, 300, prompt)
    result = fit(counts, exact_joint(hf_model, params))
    assert result["stat"] > result["bound"], result


def test_seeded_sampling_is_reproducible(sampling_gen):
    prompt = PROMPT + PROMPT[:2]

    def run(seed):
        return sampling_gen.generate(prompt, SamplingParams(temperature=1.0, seed=seed, max_new_tokens=12),
                                     "lookup", spec=LOOKUP_SPEC, adaptive=True).token_ids

    assert run(4) == run(4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_after_lookup_rounds_equals_autoregressive(gen, temperature):
    """Driven round by round: after each round every layer holds the committed tokens but the
    pending one, and their K/V equal what one-token passes build (rejected drafts' K/V cut)."""
    from hispec.cache.block_manager import BlockManager
    from hispec.cache.kv_cache import KVPool
    from hispec.decode.base import DecodeContext
    from hispec.model.runner import LayerRunner
    from hispec.decode.speculative import Lookup
    from hispec.decode.stats import DecodeStats
    from tests.decode.test_speculative_edges import kv_of

    model, prompt, max_new = gen.model, PROMPTS[1], 24
    n, max_tokens = model.num_layers, len(PROMPTS[1]) + 24
    blocks = BlockManager(2 * (max_tokens // 4 + 8), 4, n)
    pool = KVPool(n, blocks.num_blocks, 4, model.cfg.num_kv_heads, model.cfg.head_dim, model.dtype, "cpu")
    runner, stats = LayerRunner(model, blocks, pool), DecodeStats("lookup")
    blocks.add_sequence(1)
    params = SamplingParams(temperature=temperature, seed=0, max_new_tokens=max_new)
    ctx = DecodeContext(runner, 1, list(prompt), params, 0 if temperature else None, stats, max_tokens, frozenset())
    runner.forward(1, 0, ctx.token_tensor(prompt[:-1]), 0, n)
    for chunk in Lookup(SPEC).steps(ctx):
        ctx.tokens.extend(chunk)
        assert [blocks.length(1, layer) for layer in range(n)] == [len(ctx.tokens) - 1] * n
        blocks.check_invariants()
    level = stats.levels["lookup->final"]
    assert level.accepted_tokens < level.draft_tokens  # rejected drafts' K/V were cut
    assert level.accepted_tokens > 0 or temperature  # (a random model's samples rarely repeat)
    held = len(ctx.tokens) - 1
    blocks.add_sequence(2)
    for pos, token in enumerate(ctx.tokens[:held]):
        runner.forward(2, pos, torch.tensor([token]), 0, n)
    for layer in range(n):
        for got, want in zip(kv_of(blocks, pool, 1, layer, held), kv_of(blocks, pool, 2, layer, held)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_plain_runs_stop_where_lookup_drafts_would_pay():
    """``lookup_stop``: the shortest match whose drafts would pay for a pass now (at a quarter of a
    step a row: a two-token match's, not a one-token match's), none where no match pays or no
    draft fits before the token limit, any match where nothing is measured; a sampled sequence's the
    same (its tokens do not depend on where its runs stop)."""
    from types import SimpleNamespace

    from hispec.spec.proposers.lookup import lookup_stop

    class Cost:
        def __init__(self, c: float, o: float, prior: float = 0.25) -> None:
            self.c, self.o, self.prior = c, o, prior

        def relative(self, batch_size: int) -> float:
            return self.c

        def overhead(self, batch_size: int) -> float:
            return self.o

    ctx = SimpleNamespace(lookup=LookupState(max_draft=8, max_ngram=3), remaining=100, params=SamplingParams())
    sampled = SimpleNamespace(lookup=LookupState(max_draft=8, max_ngram=3), remaining=100,
                              params=SamplingParams(temperature=1.0))
    for cost, batch in ((Cost(0.25, 0.1), 1), (Cost(0.02, 0.0), 1), (Cost(0.66, 0.35), 8), (None, 1)):
        assert lookup_stop(sampled, batch, cost) == lookup_stop(ctx, batch, cost)
    assert lookup_stop(ctx, 1, Cost(0.25, 0.1)) == 2
    assert lookup_stop(ctx, 1, Cost(0.02, 0.0)) == 1  # rows nearly free: a one-token match pays too
    assert lookup_stop(ctx, 8, Cost(0.66, 0.35)) == 0  # one sequence of 8 drafting: no match pays the pass
    assert lookup_stop(ctx, 1, Cost(3.0, 0.0)) == 0
    assert lookup_stop(ctx, 1, None) == 1
    ctx.remaining = 1  # the next token is the last: no room for a draft
    assert lookup_stop(ctx, 1, None) == 0


def test_plain_runs_stop_at_lookup_matches_with_the_same_tokens(gen, monkeypatch, pinned_row_cost):
    """Adaptive greedy ``lookup``: the plain runs of several steps in one op call stop where the
    text comes to end on a match whose drafts would pay (``lookup_stop``), the next round verifies
    them, and the tokens are ar's, as with runs that never stop."""
    from hispec.spec.proposers import lookup
    from hispec.kernels import layer_op

    if layer_op.layers_op() is None:
        pytest.skip("no C++ compiler or torch headers: no op to run several steps in")
    runs = []  # (steps asked, steps run, stop n) of the plain runs of several steps
    real = layer_op.decode_steps

    def recorded(*a):
        out = real(*a)
        if a[8] > 1:
            runs.append((a[8], out.shape[1], a[10][0][1] if a[10] else 0))
        return out

    monkeypatch.setattr(layer_op, "decode_steps", recorded)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    want = [gen.generate(p, params, "ar").token_ids for p in PROMPTS]
    runs.clear()
    outs = [gen.generate(p, params, "lookup", spec=SPEC, adaptive=True) for p in PROMPTS]
    assert [o.token_ids for o in outs] == want
    stopped = sum(bool(n and ran < asked) for asked, ran, n in runs)
    assert stopped > 0, runs  # a run stopped at a match
    assert sum(o.stats.lookup_stops for o in outs) == stopped  # what --stats shows
    monkeypatch.setattr(lookup, "lookup_stop", lambda *a: 0)
    runs.clear()
    assert [gen.generate(p, params, "lookup", spec=SPEC, adaptive=True).token_ids for p in PROMPTS] == want
    assert runs and not any(n for _, _, n in runs)
