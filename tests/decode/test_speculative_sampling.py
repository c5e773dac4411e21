"""Speculative *sampling* is lossless: the committed tokens follow the full model's distribution.

The model has an 8-token vocabulary, so the exact joint distribution of the first 2-3 new
tokens is enumerated from a Hugging Face ``transformers`` forward pass of the same weights
(with temperature / top-k / top-p applied by an independent reference implementation).
Many seeded generations of each strategy are compared to it with a chi-square goodness-of-fit
test at significance ``ALPHA``; seeds are fixed, so every run gives the same statistic. The
same statistic must reject deliberately wrong acceptance rules, so the test has power. And every
strategy gives a seed's tokens exactly as ``ar`` does (each position's token is drawn with its own
uniform number, whatever drafted it).
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import hispec.decode.speculative as spec_mod
from hispec.config import SamplingParams, SpecConfig
from hispec.generate import Generator
from hispec.model.load.checkpoint import load_model
from hispec.decode.base import DecodeContext
from hispec.sampling.sampler import argmax, choose, logits_to_probs, pick, position_uniforms, sample_key
from hispec.sampling.speculative import accept_chosen, accept_chosen_batch

ALPHA = 1e-3  # chi-square significance level; the wrong samplers score p-values far below it
VOCAB = 8
PROMPT = [1, 5, 3, 7]
# Weights at initializer_range 0.2: the draft (layer 1), intermediate (layer 2) and final
# (layer 4) exits disagree substantially (total variation ~0.2-0.4), so acceptance and
# rejection both happen often and a biased rule shows.
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.2)
SPEC = SpecConfig(draft_layer=1, verify_layer=2, num_draft=2, window=2)


# ---- statistics ----------------------------------------------------------------------------

def chi2_sf(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution: P(X >= stat)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_bound(df: int, alpha: float = ALPHA) -> float:
    """The statistic whose upper tail is ``alpha`` (bisection on ``chi2_sf``)."""
    lo, hi = 0.0, df + 40.0 * math.sqrt(df) + 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def chi_square(counts: Counter, expected: dict, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expecting fewer than ``min_expected``
    draws are pooled into one. A draw outside the support makes the statistic infinite."""
    n = sum(counts.values())
    if any(key not in expected or expected[key] == 0 for key in counts):
        return math.inf, 1
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for key, p in expected.items():
        if n * p >= min_expected:
            cells.append((counts.get(key, 0), n * p))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(key, 0), pooled_exp + n * p
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, len(cells) - 1


def total_variation(counts: Counter, expected: dict) -> float:
    n = sum(counts.values())
    keys = set(counts) | set(expected)
    return 0.5 * sum(abs(counts.get(k, 0) / n - expected.get(k, 0.0)) for k in keys)


def fit(counts: Counter, expected: dict) -> dict:
    stat, df = chi_square(counts, expected)
    return {"stat": stat, "df": df, "bound": chi2_bound(df), "p": chi2_sf(stat, df) if stat < math.inf else 0.0,
            "tv": total_variation(counts, expected)}


# ---- the model and the exact target ----------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", seed=1, **TINY)


@pytest.fixture(scope="module")
def gen(model_dir) -> Generator:
    g = Generator(load_model(model_dir))
    g.eos_ids = frozenset()  # token 2 is Llama's EOS; here every run makes exactly max_new_tokens
    return g


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k (ties at the k-th value kept), then top-p (the smallest prefix of
    the sorted distribution whose mass reaches top_p), in float64. Rows of ``logits [B, V]``."""
    x = logits.double() / params.temperature
    if params.top_k:
        kth = x.topk(params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    p = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        out = torch.zeros_like(p)
        for r in range(p.shape[0]):
            mass = 0.0
            for t in p[r].argsort(descending=True).tolist():
                if mass >= params.top_p:
                    break
                out[r, t] = p[r, t]
                mass += float(p[r, t])
        p = out / out.sum(-1, keepdim=True)
    return p


def penalised(logits: torch.Tensor, prefixes: list[tuple[int, ...]], params: SamplingParams) -> torch.Tensor:
    """OpenAI's logit_bias and presence/frequency penalties over each row's generated tokens."""
    x = logits.double().clone()
    for r, s in enumerate(prefixes):
        for t, b in params.logit_bias:
            x[r, t] += b
        for t in set(s):
            x[r, t] -= params.frequency_penalty * s.count(t) + params.presence_penalty
    return x


def exact_joint(hf_model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first ``max_new_tokens`` new tokens == t) for every sequence t, by enumeration."""
    joint = {(): 1.0}
    for _ in range(params.max_new_tokens):
        prefixes = list(joint)
        with torch.no_grad():
            logits = hf_model(torch.tensor([PROMPT + list(s) for s in prefixes])).logits[:, -1]
        probs = reference_probs(penalised(logits, prefixes, params), params)
        joint = {s + (t,): joint[s] * float(probs[i, t])
                 for i, s in enumerate(prefixes) for t in range(VOCAB) if probs[i, t] > 0}
    assert abs(sum(joint.values()) - 1.0) < 1e-9
    return joint


