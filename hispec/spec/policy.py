"""The speculation policy: per step, a free-draft round, the strategy's round or a plain step, from
measured throughput (``SpecPolicy``: the one object the engine asks).

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

import time
from dataclasses import dataclass, field

import torch

from .. import envs
from ..decode.autoregressive import Autoregressive
from ..decode.base import DecodeContext, Strategy
from ..settings import SPECULATIVE
from .cost import RowCost
from .memory import memory_for, policy_key  # noqa: F401 (policy_key: the engine names its policy's memory)
from .proposers.suffix import SuffixStore

SPECULATE, CHAIN, PLAIN = "speculate", "chain", "plain"


def adaptive_modes(strategy: Strategy) -> tuple[str, ...]:
    """The modes the controller weighs for ``strategy``: its rounds and plain ones, and its rounds
    as chains where it drafts trees."""
    spec = strategy.spec
    return (SPECULATE, CHAIN, PLAIN) if spec is not None and spec.tree_width > 1 else (SPECULATE, PLAIN)


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

    def state(self) -> dict:
        return {str(b): [g.tokens, g.plain_tokens, g.rounds] for b, g in self.gain.items() if g.rounds}

    def seed(self, state: dict, clear_loss: float) -> None:
        """Start from a saved ``state``: its gains count as warmed up; where free rounds clearly lost
        (below ``clear_loss`` of plain steps' tokens) they are re-tried at the longest interval."""
        for b, (tokens, plain_tokens, rounds) in state.items():
            g = self.gain[int(b)] = _Gain(tokens, plain_tokens, max(int(rounds), self.warmup))
            if g.ratio < clear_loss:
                self._backoff[int(b)] = self.max_backoff


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

    def state(self) -> dict:
        """What it measured, to start a later process's controller from (``spec.memory``)."""
        return {"rates": {f"{b}:{m}": [r.tokens_per_second, r.samples] for (b, m), r in self.rates.items() if r.samples},
                "free": self.free.state(), "plain_seconds": {str(k): v for k, v in self.row_cost.plain.items()}}

    def seed(self, state: dict) -> None:
        """Start from ``state`` (a fresh controller; ``spec.memory``): the saved rates count as warmed
        up, so the better mode runs at once; a mode that clearly lost (below ``clear_loss`` of the
        best) is re-measured at the longest interval; the plain steps' seconds price the first drafts."""
        for key, (tps, samples) in state.get("rates", {}).items():
            b, mode = key.split(":", 1)
            if mode in self.modes:
                self.rates[(int(b), mode)] = _Rate(float(tps), max(int(samples), self.warmup))
        for b in {b for b, _ in self.rates}:
            rates = [self.rates[(b, m)].tokens_per_second for m in self.modes if (b, m) in self.rates]
            if len(rates) == len(self.modes) and min(rates) < self.clear_loss * max(rates):
                self._backoff[b] = self.max_backoff
        self.free.seed(state.get("free", {}), self.clear_loss)
        for k, v in state.get("plain_seconds", {}).items():
            self.row_cost.plain.setdefault(int(k), float(v))

    def to_dict(self) -> dict:
        return {
            "steps": dict(self.steps),
            "tokens_per_second": {f"batch<={2 ** b}:{mode}": round(r.tokens_per_second, 2)
                                  for (b, mode), r in sorted(self.rates.items()) if r.samples},  # measured ones
            "free_round_gain": self.free.to_dict(),  # free rounds' tokens/s over a plain step's
        }


class SpecPolicy:
    """The one object the engine asks about speculation, each step: a free-draft round (prompt lookup
    and the suffix cache, as many drafts per sequence as pay at the measured row costs:
    ``proposers.lookup.free_drafts``), the strategy's round, its rounds as chains, or a plain step. It
    times the rounds for the measurements that decide (``AdaptiveController``, ``FreeRoundGate``,
    ``RowCost``) and writes what the strategies read into the contexts (``row_cost``, ``lookup_stop``)
    and the statistics; the engine schedules the sequences and commits the tokens.

    ``adaptive`` (for a speculative strategy): the controller weighs the modes; ``controller``: one that
    outlives the engine (the ``Generator`` keeps one per strategy and settings), else a new one. A
    strategy with free rounds (``Strategy.has_free_rounds``) drafts across requests from ``suffix`` (a
    ``SuffixStore`` that outlives the engine), else from a store of its own of ``suffix_entries``
    n-grams in ``suffix_scopes`` scopes (none with ``suffix_entries`` 0). ``memory_key``: a fresh
    controller starts from what the policy of that key measured in earlier processes, and keeps its
    own measurements there (``spec.memory``; ``policy_key``)."""

    def __init__(self, strategy: Strategy, adaptive: bool, controller: AdaptiveController | None = None,
                 suffix: SuffixStore | None = None, suffix_entries: int = 0, suffix_scopes: int = 1,
                 memory_key: str | None = None) -> None:
        self.strategy = strategy
        self._plain = Autoregressive()
        self.controller = None
        self.memory = None  # where its measurements are kept between processes (``spec.memory``)
        if adaptive and strategy.name in SPECULATIVE:
            self.controller = controller if controller is not None else AdaptiveController(
                modes=adaptive_modes(strategy))
            self.memory = memory_for(memory_key) if memory_key is not None else None
            saved = self.memory.load() if self.memory is not None and not any(self.controller.steps.values()) else None
            if saved:
                self.controller.seed(saved)
        # the strategy's rounds as chains, where it drafts trees and the controller weighs both
        self._chain = strategy.as_chain() if self.controller is not None and CHAIN in self.controller.modes else None
        # whether the controller chooses between the strategy's step and a plain one (free
        # drafts are weighed against the measured cost of rows either way)
        self._switches = self.controller is not None and strategy.adaptive_steps
        self.suffix = None  # the suffix caches of earlier outputs, per scope
        if strategy.has_free_rounds:
            self.suffix = suffix if suffix is not None else SuffixStore.for_spec(strategy.spec, suffix_entries,
                                                                                 suffix_scopes)

    def attach(self, ctx: DecodeContext, scope: str | None) -> None:
        """A new request's context: its scope's earlier outputs draft for it (``SuffixStore``)."""
        if self.suffix is not None:
            ctx.suffix = self.suffix.cache_for(scope)

    def finished(self, scope: str | None, prompt: list[int], output: list[int]) -> None:
        """A request finished: its output drafts for the later requests of its scope (and what the
        controller measured is kept for later processes, now and then)."""
        if self.suffix is not None:
            self.suffix.add(scope, prompt, output)
        if self.memory is not None and any(self.controller.steps.values()):
            self.memory.maybe_save(self.controller.state())

    def round(self, batch: list[DecodeContext]) -> list[list[int]]:
        """One round for the batch (every sequence prefilled): each sequence's tokens to commit. Free
        drafts where the strategy has some worth verifying (``Strategy.free_round``) and measured free
        rounds pay at this batch size (``FreeRoundGate``); else the strategy's round or, where measured
        speculation does not pay, a plain one."""
        cost = self.controller.row_cost if self.controller is not None else None
        commits = self._free_round(batch, cost) if self.strategy.has_free_rounds else None
        return commits if commits is not None else self._step_round(batch, cost)

    def _free_round(self, batch: list[DecodeContext], cost: RowCost | None) -> list[list[int]] | None:
        """``free_round(batch, cost)``, timed for the adaptive controller's gate, or None (without
        calling it) where the gate finds free rounds slower than plain steps at this batch size: then
        no plain run of several steps stops early for drafts (``DecodeContext.lookup_stop``). The
        gate is off with ``HISPEC_FREE_ROUND_GATE=0`` (the tests: on their tiny models a round's
        Python outweighs a plain step, and what they check is that the drafting paths run)."""
        if self.controller is None or not envs.HISPEC_FREE_ROUND_GATE:
            return self.strategy.free_round(batch, cost)
        gate = self.controller.free
        if not gate.allows(len(batch)):
            for c in batch:
                c.lookup_stop = 0
                c.stats.free_skips += 1
            return None
        t0 = time.perf_counter()
        commits = self.strategy.free_round(batch, cost)
        if commits is not None:
            _synchronize(batch)
            gate.record(len(batch), sum(map(len, commits)), time.perf_counter() - t0, cost.plain.get(len(batch)))
            gain = gate.gain_at(len(batch))
            for c in batch:
                c.stats.free_gain = gain
        return commits

    def _step_round(self, batch: list[DecodeContext], cost: RowCost | None) -> list[list[int]]:
        """The strategy's round or a plain one, as the adaptive controller chooses."""
        # Every mode gives the same tokens (sampled ones too: each position's token is drawn with its own
        # uniform number, ``DecodeContext.uniforms``), so the measurements decide for any batch.
        mode = self.controller.choose(len(batch)) if self._switches else SPECULATE
        strategy = {SPECULATE: self.strategy, CHAIN: self._chain, PLAIN: self._plain}[mode]
        row_cost = cost.relative(len(batch)) if cost is not None else None
        for c in batch:  # what a verification row costs now: token trees add the rows that pay for it
            c.row_cost = row_cost
        t0 = time.perf_counter()
        commits = strategy.step(batch)
        if strategy is self._plain:
            for c in batch:
                c.stats.plain_steps += 1
        _synchronize(batch)
        elapsed = time.perf_counter() - t0
        if self._switches:
            self.controller.record(len(batch), mode, sum(len(c) for c in commits), elapsed)
            rates = self.controller.rates_at(len(batch))
            for c in batch:
                c.stats.modes[mode] = c.stats.modes.get(mode, 0) + 1
                c.stats.mode_rates = rates
        # a plain round: what drafts must beat
        if cost is not None and (strategy is self._plain and self._switches or not self._switches):
            cost.record_plain(len(batch), elapsed / max(map(len, commits)))
        return commits

    def to_dict(self) -> dict:
        return {"adaptive": self.controller.to_dict() if self.controller else None,
                "suffix_cache": self.suffix.to_dict() if self.suffix is not None else None}


def _synchronize(batch: list[DecodeContext]) -> None:
    """Wait for the device's work (a round's seconds on CUDA are its kernels')."""
    device = batch[0].model.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
