"""Shared fixtures: tiny random Hugging Face model folders (no network).

``tiny_model_dir(family, **overrides)`` writes a randomly initialised transformers model of
that family once per session (per distinct overrides) and returns its folder, which
``hispec.model.load.checkpoint.load_model`` reads. Weights are seeded, so runs are reproducible.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
import torch

# Batched float32 products (the tiny models' float heads and layers above SMALL_ROWS rows) on the
# panel kernel, not on whichever of it and oneDNN a fresh $HISPEC_HOME times faster: the tests that
# check a batched step ran in one op call (decode_step, decode_greedy, lookup rounds) need the panel
# route, and on an Intel Xeon with AMX the timing came out either way from one run to the next (16
# such tests failed in one CI-like run, passed in the one before). Tests of the route choice set it.
os.environ.setdefault("HISPEC_BATCH_MATMUL", "panel")

# Small enough for a 2-core CPU, deep enough for a draft exit, an intermediate exit and a
# final layer (draft 1..2, verify 2..5, 6 layers).
TINY_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _hf_model(family: str, cfg_kwargs: dict):
    import transformers as tf

    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**cfg_kwargs))
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**cfg_kwargs))
    if family == "qwen3":
        cfg_kwargs.setdefault("head_dim", cfg_kwargs["hidden_size"] // cfg_kwargs["num_attention_heads"])
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**cfg_kwargs))
    if family == "gemma3":  # a window of 8 (crossed by most sequences), every sixth layer global
        cfg_kwargs.setdefault("head_dim", cfg_kwargs["hidden_size"] // cfg_kwargs["num_attention_heads"])
        cfg_kwargs.setdefault("query_pre_attn_scalar", cfg_kwargs["head_dim"])
        cfg_kwargs.setdefault("sliding_window", 8)
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**cfg_kwargs))
    raise ValueError(f"no tiny model recipe for family {family!r}")


@pytest.fixture(autouse=True)
def _free_rounds_ungated(monkeypatch):
    """Adaptive engines take the free-draft rounds their cost model picks (``HISPEC_FREE_ROUND_GATE=0``):
    the gate decides by timing, and on tiny models a round's Python outweighs a plain step, so the
    tests that check the drafting paths ran would depend on the machine's speed. The gate's own
    tests turn it on."""
    monkeypatch.setenv("HISPEC_FREE_ROUND_GATE", "0")
    monkeypatch.setenv("HISPEC_POLICY_MEMORY", "0")  # each test's controllers measure afresh (test_memory turns it on)


@pytest.fixture
def pinned_row_cost(monkeypatch):
    """Adaptive engines price a verification row at 0.1 of a plain step and a drafting pass at no
    overhead, as the default model's small batches measure, instead of timing the tiny models (whose
    passes are mostly Python: on a slow machine no draft pays, and a test that checks drafting ran
    would fail by the machine's speed). For tests whose assertions need drafts to be taken."""
    from hispec.spec.cost import RowCost

    monkeypatch.setattr(RowCost, "relative", lambda self, batch_size: 0.1)
    monkeypatch.setattr(RowCost, "overhead", lambda self, batch_size: 0.0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Callable[..., Path]:
    """Factory: ``tiny_model_dir("llama", num_hidden_layers=4, ...) -> Path`` (cached per arguments)."""
    cache: dict[tuple, Path] = {}

    def make(family: str = "llama", *, seed: int = 0, **overrides) -> Path:
        key = (family, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            cfg_kwargs = {**TINY_BASE, **overrides}
            torch.manual_seed(seed)
            model = _hf_model(family, cfg_kwargs)
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            model.save_pretrained(folder)
            cache[key] = folder
        return cache[key]

    return make


def write_char_tokenizer(folder: Path) -> None:
    """A character-level tokenizer (printable ASCII + <unk>, <s>, </s>) so tiny models take text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + [chr(c) for c in range(32, 127)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    fast.save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_text_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny random Llama with a character tokenizer and a chat template (eos id 2)."""
    import shutil

    folder = tmp_path_factory.mktemp("tiny-text")
    shutil.copytree(tiny_model_dir("llama", eos_token_id=2, bos_token_id=1), folder, dirs_exist_ok=True)
    write_char_tokenizer(folder)
    return folder


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny matmuls are fastest on one thread, and two threads stall badly whenever the other core
    is busy (pytest, a server subprocess, another job): tests run torch on one thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def four_bit_kernel(monkeypatch):
    """``four_bit_kernel(kind)``: 4-bit weights built from now on use ``kind`` (``q4`` or ``int4``)
    instead of the one timed faster on this CPU."""
    from hispec.kernels import quant

    def use(kind: str) -> None:
        if kind == "q4":
            from hispec.kernels import fused
            if not fused.available():
                pytest.skip("the q4 kernel needs the fused CPU kernels (a C compiler)")
        monkeypatch.setenv("HISPEC_Q4_KERNEL", kind)
        quant.four_bit_kernel.cache_clear()

    yield use
    quant.four_bit_kernel.cache_clear()
