"""The one cost model of speculation: what a verification row costs (``RowCost``, measured), how
likely each free draft is to be accepted (``DraftLength``, from priors), and how many drafts of a
pass pay for their rows (``choose_drafts``).

A draft is worth its verification row when its chance of being accepted outweighs the row's cost.
Each sequence keeps its running acceptance per draft position and match length; the cost of rows is
measured from the verification passes (seconds = a + b * rows, least squares with forgetting).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class _Passes:
    """Verification passes, weighted (older ones less): the sums of an exponentially weighted
    least-squares fit of their seconds as ``a + b * rows``, and the slope ``prior_b`` the first gave."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, w*r, w*t, w*r*r, w*r*t
    prior_b: float = 0.0

    def add(self, rows: int, seconds: float, prior: float, decay: float) -> None:
        if not self.sums[0]:  # the prior: a + b*rows = seconds with b = prior * (a + b)
            self.prior_b = seconds * prior / (1 + prior * (rows - 1))
        self.fade(decay)
        for i, v in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            self.sums[i] += v

    def fade(self, decay: float) -> None:
        self.sums = [x * decay for x in self.sums]

    def fit(self, prior_weight: float) -> tuple[float, float] | None:
        """``(a, b)`` (None before the first pass): least squares with the slope drawn towards the
        prior's (ridge), so that passes which all had the same rows (a chain always drafted in
        full) keep the prior slope instead of an arbitrary one."""
        w, sr, st, srr, srt = self.sums
        if not w:
            return None
        sxx, sxy = srr - sr * sr / w, srt - sr * st / w  # the rows' spread, and with the seconds
        b = max(0.0, (sxy + prior_weight * self.prior_b) / (sxx + prior_weight))
        return (st - b * sr) / w, b