def empirical(gen: Generator, strategy: str, params: SamplingParams, num_seeds: int) -> Counter:
    counts = Counter()
    for seed in range(num_seeds):
        params.seed = seed
        out = gen.generate(PROMPT, params, strategy, spec=SPEC)
        assert len(out.token_ids) == params.max_new_tokens
        counts[tuple(out.token_ids)] += 1
    return counts


SETTINGS = {
    "T1": SamplingParams(temperature=1.0, max_new_tokens=2),
    "T0.8-topk3": SamplingParams(temperature=0.8, top_k=3, max_new_tokens=3),
    "T1.3-topp0.8": SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=2),
    "T1-penalties": SamplingParams(temperature=1.0, max_new_tokens=3, presence_penalty=0.8, frequency_penalty=1.5,
                                   logit_bias=((0, 1.5), (4, -1.0))),
}


def _copy(params: SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                          max_new_tokens=params.max_new_tokens, presence_penalty=params.presence_penalty,
                          frequency_penalty=params.frequency_penalty, logit_bias=params.logit_bias)


RESULTS: dict[str, dict] = {}  # printed with -s; the report quotes them


def report(name: str, result: dict) -> None:
    RESULTS[name] = result
    print(f"\n{name}: chi2={result['stat']:.1f} df={result['df']} bound={result['bound']:.1f} "
          f"p={result['p']:.3g} tv={result['tv']:.3f}")


# ---- end to end: the strategies sample from the target ---------------------------------------

@pytest.mark.parametrize("strategy,num_seeds", [("ar", 500), ("selfspec", 800), ("hispec", 1000)])
def test_first_two_tokens_follow_the_target(gen, hf_model, strategy, num_seeds):
    params = _copy(SETTINGS["T1"])
    result = fit(empirical(gen, strategy, params, num_seeds), exact_joint(hf_model, params))
    report(f"{strategy}/T1", result)
    assert result["stat"] <= result["bound"], result


@pytest.mark.parametrize("setting", ["T0.8-topk3", "T1.3-topp0.8", "T1-penalties"])
def test_hispec_follows_the_target_with_top_k_and_top_p(gen, hf_model, setting):
    params = _copy(SETTINGS[setting])
    counts, joint = empirical(gen, "hispec", params, 400), exact_joint(hf_model, params)
    result = fit(counts, joint)
    report(f"hispec/{setting}", result)
    assert result["stat"] <= result["bound"], result
    if params.modifies_logits:  # the penalties' own effect, with the statistic that catches blind penalties
        result = fit(*repeats(counts, joint))
        report(f"hispec/{setting} (repeats)", result)
        assert result["stat"] <= result["bound"], result


def test_the_statistic_rejects_penalties_blind_to_speculative_tokens(gen, hf_model, monkeypatch):
    """WRONG: rows of a verification pass penalised as if no speculative token preceded them."""
    import hispec.sampling.processors as processors

    right = processors.LogitsProcessor.__call__
    monkeypatch.setattr(processors.LogitsProcessor, "__call__",
                        lambda self, logits, spec: torch.cat([right(self, row, []) for row in logits.split(1)]))
    params = _copy(SETTINGS["T1-penalties"])
    result = fit(*repeats(empirical(gen, "hispec", params, 400), exact_joint(hf_model, params)))
    report("WRONG blind penalties/hispec/T1-penalties (repeats)", result)
    assert result["stat"] > result["bound"], result


