"""Adaptive speculation: per step, speculate or decode plainly, from measured throughput.

Speculation trades extra (cheap) draft and verification work for fewer full-model passes.
At batch size 1 on a memory-bound device that pays; at large, compute-bound batches the
verification work costs as much as the tokens it saves, and plain decoding wins. Rather than
a fixed rule, the controller measures both modes per batch-size bucket (committed tokens per
second of step time, an exponential moving average), picks the better one, and now and then
re-measures the other: every ``explore_every`` steps at first, twice as long after each
re-measurement that changes nothing (up to ``max_backoff`` times), back to the start when the
other mode wins. Both modes are lossless, so switching never changes the output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..decode.lookup import RowCost

SPECULATE, PLAIN = "speculate", "plain"


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
    explore_every: int = 24  # steps between re-measurements of the losing mode (at first)
    max_backoff: int = 8  # the interval grows to at most explore_every * max_backoff
    alpha: float = 0.3
    rates: dict[tuple[int, str], _Rate] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=lambda: {SPECULATE: 0, PLAIN: 0})
    _since_explore: dict[int, int] = field(default_factory=dict)
    _backoff: dict[int, int] = field(default_factory=dict)  # bucket -> interval multiplier
    _best_before: dict[int, str] = field(default_factory=dict)  # bucket -> best mode at the last exploration
    row_cost: RowCost = field(default_factory=RowCost)  # seconds of a pass by its rows: what free drafts cost

    @staticmethod
    def bucket(batch_size: int) -> int:
        """Batch sizes 1, 2, 3-4, 5-8, 9-16, ... share a measurement."""
        return (batch_size - 1).bit_length()

    def choose(self, batch_size: int) -> str:
        b = self.bucket(batch_size)
        spec, plain = self._rate(b, SPECULATE), self._rate(b, PLAIN)
        for mode, rate in ((SPECULATE, spec), (PLAIN, plain)):
            if rate.samples < self.warmup:
                return mode
        best = SPECULATE if spec.tokens_per_second >= plain.tokens_per_second else PLAIN
        if b in self._best_before:  # the first choice after an exploration: did it change anything?
            same = self._best_before.pop(b) == best
            self._backoff[b] = min(self.max_backoff, 2 * self._backoff.get(b, 1)) if same else 1
        self._since_explore[b] = self._since_explore.get(b, 0) + 1
        if self._since_explore[b] >= self.explore_every * self._backoff.get(b, 1):
            self._since_explore[b] = 0
            self._best_before[b] = best
            return PLAIN if best == SPECULATE else SPECULATE
        return best

    def record(self, batch_size: int, mode: str, tokens: int, seconds: float) -> None:
        self.steps[mode] += 1
        if seconds > 0:
            self._rate(self.bucket(batch_size), mode).add(tokens / seconds, self.alpha)

    def _rate(self, bucket: int, mode: str) -> _Rate:
        return self.rates.setdefault((bucket, mode), _Rate())

    def to_dict(self) -> dict:
        return {
            "steps": dict(self.steps),
            "tokens_per_second": {f"batch<={2 ** b}:{mode}": round(r.tokens_per_second, 2)
                                  for (b, mode), r in sorted(self.rates.items())},
        }
