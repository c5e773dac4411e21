"""BlockManager: paged KV bookkeeping (allocation, per-layer lengths, rollback, exhaustion)."""
from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hispec.cache.block_manager import BlockManager, CacheFullError


def snapshot(bm: BlockManager) -> tuple:
    seqs = {sid: (list(s.table), list(s.lengths)) for sid, s in bm._seqs.items()}
    return list(bm._free), seqs


def test_constructor_rejects_nonpositive_sizes():
    for args in ((0, 4, 2), (4, 0, 2), (4, 4, 0)):
        with pytest.raises(ValueError):
            BlockManager(*args)


def test_allocation_hands_out_low_ids_first_and_counts():
    bm = BlockManager(num_blocks=8, block_size=4, num_layers=3)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (8, 0)
    bm.add_sequence(0)
    assert bm.has_sequence(0) and not bm.has_sequence(1)
    assert bm.block_table(0) == [] and bm.capacity(0) == 0
    assert [bm.length(0, layer) for layer in range(3)] == [0, 0, 0]
    bm.ensure_capacity(0, 5)  # 5 tokens of block size 4 -> 2 blocks
    assert bm.block_table(0) == [0, 1]
    assert bm.capacity(0) == 8
    assert (bm.num_free_blocks, bm.num_used_blocks) == (6, 2)
    bm.add_sequence(1)
    bm.ensure_capacity(1, 1)
    assert bm.block_table(1) == [2]
    bm.check_invariants()
    with pytest.raises(AssertionError):
        bm.add_sequence(0)  # already exists


