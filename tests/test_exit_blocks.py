"""Exit blocks (design ``block``) and sequence distillation on tiny random models (no network)."""
from __future__ import annotations

import random

import pytest
import torch

from hispec.model.exit_block import ExitBlock
from hispec.model.loader import load_model
from hispec.train import seqdistill as S
from hispec.train import teacher as T


def encoded(n: int, seed: int = 0, vocab: int = 128) -> list[tuple[int, list[int], int]]:
    """Synthetic conversations with a learnable structure: a random walk over a few token
    patterns, so context helps predict the model's next token."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        length = r.randrange(24, 60)
        out.append((i, [r.randrange(3, vocab) for _ in range(length)], r.randrange(2, 10)))
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def shards(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher")
    cfg = T.TeacherConfig((2, 3), topk=8, max_tokens=48, batch_tokens=256, shard_positions=300)
    meta = T.collect(tiny, encoded(40), folder, cfg, {"model": "tiny"})
    return folder, meta


def test_teacher_shards_match_a_plain_forward_and_resume(tiny, shards, tmp_path):
    folder, meta = shards
    assert meta["shards"] > 1 and meta["records_done"] == 40
    data = S.load_sequences(folder, 2)
    assert data.num_sequences == 40 and data.num_positions == meta["positions"]
    # the first sequence's targets equal a fresh single-sequence teacher pass
    _, ids, _ = encoded(40)[0]
    one = T.TeacherPass(tiny, T.TeacherConfig((2,), topk=8, max_tokens=48, batch_tokens=64))([ids[:48]])
    n = len(ids[:48])
    assert torch.allclose(one["h.2"].float(), data.hidden[:n].float(), atol=2e-3)
    assert torch.equal(one["top_ids"][:, 0].long(), data.top_ids[:n, 0])
    # stopping early and continuing gives the same folder contents
    cfg = T.TeacherConfig((2, 3), topk=8, max_tokens=48, batch_tokens=256, shard_positions=300)
    part = T.collect(tiny, encoded(40), tmp_path / "t", cfg, {"model": "tiny"}, max_positions=400)
    assert part["records_done"] < 40
    full = T.collect(tiny, encoded(40), tmp_path / "t", cfg, {"model": "tiny"})
    assert full["positions"] == meta["positions"] and full["records_done"] == 40
    again = S.load_sequences(tmp_path / "t", 3)
    assert torch.equal(again.top_ids, S.load_sequences(folder, 3).top_ids)


def test_dense_block_equals_the_paged_block(tiny):
    """Training (dense, causal SDPA) and inference (paged pool) run the same function."""
    from hispec.cache.block_manager import BlockManager
    from hispec.cache.kv_cache import AttentionBatch, KVPool, SeqChunk

    block = ExitBlock(tiny, init="copy").eval()
    block.kv_layer = 0
    torch.manual_seed(0)
    h = torch.randn(1, 20, tiny.cfg.hidden_size)
    dense = block.logits(block.forward_dense(h, S.dense_rope(tiny, 20, tiny.device))[0])
    blocks = BlockManager(4, 8, 1)
    pool = KVPool(1, 4, 8, tiny.cfg.num_kv_heads, tiny.cfg.head_dim, tiny.dtype, tiny.device)
    blocks.add_sequence(0)
    blocks.ensure_capacity(0, 20)
    rows = []
    for a, b in ((0, 12), (12, 13), (13, 20)):  # a prefill, one step, a window
        batch = AttentionBatch([SeqChunk(0, a, b - a)], blocks, tiny.device)
        rows.append(block.forward_paged(h[0, a:b], batch, pool, tiny._rope(batch.positions)))
    assert torch.allclose(torch.cat(rows), dense, atol=1e-4)


@pytest.mark.parametrize("init", ["copy", "zero"])
def test_training_a_block_lowers_the_loss_and_raises_agreement(tiny, shards, init):
    folder, _ = shards
    data = S.load_sequences(folder, 2)
    block = ExitBlock(tiny, init=init)
    cfg = S.TrainConfig(epochs=12, batch_tokens=256, lr=3e-3, warmup=5)
    remap = None

    def measure():
        with torch.no_grad():
            b = S.padded(data, torch.arange(data.num_sequences), tiny.device)
            loss, _, _ = S.loss_terms(block, b, remap, cfg.ce_weight)
        return float(loss), S.agreement(block, data, reply_only=False)["top1"]

    before = measure()
    S.train(block, data, cfg)
    after = measure()
    assert after[0] < before[0] - 0.1, (before, after)
    assert after[1] > before[1], (before, after)


def test_zero_init_block_starts_at_the_shared_head_exit(tiny):
    block = ExitBlock(tiny, init="zero").eval()
    h = torch.randn(1, 7, tiny.cfg.hidden_size)
    z = block.forward_dense(h, S.dense_rope(tiny, 7, tiny.device))[0]
    assert torch.allclose(block.logits(z), tiny.final_logits(h[0]), atol=1e-4)


def test_checkpoint_resume_is_bit_identical(tiny, shards, tmp_path):
    folder, _ = shards
    data = S.load_sequences(folder, 3)
    vocab = S.frequent_vocab(data, 64, tiny.cfg.vocab_size)
    cfg = S.TrainConfig(epochs=2, batch_tokens=200, lr=2e-3, warmup=2, checkpoint_every=3)
    straight = ExitBlock(tiny, vocab)
    S.train(straight, data, cfg)
    resumed = ExitBlock(tiny, vocab)
    S.train(resumed, data, cfg, checkpoint_dir=tmp_path / "ck", max_steps=4)
    resumed = ExitBlock(tiny, vocab)  # a fresh process would start from scratch weights
    S.train(resumed, data, cfg, checkpoint_dir=tmp_path / "ck", resume=True)
    for (k, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), k
