"""Prefix caching: full KV blocks found again by the tokens they hold (vLLM's automatic prefix
caching, nano-vllm's hashed blocks).

A full block's key is a hash chain over the tokens of every block up to and including it,
rooted at a *salt* (the request's cache scope, e.g. an API key, so tenants never share blocks):

    key_0 = H(salt, tokens[0:B]),   key_i = H(key_{i-1}, tokens[i*B:(i+1)*B])

so one key names the whole prefix, not just the block's own B tokens. A block gets its key once
every layer of the pool holds all of its positions (the engine registers blocks as its prefill
chunks complete); from then on its K/V never changes: the owning sequence only writes past its
committed tokens, and rollbacks never go below them. Sequences that find the key share the block
(a reference count per block). A block nobody references but that still has a key waits in an
LRU of *evictable* blocks: still findable, and handed out for new data (its key dropped) only
when no never-keyed block is free.

Only blocks that a prefill wrote are keyed: prefill and one-token decode steps may round K/V
differently (different kernels), and a later request would prefill those positions itself.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterator


def block_keys(tokens: list[int], block_size: int, salt: str = "", parent: bytes | None = None,
               start: int = 0) -> Iterator[bytes]:
    """Chain keys of the full blocks of ``tokens`` from block ``start`` on (``parent``: the key of
    block ``start - 1``; the salt roots the chain at block 0), one at a time: a lookup that misses
    hashes no further."""
    prev = parent if start else hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for i in range(start, len(tokens) // block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes())
        prev = h.digest()
        yield prev


class PrefixIndex:
    """Which block holds which key, and the LRU of keyed blocks no sequence references."""

    def __init__(self) -> None:
        self.block_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, found in cached blocks

    def find(self, key: bytes) -> int | None:
        return self.block_of.get(key)

    def add(self, block: int, key: bytes) -> None:
        """Key a block (a block already keyed, or a key already held by another block, is left as is:
        two sequences that prefilled the same prefix side by side keep the first one's)."""
        if key not in self.block_of and block not in self.key_of:
            self.block_of[key] = block
            self.key_of[block] = key

    def park(self, block: int) -> bool:
        """A keyed block lost its last reference: it becomes evictable (most recently used). False
        for a block without a key (it goes back to the plain free list)."""
        if block not in self.key_of:
            return False
        self.evictable[block] = None
        return True

    def revive(self, block: int) -> None:
        """An evictable block is referenced again (a prefix hit)."""
        self.evictable.pop(block, None)

    def evict(self) -> int:
        """The least recently used evictable block, its key dropped, for new data."""
        block, _ = self.evictable.popitem(last=False)
        del self.block_of[self.key_of.pop(block)]
        return block

    def clear(self) -> list[int]:
        """Forget every key; the evictable blocks (now plain free blocks)."""
        freed = list(self.evictable)
        self.block_of.clear()
        self.key_of.clear()
        self.evictable.clear()
        return freed

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
