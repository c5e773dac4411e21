"""Edge cases of self-speculative decoding: EOS inside a round or a window, the token and
context limits reached mid-window, invalid exits, and the K/V cache after rejections."""
from __future__ import annotations

import pytest
import torch

import hispec.decode.speculative as spec_mod
from hispec.cache.block_manager import BlockManager
from hispec.cache.kv_cache import KVPool, slots_for
from hispec.config import ConfigError, SamplingParams, SpecConfig
from hispec.decode.base import DecodeContext, Strategy
from hispec.model.runner import LayerRunner
from hispec.decode.speculative import HiSpec, SelfSpec
from hispec.decode.stats import DecodeStats
from hispec.generate import Generator, PromptTooLongError
from hispec.model.load.checkpoint import load_model

STRATEGIES = ("ar", "selfspec", "hispec")
SPEC = SpecConfig(draft_layer=1, verify_layer=3, num_draft=4, window=4)
PROMPT = [5, 17, 99, 3, 42, 8]


def make_agreeing(model) -> None:
    """Layers 1.. barely change the residual stream: exits agree often, not always."""
    for layer in model.layers[1:]:
        layer.o_proj.weight.mul_(0.1)
        layer.down_proj.weight.mul_(0.1)



@pytest.fixture(scope="module")
def gen(tiny_model_dir) -> Generator:
    model = load_model(tiny_model_dir("llama"))
    make_agreeing(model)
    return Generator(model)


@pytest.fixture(scope="module")
def spread_gen(tiny_model_dir) -> Generator:
    """Larger random weights: the exits' distributions differ, so sampled drafts get rejected too."""
    return Generator(load_model(tiny_model_dir("llama", initializer_range=0.2)))


@pytest.fixture(scope="module")
def short_gen(tiny_model_dir) -> Generator:
    """max_position_embeddings = 40."""
    model = load_model(tiny_model_dir("llama", max_position_embeddings=40))
    make_agreeing(model)
    return Generator(model)


class Recording(Strategy):
    """A strategy wrapper that records the chunks the strategy committed (before any cut)."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.spec, self.chunks = inner, inner.name, inner.spec, []
        self.lookahead = inner.lookahead

    def step(self, batch):
        commits = self.inner.step(batch)
        self.chunks.extend(list(c) for c in commits)
        return commits

    def steps(self, ctx):
        for chunk in self.inner.steps(ctx):
            self.chunks.append(list(chunk))
            yield chunk


@pytest.fixture
def max_position(monkeypatch):
    """Records the highest position any strategy ran through the model."""
    seen = {"max": -1}
    if hasattr(LayerRunner, "forward_many"):  # the batched runner: every pass goes through it
        real_many = LayerRunner.forward_many

        def forward_many(self, items, start_layer, end_layer, **kwargs):
            for _, start_pos, x in items:
                seen["max"] = max(seen["max"], start_pos + x.shape[0] - 1)
            return real_many(self, items, start_layer, end_layer, **kwargs)

        monkeypatch.setattr(LayerRunner, "forward_many", forward_many)
    else:
        real = LayerRunner.forward

        def forward(self, seq_id, start_pos, x, start_layer, end_layer):
            seen["max"] = max(seen["max"], start_pos + x.shape[0] - 1)
            return real(self, seq_id, start_pos, x, start_layer, end_layer)

        monkeypatch.setattr(LayerRunner, "forward", forward)
    return seen


# ---- EOS -----------------------------------------------------------------------------------

def test_eos_inside_a_draft_round_and_a_window(gen, monkeypatch):
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    reference = gen.generate(PROMPT, params, "ar").token_ids
    candidates = list(dict.fromkeys(reference[1:20]))  # first occurrences, in order
    cuts = []
    real_cut = spec_mod.Window.cut_after

    def cut_after(window, length):
        cuts.append((len(window), length))
        real_cut(window, length)

    monkeypatch.setattr(spec_mod.Window, "cut_after", cut_after)
    selfspec_mid_chunk = hispec_mid_window = 0
    for eos in candidates:
        monkeypatch.setattr(gen, "eos_ids", frozenset({eos}))
        stop = reference.index(eos) + 1
        params = SamplingParams(max_new_tokens=30)
        want = gen.generate(PROMPT, params, "ar")
        assert (want.token_ids, want.finish_reason) == (reference[:stop], "eos")
        rec = Recording(SelfSpec(SPEC))
        out = gen.generate(PROMPT, params, rec)
        assert (out.token_ids, out.finish_reason) == (want.token_ids, "eos"), eos
        last = rec.chunks[-1]
        selfspec_mid_chunk += last.index(eos) < len(last) - 1  # tokens after EOS were cut away
        cuts.clear()
        out = gen.generate(PROMPT, params, "hispec", spec=SPEC)
        assert (out.token_ids, out.finish_reason) == (want.token_ids, "eos"), eos
        assert gen.blocks.num_used_blocks == 0
        hispec_mid_window += any(length < before for before, length in cuts)
        # with EOS ignored, every strategy runs on through it
        params = SamplingParams(max_new_tokens=30, ignore_eos=True)
        assert gen.generate(PROMPT, params, "hispec", spec=SPEC).token_ids == reference
    assert selfspec_mid_chunk > 0 and hispec_mid_window > 0, (selfspec_mid_chunk, hispec_mid_window)


def test_eos_ids_set_after_a_generate_call_take_effect(gen, monkeypatch):
    """``Generator.eos_ids`` may be changed between requests."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    reference = gen.generate(PROMPT, params, "ar").token_ids
    eos = reference[3]
    monkeypatch.setattr(gen, "eos_ids", frozenset({eos}))
    for strategy in STRATEGIES:
        out = gen.generate(PROMPT, SamplingParams(max_new_tokens=12), strategy, spec=SPEC)
        assert (out.token_ids, out.finish_reason) == (reference[:reference.index(eos) + 1], "eos"), strategy


