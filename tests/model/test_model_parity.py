"""Numerical parity of ``hispec.model`` with transformers, per model family (float32, CPU).

For each family a tiny random model is built with transformers, saved as safetensors, loaded
with ``hispec.model.load.checkpoint.load_model`` and compared with transformers' own forward pass:

* (a) prefill logits over a paged cache whose blocks (size 4) are crossed,
* (b) step-by-step decoding through the paged cache,
* (c) decoding after a rollback (``truncate``) onto different tokens,
* (d) layer ranges: ``[0, k)`` then ``[k, L)`` equals ``[0, L)`` (hidden states and K/V),
  including deep layers catching up on several positions the shallow layers ran ahead on,
* greedy ``ar`` generation through ``Generator`` equals ``generate(do_sample=False)``.

The weights are re-drawn with a larger spread than transformers' init (and the norm weights
and biases perturbed away from 1 and 0), so the logits are far from flat and every parameter
influences the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hispec.cache.block_manager import BlockManager  # noqa: E402
from hispec.cache.kv_cache import KVPool, slots_for  # noqa: E402
from hispec.config import SamplingParams  # noqa: E402
from hispec.model.runner import LayerRunner  # noqa: E402
from hispec.generate import Generator  # noqa: E402
from hispec.model.decoder import DecoderModel  # noqa: E402
from hispec.model.load.checkpoint import load_model  # noqa: E402

ATOL = 1e-4
BLOCK_SIZE = 4
SEQ_ID = 7
MAX_DIFF: dict[str, float] = {}  # family -> largest logit difference seen (printed with -s)

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def _llama(**kw):
    base = dict(vocab_size=211, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _qwen2():
    return transformers.Qwen2Config(vocab_size=157, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    rope_theta=1000.0, tie_word_embeddings=False, eos_token_id=5)


def _qwen3():
    # head_dim 24 != 64 / 4; GQA 4 -> 2
    return transformers.Qwen3Config(vocab_size=173, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                    max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=3)


def _gemma3():
    # sliding layers (window 5: crossed by every sequence here) with their own RoPE base, a global
    # one between; head_dim 16 != 64 / 4; a query scale that is not head_dim ** -0.5
    return transformers.Gemma3TextConfig(
        vocab_size=181, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=20,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
        tie_word_embeddings=False, bos_token_id=2, eos_token_id=1, pad_token_id=0)


def _opt():
    return transformers.OPTConfig(vocab_size=139, hidden_size=64, ffn_dim=128, num_hidden_layers=3,
                                  num_attention_heads=4, max_position_embeddings=96, dropout=0.0,
                                  pad_token_id=1, bos_token_id=2, eos_token_id=2)


FAMILIES = {
    "llama": lambda: _llama(),
    "llama3-rope": lambda: _llama(num_hidden_layers=2, num_key_value_heads=1, max_position_embeddings=1024,
                                  rope_scaling=dict(LLAMA3_SCALING)),
    "llama-tied": lambda: _llama(num_hidden_layers=3, num_key_value_heads=4, tie_word_embeddings=True),
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    "opt": _opt,
}


@dataclass
class Pair:
    family: str
    hf: torch.nn.Module
    model: DecoderModel
    path: Path

    @property
    def L(self) -> int:
        return self.model.num_layers

    @property
    def vocab(self) -> int:
        return self.model.cfg.vocab_size

    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0]

    def new_runner(self, num_blocks: int = 16) -> LayerRunner:
        cfg = self.model.cfg
        blocks = BlockManager(num_blocks, BLOCK_SIZE, cfg.num_layers)
        pool = KVPool(cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                      torch.float32, "cpu")
        blocks.add_sequence(SEQ_ID)
        return LayerRunner(self.model, blocks, pool)

    def run(self, runner: LayerRunner, start: int, ids: list[int]) -> torch.Tensor:
        """Logits ``[T, V]`` of the full model for ``ids`` at positions ``start ..``."""
        h = runner.forward(SEQ_ID, start, torch.tensor(ids), 0, self.L)
        return self.model.exit_logits(h, self.L)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: matrices N(0, 0.15^2) (embeddings N(0, 0.4^2)), 1-D params around their init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.add_(0.2 * noise)
            elif "embed" in name:
                p.copy_(0.4 * noise)
            else:
                p.copy_(0.15 * noise)



@pytest.fixture(scope="module", autouse=True)
def _print_max_diff():
    yield
    if MAX_DIFF:
        print("\nmax abs logit diff vs transformers:", {k: f"{v:.1e}" for k, v in MAX_DIFF.items()})


@pytest.fixture(scope="module", params=list(FAMILIES), ids=list(FAMILIES))
def pair(request, tmp_path_factory) -> Pair:
    family = request.param
    torch.manual_seed(0)
    hf_cfg = FAMILIES[family]()
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, attn_implementation="eager")
    _randomize(hf, seed=sorted(FAMILIES).index(family))
    hf.eval()
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path, safe_serialization=True)
    assert list(path.glob("*.safetensors")), "save_pretrained wrote no safetensors"
    model = load_model(path, dtype=torch.float32)
    return Pair(family, hf, model, path)


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _close(p: Pair, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = (got - want).abs().max().item()
    MAX_DIFF[p.family] = max(MAX_DIFF.get(p.family, 0.0), diff)
    assert diff < ATOL, f"{p.family}: {what}: max abs diff {diff:.3g} (logit scale {want.abs().max().item():.3g})"


# --------------------------------------------------------------------------------------
# sanity of the fixture itself
# --------------------------------------------------------------------------------------
def test_config_read_back(pair: Pair) -> None:
    cfg, hf_cfg = pair.model.cfg, pair.hf.config
    assert cfg.num_layers == hf_cfg.num_hidden_layers
    assert cfg.vocab_size == hf_cfg.vocab_size
    assert cfg.tie_word_embeddings == bool(hf_cfg.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        assert pair.model.lm_head.weight is pair.model.embed_tokens.weight
    if pair.family == "qwen3":
        assert cfg.head_dim == 24 and cfg.qk_norm
    if pair.family == "qwen2":
        assert cfg.attention_bias
    if pair.family == "llama3-rope":
        assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    if pair.family == "gemma3":
        assert cfg.sliding_layers == (0, 2) and cfg.sliding_window == 5 and cfg.sandwich_norm and cfg.qk_norm
        assert cfg.attn_scale == 20 ** -0.5 and cfg.embed_scale == 8.0
    # the logits are not flat: greedy choices are well separated
    logits = pair.hf_logits(_ids(17, pair.vocab, 0))
    assert logits.std().item() > 1.0, logits.std()


def test_rope_frequencies(pair: Pair) -> None:
    if pair.family == "opt":
        assert pair.model.inv_freq is None and pair.model.embed_positions is not None  # learned positions
        return
    if pair.family == "gemma3":
        rot = pair.hf.model.rotary_emb
        assert torch.allclose(pair.model.inv_freq, rot.full_attention_inv_freq.float(), rtol=1e-6, atol=0)
        assert torch.allclose(pair.model.inv_freq_local, rot.sliding_attention_inv_freq.float(), rtol=1e-6, atol=0)
        return
    want = pair.hf.model.rotary_emb.inv_freq.float()
    assert torch.allclose(pair.model.inv_freq, want, rtol=1e-6, atol=0), (pair.model.inv_freq, want)
    if pair.family == "llama3-rope":
        # all three llama3 regimes (kept, smoothed, divided by factor) occur at this head_dim
        cfg = pair.model.cfg
        plain = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).double() / cfg.head_dim))
        ratio = (plain / pair.model.inv_freq.double())
        assert torch.isclose(ratio, torch.tensor(1.0, dtype=torch.float64)).any()
        assert torch.isclose(ratio, torch.tensor(8.0, dtype=torch.float64)).any()
        assert ((ratio > 1.01) & (ratio < 7.99)).any()


# --------------------------------------------------------------------------------------
# (a) - (d)
# --------------------------------------------------------------------------------------
def test_prefill_logits(pair: Pair) -> None:
    ids = _ids(17, pair.vocab, 1)
    runner = pair.new_runner()
    got = pair.run(runner, 0, ids)
    _close(pair, got, pair.hf_logits(ids), "prefill of 17 tokens")
    assert runner.blocks.length(SEQ_ID, pair.L - 1) == 17
    runner.blocks.check_invariants()


def test_long_prefill_then_steps(pair: Pair) -> None:
    """Positions past llama3's original_max_position_embeddings (64), where its scaling shows most."""
    ids = _ids(76, pair.vocab, 9)
    want = pair.hf_logits(ids)
    runner = pair.new_runner(num_blocks=20)
    _close(pair, pair.run(runner, 0, ids[:72]), want[:72], "prefill of 72 tokens")
    _close(pair, pair.run(runner, 72, ids[72:74]), want[72:74], "a 2-token chunk at 72")
    for pos in (74, 75):
        _close(pair, pair.run(runner, pos, [ids[pos]])[0], want[pos], f"decode step at position {pos}")