def repeats(counts: Counter, joint: dict) -> tuple[Counter, dict]:
    """Both distributions over the number of repeated tokens in a sequence (what penalties act on)."""
    expected: dict = {}
    for s, p in joint.items():
        expected[len(s) - len(set(s))] = expected.get(len(s) - len(set(s)), 0.0) + p
    return Counter({len(s) - len(set(s)): 0 for s in joint}) + Counter(
        {k: sum(n for s, n in counts.items() if len(s) - len(set(s)) == k) for k in expected}), expected


def accept_all(drafts, chosen):
    """WRONG: keep every draft (the output then follows the exit's distribution)."""
    k = drafts.shape[0]
    return k, int(chosen[k]) if chosen.shape[0] > k else None


def one_number(self, start, n):
    """WRONG: one uniform number for every position (a sequence's tokens then depend on each other)."""
    return position_uniforms(self.sample_key, 0, 1) * n


@pytest.mark.parametrize("wrong,strategy,num_seeds", [("accept_all", "selfspec", 300), ("one_number", "hispec", 500)])
def test_the_statistic_rejects_a_biased_sampler(gen, hf_model, monkeypatch, wrong, strategy, num_seeds):
    if wrong == "accept_all":  # the strategies call the name they imported into hispec.decode.speculative
        monkeypatch.setattr(spec_mod, "accept_chosen", accept_all)
    else:
        monkeypatch.setattr(DecodeContext, "uniforms", one_number)
    params = _copy(SETTINGS["T1"])
    result = fit(empirical(gen, strategy, params, num_seeds), exact_joint(hf_model, params))
    report(f"WRONG {wrong}/{strategy}/T1", result)
    assert result["stat"] > result["bound"], result


def test_reference_target_matches_hispec_model(gen, hf_model):
    """The enumeration's logits (transformers) and hispec's full model agree."""
    from hispec.cache.block_manager import BlockManager
    from hispec.cache.kv_cache import KVPool
    from hispec.model.runner import LayerRunner

    model, cfg = gen.model, gen.model.cfg
    blocks = BlockManager(4, 4, model.num_layers)
    pool = KVPool(model.num_layers, 4, 4, cfg.num_kv_heads, cfg.head_dim, model.dtype, "cpu")
    blocks.add_sequence(0)
    h = LayerRunner(model, blocks, pool).forward(0, 0, torch.tensor(PROMPT), 0, model.num_layers)
    with torch.no_grad():
        want = hf_model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(model.exit_logits(h, model.num_layers), want, atol=1e-4, rtol=1e-4)


# ---- reproducibility --------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["ar", "selfspec", "hispec"])
def test_seeded_runs_are_reproducible(gen, strategy):
    def run(seed):
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=10)
        return gen.generate(PROMPT, params, strategy, spec=SPEC).token_ids

    assert run(3) == run(3)
    assert len({tuple(run(seed)) for seed in range(6)}) > 1


@pytest.mark.parametrize("strategy", ["selfspec", "hispec", "lookup"])
@pytest.mark.parametrize("setting", ["T1", "T0.8-topk3", "T1-penalties"])
def test_every_strategy_gives_a_seeds_tokens_as_ar_does(gen, strategy, setting):
    """A token is drawn with its position's number whichever level or round chooses it, so a seed's
    tokens are ``ar``'s however many drafts were kept (the exits here disagree often)."""
    for seed in range(12):
        params = _copy(SETTINGS[setting])
        params.seed, params.max_new_tokens = seed, 12
        want = gen.generate(PROMPT, params, "ar", spec=SPEC).token_ids
        assert gen.generate(PROMPT, params, strategy, spec=SPEC).token_ids == want, seed


# ---- the positional numbers -------------------------------------------------------------------