@pytest.mark.parametrize("num_tokens,blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed(num_tokens, blocks):
    assert BlockManager(4, 4, 1).blocks_needed(num_tokens) == blocks


def test_ensure_capacity_is_idempotent_and_never_shrinks():
    bm = BlockManager(8, 4, 2)
    bm.add_sequence(0)
    bm.ensure_capacity(0, 9)
    table = list(bm.block_table(0))
    bm.ensure_capacity(0, 9)
    bm.ensure_capacity(0, 3)  # fewer tokens than owned: nothing is returned
    assert bm.block_table(0) == table and bm.num_free_blocks == 5
    bm.ensure_capacity(0, 13)
    assert bm.block_table(0) == table + [3]
    bm.check_invariants()


def test_set_filled_per_layer_ranges_and_depth_order():
    bm = BlockManager(8, 4, 4)
    bm.add_sequence(0)
    bm.ensure_capacity(0, 10)
    bm.set_filled(0, 0, 4, 3)
    bm.set_filled(0, 0, 2, 10)  # shallow layers ahead (drafting)
    assert [bm.length(0, layer) for layer in range(4)] == [10, 10, 3, 3]
    bm.set_filled(0, 2, 3, 7)
    assert [bm.length(0, layer) for layer in range(4)] == [10, 10, 7, 3]
    with pytest.raises(AssertionError):  # a deep layer may not hold more than a shallow one
        bm.set_filled(0, 3, 4, 8)
    with pytest.raises(AssertionError):  # write past the allocated blocks
        bm.set_filled(0, 0, 1, 13)


def test_truncate_rolls_back_lengths_frees_tail_blocks_and_copies_nothing():
    bm = BlockManager(8, 4, 3)
    bm.add_sequence(0)
    bm.ensure_capacity(0, 14)  # 4 blocks
    bm.set_filled(0, 0, 3, 6)
    bm.set_filled(0, 0, 2, 14)
    table = list(bm.block_table(0))
    assert [bm.length(0, layer) for layer in range(3)] == [14, 14, 6]
    bm.truncate(0, 9)
    assert [bm.length(0, layer) for layer in range(3)] == [9, 9, 6]
    assert bm.block_table(0) == table[:3]  # the surviving prefix of the table is untouched
    assert bm.num_free_blocks == 5
    bm.truncate(0, 12)  # truncating to more than is held changes nothing
    assert [bm.length(0, layer) for layer in range(3)] == [9, 9, 6] and bm.block_table(0) == table[:3]
    bm.truncate(0, 4)
    assert [bm.length(0, layer) for layer in range(3)] == [4, 4, 4] and bm.block_table(0) == table[:1]
    bm.truncate(0, 0)
    assert bm.block_table(0) == [] and bm.num_free_blocks == 8
    bm.check_invariants()


def test_truncate_frees_unfilled_allocated_blocks():
    """Blocks reserved by ensure_capacity but never filled are returned by a rollback."""
    bm = BlockManager(8, 4, 2)
    bm.add_sequence(0)
    bm.ensure_capacity(0, 16)
    bm.set_filled(0, 0, 2, 5)
    bm.truncate(0, 5)
    assert len(bm.block_table(0)) == 2 and bm.num_free_blocks == 6
    bm.check_invariants()


def test_freed_blocks_are_reused():
    bm = BlockManager(4, 2, 1)
    bm.add_sequence(0)
    bm.ensure_capacity(0, 8)
    assert bm.num_free_blocks == 0
    bm.free(0)
    assert not bm.has_sequence(0) and bm.num_free_blocks == 4
    bm.add_sequence(1)
    bm.ensure_capacity(1, 8)
    assert sorted(bm.block_table(1)) == [0, 1, 2, 3]
    bm.check_invariants()
    with pytest.raises(KeyError):
        bm.free(0)


def test_exhaustion_raises_and_leaves_state_unchanged():
    bm = BlockManager(5, 4, 2)
    bm.add_sequence(0)
    bm.add_sequence(1)
    bm.ensure_capacity(0, 8)
    bm.set_filled(0, 0, 2, 8)
    bm.ensure_capacity(1, 9)
    before = snapshot(bm)
    assert not bm.can_allocate(0, 13)
    with pytest.raises(CacheFullError, match="KV cache full"):
        bm.ensure_capacity(0, 13)  # needs 2 more, 0 free
    assert snapshot(bm) == before
    bm.truncate(1, 0)
    assert bm.can_allocate(0, 20) and not bm.can_allocate(0, 21)
    before = snapshot(bm)
    with pytest.raises(CacheFullError):
        bm.ensure_capacity(0, 21)
    assert snapshot(bm) == before
    bm.ensure_capacity(0, 20)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


@pytest.mark.parametrize("num_tokens", range(0, 30))
def test_can_allocate_agrees_with_ensure_capacity(num_tokens):
    for owned_tokens in (0, 3, 4, 9):
        bm = BlockManager(6, 4, 1)
        bm.add_sequence(7)
        bm.ensure_capacity(7, owned_tokens)
        bm.add_sequence(8)
        bm.ensure_capacity(8, 4)  # another sequence holds one block
        predicted = bm.can_allocate(7, num_tokens)
        try:
            bm.ensure_capacity(7, num_tokens)
            happened = True
        except CacheFullError:
            happened = False
        assert predicted == happened, (owned_tokens, num_tokens)
    fresh = BlockManager(6, 4, 1)
    assert fresh.can_allocate(99, num_tokens) == (fresh.blocks_needed(num_tokens) <= 6)


# ---- stateful: random operation sequences against a simple model -------------------------

class BlockManagerMachine(RuleBasedStateMachine):
    """Model: per sequence, the number of blocks owned and the filled length of each layer."""

    NUM_BLOCKS, BLOCK_SIZE, NUM_LAYERS = 10, 3, 4

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, self.BLOCK_SIZE, self.NUM_LAYERS)
        self.owned: dict[int, int] = {}  # seq -> blocks
        self.lengths: dict[int, list[int]] = {}
        self.next_id = 0

    def _need(self, tokens: int) -> int:
        return -(-tokens // self.BLOCK_SIZE)

    @rule()
    def add(self):
        self.bm.add_sequence(self.next_id)
        self.owned[self.next_id] = 0
        self.lengths[self.next_id] = [0] * self.NUM_LAYERS
        self.next_id += 1

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), tokens=st.integers(0, 40))
    def ensure(self, data, tokens):
        sid = data.draw(st.sampled_from(sorted(self.owned)))
        free = self.NUM_BLOCKS - sum(self.owned.values())
        missing = max(0, self._need(tokens) - self.owned[sid])
        predicted = self.bm.can_allocate(sid, tokens)
        assert predicted == (missing <= free)
        before = snapshot(self.bm)
        if missing > free:
            with pytest.raises(CacheFullError):
                self.bm.ensure_capacity(sid, tokens)
            assert snapshot(self.bm) == before
        else:
            self.bm.ensure_capacity(sid, tokens)
            self.owned[sid] += missing
            assert self.bm.block_table(sid)[:len(before[1][sid][0])] == before[1][sid][0]

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def fill(self, data):
        """Fill a layer range the way LayerRunner.forward does: only where the depth order holds."""
        sid = data.draw(st.sampled_from(sorted(self.owned)))
        cap = self.owned[sid] * self.BLOCK_SIZE
        start = data.draw(st.integers(0, self.NUM_LAYERS - 1))
        end = data.draw(st.integers(start + 1, self.NUM_LAYERS))
        lens = self.lengths[sid]
        lo = lens[end] if end < self.NUM_LAYERS else 0
        hi = lens[start - 1] if start > 0 else cap
        assume(lo <= hi)
        length = data.draw(st.integers(lo, min(hi, cap)))
        self.bm.set_filled(sid, start, end, length)
        for layer in range(start, end):
            lens[layer] = length

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), length=st.integers(0, 40))
    def truncate(self, data, length):
        sid = data.draw(st.sampled_from(sorted(self.owned)))
        table = list(self.bm.block_table(sid))
        self.bm.truncate(sid, length)
        self.lengths[sid] = [min(n, length) for n in self.lengths[sid]]
        self.owned[sid] = self._need(max(self.lengths[sid]))
        assert self.bm.block_table(sid) == table[:self.owned[sid]]

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.owned)))
        self.bm.free(sid)
        del self.owned[sid], self.lengths[sid]

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.NUM_BLOCKS - sum(self.owned.values())
        for sid, n in self.owned.items():
            assert len(self.bm.block_table(sid)) == n
            assert [self.bm.length(sid, layer) for layer in range(self.NUM_LAYERS)] == self.lengths[sid]


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.filter_too_much])


def test_snapshot_helper_detects_changes():
    bm = BlockManager(3, 2, 1)
    bm.add_sequence(0)
    before = copy.deepcopy(snapshot(bm))
    bm.ensure_capacity(0, 1)
    assert snapshot(bm) != before
