"""Per-request and aggregate decoding statistics, named as in vLLM's spec-decode metrics
(draft tokens, accepted tokens, acceptance per position; see docs/design.md)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

# prefill; draft (layers [0, L_d)); intermediate_verify (layers [L_d, L_i), hispec only);
# full_verify (through the last layer); other (the engine's bookkeeping: committing, end
# conditions, detokenising)
PHASES = ("prefill", "draft", "intermediate_verify", "full_verify", "other")


@dataclass
class LevelStats:
    """One verification level, e.g. ``draft->intermediate``: how many proposed tokens survived."""

    rounds: int = 0  # verification rounds at this level
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: rounds whose draft j was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [j]: rounds that proposed a draft j

    def record(self, num_drafted: int, num_accepted: int, depth: int | None = None) -> None:
        """A round that proposed ``num_drafted`` tokens and accepted ``num_accepted``; a token tree
        proposes positions up to its ``depth`` (several nodes per position), a chain ``num_drafted``."""
        positions = num_drafted if depth is None else depth
        self.rounds += 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += num_accepted
        _grow(self.accepted_per_position, positions)
        _grow(self.drafted_per_position, positions)
        for j in range(positions):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def merge(self, other: "LevelStats") -> None:
        self.rounds += other.rounds
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            _grow(mine, len(theirs))
            for j, n in enumerate(theirs):
                mine[j] += n

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafts": self.rounds,  # the same count, under the name it had before "rounds"
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_per_position": [round(a / d, 4) if d else 0.0 for a, d in
                                        zip(self.accepted_per_position, self.drafted_per_position)],
        }


def _grow(values: list[int], n: int) -> None:
    values.extend([0] * (n - len(values)))


@dataclass
class DecodeStats:
    strategy: str
    new_tokens: int = 0
    full_passes: int = 0  # forward passes through the last layer (ar: one per token)
    levels: dict[str, LevelStats] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    draft_forward_tokens: int = 0  # tokens run through the draft layers
    plain_steps: int = 0  # steps the adaptive controller decoded plainly (no speculation)
    # plain runs of several steps in one call that stopped early where the text came to end on a
    # prompt-lookup match whose drafts would pay (``DecodeContext.lookup_stop``)
    lookup_stops: int = 0
    # rounds by where their drafts came from: "lookup" (prompt lookup), "suffix" (earlier requests' outputs),
    # "exits" (draft exits), "plain" (none)
    rounds: dict[str, int] = field(default_factory=dict)
    # adaptive decoding: rounds by the mode the controller chose ("speculate", "chain", "plain"), and
    # the tokens/s it had measured for each mode at this batch size when it last chose (why it chose)
    modes: dict[str, int] = field(default_factory=dict)
    mode_rates: dict[str, float] = field(default_factory=dict)
    # free-draft rounds: steps that skipped them because they measured slower than plain steps at the
    # batch size, and their measured gain (tokens/s over a plain step's) when last taken
    free_skips: int = 0
    free_gain: float | None = None

    def count_round(self, kind: str) -> None:
        self.rounds[kind] = self.rounds.get(kind, 0) + 1

    def level(self, name: str) -> LevelStats:
        return self.levels.setdefault(name, LevelStats())

    @property
    def mean_accepted_length(self) -> float:
        return self.new_tokens / self.full_passes if self.full_passes else 0.0

    @property
    def verification_wall(self) -> float | None:
        """Full-verification seconds per committed token / drafting seconds per drafted token."""
        draft = self.phase_seconds["draft"] / self.draft_forward_tokens if self.draft_forward_tokens else 0.0
        full = self.phase_seconds["full_verify"] / self.new_tokens if self.new_tokens else 0.0
        return full / draft if draft else None

    def merge(self, other: "DecodeStats") -> None:
        self.new_tokens += other.new_tokens
        self.full_passes += other.full_passes
        self.draft_forward_tokens += other.draft_forward_tokens
        self.plain_steps += other.plain_steps
        self.lookup_stops += other.lookup_stops
        self.free_skips += other.free_skips
        self.free_gain = other.free_gain if other.free_gain is not None else self.free_gain
        for kind, n in other.rounds.items():
            self.rounds[kind] = self.rounds.get(kind, 0) + n
        for mode, n in other.modes.items():
            self.modes[mode] = self.modes.get(mode, 0) + n
        self.mode_rates = dict(other.mode_rates) or self.mode_rates
        for name, lv in other.levels.items():
            self.level(name).merge(lv)
        for k, v in other.phase_seconds.items():
            self.phase_seconds[k] = self.phase_seconds.get(k, 0.0) + v

    def to_dict(self) -> dict:
        wall = self.verification_wall
        return {
            "strategy": self.strategy,
            "new_tokens": self.new_tokens,
            "full_passes": self.full_passes,
            "plain_steps": self.plain_steps,
            "lookup_stops": self.lookup_stops,
            "rounds": dict(self.rounds),
            "modes": dict(self.modes),
            "mode_rates": {m: round(r, 2) for m, r in self.mode_rates.items()},
            "free_skips": self.free_skips,
            "free_gain": None if self.free_gain is None else round(self.free_gain, 3),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "levels": {name: lv.to_dict() for name, lv in self.levels.items()},
            "phase_seconds": {k: round(v, 6) for k, v in self.phase_seconds.items()},
            "verification_wall": None if wall is None else round(wall, 4),
        }


@contextmanager
def phase_timer(stats: DecodeStats | list[DecodeStats], phase: str, device: torch.device):
    """Add the wall time of the block to ``phase_seconds[phase]`` of each stats object (a batch's
    sequences all wait for the whole phase), synchronising CUDA so the time is real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        for s in stats if isinstance(stats, list) else [stats]:
            s.phase_seconds[phase] += elapsed
