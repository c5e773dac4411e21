"""Per-request changes to the logits before a token is chosen: ``logit_bias``, OpenAI's
presence and frequency penalties, and a grammar's mask (``sampling.grammar``).

Speculative sampling stays exact with respect to the *modified* target distribution only if
every level (draft, intermediate, final) and every row of a verification pass sees the
logits that plain decoding would see at that position. A row that follows speculative
tokens ``s_1 .. s_r`` (drafted or tentatively accepted, not yet committed) is preceded by the
committed tokens and ``s_1 .. s_r``, so its penalty counts include those tokens:

    logits'[r, v] = logits[r, v] + bias[v] - frequency * c_r[v] - presence * [c_r[v] > 0]

where ``c_r[v]`` counts ``v`` among the generated tokens before row ``r``'s next token
(committed output plus ``s_1 .. s_r``), as OpenAI defines the penalties.
"""
from __future__ import annotations

import torch

from ..config import SamplingParams


class LogitsProcessor:
    """The state one request needs: bias vector and counts of its committed output tokens."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device) -> None:
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        self.bias: torch.Tensor | None = None  # [V]
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias = torch.zeros(vocab_size, device=device).index_put_(
                (torch.tensor(ids, device=device),), torch.tensor(values, device=device), accumulate=True)
        self.counts = torch.zeros(vocab_size, device=device)  # [V] occurrences in the committed output
        self.grammar = params.grammar.state() if params.grammar is not None else None  # GrammarState

    @property
    def penalised(self) -> bool:
        return bool(self.presence or self.frequency)

    def commit(self, tokens: list[int]) -> None:
        """Count newly committed output tokens."""
        if tokens and self.penalised:
            self._count(self.counts, tokens)
        if self.grammar is not None:
            self.grammar.commit(tokens)

    def __call__(self, logits: torch.Tensor,  # [T, V]
                 spec: list[int]) -> torch.Tensor:
        """The modified logits ``[T, V]`` (float32).

        ``spec``: the speculative tokens after the committed ones, at least ``T - 1``; the last
        ``T - 1`` of them are the tokens of this pass: the last row follows all of ``spec``,
        row ``r`` follows ``spec`` without its last ``T - 1 - r`` tokens.
        """
        logits = logits.float()
        if self.bias is not None:
            logits = logits + self.bias
        if self.penalised:
            t = logits.shape[0]
            assert len(spec) >= t - 1, f"{t} rows need at least {t - 1} speculative tokens, got {len(spec)}"
            counts = self.counts.clone()
            before = spec[:len(spec) - (t - 1)]
            if before:
                self._count(counts, before)
            counts = counts.expand(logits.shape).clone()  # [T, V]
            if t > 1:
                step = torch.zeros_like(counts)
                ids = torch.tensor(spec[len(spec) - (t - 1):], device=counts.device)
                step[torch.arange(1, t, device=counts.device), ids] = 1.0
                counts += step.cumsum(0)  # row r also counts the pass's first r tokens
            logits = logits - self.frequency * counts - self.presence * (counts > 0).float()
        if self.grammar is not None:
            if self.bias is None and not self.penalised:
                logits = logits.clone()  # the mask is applied in place: keep the caller's raw logits
            logits = self.grammar.mask(logits, spec)
        return logits

    @staticmethod
    def _count(counts: torch.Tensor, tokens: list[int]) -> None:
        ids = torch.tensor(tokens, device=counts.device)
        counts.index_put_((ids,), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)
