"""Token trees are lossless: the walk over a tree samples the target exactly (chi-square, on a
synthetic tree and end to end), greedy trees give ``ar``'s ids with penalties and biases, and the
trees are not vacuous (runners-up and second lookup branches are accepted)."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import hispec.decode.speculative as spec_mod
import hispec.spec.proposers.exit as exit_mod
from hispec.config import ConfigError, SamplingParams, SpecConfig
from hispec.decode.tree import DraftTree, accept_tree, exit_tree
from hispec.generate import Generator
from hispec.model.load.checkpoint import load_model
from hispec.sampling.sampler import position_uniforms, sample_key
from tests.decode.test_speculative_greedy import make_agreeing
from tests.decode.test_speculative_sampling import (SETTINGS, SPEC, _copy, empirical, exact_joint, fit, gen,  # noqa: F401
                                                    hf_model, model_dir, repeats, report)


def _ctx(temperature: float, seed: int):
    return SimpleNamespace(params=SamplingParams(temperature=temperature), processor=None,
                           process=lambda logits, spec=(): logits)


def _u(seed: int) -> list[float]:
    """A sequence's numbers for the three positions after a root (``DecodeContext.uniforms``)."""
    return position_uniforms(sample_key(seed), 10, 3)


# ---- the walk, on a synthetic tree ----------------------------------------------------------
# root -> {1: a=2, 2: b=0, 3: c=5}; a -> {4: 3, 5: 1}; b -> {6: 3}. Rows: after each node.
TREE = DraftTree([7, 2, 0, 5, 3, 1, 3], [-1, 0, 0, 0, 1, 1, 2])
V = 6


def _logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(len(TREE), V, generator=g) * 1.2  # [N, V]


def _exact_two_tokens(logits: torch.Tensor) -> dict[tuple[int, int], float]:
    """P(first two committed tokens) by plain sampling: the root's row, then the row after the
    first token (the tree has a row only where that token is a node; elsewhere any row serves,
    but the walk never reaches one: its second token then comes from the root's recovery)."""
    p0 = logits[0].softmax(-1)
    out = {}
    for t1 in range(V):
        node = next((c for c in TREE.children(0) if TREE.tokens[c] == t1), None)
        if node is None:
            continue  # the walk stops after t1: only the first token is compared there
        p1 = logits[node].softmax(-1)
        for t2 in range(V):
            out[(t1, t2)] = float(p0[t1] * p1[t2])
    return out


def test_walk_samples_the_target():
    logits = _logits()
    first, pairs = Counter(), Counter()
    n = 20000
    for seed in range(n):
        path, nxt = accept_tree(_ctx(1.0, seed), TREE, logits, (), _u(seed))
        tokens = [TREE.tokens[i] for i in path[1:]] + [nxt]
        first[tokens[0]] += 1
        if len(tokens) >= 2:
            pairs[tuple(tokens[:2])] += 1
    p0 = logits[0].softmax(-1)
    result = fit(first, {t: float(p0[t]) for t in range(V)})
    assert result["stat"] <= result["bound"], result
    exact = _exact_two_tokens(logits)
    total = sum(exact.values())
    result = fit(pairs, {k: v / total for k, v in exact.items()})  # given the first token is a node
    assert result["stat"] <= result["bound"], result


def test_walk_rejects_a_wrong_rule():
    """WRONG: every position drawn with the first position's number (the second token then depends on
    the first): the statistic on pairs must catch it (so the test above can fail)."""
    logits, pairs = _logits(), Counter()
    for seed in range(20000):
        path, nxt = accept_tree(_ctx(1.0, seed), TREE, logits, (), _u(seed)[:1] * 3)
        tokens = [TREE.tokens[i] for i in path[1:]] + [nxt]
        if len(tokens) >= 2:
            pairs[tuple(tokens[:2])] += 1
    exact = _exact_two_tokens(logits)
    total = sum(exact.values())
    result = fit(pairs, {k: v / total for k, v in exact.items()})
    assert result["stat"] > result["bound"], result