def test_position_uniforms_are_uniform_and_independent_across_positions_and_keys():
    """Each number follows U[0, 1) (20 bins), a position's number is independent of the next one's
    (a 5 x 5 grid of pairs), keys from nearby seeds give unrelated streams, and a number depends on
    its key and position only (the same for any ``start``)."""
    keys = [sample_key(seed) for seed in range(400)]
    u = [position_uniforms(k, 10, 30) for k in keys]  # [400][30]
    flat = [x for row in u for x in row]
    assert all(0.0 <= x < 1.0 for x in flat)
    result = fit(Counter(int(x * 20) for x in flat), {b: 1 / 20 for b in range(20)})
    assert result["stat"] <= result["bound"], result
    pairs = Counter((int(a * 5), int(b * 5)) for row in u for a, b in zip(row, row[1:]))
    result = fit(pairs, {(i, j): 1 / 25 for i in range(5) for j in range(5)})
    assert result["stat"] <= result["bound"], result
    across = Counter((int(a[0] * 5), int(b[0] * 5)) for a, b in zip(u, u[1:]))  # seeds s and s + 1
    result = fit(across, {(i, j): 1 / 25 for i in range(5) for j in range(5)})
    assert result["stat"] <= result["bound"], result
    assert position_uniforms(keys[3], 15, 2) == u[3][5:7]
    assert sample_key(-1) != sample_key(1) and len(set(keys)) == len(keys)


# ---- the accept rule ------------------------------------------------------------------------

@pytest.mark.parametrize("drafts,argmax,expected", [
    ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all accepted, bonus
    ([1, 2, 3], [1, 5, 3, 4], (1, 5)),  # first mismatch ends the run, even if later ones match
    ([1, 2, 3], [0, 2, 3, 4], (0, 0)),
    ([1, 2, 3], [1, 2, 3], (3, None)),  # no bonus row
    ([1, 2, 3], [1, 2, 0], (2, 0)),
    ([], [6], (0, 6)),
])
def test_accept_chosen(drafts, argmax, expected):
    assert accept_chosen(torch.tensor(drafts, dtype=torch.long), torch.tensor(argmax)) == expected


# ---- the batched rules are the one-sequence rules, sequence by sequence ----------------------

def test_batched_accept_rule_equals_the_one_sequence_rule():
    """Ragged batches (0 to 4 drafts): each sequence gets exactly what ``accept_chosen`` gives it."""
    r = torch.Generator().manual_seed(0)
    for trial in range(200):
        counts = torch.randint(0, 5, (int(torch.randint(1, 6, (1,), generator=r)),), generator=r).tolist()
        chosen = [torch.randint(0, 3, (k + 1,), generator=r) for k in counts]
        guesses = [torch.randint(0, 3, (k,), generator=r) for k in counts]
        num, token = accept_chosen_batch(guesses, torch.cat(chosen))
        assert list(zip(num.tolist(), token.tolist())) == [accept_chosen(g, a) for g, a in zip(guesses, chosen)]


