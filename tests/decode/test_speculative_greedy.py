"""Greedy decoding is lossless: ``selfspec`` and ``hispec`` produce ``ar``'s token ids exactly.

"Identical" here means the same token ids in the same precision and kernels (float32, or the
int4/int8 kernels) on these tiny random models: batched
verification passes may differ from one-token passes in the last bits of the logits, which
would only matter at an exact argmax tie (none occurs on these models and settings).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hispec.config import SamplingParams, SpecConfig
from hispec.decode.stats import LevelStats
from hispec.generate import Generator
from hispec.model.load.checkpoint import apply_quantization, load_model

# name -> (family, overrides, agreeing)
MODELS = {
    "llama": ("llama", {}, False),
    "qwen2": ("qwen2", {}, False),
    "qwen3-5l": ("qwen3", {"num_hidden_layers": 5}, False),
    "llama-agree": ("llama", {}, True),
    "qwen2-agree": ("qwen2", {}, True),
    "llama-int4": ("llama", {}, False),  # decoder linears on the int4 kernel (bfloat16 activations)
    "qwen2-agree-int8": ("qwen2", {}, True),
    "llama-agree-kv-bf16": ("llama", {}, True),  # a bfloat16 KV cache on the fused kernels
    "qwen3-kv-bf16": ("qwen3", {"num_hidden_layers": 5}, False),  # ... and on the eager path (q/k norms)
    "gemma3": ("gemma3", {}, False),  # sliding windows of 8 crossed, sandwich norms, GeGLU
    "gemma3-agree-int4": ("gemma3", {}, True),
}
QUANTIZED = {"llama-int4": "int4", "qwen2-agree-int8": "int8", "gemma3-agree-int4": "int4"}
KV_BF16 = {"llama-agree-kv-bf16", "qwen3-kv-bf16"}


def make_agreeing(model) -> None:
    """Shrink what layers 1.. add to the residual stream, so every exit's argmax mostly agrees
    with the final layer's (long accepted runs, bonus tokens) while the output still depends
    on every layer."""
    for layer in model.layers[1:]:
        if layer.attn_out_norm is not None:  # sandwich norms: the norms after attention and MLP set the scale
            layer.attn_out_norm.weight.mul_(0.1)
            layer.mlp_out_norm.weight.mul_(0.1)
        else:
            layer.o_proj.weight.mul_(0.1)
            layer.down_proj.weight.mul_(0.1)



@pytest.fixture(scope="module")
def gens(tiny_model_dir) -> dict[str, Generator]:
    out = {}
    for name, (family, overrides, agreeing) in MODELS.items():
        model = load_model(tiny_model_dir(family, **overrides))
        if agreeing:
            make_agreeing(model)
        if name in QUANTIZED:
            apply_quantization(model, QUANTIZED[name])
        if name in KV_BF16:
            model.kv_cache_dtype = torch.bfloat16
        out[name] = Generator(model)
    return out


_AR_CACHE: dict[tuple, tuple[list[int], str]] = {}


def ar_reference(gen: Generator, key: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    ck = (key, tuple(prompt), params.max_new_tokens, params.ignore_eos, gen.eos_ids)
    if ck not in _AR_CACHE:
        out = gen.generate(prompt, params, "ar")
        _AR_CACHE[ck] = (out.token_ids, out.finish_reason)
    return _AR_CACHE[ck]


@st.composite
def cases(draw, hierarchical: bool):
    name = draw(st.sampled_from(sorted(MODELS)))
    family, overrides, _ = MODELS[name]
    n = overrides.get("num_hidden_layers", 6)
    top = n - 1 if hierarchical else n  # hispec needs L_i < L_f
    draft_layer = draw(st.integers(1, top - 1))
    verify_layer = draw(st.integers(draft_layer + 1, top))
    policy = draw(st.sampled_from(["fixed", "svip", "heuristic"]))
    spec = SpecConfig(draft_layer=draft_layer, verify_layer=verify_layer,
                      num_draft=draw(st.integers(1, 6)), window=draw(st.integers(1, 6)),
                      draft_policy=policy, svip_threshold=draw(st.floats(0.05, 6.0)),
                      max_draft=draw(st.integers(1, 10)), tree_width=draw(st.sampled_from([1, 1, 2, 4])),
                      tree_min_prob=draw(st.sampled_from([None, 0.0, 0.05, 0.3])),
                      lookup_branches=draw(st.sampled_from([1, 1, 2, 4])))
    prompt = draw(st.lists(st.integers(0, 127), min_size=1, max_size=30))
    params = SamplingParams(max_new_tokens=draw(st.integers(1, 40)), ignore_eos=draw(st.booleans()))
    return name, spec, prompt, params


def check_same_as_ar(gens, name, spec, prompt, params, strategy):
    gen = gens[name]
    want_ids, want_finish = ar_reference(gen, name, prompt, params)
    out = gen.generate(prompt, params, strategy, spec=spec)
    assert out.token_ids == want_ids, (name, spec, strategy)
    assert out.finish_reason == want_finish
    assert gen.blocks.num_used_blocks == 0  # the sequence was freed
    assert gen.pool.k[0].dtype == (torch.bfloat16 if name in KV_BF16 else gen.model.dtype)
    gen.blocks.check_invariants()
    return out


@settings(max_examples=25, deadline=None)
@given(case=cases(hierarchical=False))
def test_selfspec_greedy_equals_ar(gens, case):
    check_same_as_ar(gens, *case, "selfspec")


@settings(max_examples=25, deadline=None)
@given(case=cases(hierarchical=True))
def test_hispec_greedy_equals_ar(gens, case):
    check_same_as_ar(gens, *case, "hispec")


# ---- not vacuous: long accepted runs and bonus tokens at both levels ----------------------

class RoundSpy:
    """Records every verification round as ``(level name, drafted, accepted)`` by wrapping
    ``LevelStats.record`` (the level is found from the request's stats afterwards)."""

    def __init__(self, monkeypatch) -> None:
        self.rounds: list[tuple[int, int, int]] = []  # (id of the LevelStats, drafted, accepted)
        self.by_level: dict[str, list[tuple[int, int]]] = {}
        real = LevelStats.record

        def record(level, num_drafted, num_accepted):
            self.rounds.append((id(level), num_drafted, num_accepted))
            real(level, num_drafted, num_accepted)

        monkeypatch.setattr(LevelStats, "record", record)

    def collect(self, stats) -> None:
        """Attribute the rounds recorded so far to the levels of ``stats`` (one request's)."""
        names = {id(lv): name for name, lv in stats.levels.items()}
        for key, drafted, accepted in self.rounds:
            self.by_level.setdefault(names[key], []).append((drafted, accepted))
        self.rounds.clear()

    def bonus_rounds(self, level: str) -> int:
        """Rounds whose drafts were all accepted: the verifier then emits a bonus token."""
        return sum(1 for k, num in self.by_level.get(level, []) if k > 0 and num == k)

    def rejected_rounds(self, level: str) -> int:
        return sum(1 for k, num in self.by_level.get(level, []) if num < k)


PROMPTS = [[5, 17, 99, 3], list(range(40, 70)), [1]]


@pytest.mark.parametrize("name", ["llama-agree", "qwen2-agree"])
@pytest.mark.parametrize("spec", [
    SpecConfig(draft_layer=1, verify_layer=3, num_draft=4, window=4),
    SpecConfig(draft_layer=2, verify_layer=4, num_draft=3, window=6, draft_policy="heuristic"),
    SpecConfig(draft_layer=1, verify_layer=4, num_draft=5, window=3, draft_policy="svip", svip_threshold=4.5),
], ids=["fixed", "heuristic", "svip"])
def test_agreeing_model_exercises_long_runs(gens, monkeypatch, name, spec):
    spy = RoundSpy(monkeypatch)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    full_passes = new_tokens = 0
    for strategy in ("hispec", "selfspec"):
        for prompt in PROMPTS:
            spy.rounds.clear()
            out = check_same_as_ar(gens, name, spec, prompt, params, strategy)
            spy.collect(out.stats)
            full_passes, new_tokens = full_passes + out.stats.full_passes, new_tokens + len(out.token_ids)
    # the full model ran fewer times than tokens were committed: real speculation
    assert full_passes < new_tokens
    # every level accepted drafts, accepted whole rounds (bonus tokens), and rejected some
    for level in ("draft->intermediate", "intermediate->final", "draft->final"):
        assert spy.bonus_rounds(level) > 0, (level, spy.by_level.get(level))
        assert spy.rejected_rounds(level) > 0, (level, spy.by_level.get(level))


def test_eos_ends_all_strategies_at_the_same_place(gens):
    """Llama's config has eos_token_id 2: with EOS honoured, every strategy stops where ar does."""
    gen = gens["llama-agree"]
    params = SamplingParams(max_new_tokens=40)
    spec = SpecConfig(draft_layer=1, verify_layer=3, num_draft=4, window=4)
    for prompt in PROMPTS:
        want = gen.generate(prompt, params, "ar")
        for strategy in ("selfspec", "hispec"):
            out = gen.generate(prompt, params, strategy, spec=spec)
            assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason)
