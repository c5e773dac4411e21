"""Paged KV-cache bookkeeping: which blocks a sequence owns and how much of each layer is filled.

Plain Python, no tensors. A sequence owns a *block table* (a list of block ids); token
position ``p`` lives in block ``table[p // block_size]`` at offset ``p % block_size``.

Each layer has its own filled length, because self-speculation computes layers in ranges:
drafting fills layers ``0..L_d`` ahead of the deeper layers, which catch up later. The
lengths never increase with depth (a deep layer cannot hold a token a shallow one lacks).

Rollback (``truncate``) only shortens lengths and returns whole tail blocks to the pool:
nothing is copied and nothing needs clearing, since a slot past a layer's length is never read.

Prefix caching (``cache.prefix``): full blocks that a prefill wrote are keyed by the tokens of
their prefix; a new sequence whose prompt starts with the same tokens takes those blocks
(``match_prefix``) instead of recomputing them. A block can then belong to several sequences
(a reference count); one that nobody holds but that still has a key is *evictable*: it counts
as free and is reused for new data only after the never-keyed free blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .prefix import PrefixIndex, block_keys


class CacheFullError(RuntimeError):
    """The block pool has too few free blocks for the request."""


@dataclass(slots=True)
class _SeqBlocks:
    table: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # filled length per layer
    keys: list[bytes] = field(default_factory=list)  # prefix keys of table[:len(keys)] (cache.prefix)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_exit_layers: int = 0) -> None:
        """``num_exit_layers``: K/V layers of exit blocks, tracked after the model's ``num_layers``;
        they run ahead of the deeper layers (drafts), so the depth order does not apply to them."""
        if num_blocks < 1 or block_size < 1 or num_layers < 1 or num_exit_layers < 0:
            raise ValueError("num_blocks, block_size and num_layers must all be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_exit_layers = num_exit_layers
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._seqs: dict[int, _SeqBlocks] = {}
        self._refs: dict[int, int] = {}  # block -> sequences whose table holds it
        self.prefix = PrefixIndex()
        self._salt: object = None  # what the keyed blocks were computed with (``use_prefix_salt``)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: never keyed, or keyed but held by nobody (evictable)."""
        return len(self._free) + len(self.prefix.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by sequences."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a prefix key (held or evictable)."""
        return len(self.prefix.key_of)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Could the sequence (new or existing) hold ``num_tokens`` positions in total?"""
        owned = len(self._seqs[seq_id].table) if seq_id in self._seqs else 0
        return self.blocks_needed(num_tokens) - owned <= self.num_free_blocks

    def block_table(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id].table

    def length(self, seq_id: int, layer: int) -> int:
        return self._seqs[seq_id].lengths[layer]

    def capacity(self, seq_id: int) -> int:
        return len(self._seqs[seq_id].table) * self.block_size

    # ---- changes -------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        assert seq_id not in self._seqs, f"sequence {seq_id} already exists"
        self._seqs[seq_id] = _SeqBlocks(lengths=[0] * (self.num_layers + self.num_exit_layers))

    def ensure_capacity(self, seq_id: int, num_tokens: int) -> None:
        """Grow the block table so positions ``0..num_tokens-1`` have slots."""
        seq = self._seqs[seq_id]
        missing = self.blocks_needed(num_tokens) - len(seq.table)
        if missing > self.num_free_blocks:
            raise CacheFullError(f"KV cache full: need {missing} more blocks of {self.block_size} tokens, "
                                 f"{self.num_free_blocks} free of {self.num_blocks}")
        for _ in range(missing):
            block = self._free.pop() if self._free else self.prefix.evict()
            self._refs[block] = 1
            seq.table.append(block)
        self._check(seq_id)

    def set_filled(self, seq_id: int, start_layer: int, end_layer: int, length: int) -> None:
        """Record that layers ``[start_layer, end_layer)`` now hold positions ``0..length-1``."""
        seq = self._seqs[seq_id]
        assert length <= len(seq.table) * self.block_size, "write past the allocated blocks"
        for layer in range(start_layer, end_layer):
            seq.lengths[layer] = length
        self._check(seq_id)

    def truncate(self, seq_id: int, length: int, *, keep_blocks: bool = False) -> None:
        """Roll back: every layer keeps at most ``length`` positions; surplus tail blocks are freed
        (kept with ``keep_blocks``: they stay reserved for the rest of a step)."""
        seq = self._seqs[seq_id]
        seq.lengths = [min(n, length) for n in seq.lengths]
        if keep_blocks:
            self._check(seq_id)
            return
        keep = self.blocks_needed(max(seq.lengths, default=0))
        assert keep >= len(seq.keys), "a rollback into keyed (shared) blocks"
        while len(seq.table) > keep:
            self._release(seq.table.pop())
        self._check(seq_id)

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (the tail first: its deepest keyed blocks are evicted first)."""
        seq = self._seqs.pop(seq_id)
        for block in reversed(seq.table):
            self._release(block)

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if not self._refs[block]:
            del self._refs[block]
            if not self.prefix.park(block):
                self._free.append(block)

    # ---- prefix caching ------------------------------------------------------------------
    def use_prefix_salt(self, salt: object) -> None:
        """Keyed blocks hold K/V of one model (weights, exits, KV dtype): an engine names what it
        computes with, and keys made with anything else are forgotten."""
        if salt != self._salt:
            self._free.extend(self.prefix.clear())
            self._salt = salt

    def match_prefix(self, seq_id: int, tokens: list[int], scope: str = "") -> int:
        """Give a new sequence the keyed blocks that hold the longest block-aligned prefix of
        ``tokens`` (the positions it would prefill) in ``scope``; every layer then holds that many
        positions. Returns them (a multiple of the block size; 0 on a miss)."""
        seq = self._seqs[seq_id]
        assert not seq.table, "prefix blocks go first in a table"
        self.prefix.queries += len(tokens)
        for key in block_keys(tokens, self.block_size, scope):
            block = self.prefix.find(key)
            if block is None:
                break
            self.prefix.revive(block)
            self._refs[block] = self._refs.get(block, 0) + 1
            seq.table.append(block)
            seq.keys.append(key)
        hit = len(seq.keys) * self.block_size
        self.prefix.hits += hit
        seq.lengths = [hit] * len(seq.lengths)
        return hit

    def cache_blocks(self, seq_id: int, tokens: list[int], scope: str = "") -> None:
        """Key the sequence's full blocks of ``tokens`` (positions a prefill wrote) that every layer
        holds, so later sequences can find them."""
        seq = self._seqs[seq_id]
        upto = min(len(tokens), *seq.lengths) // self.block_size
        if upto <= len(seq.keys):
            return
        start = len(seq.keys)
        keys = list(block_keys(tokens[:upto * self.block_size], self.block_size, scope,
                               seq.keys[-1] if seq.keys else None, start))
        for block, key in zip(seq.table[start:upto], keys):
            self.prefix.add(block, key)
        seq.keys += keys

    # ---- invariants ----------------------------------------------------------------------
    def _check(self, seq_id: int) -> None:
        seq = self._seqs[seq_id]
        model = seq.lengths[:self.num_layers]
        assert all(a >= b for a, b in zip(model, model[1:])), f"layer lengths must not increase with depth: {model}"
        assert max(seq.lengths) <= len(seq.table) * self.block_size

    def check_invariants(self) -> None:
        """Every block is free, evictable or held, and a held block's count is the tables holding
        it; only keyed blocks are shared (for tests)."""
        held: dict[int, int] = {}
        for s in self._seqs.values():
            assert len(s.table) == len(set(s.table)), "a table holds a block twice"
            for b in s.table:
                held[b] = held.get(b, 0) + 1
        assert held == self._refs, "reference counts differ from the tables"
        assert all(n == 1 or b in self.prefix.key_of for b, n in held.items()), "an unkeyed block is shared"
        free, evictable = set(self._free), set(self.prefix.evictable)
        assert len(free) == len(self._free), "a block is free twice"
        assert not (free & evictable) and not (set(held) & (free | evictable)), "a block is both free and held"
        assert evictable <= set(self.prefix.key_of), "an evictable block has no key"
        assert len(held) + len(free) + len(evictable) == self.num_blocks, "a block leaked"
        for seq_id in self._seqs:
            self._check(seq_id)