def test_per_row_sampling_parameters_give_each_row_its_own_result():
    rows = [SamplingParams(temperature=0.9, top_p=0.95), SamplingParams(temperature=0.7, top_k=5), SamplingParams(),
            SamplingParams(temperature=1.3, top_k=3, top_p=0.5), SamplingParams(temperature=1.0, top_k=100),
            SamplingParams(temperature=1e-40)]
    logits = 3 * torch.randn(len(rows), 40, generator=torch.Generator().manual_seed(1))
    together = logits_to_probs(logits, rows)
    for r, params in enumerate(rows):
        assert torch.equal(together[r], logits_to_probs(logits[r:r + 1], params)[0]), params
    u = torch.rand(len(rows), dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    tokens, probs = choose(logits, rows, u)
    assert tokens.tolist() == [int(argmax(logits[r])) if p.greedy else int(pick(logits_to_probs(logits[r:r + 1], p),
                                                                               u[r:r + 1])[0])
                               for r, p in enumerate(rows)]
    sampled = [r for r, p in enumerate(rows) if not p.greedy]
    assert torch.equal(probs, together[sampled])


def full_sort_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by sorting the whole row (what ``_top_p`` did before it sorted a prefix), renormalised."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p >= top_p
    drop[..., 0] = False
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("spread", [0.3, 2.0, 8.0])
def test_top_p_sorts_a_prefix_and_keeps_what_a_full_sort_keeps(spread, monkeypatch):
    """The nucleus from each row's largest tokens (``TOP_P_PREFIX``, 8x more while a nucleus is longer)
    has the bits of a full sort's, from a one-token nucleus to one of thousands of tokens (flat rows),
    with rows without top-p beside them; and it matches the float64 definition."""
    from hispec.sampling import sampler

    monkeypatch.setattr(sampler, "TOP_P_PREFIX", 16)  # nuclei past 16 and 128 tokens on a 4,096-token row
    g = torch.Generator().manual_seed(7)
    logits = spread * torch.randn(6, 4096, generator=g)
    probs = torch.softmax(logits, -1)
    for top_p in (0.0, 0.3, 0.9, 0.999):
        kept = sampler._top_p(probs, [top_p] * 6)
        assert torch.equal(kept, full_sort_top_p(probs, top_p)), top_p
        lengths = (kept > 0).sum(-1)
        assert lengths.min() >= 1 and (spread < 1 and top_p > 0.5) <= bool(lengths.max() > 128)
    mixed = sampler._top_p(probs, [0.9, 1.0, 0.5, 1.0, 0.999, 0.2])
    for r, top_p in enumerate([0.9, 1.0, 0.5, 1.0, 0.999, 0.2]):
        assert torch.equal(mixed[r], probs[r] if top_p == 1.0 else full_sort_top_p(probs[r:r + 1], top_p)[0])
    params = SamplingParams(temperature=1.0, top_p=0.9)
    assert torch.allclose(logits_to_probs(logits, params).double(), reference_probs(logits, params), atol=1e-6)


def test_pick_draws_each_row_exactly(monkeypatch):
    """``pick`` follows each row's distribution for uniform ``u`` (a race where few tokens have p > 0, the
    inverse distribution function elsewhere), never gives a token with p = 0 (not even where rounding
    reaches the end of a long row), gives 0 for a row of zeros, and the compiled kernel picks what the
    PyTorch / NumPy definition picks, on rows of both kinds."""
    from hispec.sampling import sampler

    probs = torch.zeros(3, 1000)
    probs[0, [3, 500, 999]] = torch.tensor([0.2, 0.5, 0.3])
    probs[1, 42] = 1.0
    u = torch.tensor(position_uniforms(sample_key(0), 0, 6000), dtype=torch.float64)
    counts = Counter(sampler.pick(probs[:1].expand(6000, -1).contiguous(), u).tolist())
    assert set(counts) == {3, 500, 999}
    assert all(abs(counts[t] / 6000 - p) < 0.025 for t, p in ((3, 0.2), (500, 0.5), (999, 0.3))), counts
    g = torch.Generator().manual_seed(4)
    long = torch.zeros(2, 2000)
    long[:, :1500] = torch.softmax(torch.randn(2, 1500, generator=g), -1)  # more than RACE_MAX tokens
    small = torch.softmax(3 * torch.randn(40, 300, generator=g), -1)
    small[small < 1e-3] = 0.0  # tens of tokens each: races
    u = torch.rand(40, dtype=torch.float64, generator=g)
    edge = torch.tensor([1.0 - 2.0 ** -53, 0.3], dtype=torch.float64)
    picks = []
    for kernel in (True, False):  # the compiled pick (where built), then the definition
        if not kernel:
            monkeypatch.setattr(sampler.fused, "available", lambda: False)
        assert sampler.pick(probs[1:2], u[:1]).tolist() == [42]
        assert sampler.pick(torch.zeros(1, 10), u[:1]).tolist() == [0]
        got = sampler.pick(long, edge).tolist()
        assert got[0] == 1499 and got[1] == int(torch.searchsorted(long[1].double().cumsum(0),
                                                                   0.3 * long[1].double().sum(), right=True))
        picks.append(sampler.pick(small, u))
        assert bool((small.gather(1, picks[-1][:, None]) > 0).all())
    assert torch.equal(picks[0], picks[1])


def test_rows_drawn_with_one_number_agree_as_a_coupling_allows():
    """Two close distributions drawn with the same numbers (an exit's draft and its verifier's draw) give
    the same token nearly as often as ``1 - TV`` allows (the race), far more than inverting both in
    vocabulary order would, and each still follows its own distribution."""
    from hispec.sampling import sampler

    g = torch.Generator().manual_seed(5)
    logits = 4 * torch.randn(3000, 200, generator=g)
    p, q = torch.softmax(logits, -1), torch.softmax(logits + 0.5 * torch.randn(3000, 200, generator=g), -1)
    u = torch.rand(3000, dtype=torch.float64, generator=g)
    same = float((sampler.pick(p, u) == sampler.pick(q, u)).double().mean())
    bound = 1 - 0.5 * float((p - q).abs().sum(-1).mean())
    inverse = [torch.searchsorted(x.double().cumsum(-1), u[:, None] * x.double().sum(-1, keepdim=True), right=True)
               for x in (p, q)]
    vocab_order = float((inverse[0] == inverse[1]).double().mean())
    assert bound - 0.06 < same <= bound + 0.02 and same > vocab_order + 0.05, (same, bound, vocab_order)
    row = torch.softmax(torch.randn(1, 12, generator=g), -1)
    u = torch.tensor(position_uniforms(sample_key(1), 0, 8000), dtype=torch.float64)
    counts = Counter(sampler.pick(row.expand(8000, -1).contiguous(), u).tolist())
    result = fit(counts, {t: float(row[0, t]) for t in range(12)})
    assert result["stat"] <= result["bound"], result


def test_the_sampling_kernel_gives_the_pytorch_distributions(monkeypatch):
    """``logits_to_probs`` on a CPU (the compiled kernel) against the PyTorch definition (the path other
    devices take), rows of mixed parameters side by side: the same kept tokens (top-k, nuclei of one to
    thousands of tokens, greedy rows one-hot) and the same values to float rounding."""
    from hispec.kernels import fused
    from hispec.sampling import sampler

    if not fused.available():
        pytest.skip("hispec's compiled kernels are unavailable")
    g = torch.Generator().manual_seed(11)
    rank = torch.randperm(4096, generator=g).float() + 1
    logits = torch.cat([3 * torch.randn(4, 4096, generator=g), (-1.5 * rank.log())[None].expand(2, -1),
                        0.2 * torch.randn(2, 4096, generator=g)])  # [8, V]: spread, peaked, flat rows
    logits[1, 7] = float("-inf")  # a masked token (a grammar, a logit bias)
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.3, top_k=50), SamplingParams(),
              SamplingParams(temperature=0.5, top_k=20, top_p=0.8), SamplingParams(temperature=1.0, top_p=0.999),
              SamplingParams(temperature=1.0, top_p=0.95), SamplingParams(temperature=2.0, top_k=4000, top_p=0.5)]
    kernel = logits_to_probs(logits, params)
    alone = [logits_to_probs(logits[r:r + 1], params[r])[0] for r in range(8)]  # a row does not see the others
    monkeypatch.setattr(fused, "available", lambda: False)
    reference = logits_to_probs(logits, params)  # the PyTorch ops
    assert torch.equal(kernel > 0, reference > 0)
    assert torch.allclose(kernel, reference, rtol=1e-5, atol=1e-7)
    assert kernel[1, 7] == 0 and torch.equal(kernel[3], torch.nn.functional.one_hot(logits[3].argmax(), 4096).float())
    assert ((kernel > 0).sum(-1) > 1000).any() and (kernel > 0).sum(-1).tolist()[2] == 50
    assert torch.allclose(kernel.sum(-1), torch.ones(8))
    assert all(torch.equal(kernel[r], alone[r]) for r in range(8))


