"""Free drafts: tokens proposed without running the model, from the sequence's own text (prompt
lookup, ``proposers.ngram``) or the outputs of earlier requests (``proposers.suffix``), as many as pay
for their rows (``spec.cost``).
"""
from __future__ import annotations

from typing import NamedTuple

from ..cost import SUFFIX_PRIOR, DraftLength, RowCost, lookup_prior, shortest_paying
from .ngram import NgramIndex, continuation
from .suffix import SuffixCache


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
        chosen = cost.choose([batch[b].lookup.length.gains(rows[b], len(found[b].tokens)) for b in drafting],
                             B) if drafting else []
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
    return shortest_paying((state.length.gains(state.row(LOOKUP, n), room) for n in range(1, state.max_ngram + 1)),
                           batch_size, cost)
