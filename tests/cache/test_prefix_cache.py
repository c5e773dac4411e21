"""Prefix-cache bookkeeping: chain keys name whole prefixes, shared blocks are counted, evictable
blocks are reused last and only keyed blocks are ever shared."""
from __future__ import annotations

import random

import pytest

from hispec.cache.block_manager import BlockManager, CacheFullError
from hispec.cache.prefix import block_keys


def test_keys_name_the_whole_prefix_and_the_scope():
    def keys(*args, **kw):
        return list(block_keys(*args, **kw))

    a = keys(list(range(12)), 4)
    assert len(a) == 3 and len(set(a)) == 3
    assert keys(list(range(12)) + [99], 4) == a  # a partial block has no key
    b = keys([7] + list(range(1, 12)), 4)
    assert b[0] != a[0] and b[1] != a[1]  # the same tokens after another first block: other keys
    assert keys(list(range(12)), 4, "tenant-b") != a
    assert keys(list(range(12)), 4, parent=a[0], start=1) == a[1:]  # the chain goes on


def filled(blocks: BlockManager, seq: int, tokens: list[int]) -> None:
    """As a prefill of ``tokens`` would leave it: slots, every layer filled."""
    blocks.ensure_capacity(seq, len(tokens))
    blocks.set_filled(seq, 0, blocks.num_layers + blocks.num_exit_layers, len(tokens))


def test_a_second_sequence_shares_the_first_ones_prefix_blocks():
    blocks = BlockManager(8, 4, 2, 1)
    prompt = list(range(10))
    blocks.add_sequence(0)
    assert blocks.match_prefix(0, prompt) == 0
    filled(blocks, 0, prompt)
    blocks.cache_blocks(0, prompt)
    assert blocks.num_cached_blocks == 2  # the third block is partial

    blocks.add_sequence(1)
    assert blocks.match_prefix(1, prompt[:9] + [50]) == 8
    assert blocks.block_table(1) == blocks.block_table(0)[:2]
    assert all(blocks.length(1, layer) == 8 for layer in range(3))
    assert blocks.num_used_blocks == 3
    blocks.check_invariants()
    blocks.add_sequence(2)
    assert blocks.match_prefix(2, prompt, scope="other tenant") == 0
    blocks.check_invariants()


def test_freed_keyed_blocks_stay_findable_until_the_pool_needs_them():
    blocks = BlockManager(4, 4, 1)
    prompt = list(range(8))
    blocks.add_sequence(0)
    filled(blocks, 0, prompt)
    blocks.cache_blocks(0, prompt)
    blocks.free(0)
    assert blocks.num_free_blocks == 4 and blocks.num_cached_blocks == 2
    blocks.add_sequence(1)
    filled(blocks, 1, [1] * 8)  # takes the two never-keyed blocks first
    assert blocks.num_cached_blocks == 2
    blocks.add_sequence(2)
    assert blocks.match_prefix(2, prompt) == 8
    blocks.free(2)
    blocks.ensure_capacity(1, 12)  # now one keyed block is evicted: the tail of the prefix first
    assert blocks.num_cached_blocks == 1
    blocks.add_sequence(3)
    assert blocks.match_prefix(3, prompt) == 4
    with pytest.raises(CacheFullError):
        blocks.ensure_capacity(1, 17)
    blocks.check_invariants()


def test_rollback_never_reaches_shared_blocks():
    blocks = BlockManager(6, 4, 2)
    prompt = list(range(9))
    blocks.add_sequence(0)
    filled(blocks, 0, prompt[:8])
    blocks.cache_blocks(0, prompt[:8])
    blocks.add_sequence(1)
    assert blocks.match_prefix(1, prompt[:8]) == 8
    filled(blocks, 1, prompt + [5, 6])
    blocks.truncate(1, 8)  # speculation's rollback to the committed tokens
    assert blocks.block_table(1) == blocks.block_table(0)
    with pytest.raises(AssertionError):
        blocks.truncate(1, 3)
    blocks.check_invariants()


def test_random_operations_keep_every_block_accounted_for():
    rng = random.Random(0)
    blocks = BlockManager(24, 4, 2, 1)
    prefixes = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]
    live: dict[int, list[int]] = {}
    for seq in range(300):
        if live and (len(live) > 4 or rng.random() < 0.4):
            blocks.free(live.pop(rng.choice(list(live))))
        tokens = rng.choice(prefixes)[:rng.randint(0, 12)] + [rng.randrange(5) for _ in range(rng.randint(1, 8))]
        if not blocks.can_allocate(seq, len(tokens) + 4):
            continue
        blocks.add_sequence(seq)
        hit = blocks.match_prefix(seq, tokens)
        assert hit % 4 == 0 and hit <= len(tokens)
        filled(blocks, seq, tokens)
        blocks.cache_blocks(seq, tokens)
        blocks.ensure_capacity(seq, len(tokens) + 4)
        blocks.truncate(seq, len(tokens) + rng.randint(0, 4))
        live[seq] = seq
        blocks.check_invariants()
    assert blocks.prefix.hits > 0
    for seq in list(live):
        blocks.free(seq)
    assert blocks.num_used_blocks == 0
    blocks.check_invariants()
