"""Paged key/value tensors and the per-call attention metadata that reads them.

The pool of each layer is one tensor ``[num_kv_heads, num_blocks * block_size, head_dim]``
(each KV head's rows in slot order: a sequence's consecutive blocks are one stretch of memory per
head, which is how attention reads them); a token's *slot* is ``block_id * block_size + offset``.
Writing puts the new tokens' rows at their slots; reading gathers a sequence's slots
``0..context_len-1`` through its block table. Rollback never touches these tensors (see
``BlockManager.truncate``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import hugepages
from ..kernels.fused import KernelBatch
from .block_manager import BlockManager


class KVPool:
    """K and V tensors for every layer, ``[num_kv_heads, num_blocks * block_size, head_dim]`` each,
    addressed by slot."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (num_kv_heads, num_blocks * block_size, head_dim)
        if torch.device(device).type == "cpu":  # attention streams these: in huge pages where the OS has them
            kv = hugepages.zeros([shape] * (2 * num_layers), dtype)
            self.k, self.v = kv[:num_layers], kv[num_layers:]
        else:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def bytes_per_block(self) -> int:
        per_layer = self.k[0].numel() // self.num_blocks * self.k[0].element_size()  # one block of one layer
        return 2 * len(self.k) * per_layer

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [T]; k, v: [T, num_kv_heads, head_dim] (cast to the pool's dtype)
        kp, vp = self.k[layer], self.v[layer]
        kp[:, slots] = (k if k.dtype == kp.dtype else k.to(kp.dtype)).transpose(0, 1)
        vp[:, slots] = (v if v.dtype == vp.dtype else v.to(vp.dtype)).transpose(0, 1)

    def move(self, layer: int, src: list[int], dst: list[int]) -> None:
        """Copy the K/V rows at slots ``src`` to slots ``dst`` (all read first, then written)."""
        s, d = torch.tensor(src, device=self.k[layer].device), torch.tensor(dst, device=self.k[layer].device)
        for t in (self.k[layer], self.v[layer]):
            t[:, d] = t[:, s]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # slots: [C] -> k, v: [C, num_kv_heads, head_dim]
        return self.k[layer][:, slots].transpose(0, 1), self.v[layer][:, slots].transpose(0, 1)

    def context(self, layer: int, batch: "AttentionBatch", i: int,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[C, num_kv_heads, head_dim]`` that chunk ``i`` of ``batch`` attends to: views of
        the pool when its slots are one run (no copy), else gathered; in ``dtype`` if given (a
        bfloat16 pool read by float32 queries: the values it holds, exactly)."""
        run = batch.context_runs[i]
        if run is None:
            k, v = self.read(layer, batch.context_slots[i])
        else:
            first, n = run
            k = self.k[layer][:, first:first + n].transpose(0, 1)
            v = self.v[layer][:, first:first + n].transpose(0, 1)
        return (k, v) if dtype is None or dtype == k.dtype else (k.to(dtype), v.to(dtype))


def slots_for(table: list[int], start: int, end: int, block_size: int, device) -> torch.Tensor:
    """Slots of positions ``start..end-1`` of a sequence with block table ``table``. -> [end - start]"""
    pos = torch.arange(start, end, device="cpu")
    blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
    return (blocks * block_size + pos % block_size).to(device)


def _run(table: list[int], length: int, block_size: int) -> tuple[int, int] | None:
    """``(first slot, length)`` if positions ``0..length-1`` sit in consecutive blocks, else None."""
    used = -(-length // block_size)
    first = table[0]
    if any(table[j] != first + j for j in range(1, used)):
        return None
    return first * block_size, length


@dataclass(frozen=True)
class TreeLayout:
    """Where a token tree's nodes lie in a sequence's cache: node ``i`` (flat index, parents first)
    is written at position ``root + i`` and stands at position ``root + depth(i)`` of its own
    branch (RoPE); node 0, the pending token, follows the committed prefix ``0 .. root - 1``, and
    node ``i > 0`` follows its parent ``parents[i] < i``. Node ``i`` attends to the prefix and to
    its ancestors and itself (``path(i)``), so it computes what it would as the last token of a
    chain, bit for bit on the fused kernels."""

    root: int
    parents: tuple[int, ...]  # [N], parents[0] == -1

    def __post_init__(self) -> None:
        assert self.parents and self.parents[0] == -1 and all(0 <= p < i for i, p in enumerate(self.parents) if i), \
            f"tree parents must come before their children, the root first: {self.parents}"

    def depth(self, i: int) -> int:
        d = 0
        while i > 0:
            i, d = self.parents[i], d + 1
        return d

    def path(self, i: int) -> list[int]:
        """Node ``i``'s ancestors from the root, then ``i``."""
        out = [i]
        while out[-1] > 0:
            out.append(self.parents[out[-1]])
        return out[::-1]


@dataclass
class SeqChunk:
    """One sequence's part of a ragged forward call: ``num_tokens`` new tokens at positions
    ``start .. start + num_tokens - 1``, attending to everything before them in the cache; or,
    with ``tree``, that tree's nodes ``start - tree.root ..`` (each attending to the prefix and
    its own ancestors)."""

    seq_id: int
    start: int
    num_tokens: int
    tree: TreeLayout | None = None

    def nodes(self) -> range:
        """The chunk's tree nodes (flat indices); only with a tree."""
        first = self.start - self.tree.root
        return range(first, first + self.num_tokens)

    def positions(self) -> list[int]:
        """The new tokens' positions as RoPE sees them."""
        if self.tree is None:
            return list(range(self.start, self.start + self.num_tokens))
        return [self.tree.root + self.tree.depth(i) for i in self.nodes()]

    def keys(self, j: int) -> list[int] | int:
        """The positions the chunk's ``j``-th token attends to, in order: a count ``n`` (the first
        ``n`` positions) for a chain, else the prefix and the node's path, as a list."""
        if self.tree is None:
            return self.start + j + 1
        t = self.tree
        return list(range(t.root)) + [t.root + a for a in t.path(self.start - t.root + j)]


class AttentionBatch:
    """Metadata for one forward call over a layer range, for a ragged batch of sequences.

    Built once per call and shared by every layer in the range; the new tokens of all
    sequences are concatenated into flat tensors (no padding).
    """

    def __init__(self, chunks: list[SeqChunk], blocks: BlockManager, device, prefill: bool = False) -> None:
        self.chunks = chunks
        self.device = device
        self.prefill = prefill  # prompt tokens: layers may take their prefill weights (QuantLinear.dense)
        bs = blocks.block_size
        self.offsets = [0]
        for c in chunks:
            self.offsets.append(self.offsets[-1] + c.num_tokens)
        tables = [blocks.block_table(c.seq_id) for c in chunks]
        self._tables, self._block_size, self._kernel = tables, bs, {}
        self.has_tree = any(c.tree is not None for c in chunks)
        positions = [p for c in chunks for p in c.positions()]
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)  # [T]
        # the new tokens' slots, straight from the block tables (no tensor ops per sequence)
        self.write_slots = torch.tensor([t[p // bs] * bs + p % bs for t, c in zip(tables, chunks)
                                         for p in range(c.start, c.start + c.num_tokens)], dtype=torch.long, device=device)  # [T]
        self._context_slots = self._context_runs = self._masks = None

    # What the eager attention path reads (the fused kernels read the block tables themselves), made
    # on first use: every slot a sequence attends to, (first slot, length) where those slots are one
    # run (consecutive blocks, the usual case for a lone sequence: attention reads a view instead of
    # a gather), and the causal masks.
    @property
    def context_slots(self) -> list[torch.Tensor]:
        if self._context_slots is None:
            self._context_slots = [slots_for(t, 0, c.start + c.num_tokens, self._block_size, self.device)
                                   for t, c in zip(self._tables, self.chunks)]
        return self._context_slots

    @property
    def context_runs(self) -> list[tuple[int, int] | None]:
        if self._context_runs is None:
            self._context_runs = [_run(t, c.start + c.num_tokens, self._block_size)
                                  for t, c in zip(self._tables, self.chunks)]
        return self._context_runs

    @property
    def masks(self) -> list[torch.Tensor | None]:
        if self._masks is None:
            self._masks = [self._causal_mask(c, self.device) for c in self.chunks]
        return self._masks

    def kernel(self, i: int | None = None):
        """The fused attention kernel's metadata (``kernels/fused.py``) for every chunk, or chunk ``i``."""
        if i not in self._kernel:
            idx = range(len(self.chunks)) if i is None else [i]
            self._kernel[i] = KernelBatch([self._tables[j] for j in idx], [self.chunks[j] for j in idx],
                                          self._block_size)
        return self._kernel[i]

    @staticmethod
    def _causal_mask(c: SeqChunk, device) -> torch.Tensor | None:
        """[num_tokens, start + num_tokens] bool, True where query i may attend key j; None for one
        token of a chain. A tree node sees the prefix and its own path."""
        if c.tree is not None:
            mask = torch.zeros((c.num_tokens, c.start + c.num_tokens), dtype=torch.bool)
            for j in range(c.num_tokens):
                mask[j, c.keys(j)] = True
            return mask.to(device)
        if c.num_tokens == 1:
            return None
        q_pos = torch.arange(c.start, c.start + c.num_tokens, device=device)[:, None]
        k_pos = torch.arange(c.start + c.num_tokens, device=device)[None, :]
        return k_pos <= q_pos

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]