def test_greedy_walk_follows_the_argmax():
    logits = torch.full((len(TREE), V), -5.0)
    logits[0, 0], logits[2, 3], logits[6, 4] = 5.0, 5.0, 5.0  # root -> b (node 2) -> 3 (node 6) -> 4
    path, nxt = accept_tree(_ctx(0.0, 0), TREE, logits)
    assert path == [0, 2, 6] and nxt == 4


def test_trees_from_branches_and_exits():
    t = DraftTree.of_branches(9, [[1, 2, 3], [1, 2, 4], [5]])
    assert t.tokens == [9, 1, 2, 3, 4, 5] and t.parents == [-1, 0, 1, 2, 2, 0]
    assert not t.is_chain and DraftTree.of_branches(9, [[1, 2]]).is_chain
    e = exit_tree(9, [1, 2], [[3, 4], [5]])
    assert e.tokens == [9, 1, 2, 3, 4, 5] and e.parents == [-1, 0, 1, 0, 0, 1]
    assert e.first(4).parents == [-1, 0, 1, 0]


@pytest.mark.parametrize("flag,value", [("tree_width", 0), ("tree_width", 9), ("lookup_branches", 0),
                                        ("lookup_branches", 5), ("tree_min_prob", -0.1), ("tree_min_prob", 1.0)])
def test_out_of_range_settings_name_the_flag(flag, value):
    with pytest.raises(ConfigError, match="--" + flag.replace("_", "-")):
        SpecConfig(draft_layer=1, verify_layer=2, **{flag: value})


def test_tree_levels_count_nodes_and_positions_by_depth():
    """A tree's round proposes every node (draft tokens) but positions only down to its depth: the
    acceptance per position is per depth, as a chain's."""
    from hispec.decode.stats import LevelStats

    t = exit_tree(9, [1, 2], [[3, 4], [5]])  # depth 2, 5 nodes below the root
    assert t.depth == 2 and DraftTree([9]).depth == 0 and DraftTree.of_branches(9, [[1, 2, 3], [4]]).depth == 3
    lv = LevelStats()
    lv.record(len(t) - 1, 1, depth=t.depth)
    lv.record(3, 3)  # a chain
    d = lv.to_dict()
    assert d["draft_tokens"] == 8 and d["accepted_tokens"] == 4
    assert d["acceptance_per_position"] == [1.0, 0.5, 1.0]


