"""Continuous batching: which sequences run this step.

A finished sequence leaves at once and a waiting one joins as soon as the batch has room and
the KV pool has blocks for it. Before each step every running sequence must be able to grow
by the strategy's look-ahead; when the pool is short, the most recently admitted sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
from its tokens later. The scheduler is the only allocator: once the batch is settled it
reserves each sequence's slots for the step (as vLLM's ``allocate_slots`` with its look-ahead
tokens), and nothing during the step allocates. A sequence admitted with a ``prefix_scope``
first takes the cached blocks of its prompt's longest cached prefix (``BlockManager.match_prefix``);
its prefill starts after them.
"""
from __future__ import annotations

from collections import deque

from ..cache.block_manager import BlockManager, CacheFullError
from .sequence import Sequence, SeqStatus


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_size: int, lookahead: int) -> None:
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.lookahead = lookahead  # positions a step may add per sequence
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _need(self, seq: Sequence) -> int:
        """Positions the sequence may hold after one more step."""
        return min(len(seq.ctx.tokens) + self.lookahead, seq.ctx.token_cap + 1)

    def _shortfall(self) -> int:
        """Blocks the running sequences still lack for their next step."""
        missing = 0
        for s in self.running:
            owned = len(self.blocks.block_table(s.seq_id))
            missing += max(0, self.blocks.blocks_needed(self._need(s)) - owned)
        return missing

    def schedule(self) -> list[Sequence]:
        """The batch for the next step (preempting or admitting as the pool allows)."""
        while self.running and self._shortfall() > self.blocks.num_free_blocks:
            self._preempt(self.running[-1])
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if not self._can_admit(seq):
                break
            self.waiting.popleft()
            self.blocks.add_sequence(seq.seq_id)
            if seq.prefix_scope is not None:
                # (cached blocks hold prefilled prompt tokens: a preempted sequence's later ones are not looked up)
                seq.num_cached = self.blocks.match_prefix(seq.seq_id, seq.ctx.tokens[:seq.prompt_end],
                                                          seq.prefix_scope)
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = seq.num_cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        if not self.running and self.waiting:
            seq = self.waiting[0]
            raise CacheFullError(f"request {seq.request_id} needs {self.blocks.blocks_needed(self._need(seq))} "
                                 f"KV blocks but the pool has only {self.blocks.num_blocks}: raise --kv-blocks")
        for s in self.running:  # the step's slots (room was checked above)
            self.blocks.ensure_capacity(s.seq_id, self._need(s))
        return list(self.running)

    def _can_admit(self, seq: Sequence) -> bool:
        need = self.blocks.blocks_needed(self._need(seq))
        return need <= self.blocks.num_free_blocks - self._shortfall()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.forget_cache()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
