"""Free drafts: tokens proposed without running the model, and how many of them pay for their rows.

- **Prompt lookup** (Saxena 2023; transformers' ``prompt_lookup_num_tokens``, vLLM's ``ngram``
  proposer): the last ``n`` tokens of prompt + output so far (``n = max_ngram .. 1``, longest
  first) are looked up in the earlier text; the tokens that followed their most recent earlier
  occurrence are the drafts. Much of what users ask for (summaries, answers from given text,
  edits, code) repeats the prompt or earlier output. ``NgramIndex`` keeps, per sequence, where
  each n-gram last ended (a few distinct continuations each, for token trees), updated as
  tokens are committed: O(max_ngram) dictionary operations per token.
- **A suffix cache over recent outputs** (SuffixDecoding, arXiv 2411.04975, simplified): the
  continuations that followed each n-gram in the outputs of recent requests, bounded in
  entries (least recently used out), for what recurs across requests rather than within one.
  ``SuffixStore`` keeps one per scope (a client: the server's API key and ``user``), bounded
  in scopes too; the engine adds each finished request's output to its scope's cache, and a
  sequence drafts from it where its match is longer than prompt lookup's.
- **Draft length** (``DraftLength``, ``RowCost``): a draft is worth its verification row when
  its chance of being accepted outweighs the row's cost. Each sequence keeps its running
  acceptance per draft position and match length; the cost of rows is measured from the
  verification passes (seconds = a + b * rows, least squares with forgetting).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple


def continuation(tokens: list[int], end: int, k: int) -> list[int]:
    """Up to ``k`` tokens after position ``end`` of ``tokens``. Past the last token the text is
    taken to go on repeating with the period of the match (``len(tokens) - 1 - end``): the
    drafts already made stand in for the tokens not yet written, as in a loop."""
    out: list[int] = []
    length = len(tokens)
    for i in range(k):
        pos = end + 1 + i
        out.append(tokens[pos] if pos < length else out[pos - length])
    return out


class NgramIndex:
    """Where each n-gram (``n = 1 .. max_ngram``) of one growing token list ended, most recent
    last: at most ``branches`` end positions per n-gram, with distinct next tokens."""

    def __init__(self, max_ngram: int, branches: int = 4) -> None:
        self.max_ngram, self.branches = max_ngram, branches
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # the n-grams ending before this position are in the index

    def _update(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending at positions ``indexed .. upto - 1``."""
        if upto < self.indexed:  # the list was cut (not from the engine): start again
            self.ends.clear()
            self.indexed = 0
        for e in range(self.indexed, upto):
            nxt = tokens[e + 1]
            for n in range(1, min(self.max_ngram, e + 1) + 1):
                ends = self.ends.setdefault(tuple(tokens[e - n + 1:e + 1]), [])
                for i, old in enumerate(ends):  # one end per next token: the most recent
                    if tokens[old + 1] == nxt:
                        del ends[i]
                        break
                ends.append(e)
                if len(ends) > self.branches:
                    del ends[0]
        self.indexed = upto

    def match(self, tokens: list[int]) -> tuple[int, list[int]]:
        """The longest ``n`` whose last-``n``-token suffix of ``tokens`` occurred earlier, and
        the end positions of its earlier occurrences (most recent last); ``(0, [])`` if none."""
        length = len(tokens)
        self._update(tokens, length - 1)  # an occurrence needs a next token: ends <= length - 2
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            ends = self.ends.get(tuple(tokens[length - n:]))
            if ends:
                return n, ends
        return 0, []

    def propose(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """``(n, drafts)``: up to ``k`` tokens after the most recent earlier occurrence of the
        longest matching suffix (``n`` tokens); ``(0, [])`` without a match."""
        n, ends = self.match(tokens)
        return (n, continuation(tokens, ends[-1], k)) if n and k > 0 else (0, [])

    def branches_of(self, tokens: list[int], k: int) -> list[list[int]]:
        """Up to ``branches`` distinct continuations of the longest matching suffix, most recent
        first (for a token tree: several matches become several branches)."""
        n, ends = self.match(tokens)
        return [continuation(tokens, e, k) for e in reversed(ends)] if n and k > 0 else []


class SuffixCache:
    """Continuations that followed n-grams in the outputs of recent requests of one scope (a
    client: see ``SuffixStore``), bounded: at most ``capacity`` n-grams, least recently used out,
    each with at most ``branches`` continuations (distinct next tokens, most recent last) of at
    most ``k`` tokens. Memory: ``capacity * (max_ngram + branches * k)`` token ids at most.

    ``add(tokens, start)`` records, for each n-gram (``n = 1 .. max_ngram``) of ``tokens``, the
    ``k`` tokens that followed it, where they start at ``start`` or later: the n-grams may reach
    into ``tokens[:start]`` (the end of the prompt) but their continuations are output only.
    ``propose(tokens, k)`` looks up the longest suffix of ``tokens`` as ``NgramIndex.propose``
    does; ``branches_of`` gives every continuation kept for it."""

    def __init__(self, max_ngram: int, k: int, capacity: int = 65536, branches: int = 4) -> None:
        self.max_ngram, self.k, self.capacity, self.branches = max_ngram, k, capacity, branches
        self.table: OrderedDict[tuple[int, ...], list[tuple[int, ...]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.table)

    def add(self, tokens: list[int], start: int = 0) -> None:
        for e in range(max(start - 1, 0), len(tokens) - 1):
            follow = tuple(tokens[e + 1:e + 1 + self.k])
            for n in range(1, min(self.max_ngram, e + 1) + 1):
                key = tuple(tokens[e - n + 1:e + 1])
                kept = [f for f in self.table.pop(key, ()) if f[0] != follow[0]]  # one per next token
                kept.append(follow)
                self.table[key] = kept[-self.branches:]  # (re)inserted last: the most recently used
        while len(self.table) > self.capacity:
            self.table.popitem(last=False)

    def match(self, tokens: list[int]) -> tuple[int, list[tuple[int, ...]]]:
        """The longest ``n`` whose last-``n``-token suffix of ``tokens`` is in the table, and its
        continuations (most recent last); ``(0, [])`` if none. A match counts as a use (LRU)."""
        for n in range(min(self.max_ngram, len(tokens)), 0, -1):
            key = tuple(tokens[len(tokens) - n:])
            follows = self.table.get(key)
            if follows:
                self.table.move_to_end(key)
                return n, follows
        return 0, []

    def propose(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """``(n, drafts)``: up to ``k`` tokens of the most recent continuation of the longest
        matching suffix (``n`` tokens); ``(0, [])`` without a match."""
        n, follows = self.match(tokens)
        return (n, list(follows[-1][:k])) if n and k > 0 else (0, [])

    def branches_of(self, tokens: list[int], k: int) -> list[list[int]]:
        """Up to ``branches`` distinct continuations (up to ``k`` tokens each) of the longest
        matching suffix, most recent first (for a token tree)."""
        n, follows = self.match(tokens)
        return [list(f[:k]) for f in reversed(follows)] if n and k > 0 else []


DEFAULT_SCOPE = ""  # the scope of requests that name none (a library's, a server's without a key or user)


class SuffixStore:
    """One ``SuffixCache`` per scope, at most ``scopes`` of them (least recently used out), so
    that the memory of all of them is bounded (``scopes * entries`` n-grams) and one scope's
    outputs never shape another's drafts (nor, through them, its timing). A scope is any string
    (the server makes it from a hash of the API key and the request's ``user``)."""

    def __init__(self, entries: int, scopes: int, max_ngram: int, k: int, branches: int = 4) -> None:
        self.entries, self.scopes, self.max_ngram, self.k, self.branches = entries, scopes, max_ngram, k, branches
        self.caches: OrderedDict[str, SuffixCache] = OrderedDict()

    @classmethod
    def for_spec(cls, spec, entries: int, scopes: int) -> "SuffixStore | None":
        """A store for the free drafts of a strategy run with ``spec`` (its lookup length and
        draft count); None when it has none (no spec, ``lookup_max_draft`` 0) or ``entries`` is 0."""
        if spec is None or not entries or getattr(spec, "lookup_max_draft", 0) < 1:
            return None
        return cls(entries, scopes, spec.lookup_ngram, spec.lookup_max_draft)

    def cache_for(self, scope: str | None) -> SuffixCache:
        """The scope's cache (made if it has none; a use, for the least-recently-used order)."""
        scope = DEFAULT_SCOPE if scope is None else scope
        cache = self.caches.pop(scope, None)
        if cache is None:
            cache = SuffixCache(self.max_ngram, self.k, self.entries, self.branches)
        self.caches[scope] = cache
        while len(self.caches) > self.scopes:
            self.caches.popitem(last=False)
        return cache

    def add(self, scope: str | None, prompt: list[int], output: list[int]) -> None:
        """A finished request's output, into its scope's cache. Only the output's tokens become
        continuations: they are the model's own text, which is what a later request's model will
        write; the prompt is the client's (and prompt lookup already covers the request's own).
        The prompt's last tokens lead the output in, so that the n-grams of the output's first
        positions (e.g. a chat template's assistant header) draft its first tokens."""
        lead = prompt[len(prompt) - self.max_ngram:] if self.max_ngram < len(prompt) else list(prompt)
        if output:
            self.cache_for(scope).add(lead + list(output), start=len(lead))

    @property
    def num_entries(self) -> int:
        return sum(len(c) for c in self.caches.values())

    def to_dict(self) -> dict:
        return {"scopes": len(self.caches), "entries": self.num_entries,
                "max_scopes": self.scopes, "max_entries_per_scope": self.entries}


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


class Branch(NamedTuple):
    """A free continuation: where it came from (``LOOKUP`` or ``SUFFIX``), the length ``n`` of
    the match that found it, its tokens."""

    source: str
    n: int
    tokens: list[int]


LOOKUP, SUFFIX = "lookup", "suffix"  # free-draft sources: prompt lookup, the suffix cache of earlier outputs


class LookupState:
    """A sequence's free-draft source: its n-gram index and its draft-length estimates, one table
    per source and match length (row ``n`` for prompt lookup, ``max_ngram + n`` for the suffix
    cache: a match in another request's output is not as likely to go on as one in this text)."""

    def __init__(self, max_draft: int, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.index = NgramIndex(max_ngram)
        self.length = DraftLength([[SUFFIX_PRIOR] * max_draft]  # row 0: no match (never drafts)
                                  + [lookup_prior(n, max_draft) for n in range(1, max_ngram + 1)]
                                  + [[SUFFIX_PRIOR] * max_draft] * max_ngram)
        self.last_n = 0  # the rate row (``row``) of the drafts now being verified
        self.source = LOOKUP  # where they came from

    def row(self, source: str, n: int) -> int:
        """The rate table row of a match of ``n`` tokens from ``source``."""
        return self.max_ngram + min(n, self.max_ngram) if source == SUFFIX and n else n

    def find(self, tokens: list[int], suffix: SuffixCache | None, k: int) -> Branch:
        """Up to ``k`` drafts after ``tokens``: from the longest match, the sequence's own text
        (prompt lookup) where the suffix cache's is not longer."""
        n, ends = self.index.match(tokens)
        if suffix is not None:
            m, follow = suffix.propose(tokens, k)
            if m > n:
                return Branch(SUFFIX, m, follow)
        return Branch(LOOKUP, n, continuation(tokens, ends[-1], k) if n and k > 0 else [])

    def branches(self, tokens: list[int], suffix: SuffixCache | None, k: int) -> list[Branch]:
        """Every distinct continuation both sources offer (up to ``k`` tokens each, up to
        ``branches`` per source), longest match first, prompt lookup first at equal length,
        most recent first within a source: the free branches of a token tree."""
        n, _ = self.index.match(tokens)
        found = [Branch(LOOKUP, n, b) for b in self.index.branches_of(tokens, k)]
        if suffix is not None:
            m, _ = suffix.match(tokens)
            found += [Branch(SUFFIX, m, b) for b in suffix.branches_of(tokens, k)]
        found.sort(key=lambda b: -b.n)  # stable: the order above within equal lengths
        seen: set[tuple[int, ...]] = set()
        return [b for b in found if not (tuple(b.tokens) in seen or seen.add(tuple(b.tokens)))]


def free_drafts(batch: list, max_draft: int, max_ngram: int, cost: RowCost | None) -> list[list[int]]:
    """Each sequence's free drafts for this round (``[]``: none), at most ``max_draft`` and never
    past its token limit: from prompt lookup, or from its scope's suffix cache of earlier outputs
    (``ctx.suffix``) where that matches a longer suffix. ``cost`` None: every draft the match
    gives; else as many as pay for their rows at the measured row cost, the batch's sequences
    together (``choose_drafts``: the pass's overhead is the batch's), with each sequence's running
    acceptance per source and match length. Greedy and sampled sequences alike: a sampled
    sequence's tokens do not depend on its drafts (``speculative.verify_free``), so neither timing
    nor its batch nor earlier requests change a seeded request's output."""
    found, rows = [], []
    for ctx in batch:
        if ctx.lookup is None:
            ctx.lookup = LookupState(max_draft, max_ngram)
        state: LookupState = ctx.lookup
        room = min(max_draft, ctx.remaining - 1)  # the bonus token may be the last one allowed
        f = state.find(ctx.tokens, ctx.suffix, room) if room > 0 else Branch(LOOKUP, 0, [])
        found.append(f)
        rows.append(state.row(f.source, f.n))
        state.source, state.last_n = f.source, rows[-1]
    ks = [len(f.tokens) for f in found]
    if cost is not None:
        drafting = [b for b, f in enumerate(found) if f.n]
        B = len(batch)
        chosen = choose_drafts([batch[b].lookup.length.gains(rows[b], len(found[b].tokens)) for b in drafting], B,
                               cost.relative(B), cost.overhead(B)) if drafting else []
        for b, k in zip(drafting, chosen):
            ks[b] = batch[b].lookup.length.chosen(rows[b], k, len(found[b].tokens))
    for ctx, k in zip(batch, ks):  # (a sequence that drafts now is looked up again next round)
        ctx.lookup_stop = lookup_stop(ctx, len(batch), cost) if not k else 0
    return [f.tokens[:k] for f, k in zip(found, ks)]


def lookup_stop(ctx, batch_size: int, cost: RowCost | None) -> int:
    """The shortest prompt-lookup match (``n`` tokens) whose drafts would pay for a pass of this
    batch now, one sequence drafting (``choose_drafts`` with its rates for such a match), or 0 if
    none would: where the sequence's text comes to end on
    such a match, a plain run of several steps in one op call stops (``DecodeContext.lookup_stop``)
    and the next round verifies them.
    Without a measured ``cost`` every match drafts: 1."""
    state: LookupState = ctx.lookup
    room = min(len(state.length.rates[0]), ctx.remaining - 1)
    if room < 1:
        return 0
    if cost is None:
        return 1
    row_cost, overhead = cost.relative(batch_size), cost.overhead(batch_size)
    for n in range(1, state.max_ngram + 1):
        if choose_drafts([state.length.gains(state.row(LOOKUP, n), room)], batch_size, row_cost, overhead)[0]:
            return n
    return 0
