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

Free-draft rounds (prompt lookup, the suffix cache) are weighed the same way (``FreeRoundGate``):
the tokens they commit against those plain steps at their batch size would make in the same time;
where they measure slower (at batch 8 on 2 Zen 4 cores: mostly one sequence of eight drafting ~2
tokens, in a pass that cost more than they saved) the engine skips them, re-measuring now and then.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .cost import RowCost

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
class _Gain:
    """Free rounds' tokens against what plain steps would have made in their seconds, both summed with
    older rounds weighing less (``decay`` per round): their ratio weighs each round by its time, so
    that a run of rounds with few drafts (each about as fast as a plain step) does not hide the rounds
    that commit several tokens at once."""

    tokens: float = 0.0
    plain_tokens: float = 0.0
    rounds: int = 0

    def add(self, tokens: float, plain_tokens: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.plain_tokens = decay * self.plain_tokens + plain_tokens
        self.rounds += 1

    @property
    def ratio(self) -> float:
        return self.tokens / self.plain_tokens if self.plain_tokens > 0 else 1.0


@dataclass
class FreeRoundGate:
    """Whether free-draft rounds pay at a batch size, by measurement: the tokens they committed over
    those plain steps would have made in the same seconds (``RowCost.plain``: a plain step's seconds
    at that batch size), per batch-size bucket (``_Gain``). Rounds are taken while a bucket has fewer
    than ``warmup`` of them or a gain of at least 1; else skipped, but every ``explore_every`` skipped
    steps one is taken again (the interval doubling, up to ``max_backoff`` times, while they keep
    losing; back to the start when they pay again). The drafts a round takes are still chosen by
    their measured costs (``cost.choose_drafts``); this catches what that model leaves out (the
    Python of a round, the plain runs it cuts short): at batch 8 on 2 Zen 4 cores, rounds where one
    sequence of eight drafted ~2 tokens cost more than they saved (0.92x a plain step's tokens/s
    greedy, 0.76-0.81x sampled), while at batch 1 they made 1.1-2.7x by category."""

    warmup: int = 8
    explore_every: int = 24
    max_backoff: int = 8
    decay: float = 0.95
    gain: dict[int, _Gain] = field(default_factory=dict)  # bucket -> free rounds' tokens over plain's
    skipped: dict[int, int] = field(default_factory=dict)  # bucket -> steps skipped since the last round
    _backoff: dict[int, int] = field(default_factory=dict)
    _exploring: set[int] = field(default_factory=set)

    def allows(self, batch_size: int) -> bool:
        """Whether this step may take a free round (a skipped step counts towards the next try)."""
        b = AdaptiveController.bucket(batch_size)
        g = self.gain.get(b)
        if g is None or g.rounds < self.warmup or g.ratio >= 1.0:
            return True
        self.skipped[b] = self.skipped.get(b, 0) + 1
        if self.skipped[b] >= self.explore_every * self._backoff.get(b, 1):
            self.skipped[b] = 0
            self._exploring.add(b)
            return True
        return False

    def record(self, batch_size: int, tokens: int, seconds: float, plain_seconds: float | None) -> None:
        """A free round of ``batch_size`` sequences committed ``tokens`` in ``seconds``, where a plain
        step of that batch takes ``plain_seconds`` (None: not measured yet, nothing to weigh)."""
        if not plain_seconds or seconds <= 0:
            return
        b = AdaptiveController.bucket(batch_size)
        g = self.gain.setdefault(b, _Gain())
        g.add(tokens, seconds / plain_seconds * batch_size, self.decay)
        if b in self._exploring:
            self._exploring.discard(b)
            self._backoff[b] = min(self.max_backoff, 2 * self._backoff.get(b, 1)) if g.ratio < 1.0 else 1

    def gain_at(self, batch_size: int) -> float | None:
        g = self.gain.get(AdaptiveController.bucket(batch_size))
        return g.ratio if g is not None and g.rounds else None

    def to_dict(self) -> dict:
        return {f"batch<={2 ** b}": round(g.ratio, 3) for b, g in sorted(self.gain.items()) if g.rounds}


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
    free: FreeRoundGate = field(default_factory=FreeRoundGate)  # whether free-draft rounds pay, per batch size
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
            "free_round_gain": self.free.to_dict(),  # free rounds' tokens/s over a plain step's
        }