def test_eos_as_the_first_token(gen, monkeypatch):
    first = gen.generate(PROMPT, SamplingParams(max_new_tokens=1), "ar").token_ids[0]
    monkeypatch.setattr(gen, "eos_ids", frozenset({first}))
    for strategy in STRATEGIES:
        out = gen.generate(PROMPT, SamplingParams(max_new_tokens=10), strategy, spec=SPEC)
        assert (out.token_ids, out.finish_reason) == ([first], "eos")


# ---- the token limit ------------------------------------------------------------------------

@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("spec", [SPEC, SpecConfig(draft_layer=2, verify_layer=4, num_draft=6, window=4,
                                                  draft_policy="heuristic")], ids=["fixed", "heuristic"])
def test_token_limit_mid_window(gen, max_position, max_new, spec, monkeypatch):
    monkeypatch.setattr(gen, "eos_ids", frozenset())
    params = SamplingParams(max_new_tokens=max_new)
    want = gen.generate(PROMPT, params, "ar")
    assert len(want.token_ids) == max_new and want.finish_reason == "length"
    for strategy in ("selfspec", "hispec"):
        max_position["max"] = -1
        out = gen.generate(PROMPT, params, strategy, spec=spec)
        assert (out.token_ids, out.finish_reason) == (want.token_ids, "length")
        # the last new token is never run through the model, so no position reaches the limit
        assert max_position["max"] < len(PROMPT) + max_new
        assert gen.blocks.num_used_blocks == 0


@pytest.mark.parametrize("max_new", [1, 2, 3, 5])
def test_token_limit_when_sampling(gen, max_new, monkeypatch):
    monkeypatch.setattr(gen, "eos_ids", frozenset())
    for strategy in STRATEGIES:
        for seed in range(4):
            params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=max_new)
            out = gen.generate(PROMPT, params, strategy, spec=SPEC)
            assert len(out.token_ids) == max_new and out.finish_reason == "length"


# ---- the context limit ----------------------------------------------------------------------

@pytest.mark.parametrize("prompt_len,temperature", [(30, 0.0), (30, 1.0), (37, 0.0), (39, 0.0)])
def test_context_limit(short_gen, max_position, prompt_len, temperature, monkeypatch):
    monkeypatch.setattr(short_gen, "eos_ids", frozenset())
    prompt = [(7 * i + 3) % 128 for i in range(prompt_len)]
    params = SamplingParams(temperature=temperature, seed=0, max_new_tokens=50)
    outs = {}
    for strategy in STRATEGIES:
        max_position["max"] = -1
        out = short_gen.generate(prompt, params, strategy, spec=SPEC)
        assert out.finish_reason == "context" and len(out.token_ids) == 40 - prompt_len
        assert max_position["max"] < 40  # no position past the model's context
        outs[strategy] = out.token_ids
    if temperature == 0.0:
        assert outs["selfspec"] == outs["ar"] and outs["hispec"] == outs["ar"]


def test_prompt_filling_the_context_is_refused(short_gen):
    with pytest.raises(PromptTooLongError):
        short_gen.generate(list(range(40)), SamplingParams(max_new_tokens=5), "hispec", spec=SPEC)


# ---- invalid exits --------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["selfspec", "hispec"])
@pytest.mark.parametrize("draft,verify", [(2, 2), (3, 2), (0, 2), (6, 6), (1, 7)])
def test_invalid_layers_are_rejected(gen, strategy, draft, verify):
    with pytest.raises(ConfigError):
        gen.generate(PROMPT, SamplingParams(max_new_tokens=3), strategy,
                     spec=SpecConfig(draft_layer=draft, verify_layer=verify))
    assert gen.blocks.num_used_blocks == 0


