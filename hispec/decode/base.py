"""What every decoding strategy shares: the per-request context and the strategy protocol. The
model runner they call (``LayerRunner``) is ``model/runner.py``.

Cache invariant between steps (all strategies): the committed tokens are ``ctx.tokens``;
every layer holds K/V for positions ``0 .. len(tokens) - 2``; the last committed token is
*pending*: it has been chosen but not yet run through the model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..config import SamplingParams, SpecConfig
from ..model.decoder import DecoderModel
from ..model.runner import LayerRunner
from ..sampling.processors import LogitsProcessor
from ..sampling.sampler import choose, position_uniforms, sample_key
from .stats import DecodeStats


@dataclass
class DecodeContext:
    """One request being decoded."""

    runner: LayerRunner
    seq_id: int
    tokens: list[int]  # prompt + committed tokens; tokens[-1] is pending
    params: SamplingParams
    seed: int | None  # a sampled request's (its own, or drawn at random), None for a greedy one
    stats: DecodeStats
    token_cap: int  # len(tokens) may not exceed this: prompt + max_new_tokens, capped by the context
    eos_ids: frozenset[int]
    policy: object | None = None  # the strategy's per-sequence draft-length policy, made on first use
    processor: LogitsProcessor | None = None  # penalties and biases, applied at every level
    lookup: object | None = None  # its free-draft source (``spec.proposers.lookup.LookupState``), made on first use
    suffix: object | None = None  # its scope's earlier outputs (``spec.proposers.suffix.SuffixCache``), or None
    row_cost: float | None = None  # a verification row's measured cost relative to a plain step (the engine's)
    # A plain run of several steps stops where the text ends on an n-gram seen before, n >= this
    # (0: never), so that prompt lookup's drafts from such a match are verified before the next
    # plain step; set by the free-draft round (``spec.proposers.lookup.free_drafts``) where they would pay.
    lookup_stop: int = 0
    # The final layer's raw logits [n, V] of the n tokens the last step committed (row j chose
    # token j); set by every strategy where it verifies, read by the engine for logprobs.
    target_logits: torch.Tensor | None = None
    # The key of a sampled request's random numbers (``sampler.position_uniforms``), from its seed.
    sample_key: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.seed is not None:
            self.sample_key = sample_key(self.seed)

    @property
    def model(self) -> DecoderModel:
        return self.runner.model

    @property
    def remaining(self) -> int:
        return self.token_cap - len(self.tokens)

    def token_tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.model.device)

    def uniforms(self, start: int, n: int) -> list[float]:
        """The uniform numbers of this request's tokens at positions ``start .. start + n - 1``
        (zeros for a greedy one): whichever round chooses a position's token draws it with that
        position's number, so drafting never changes a seeded request's tokens."""
        return [0.0] * n if self.params.greedy else position_uniforms(self.sample_key, start, n)

    def process(self, logits: torch.Tensor, spec: list[int] | tuple = ()) -> torch.Tensor:
        """``logits [T, V]`` as this request samples from them: row ``r`` follows the committed
        tokens and the speculative tokens ``spec[:r]`` (see ``sampling.processors``)."""
        return logits if self.processor is None else self.processor(logits, list(spec))


class Strategy:
    """A decoding strategy (``ar``, ``selfspec``, ``hispec``): which layers run when.

    ``lookahead`` declares an upper bound on the positions past the pending token one step may
    write per sequence; the engine's scheduler reserves that many slots before each step. What the
    speculation policy (``spec.policy.SpecPolicy``) asks of a strategy is declared here too: its
    settings (``spec``), whether its step is worth weighing against a plain one (``adaptive_steps``),
    whether it has free rounds (``has_free_rounds``), its rounds as chains (``as_chain``).
    """

    name = "base"
    lookahead = 2
    spec: SpecConfig | None = None  # a speculative strategy's settings
    adaptive_steps = True  # whether the adaptive controller weighs its step against a plain one

    def step(self, batch: list[DecodeContext]) -> list[list[int]]:
        """One round for every sequence of the batch (each with ``remaining > 0``): the tokens
        each one commits (at least one). The caller appends them to ``ctx.tokens``."""
        raise NotImplementedError

    def free_round(self, batch: list[DecodeContext], cost) -> list[list[int]] | None:
        """A round that verifies drafts which cost no model time (prompt lookup): each sequence's
        committed tokens as ``step`` returns them (those without drafts take a plain row), or None
        when no sequence has drafts worth verifying now. ``cost``: the measured cost of verification
        rows (``spec.cost.RowCost``) that decides how many drafts pay; None: always verify every
        draft there is."""
        return None

    @property
    def has_free_rounds(self) -> bool:
        """Whether it has free rounds (it overrides ``free_round``)."""
        return type(self).free_round is not Strategy.free_round

    def as_chain(self) -> "Strategy":
        """The same strategy drafting one token per position where its settings draft token trees
        (the adaptive controller's ``chain`` mode)."""
        return type(self)(dataclasses.replace(self.spec, tree_width=1))

    def steps(self, ctx: DecodeContext) -> Iterator[list[int]]:
        """Rounds of one sequence; the caller appends each chunk to ``ctx.tokens`` before the next."""
        while ctx.remaining > 0:
            yield self.step([ctx])[0]


def split_rows(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(t.split(sizes)) if len(sizes) > 1 else [t]


def process_rows(batch: list[DecodeContext], logits: torch.Tensor, sizes: list[int],
                 specs: list[list[int] | tuple]) -> torch.Tensor:
    """``logits [sum n_b, V]`` (``batch[b]``'s ``n_b = sizes[b]`` rows consecutive) as each request
    samples from them (``DecodeContext.process`` with ``specs[b]``). Only the requests with a
    logits processor (penalties, biases, a grammar) are touched, one by one."""
    if all(c.processor is None for c in batch):
        return logits
    return torch.cat([c.process(lg, spec) for c, lg, spec in zip(batch, split_rows(logits, sizes), specs)])


def choose_tokens(batch: list[DecodeContext], logits: torch.Tensor) -> torch.Tensor:
    """One next token per sequence from ``logits [B, V]`` (row b belongs to ``batch[b]``) -> ``[B]``.
    Greedy rows take the argmax; sampled rows use their own parameters and their next position's
    uniform number (``DecodeContext.uniforms``), in one pass."""
    logits = process_rows(batch, logits, [1] * len(batch), [()] * len(batch))
    u = torch.tensor([c.uniforms(len(c.tokens), 1)[0] for c in batch], dtype=torch.float64, device=logits.device)
    return choose(logits, [c.params for c in batch], u)[0]
