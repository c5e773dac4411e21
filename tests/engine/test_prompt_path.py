"""Prompt tokens on an arithmetic of their own (attention on AMX tiles, where the CPU has them:
``fused.prompt_attention_on_tiles``). A prompt's K/V may then differ in their last bits from the same
tokens decoded (a step's products are on the tiles too, the same sums; the softmax's weights are
summed in another order), yet every strategy, batch, prefill chunking, prefix-cache hit and preemption gives
batch-of-one ``ar``'s tokens: every path prefills a prompt the same
way, and a preempted sequence's tokens after its prompt are recomputed as they were decoded.
(For ``ar`` one request at a time the log-probabilities are compared too: they show a changed bit
that a token may hide.)

The model: a tiny Llama with SmolLM2's head size (64) and a bfloat16 pool, the case the tile path
takes. On a CPU without AMX both paths are one and the tests check the rest as before."""
from __future__ import annotations

import random

import pytest
import torch

from hispec.config import SamplingParams
from hispec.engine import Engine
from hispec.generate import make_strategy
from hispec.kernels import fused
from hispec.model.load.checkpoint import load_model

from tests.engine.test_engine import STRATEGIES as ALL_STRATEGIES

STRATEGIES = {name: ALL_STRATEGIES[name] for name in ("ar", "selfspec", "hispec", "lookup")}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    m = load_model(tiny_model_dir("llama", hidden_size=192, intermediate_size=256, num_attention_heads=3,
                                  num_key_value_heads=1, head_dim=64))
    for layer in m.layers[2:]:  # upper layers barely change the residual: early exits agree often
        layer.o_proj.weight.mul_(0.1)
        layer.down_proj.weight.mul_(0.1)
    m.kv_cache_dtype = torch.bfloat16
    return m


@pytest.fixture(scope="module")
def prompts():
    """Prompts of 1-90 tokens (tiles of 32 queries, several of them), some sharing a 40-token start."""
    rng = random.Random(11)
    shared = [rng.randrange(128) for _ in range(40)]
    out = [[rng.randrange(128) for _ in range(n)] for n in (1, 2, 17, 33, 64, 90)]
    return out + [shared + [rng.randrange(128) for _ in range(n)] for n in (0, 5, 31)]


PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=2)


def run(model, name, prompts, *, batch_size=4, kv_blocks=300, block_size=16, params=PARAMS, **config):
    """The engine, and each request's tokens with the log-probabilities of its tokens and their
    alternatives (as its steps gave them)."""
    engine = Engine(model, make_strategy(name, STRATEGIES[name], model.num_layers), block_size=block_size, kv_blocks=kv_blocks,
                    max_batch_size=batch_size, adaptive=False, **config)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens, logprobs = {}, {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            logprobs[out.request_id] += [(lp.token, lp.logprob, lp.top) for lp in out.new_logprobs or []]
            tokens[out.request_id] = out.token_ids
    engine.blocks.check_invariants()
    return engine, [(tokens[i], logprobs[i]) for i in ids]


@pytest.fixture(scope="module")
def reference(model, prompts):
    """Batch-of-one ``ar``, one request at a time, each prompt prefilled in one chunk."""
    return run(model, "ar", prompts, batch_size=1, prefill_chunk=0)[1]


def test_prompt_tokens_take_their_own_path(model, prompts):
    """Where the tile path runs, a prompt's hidden states are the same tokens decoded to within
    bfloat16 products (here often the same bits: the weights' sums come out exact in either order)."""
    if not fused.prompt_attention_on_tiles():
        pytest.skip("prompt attention is the decoding path's on this CPU")
    engine = Engine(model, make_strategy("ar", None, model.num_layers), block_size=16, kv_blocks=40)
    x = torch.tensor(prompts[4])
    states = []
    for i, prefill in enumerate((True, False)):
        engine.blocks.add_sequence(i)
        engine.blocks.ensure_capacity(i, len(x))
        states.append(engine.runner.forward_many([(i, 0, x)], 0, model.num_layers, prefill=prefill)[0])
    torch.testing.assert_close(states[0], states[1], rtol=0, atol=2e-3 * states[1].abs().max().item())


def tokens(outputs):
    return [ids for ids, _ in outputs]


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("batch_size", [1, 4])
def test_every_strategy_gives_ars_tokens(model, prompts, reference, name, batch_size):
    """(Log-probabilities: one request at a time with ``ar``, below; a speculative strategy's, and
    ``ar``'s in a batch, already differed from batch-of-one ``ar``'s in their last bits before
    prompts had a path of their own.)"""
    _, got = run(model, name, prompts, batch_size=batch_size)
    assert tokens(got) == tokens(reference)
    assert name != "ar" or batch_size > 1 or got == reference


@pytest.mark.parametrize("chunk", [7, 32, 45])
@pytest.mark.parametrize("name", ["ar", "hispec"])
def test_prefill_chunks_change_no_bit(model, prompts, reference, chunk, name):
    """A prompt cut into chunks (tiles of other queries, keys in other calls) gives its tokens (and,
    for ``ar``, its log-probabilities to the bit)."""
    _, got = run(model, name, prompts, batch_size=1, prefill_chunk=chunk)
    assert tokens(got) == tokens(reference)
    assert name != "ar" or got == reference


def test_preempted_sequences_recompute_their_tokens_as_decoded(model, prompts):
    """Under a pool too small for the batch, preempted sequences recompute their prompt as a prompt and
    their own tokens as decoded tokens: the same bits as never preempted."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    _, expected = run(model, "ar", prompts, batch_size=1, prefill_chunk=0, params=params)
    engine, got = run(model, "ar", prompts, batch_size=9, kv_blocks=40, block_size=4, params=params)
    assert engine.scheduler.num_preemptions > 0
    assert tokens(got) == tokens(expected)  # (recomputed as a prompt, a token here came out otherwise)


@pytest.mark.parametrize("name", ["ar", "hispec"])
def test_cached_prompt_blocks_change_no_bit(model, prompts, reference, name):
    engine, got = run(model, name, prompts, batch_size=1, prefix_caching=True)
    assert engine.blocks.prefix.hits > 0
    assert tokens(got) == tokens(reference)
    assert name != "ar" or got == reference


def test_stats_say_where_prompts_run(model):
    """``--stats``' kernels line says when a prompt's attention runs on AMX tiles."""
    from hispec.kernels.select import describe

    said = "a prompt's on AMX tiles" in describe(model)
    assert said == (fused.prompt_attention_on_tiles() and fused.bf16_attention_products(64))