def test_argmax_is_torch_argmax():
    """``sampler.argmax`` (numpy's on CPU float32) picks what ``torch.argmax`` picks: the first of
    tied maxima, the first NaN, index 0 of an all ``-inf`` row, rows of any leading shape and
    strides; other dtypes go to torch itself."""
    g = torch.Generator().manual_seed(0)
    nan, inf = float("nan"), float("inf")
    cases = [torch.tensor([[1.0, 3.0, 3.0, 2.0], [-inf, -inf, -inf, -inf], [1.0, nan, 5.0, nan], [inf, 1.0, inf, 0.0],
                           [0.0, -0.0, 0.0, -1.0], [-0.0, 0.0, -1.0, -1.0]]),
             torch.randint(0, 4, (64, 300), generator=g).float(),  # many ties
             torch.randn(3, 5, 49, generator=g),
             torch.randn(8, 98, generator=g)[:, ::2],  # strided rows
             torch.randn(98, 8, generator=g).T,
             torch.randn(7, generator=g)]
    for x in cases:
        got = argmax(x)
        assert got.dtype == torch.long and torch.equal(got, x.argmax(-1)), x
    for dtype in (torch.bfloat16, torch.float64):
        x = torch.randint(0, 4, (16, 64), generator=g).to(dtype)
        assert torch.equal(argmax(x), x.argmax(-1))