def test_step_by_step_decoding(pair: Pair) -> None:
    ids = _ids(17, pair.vocab, 2)
    want = pair.hf_logits(ids)
    runner = pair.new_runner()
    _close(pair, pair.run(runner, 0, ids[:9]), want[:9], "prefill of 9 tokens")
    for pos in range(9, 17):
        _close(pair, pair.run(runner, pos, [ids[pos]])[0], want[pos], f"decode step at position {pos}")
    assert [runner.blocks.length(SEQ_ID, layer) for layer in range(pair.L)] == [17] * pair.L


@pytest.mark.parametrize("keep", [9, 8], ids=["mid-block", "block-edge"])
def test_decoding_after_rollback(pair: Pair, keep: int) -> None:
    ids = _ids(keep, pair.vocab, 3)
    extra = _ids(5, pair.vocab, 4)
    new = [(t + 17) % (pair.vocab - 3) + 3 for t in _ids(6, pair.vocab, 5)]
    assert new[0] != extra[0]
    runner = pair.new_runner(num_blocks=6)
    pair.run(runner, 0, ids)
    pair.run(runner, keep, extra[:2])  # a chunk, then single steps
    for j in range(2, 5):
        pair.run(runner, keep + j, [extra[j]])
    used = runner.blocks.num_used_blocks
    runner.truncate(SEQ_ID, keep)
    assert runner.blocks.num_used_blocks == -(-keep // BLOCK_SIZE) < used
    runner.blocks.check_invariants()

    seq = ids + new
    want = pair.hf_logits(seq)
    _close(pair, pair.run(runner, keep, new[:3]), want[keep:keep + 3], "chunk after rollback")
    for j in range(3, 6):
        _close(pair, pair.run(runner, keep + j, [new[j]])[0], want[keep + j], f"step {j} after rollback")
    # the rolled-back tokens left no trace: a fresh cache gives the same logits
    fresh = pair.new_runner()
    _close(pair, pair.run(fresh, 0, seq), want, "fresh prefill of the new sequence")


def _kv(runner: LayerRunner, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = slots_for(runner.blocks.block_table(SEQ_ID), 0, n, BLOCK_SIZE, "cpu")
    return runner.pool.read(layer, slots)


def _same_cache(pair: Pair, a: LayerRunner, b: LayerRunner, n: int, what: str) -> None:
    for layer in range(pair.L):
        assert a.blocks.length(SEQ_ID, layer) == b.blocks.length(SEQ_ID, layer) == n
        (ka, va), (kb, vb) = _kv(a, layer, n), _kv(b, layer, n)
        torch.testing.assert_close(ka, kb, rtol=0, atol=1e-6, msg=f"{what}: K of layer {layer}")
        torch.testing.assert_close(va, vb, rtol=0, atol=1e-6, msg=f"{what}: V of layer {layer}")


def test_layer_ranges(pair: Pair) -> None:
    ids = _ids(13, pair.vocab, 6)
    L = pair.L
    whole = pair.new_runner()
    h_whole = whole.forward(SEQ_ID, 0, torch.tensor(ids[:10]), 0, L)
    h_step = whole.forward(SEQ_ID, 10, torch.tensor(ids[10:11]), 0, L)
    for k in range(1, L):
        split = pair.new_runner()
        h = split.forward(SEQ_ID, 0, torch.tensor(ids[:10]), 0, k)
        assert split.blocks.length(SEQ_ID, k - 1) == 10 and split.blocks.length(SEQ_ID, k) == 0
        h = split.forward(SEQ_ID, 0, h, k, L)
        torch.testing.assert_close(h, h_whole, rtol=0, atol=1e-5, msg=f"prefill split at layer {k}")
        h = split.forward(SEQ_ID, 10, split.forward(SEQ_ID, 10, torch.tensor(ids[10:11]), 0, k), k, L)
        torch.testing.assert_close(h, h_step, rtol=0, atol=1e-5, msg=f"decode step split at layer {k}")
        _same_cache(pair, split, whole, 11, f"split at layer {k}")


def test_deep_layers_catch_up(pair: Pair) -> None:
    """Shallow layers run ahead one token at a time (drafting); the deep layers then process
    those positions in one call (verification), and the result equals transformers."""
    ids = _ids(16, pair.vocab, 7)
    want = pair.hf_logits(ids)
    L, k = pair.L, 1
    runner = pair.new_runner()
    pair.run(runner, 0, ids[:9])
    shallow = [runner.forward(SEQ_ID, pos, torch.tensor([ids[pos]]), 0, k) for pos in range(9, 14)]
    assert runner.blocks.length(SEQ_ID, 0) == 14 and runner.blocks.length(SEQ_ID, L - 1) == 9
    h = runner.forward(SEQ_ID, 9, torch.cat(shallow), k, L)
    _close(pair, pair.model.exit_logits(h, L), want[9:14], "deep layers catching up on 5 positions")
    _close(pair, pair.run(runner, 14, ids[14:16]), want[14:16], "after the catch-up")


# --------------------------------------------------------------------------------------
# greedy generation
# --------------------------------------------------------------------------------------
def test_generator_ar_matches_hf_generate(pair: Pair) -> None:
    prompt = _ids(7, pair.vocab, 8)
    gen = Generator(pair.model, block_size=BLOCK_SIZE)
    out = gen.generate(list(prompt), SamplingParams(max_new_tokens=20, ignore_eos=True), "ar")
    with torch.no_grad():
        # eos disabled so transformers neither stops early nor suppresses the eos logit
        hf_out = pair.hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  do_sample=False, max_new_tokens=20, min_new_tokens=20,
                                  eos_token_id=None, pad_token_id=0)
    want = hf_out[0, len(prompt):].tolist()
    assert len(want) == 20 and out.new_tokens == 20 and out.finish_reason == "length"
    assert out.token_ids == want, f"{pair.family}: hispec {out.token_ids} != transformers {want}"
    assert len(set(want)) > 2, "degenerate test: the model repeats one token"
