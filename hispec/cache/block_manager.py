"""Paged KV-cache bookkeeping: which blocks a sequence owns and how much of each layer is filled.

Plain Python, no tensors. A sequence owns a *block table* (a list of block ids); token
position ``p`` lives in block ``table[p // block_size]`` at offset ``p % block_size``.

Each layer has its own filled length, because self-speculation computes layers in ranges:
drafting fills layers ``0..L_d`` ahead of the deeper layers, which catch up later. The
lengths never increase with depth (a deep layer cannot hold a token a shallow one lacks).

Rollback (``truncate``) only shortens lengths and returns whole tail blocks to the pool:
nothing is copied and nothing needs clearing, since a slot past a layer's length is never read.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class CacheFullError(RuntimeError):
    """The block pool has too few free blocks for the request."""


@dataclass(slots=True)
class _SeqBlocks:
    table: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # filled length per layer


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

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Could the sequence (new or existing) hold ``num_tokens`` positions in total?"""
        owned = len(self._seqs[seq_id].table) if seq_id in self._seqs else 0
        return self.blocks_needed(num_tokens) - owned <= len(self._free)

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
        if missing > len(self._free):
            raise CacheFullError(f"KV cache full: need {missing} more blocks of {self.block_size} tokens, "
                                 f"{len(self._free)} free of {self.num_blocks}")
        for _ in range(missing):
            seq.table.append(self._free.pop())
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
        while len(seq.table) > keep:
            self._free.append(seq.table.pop())
        self._check(seq_id)

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id)
        self._free.extend(reversed(seq.table))
        assert len(self._free) <= self.num_blocks

    # ---- invariants ----------------------------------------------------------------------
    def _check(self, seq_id: int) -> None:
        seq = self._seqs[seq_id]
        model = seq.lengths[:self.num_layers]
        assert all(a >= b for a, b in zip(model, model[1:])), f"layer lengths must not increase with depth: {model}"
        assert max(seq.lengths) <= len(seq.table) * self.block_size

    def check_invariants(self) -> None:
        """Every block is either free or owned by exactly one sequence (for tests)."""
        owned = [b for s in self._seqs.values() for b in s.table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(self._free), "a block is both free and owned"
        assert len(owned) + len(self._free) == self.num_blocks, "a block leaked"
        for seq_id in self._seqs:
            self._check(seq_id)
