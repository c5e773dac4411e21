"""What every decoding strategy shares: the layer runner, the per-request context, the protocol.

Cache invariant between steps (all strategies): the committed tokens are ``ctx.tokens``;
every layer holds K/V for positions ``0 .. len(tokens) - 2``; the last committed token is
*pending*: it has been chosen but not yet run through the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from ..cache.block_manager import BlockManager
from ..cache.kv_cache import AttentionBatch, KVPool, SeqChunk
from ..config import SamplingParams
from ..model.llama import DecoderModel
from .stats import DecodeStats


class LayerRunner:
    """Runs a sequence's new tokens through a layer range and keeps the block manager in step."""

    def __init__(self, model: DecoderModel, blocks: BlockManager, pool: KVPool) -> None:
        self.model, self.blocks, self.pool = model, blocks, pool

    def forward(self, seq_id: int, start_pos: int, x: torch.Tensor, start_layer: int, end_layer: int) -> torch.Tensor:
        """Run positions ``start_pos ..`` through layers ``[start_layer, end_layer)``.

        ``x`` is token ids ``[T]`` when ``start_layer == 0``, else the hidden states ``[T, H]``
        entering ``start_layer``. Returns the hidden states ``[T, H]`` after ``end_layer - 1``.
        """
        num = x.shape[0]
        for layer in (start_layer, end_layer - 1):
            assert self.blocks.length(seq_id, layer) == start_pos, \
                f"layer {layer} holds {self.blocks.length(seq_id, layer)} positions, expected {start_pos}"
        self.blocks.ensure_capacity(seq_id, start_pos + num)
        batch = AttentionBatch([SeqChunk(seq_id, start_pos, num)], self.blocks, self.model.device)
        h = self.model.embed(x, batch.positions) if start_layer == 0 else x
        h = self.model.run_layers(h, start_layer, end_layer, batch, self.pool)
        self.blocks.set_filled(seq_id, start_layer, end_layer, start_pos + num)
        return h

    def truncate(self, seq_id: int, length: int) -> None:
        self.blocks.truncate(seq_id, length)


@dataclass
class DecodeContext:
    """One request being decoded."""

    runner: LayerRunner
    seq_id: int
    tokens: list[int]  # prompt + committed tokens; tokens[-1] is pending
    params: SamplingParams
    generator: torch.Generator | None
    stats: DecodeStats
    max_tokens: int  # len(tokens) may not exceed this (new-token limit and context limit)
    eos_ids: frozenset[int]

    @property
    def model(self) -> DecoderModel:
        return self.runner.model

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.tokens)

    def token_tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.model.device)


class Strategy(Protocol):
    name: str

    def steps(self, ctx: DecodeContext) -> Iterator[list[int]]:
        """Yield committed tokens, a chunk at a time. The caller appends each chunk to
        ``ctx.tokens`` (and may stop iterating) before the strategy resumes."""
        ...
