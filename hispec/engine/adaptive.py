"""Adaptive speculation: per step, speculate or decode plainly, from measured throughput.

Speculation trades extra (cheap) draft and verification work for fewer full-model passes.
At batch size 1 on a memory-bound device that pays; at large, compute-bound batches the
verification work costs as much as the tokens it saves, and plain decoding wins. Rather than
a fixed rule, the controller measures both modes per batch-size bucket (committed tokens per
second of step time, an exponential moving average; each mode once, then a few more times unless
it clearly loses), picks the better one, and now and then re-measures the other: every
``explore_every`` steps at first, twice as long after each re-measurement that changes nothing (up
to ``max_backoff`` times), back to the start when the other mode wins. Both modes are lossless, so
switching never changes the output.

A strategy that drafts token trees (``--tree-width``) has a third mode, ``chain``: its rounds with
one draft per position. The controller then weighs the three (trees pay only where verification
rows are cheap: ``decode/tree.py``), re-measuring the losers in turn.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..decode.lookup import RowCost

SPECULATE, CHAIN, PLAIN = "speculate", "chain", "plain"


def adaptive_modes(strategy) -> tuple[str, ...]:
    """The modes the controller weighs for ``strategy``: its rounds and plain ones, and its rounds
    as chains where it drafts trees."""
    spec = getattr(strategy, "spec", None)
    return (SPECULATE, CHAIN, PLAIN) if getattr(spec, "tree_width", 1) > 1 else (SPECULATE, PLAIN)


@dataclass
class _Rate:
    tokens_per_second: float = 0.0
    samples: int = 0

    def add(self, value: float, alpha: float) -> None:
        self.tokens_per_second = value if self.samples == 0 else (1 - alpha) * self.tokens_per_second + alpha * value
        self.samples += 1


@dataclass
class AdaptiveController:
    warmup: int = 3  # measurements of each mode before trusting the averages
    # ... unless its first ones are below this fraction of the best mode's: then it is measured enough
    # (a speculative round that takes ~4x a plain step per token is not noise, and every extra
    # warm-up round of it costs a fresh process ~5% of a short generation; exploration re-measures)
    clear_loss: float = 0.5
    explore_every: int = 24  # steps between re-measurements of the losing mode (at first)
    max_backoff: int = 8  # the interval grows to at most explore_every * max_backoff
    alpha: float = 0.3
    modes: tuple[str, ...] = (SPECULATE, PLAIN)  # the first wins ties
    rates: dict[tuple[int, str], _Rate] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    _since_explore: dict[int, int] = field(default_factory=dict)
    _backoff: dict[int, int] = field(default_factory=dict)  # bucket -> interval multiplier
    _best_before: dict[int, str] = field(default_factory=dict)  # bucket -> best mode at the last exploration
    row_cost: RowCost = field(default_factory=RowCost)  # seconds of a pass by its rows: what free drafts cost
    _explored: dict[tuple[int, str], int] = field(default_factory=dict)  # (bucket, mode) -> when last re-measured

    def __post_init__(self) -> None:
        self.steps = {m: self.steps.get(m, 0) for m in self.modes}

    @staticmethod
    def bucket(batch_size: int) -> int:
        """Batch sizes 1, 2, 3-4, 5-8, 9-16, ... share a measurement."""
        return (batch_size - 1).bit_length()

    def choose(self, batch_size: int) -> str:
        b = self.bucket(batch_size)
        rates = {m: self._rate(b, m) for m in self.modes}
        for mode, rate in rates.items():  # each mode once, then the warm-up of those not clearly losing
            if rate.samples == 0:
                return mode
        top = max(r.tokens_per_second for r in rates.values())
        for mode, rate in rates.items():
            if rate.samples < self.warmup and rate.tokens_per_second >= self.clear_loss * top:
                return mode
        best = max(self.modes, key=lambda m: rates[m].tokens_per_second)  # the first of equals
        if b in self._best_before:  # the first choice after an exploration: did it change anything?
            same = self._best_before.pop(b) == best
            self._backoff[b] = min(self.max_backoff, 2 * self._backoff.get(b, 1)) if same else 1
        self._since_explore[b] = self._since_explore.get(b, 0) + 1
        if self._since_explore[b] >= self.explore_every * self._backoff.get(b, 1):
            self._since_explore[b] = 0
            self._best_before[b] = best
            mode = min((m for m in self.modes if m != best), key=lambda m: self._explored.get((b, m), -1))
            self._explored[(b, mode)] = sum(self.steps.values())  # the losers in turn
            return mode
        return best

    def record(self, batch_size: int, mode: str, tokens: int, seconds: float) -> None:
        self.steps[mode] = self.steps.get(mode, 0) + 1
        if seconds > 0:
            self._rate(self.bucket(batch_size), mode).add(tokens / seconds, self.alpha)

    def rates_at(self, batch_size: int) -> dict[str, float]:
        """The measured tokens/s of each mode at this batch size (those measured so far)."""
        b = self.bucket(batch_size)
        return {m: self.rates[(b, m)].tokens_per_second for m in self.modes if (b, m) in self.rates}

    def _rate(self, bucket: int, mode: str) -> _Rate:
        return self.rates.setdefault((bucket, mode), _Rate())

    def to_dict(self) -> dict:
        return {
            "steps": dict(self.steps),
            "tokens_per_second": {f"batch<={2 ** b}:{mode}": round(r.tokens_per_second, 2)
                                  for (b, mode), r in sorted(self.rates.items()) if r.samples},  # measured ones
        }