def test_runners_up_kept_by_their_branch_probability():
    """A runner-up joins the tree when its probability times the chain's before it (``reach``)
    reaches ``min_prob``; -inf (ruled out) never; and each row's chosen probability comes back."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.9, 0.04, 0.03, 0.02, 0.01]])
    logits = torch.log(p)  # row 0's last token ruled out (-inf)
    chosen = torch.tensor([0, 0])
    alts, p_chosen = exit_mod._runners_up(logits, chosen, 5)
    assert alts == [[1, 2, 3], [1, 2, 3, 4]] and p_chosen == pytest.approx([0.5, 0.9])
    alts, _ = exit_mod._runners_up(logits, chosen, 5, [0.1, 0.1])
    assert alts == [[1, 2], []]
    alts, _ = exit_mod._runners_up(logits, chosen, 5, [0.1, 0.1], reach=[0.5, 1.0])
    assert alts == [[1], []]  # 0.5 * 0.3 >= 0.1 > 0.5 * 0.15
    alts, _ = exit_mod._runners_up(logits, torch.tensor([1, 0]), 3)
    assert alts[0] == [0, 2]  # the chosen one is never its own runner-up; at most width - 1


def test_tree_min_probs_follow_the_measured_row_cost(agreeing):
    """``tree_min_prob=None``: a sequence, greedy or sampled, weighs a runner-up against what its row
    costs (the engine's measured share of a plain step, times the layers it runs through; the prior
    before one is measured); a number is taken as it is."""
    from hispec.spec.cost import RowCost

    model = agreeing.model
    n = model.num_layers
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0)
    batch = [SimpleNamespace(model=model, params=greedy, row_cost=0.4),
             SimpleNamespace(model=model, params=sampled, row_cost=0.4),
             SimpleNamespace(model=model, params=greedy, row_cost=None)]
    auto = SpecConfig(draft_layer=1, verify_layer=3, tree_width=3)
    assert auto.tree_min_prob is None
    got = exit_mod.tree_min_probs(batch, auto, 3)
    assert got == pytest.approx([0.4 * 3 / n, 0.4 * 3 / n, RowCost.prior * 3 / n])
    assert exit_mod.tree_min_probs(batch, replace(auto, tree_min_prob=0.07), 3) == [0.07] * 3


LIKELY = 1e-2  # the tiny agreeing model's exits are sure of themselves: its runners-up are unlikely


def test_min_prob_trees_draft_only_likely_branches(agreeing, monkeypatch):
    """``tree_min_prob`` keeps the trees lossless and smaller: fewer nodes verified than with every
    runner-up, and a round with none verifies a chain (counted as an ``exits`` round)."""
    sizes = {}
    real = spec_mod.verify_tree

    def spy(batch, trees, *args, **kwargs):
        sizes.setdefault(key, []).extend(len(t) for t in trees)
        return real(batch, trees, *args, **kwargs)

    monkeypatch.setattr(spec_mod, "verify_tree", spy)
    prompt = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    want = agreeing.generate(prompt, params, "ar").token_ids
    rounds = {}
    for key, p in (("all", 0.0), ("likely", LIKELY), ("none", 0.99)):
        spec = SpecConfig(draft_layer=1, verify_layer=6, num_draft=3, tree_width=4, tree_min_prob=p,
                          lookup_max_draft=0)
        out = agreeing.generate(prompt, params, "selfspec", spec=spec)
        assert out.token_ids == want, key
        rounds[key] = dict(out.stats.rounds)
    assert sum(sizes["all"]) > sum(sizes.get("likely", [])) > 0, sizes
    assert "none" not in sizes and rounds["none"].get("tree", 0) == 0 and rounds["none"]["exits"] > 0


# ---- end to end: sampling with trees follows the target ---------------------------------------
TREE_SPEC = replace(SPEC, tree_width=3, tree_min_prob=0.0, lookup_branches=3)  # every runner-up


@pytest.mark.parametrize("strategy,num_seeds", [("selfspec", 800), ("hispec", 1000)])
def test_tree_sampling_follows_the_target(gen, hf_model, strategy, num_seeds, monkeypatch):  # noqa: F811
    monkeypatch.setattr("tests.decode.test_speculative_sampling.SPEC", TREE_SPEC)
    params = _copy(SETTINGS["T1"])
    result = fit(empirical(gen, strategy, params, num_seeds), exact_joint(hf_model, params))
    report(f"{strategy}-tree/T1", result)
    assert result["stat"] <= result["bound"], result


def test_tree_sampling_with_penalties_follows_the_target(gen, hf_model, monkeypatch):  # noqa: F811
    monkeypatch.setattr("tests.decode.test_speculative_sampling.SPEC", TREE_SPEC)
    params = _copy(SETTINGS["T1-penalties"])
    counts, joint = empirical(gen, "hispec", params, 400), exact_joint(hf_model, params)
    for result in (fit(counts, joint), fit(*repeats(counts, joint))):
        assert result["stat"] <= result["bound"], result


# ---- greedy: ar's ids, and not vacuous ----------------------------------------------------------
@pytest.fixture(scope="module")
def agreeing(tiny_model_dir) -> Generator:
    model = load_model(tiny_model_dir("llama"))
    make_agreeing(model)
    return Generator(model)


class PathSpy:
    """Counts accepted tree nodes that are not on the first branch (runners-up, other matches)."""

    def __init__(self, monkeypatch) -> None:
        self.off_chain = 0
        real = spec_mod.accept_tree

        def spy(ctx, tree, logits, prefix=(), u=None):
            path, nxt = real(ctx, tree, logits, prefix, u)
            self.off_chain += sum(1 for j, n in enumerate(path) if n != j)
            return path, nxt

        monkeypatch.setattr(spec_mod, "accept_tree", spy)


PENALISED = dict(presence_penalty=0.5, frequency_penalty=0.7, logit_bias=((3, 2.0), (17, -1.0)))


@pytest.mark.parametrize("strategy", ["selfspec", "hispec"])
@pytest.mark.parametrize("extra", [{}, PENALISED])
def test_greedy_exit_trees_equal_ar(agreeing, monkeypatch, strategy, extra):
    spy = PathSpy(monkeypatch)
    spec = SpecConfig(draft_layer=1, verify_layer=6 if strategy == "selfspec" else 3, num_draft=3, window=4,
                      tree_width=4, tree_min_prob=0.0, lookup_max_draft=0)
    for seed in range(6):
        prompt = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        params = SamplingParams(max_new_tokens=30, ignore_eos=True, **extra)
        assert agreeing.generate(prompt, params, strategy, spec=spec).token_ids == \
            agreeing.generate(prompt, params, "ar").token_ids
        agreeing.blocks.check_invariants()
    assert spy.off_chain > 0, "no runner-up was ever accepted: the test cannot fail"


@pytest.mark.parametrize("strategy", ["lookup", "hispec"])
def test_greedy_lookup_branches_equal_ar(agreeing, monkeypatch, strategy):
    """Real matches: several branches where the text repeats a token with different followers."""
    spec = SpecConfig(draft_layer=1, verify_layer=3, lookup_max_draft=4, lookup_branches=4, lookup_ngram=1)
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        motif = int(torch.randint(3, 128, (1,), generator=g))
        prompt = [t for _ in range(5) for t in [motif] + torch.randint(3, 128, (2,), generator=g).tolist()]
        params = SamplingParams(max_new_tokens=30, ignore_eos=True)
        assert agreeing.generate(prompt, params, strategy, spec=spec).token_ids == \
            agreeing.generate(prompt, params, "ar").token_ids


def test_second_lookup_branch_is_accepted(agreeing, monkeypatch):
    """Not vacuous: where the first branch is wrong and another holds the text to come, the round
    accepts along the other one (and the output is still ar's)."""
    spy = PathSpy(monkeypatch)
    spec = SpecConfig(draft_layer=1, verify_layer=3, lookup_max_draft=3, lookup_branches=2)
    prompt = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = agreeing.generate(prompt, params, "ar").token_ids
    real = spec_mod.free_drafts

    def oracle(batch, max_draft, max_ngram, cost):
        real(batch, max_draft, max_ngram, cost)  # (makes each sequence's lookup state)
        out = []
        for c in batch:
            done = len(c.tokens) - len(prompt)  # output tokens committed; want[done - 1] is pending
            right = want[done:done + min(3, c.remaining - 1)]
            wrong = [(t + 1) % 128 for t in right]
            c.lookup.index.branches_of = lambda tokens, k, w=wrong, r=right: [w[:k], r[:k]]
            out.append(wrong)
        return out

    monkeypatch.setattr(spec_mod, "free_drafts", oracle)
    assert agreeing.generate(prompt, params, "lookup", spec=spec).token_ids == want
    assert spy.off_chain > 0


def test_adaptive_tree_engine_weighs_chains_and_equals_ar(agreeing):
    """Adaptive decoding of a tree-drafting strategy runs trees, chains and plain steps, and its
    output is ar's whichever ran."""
    from hispec.llm import LLM

    spec = SpecConfig(draft_layer=1, verify_layer=3, num_draft=3, tree_width=3, tree_min_prob=0.0,
                      lookup_max_draft=0)
    llm = LLM(agreeing, "hispec", spec=spec, max_batch_size=4, adaptive=True)
    llm.engine.adaptive.warmup, llm.engine.adaptive.explore_every = 1, 2
    prompts = [torch.randint(3, 128, (10,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == [agreeing.generate(p, params, "ar").token_ids for p in prompts]
    assert all(n > 0 for n in llm.engine.adaptive.steps.values()), llm.engine.adaptive.steps
