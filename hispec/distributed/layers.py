"""The modules a rank holds in place of the model's full ones (Megatron-style tensor parallelism).

- column-parallel (q/k/v, gate/up, OPT fc1): a plain ``Linear`` holding this rank's output rows,
  i.e. its attention heads (whole K/V head groups, with their query heads) or MLP columns; no
  communication.
- :class:`RowParallelLinear` (o_proj, down_proj, OPT fc2): this rank's input columns; the partial
  products are summed over the ranks with one all-reduce, then the (replicated) bias is added.
- :class:`VocabParallelEmbedding`: this rank's vocabulary rows; tokens outside them give zeros,
  and one all-reduce sums the ranks (exactly: one non-zero term per token).
- :class:`VocabParallelHead`: this rank's vocabulary rows of the output head; the ranks' logits
  are all-gathered, so every rank holds the same full ``[T, V]`` logits.

Exit heads keep their small ``H x H`` adapter replicated (sharding it would cost an all-reduce
per exit for 0.25% of the weights) and use the vocabulary-parallel head (:func:`exit_logits`).
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.matmul import linear
from .comm import Comm, split_range


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local.T) + b``: ``weight [out, in_local]``, ``bias [out]`` or None."""

    def __init__(self, in_local: int, out_features: int, bias: bool, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.comm.all_reduce(linear(x, self.weight))  # [T, out], summed over ranks
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, stop)`` of the embedding; ``forward(ids [T]) -> [T, D]`` on every rank."""

    def __init__(self, vocab_size: int, dim: int, comm: Comm) -> None:
        super().__init__()
        self.start, self.stop = split_range(vocab_size, comm.world_size, comm.rank)
        self.weight = nn.Parameter(torch.empty(self.stop - self.start, dim))
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)  # [T]
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = nn.functional.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)  # [T, D]
        return self.comm.all_reduce(out)


class VocabParallelHead(nn.Module):
    """Rows ``[start, stop)`` of the output head; ``forward(h [T, D]) -> [T, V]`` on every rank."""

    def __init__(self, vocab_size: int, dim: int, comm: Comm) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.start, self.stop = split_range(vocab_size, comm.world_size, comm.rank)
        self.sizes = [b - a for a, b in (split_range(vocab_size, comm.world_size, r) for r in range(comm.world_size))]
        self.weight = nn.Parameter(torch.empty(self.stop - self.start, dim))
        self.comm = comm

    def local_logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.weight)  # [T, V_local]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_last(local, self.sizes)  # [T, V]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.gather(self.local_logits(h))


def exit_logits(model: nn.Module, head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Logits ``[T, V]`` of an exit head (``hispec.model.exits.ExitHead``) on a sharded model.

    The adapter runs replicated; the output head is the vocabulary-parallel one. A head with a
    restricted vocabulary computes the rows of its subset that fall in this rank's range and
    leaves ``-inf`` elsewhere, exactly as the single-process head does over the full vocabulary.
    """
    lm_head: VocabParallelHead = model.lm_head
    y = head.output_input(head.adapt(h))  # [T, D]
    if head.vocab_ids is None:
        return lm_head(y)
    ids, rows = local_subset(head, lm_head)
    local = y.new_full((h.shape[0], lm_head.stop - lm_head.start), float("-inf"))
    if ids.numel():
        local.index_copy_(1, ids, linear(y, rows))
    return lm_head.gather(local)


def local_subset(head: nn.Module, lm_head: VocabParallelHead) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a restricted head's vocabulary: local ids ``[k]`` and head rows ``[k, D]`` (cached)."""
    cached = head.__dict__.get("_tp_subset")
    if cached is None or cached[1].device != lm_head.weight.device or cached[1].dtype != lm_head.weight.dtype:
        ids = head.vocab_ids.to(lm_head.weight.device)
        ids = ids[(ids >= lm_head.start) & (ids < lm_head.stop)] - lm_head.start
        cached = (ids, lm_head.weight.detach()[ids].contiguous())
        head.__dict__["_tp_subset"] = cached
    return cached