def batch_bucket(batch_size: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, 9-16, ... share a fit of their passes (as they share the
    adaptive controller's measurements)."""
    return (batch_size - 1).bit_length()


@dataclass
class RowCost:
    """What verification costs, measured: the seconds of a verification pass as ``a + b * rows``
    (exponentially weighted least squares over its passes, the slope drawn towards a prior
    relative row cost ``prior`` (``b / (a + b)`` of the first pass), which passes of different rows
    outweigh after a few), and the seconds of a plain step per batch size (a running mean).

    The two are kept apart because a plain step is not a one-row verification pass: greedy plain
    steps run several to an op call with nothing in Python between them, while a verification
    pass is one call with its drafts to build and check. Fitted together, that fixed difference
    read as a steep cost per row (~0.4 of a step for the default model where the op's own rows
    cost ~0.1), and free drafts were cut to one token even when nine in ten were accepted.

    The passes are fitted per batch-size bucket (``batch_bucket``; all of them together where a
    bucket has none yet), because a row's cost is not one line from 1 to 20 rows: on the default
    model, rows are nearly free up to a few and cost ~0.6 ms each beyond 8 (2 Zen 4 cores), and a
    pass of 9 rows took 1.4x a plain step of 8. One line through the passes of a batch of 8 and of
    the batches of 1-4 that its last sequences make read half that overhead at 8, and drafted where
    it did not pay."""

    prior: float = 0.25
    decay: float = 0.95  # weight of older observations per new one
    prior_weight: float = 1.0  # the prior slope counts as this many passes one row apart
    passes: _Passes = field(default_factory=_Passes)  # every pass
    buckets: dict[int, _Passes] = field(default_factory=dict)  # the passes per batch-size bucket
    plain: dict[int, float] = field(default_factory=dict)  # batch size -> seconds of a plain step

    @property
    def prior_b(self) -> float:
        """Seconds per row the prior gives (set by the first pass)."""
        return self.passes.prior_b

    def record(self, rows: int, seconds: float, batch_size: int | None = None) -> None:
        """A verification pass of ``rows`` rows (the batch's plain rows and every draft) for
        ``batch_size`` sequences (None: counted with every batch size's)."""
        if seconds <= 0 or rows < 1:
            return
        self.passes.add(rows, seconds, self.prior, self.decay)
        if batch_size:
            self.buckets.setdefault(batch_bucket(batch_size), _Passes()).add(rows, seconds, self.prior, self.decay)

    def record_plain(self, batch_size: int, seconds: float) -> None:
        """A plain step of ``batch_size`` sequences (one token each) took ``seconds``. The passes
        measured before it weigh less from now on (as at a pass): while nothing drafts, the
        estimates go back towards the prior, and drafting is tried again."""
        if seconds > 0 and batch_size > 0:
            self.passes.fade(self.decay)
            if batch_bucket(batch_size) in self.buckets:
                self.buckets[batch_bucket(batch_size)].fade(self.decay)
            old = self.plain.get(batch_size)
            self.plain[batch_size] = seconds if old is None else old + (1 - self.decay) * (seconds - old)

    def _passes(self, batch_size: int) -> _Passes:
        """The passes of this batch size's bucket, or every pass where it has none."""
        bucket = self.buckets.get(batch_bucket(batch_size))
        return bucket if bucket is not None and bucket.sums[0] else self.passes

    def _step(self, batch_size: int, fit: tuple[float, float]) -> float:
        """A plain step's seconds at this batch size: measured, else a draft-less verification pass."""
        return self.plain.get(batch_size) or fit[0] + fit[1] * batch_size

    def relative(self, batch_size: int) -> float:
        """One extra row's cost as a share of one sequence's plain step: ``b / (step / B)``."""
        fit = self._passes(batch_size).fit(self.prior_weight)
        if fit is None:
            return self.prior
        step = self._step(batch_size, fit)
        return fit[1] * batch_size / step if step > 0 else self.prior

    def overhead(self, batch_size: int) -> float:
        """What a verification pass of the batch's rows costs beyond a plain step of the batch, as a
        share of that step, paid once per round that drafts: drawn towards 0 (the prior) as
        ``w / (w + prior_weight)`` with ``w`` the passes' remaining weight, so that one slow pass
        long ago does not stop drafting for good (0 before both are measured)."""
        passes = self._passes(batch_size)
        fit = passes.fit(self.prior_weight)
        if fit is None or not self.plain.get(batch_size):
            return 0.0
        step, w = self.plain[batch_size], passes.sums[0]
        return max(0.0, fit[0] + fit[1] * batch_size - step) / step * w / (w + self.prior_weight)

    def choose(self, gains: list[list[float]], batch_size: int) -> list[int]:
        """How many drafts each sequence of a pass of ``batch_size`` sequences takes (``gains[i]``:
        sequence i's drafts' expected tokens) at the measured costs: ``choose_drafts``."""
        return choose_drafts(gains, batch_size, self.relative(batch_size), self.overhead(batch_size))


# The prior of ``DraftLength``'s estimates for prompt lookup: P(draft j accepted | the drafts before
# it accepted), by the match length n (rows: n = 1, 2, 3; longer matches take n = 3's) and draft j
# (past the eighth: the eighth's). Measured at every position of the default model's greedy text
# (256 new tokens) for 20 Spec-Bench prompts kept for calibration (question.jsonl lines 13, 37, ..., none
# of them held out for the benchmarks): 569, 346 and 2,114 positions with a match of 1, 2 and 3 tokens.
# A one-token match is a poor guess (29%), a three-token one a good one (85%), and a draft after
# accepted ones is likelier right than the first (a copy, once started, goes on).
LOOKUP_PRIORS = ((0.29, 0.63, 0.63, 0.70, 0.76, 0.86, 0.93, 0.79),
                 (0.56, 0.68, 0.70, 0.71, 0.85, 0.88, 0.86, 0.81),
                 (0.85, 0.89, 0.92, 0.94, 0.94, 0.95, 0.95, 0.96))
SUFFIX_PRIOR = 0.6  # drafts from other requests' outputs (the suffix cache): not measured, a flat guess


def lookup_prior(n: int, max_draft: int) -> list[float]:
    """The prior rates of a prompt-lookup match of ``n`` tokens for drafts ``1 .. max_draft``."""
    row = LOOKUP_PRIORS[min(max(n, 1), len(LOOKUP_PRIORS)) - 1]
    return [row[min(j, len(row) - 1)] for j in range(max_draft)]


class DraftLength:
    """One sequence's running acceptance of free drafts: per rate row ``n`` (a source and match
    length, ``LookupState.row``) and draft position ``j``, an estimate of P(draft j accepted |
    drafts before it accepted), starting from ``priors[n]``.

    ``gains`` gives each draft's expected tokens for ``choose_drafts``, which picks the drafts of
    a pass; ``chosen`` keeps the books of what it picked. While it is not drafting, its estimates
    drift back towards the prior, so it tries again later."""

    def __init__(self, priors: list[list[float]], alpha: float = 0.3, recover: float = 0.01,
                 explore_every: int = 32) -> None:
        self.alpha, self.recover, self.explore_every = alpha, recover, explore_every
        self.priors = [list(p) for p in priors]  # [n][j]
        self.rates = [list(p) for p in priors]
        self.declined = 0  # matches in a row it did not draft from

    @classmethod
    def flat(cls, max_draft: int, rows: int, prior: float = SUFFIX_PRIOR, **kw) -> "DraftLength":
        """Rows ``0 .. rows`` of ``max_draft`` drafts, every estimate starting at ``prior``."""
        return cls([[prior] * max_draft for _ in range(rows + 1)], **kw)

    def gains(self, n: int, available: int) -> list[float]:
        """Each draft's expected tokens, ``prod_{i<=j} a_i`` for ``j = 1 .. available`` (at most
        ``max_draft``): the chance that it and every draft before it are accepted."""
        out, p = [], 1.0
        for r in self.rates[n][:available]:
            p *= r
            out.append(p)
        return out

    def chosen(self, n: int, k: int, available: int) -> int:
        """The bookkeeping of a round whose pass took ``k`` drafts of row ``n`` (0: none): while
        it declines, the row drifts back towards its prior, and after ``explore_every`` declines
        in a row it takes 2 drafts anyway (the costs may have changed). The drafts to take."""
        if k == 0:
            self.rates[n] = [r + self.recover * (q - r) for r, q in zip(self.rates[n], self.priors[n])]
            self.declined += 1
            if self.declined >= self.explore_every:
                k = min(available, len(self.rates[n]), 2)
        if k:
            self.declined = 0
        return k

    def choose(self, n: int, available: int, row_cost: float, overhead: float = 0.0) -> int:
        """The drafts of row ``n`` a sequence verifying alone takes (``choose_drafts`` for one)."""
        return self.chosen(n, choose_drafts([self.gains(n, available)], 1, row_cost, overhead)[0], available)

    def record(self, n: int, drafted: int, accepted: int) -> None:
        """A round of ``drafted`` drafts from a match of ``n`` tokens, ``accepted`` of them accepted."""
        rates = self.rates[n]
        for j in range(min(drafted, accepted + 1)):  # draft j was tested when all before it were accepted
            rates[j] += self.alpha * (float(j < accepted) - rates[j])


def choose_drafts(gains: list[list[float]], batch_size: int, row_cost: float, overhead: float) -> list[int]:
    """How many drafts each of the sequences of one verification pass takes: ``gains[i]``, sequence
    i's drafts' expected tokens (``DraftLength.gains``, non-increasing). A pass of the batch's
    ``B`` sequences costs ``B (1 + o) + c K`` (in units of one sequence's share of a plain step:
    ``o`` the pass's fixed extra cost over a plain step, ``c`` a draft row's cost, ``K`` the drafts)
    for ``B + sum(gains taken)`` tokens, where a plain step gives ``B`` for ``B``. The drafts are
    taken best first while one adds more tokens per unit than the pass makes so far (``g / c > R``),
    which maximises ``R``; all none (plain) unless ``R > 1``.

    The overhead is the whole batch's: a pass that one sequence of 8 drafts for takes every one of
    the 8 through a step that is ``1 + o`` long, so that sequence's drafts must win ``8 o`` back on
    their own, where several drafting sequences share it. (Each deciding alone, as if it paid ``o``,
    drafted at batch 8 where the pass did not pay.) For one sequence this is the best ``k`` of
    ``(1 + sum_{j<=k} g_j) / (1 + o + c k)``."""
    ranked = sorted(((g, i) for i, gs in enumerate(gains) for g in gs), key=lambda x: -x[0])  # stable
    tokens, units, ks = float(batch_size), batch_size * (1.0 + overhead), [0] * len(gains)
    for g, i in ranked:
        if g * units <= row_cost * tokens + 1e-12:  # g / c <= R: it (and every draft after it) lowers R
            break
        tokens, units, ks[i] = tokens + g, units + row_cost, ks[i] + 1
    return ks if tokens > units * (1 + 1e-9) else [0] * len(gains)


def shortest_paying(gains: Iterable[list[float]], batch_size: int, cost: RowCost) -> int:
    """The first (from 1) of ``gains`` (a sequence's drafts' expected tokens for matches of ``n = 1,
    2, ...`` tokens) whose drafts would pay for a pass of this batch now, that sequence drafting
    alone (``choose_drafts``), or 0 if none would: what ``proposers.lookup.lookup_stop`` prices."""
    row_cost, overhead = cost.relative(batch_size), cost.overhead(batch_size)
    for n, g in enumerate(gains, 1):
        if choose_drafts([g], batch_size, row_cost, overhead)[0]:
            return n
    return 0