def test_hispec_needs_an_intermediate_layer_below_the_last(gen):
    num_layers = gen.model.num_layers
    with pytest.raises(ConfigError, match="verify layer"):
        gen.generate(PROMPT, SamplingParams(max_new_tokens=3), "hispec",
                     spec=SpecConfig(draft_layer=1, verify_layer=num_layers))
    # selfspec ignores L_i; verify_layer == num_layers is its natural setting
    out = gen.generate(PROMPT, SamplingParams(max_new_tokens=3), "selfspec",
                       spec=SpecConfig(draft_layer=1, verify_layer=num_layers))
    assert len(out.token_ids) >= 1


# ---- the K/V cache after rejections equals autoregressive decoding's -----------------------

def kv_of(blocks: BlockManager, pool: KVPool, seq_id: int, layer: int, length: int):
    slots = slots_for(blocks.block_table(seq_id), 0, length, blocks.block_size, "cpu")
    return pool.read(layer, slots)


@pytest.mark.parametrize("strategy", [SelfSpec(SPEC), HiSpec(SPEC),
                                      HiSpec(SpecConfig(draft_layer=2, verify_layer=4, num_draft=3, window=5,
                                                        draft_policy="heuristic"))],
                         ids=["selfspec", "hispec", "hispec-heuristic"])
@pytest.mark.parametrize("which,temperature", [("gen", 0.0), ("spread_gen", 0.0), ("spread_gen", 1.0)])
def test_cache_after_rejections_equals_autoregressive(request, strategy, which, temperature):
    """Drive the strategy round by round, as the generator does; after every round, every
    layer holds exactly the committed tokens but the pending one, and at the end their K/V
    equal (atol 1e-4, the float32 noise of batching tokens in one pass) what one-token-at-a-time autoregressive passes over the same tokens build."""
    model = request.getfixturevalue(which).model
    cfg, num_layers = model.cfg, model.num_layers
    max_new = 24
    max_tokens = len(PROMPT) + max_new
    blocks = BlockManager(2 * (max_tokens // 4 + 8), 4, num_layers)  # block size 4: many blocks, tails freed
    pool = KVPool(num_layers, blocks.num_blocks, 4, cfg.num_kv_heads, cfg.head_dim, model.dtype, "cpu")
    runner = LayerRunner(model, blocks, pool)
    seq, ref = 1, 2
    blocks.add_sequence(seq)
    params = SamplingParams(temperature=temperature, seed=0, max_new_tokens=max_new)
    stats = DecodeStats(strategy.name)
    ctx = DecodeContext(runner, seq, list(PROMPT), params, 0 if temperature else None, stats, max_tokens, frozenset())
    runner.forward(seq, 0, ctx.token_tensor(PROMPT[:-1]), 0, num_layers)  # prefill
    snapshots = []  # after each round: (positions held, [(K, V) of each layer])
    for chunk in strategy.steps(ctx):
        ctx.tokens.extend(chunk)
        held = len(ctx.tokens) - 1  # the invariant: every layer holds all but the pending token
        assert [blocks.length(seq, layer) for layer in range(num_layers)] == [held] * num_layers
        assert len(blocks.block_table(seq)) == blocks.blocks_needed(held)  # rolled-back tail blocks freed
        blocks.check_invariants()
        snapshots.append((held, [tuple(t.clone() for t in kv_of(blocks, pool, seq, layer, held))
                                 for layer in range(num_layers)]))
    assert len(ctx.tokens) >= max_tokens
    held = len(ctx.tokens) - 1
    blocks.add_sequence(ref)  # autoregressive decoding's cache of the same tokens
    for pos, token in enumerate(ctx.tokens[:held]):
        runner.forward(ref, pos, torch.tensor([token]), 0, num_layers)
    reference = [kv_of(blocks, pool, ref, layer, held) for layer in range(num_layers)]
    # K/V at position p depend on tokens 0..p only, so every round's cache is a prefix of it
    for n, per_layer in snapshots:
        for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(per_layer, reference)):
            where = f"layer {layer}, first {n} positions"
            torch.testing.assert_close(k, k_ref[:n], atol=1e-4, rtol=0, msg=lambda m: f"K of {where}: {m}")
            torch.testing.assert_close(v, v_ref[:n], atol=1e-4, rtol=0, msg=lambda m: f"V of {where}: {m}")
    rounds = len(snapshots)
    # not vacuous: rejections happened at every level (and some drafts were accepted)
    assert stats.levels, "no verification ran"
    for name, level in stats.levels.items():
        assert level.accepted_tokens < level.draft_tokens, name
        assert level.accepted_tokens > 0, name
    assert rounds < max_new
