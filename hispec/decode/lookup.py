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
- **Draft length** (``DraftLength``, ``RowCost``): a draft is worth its verification row when
  its chance of being accepted outweighs the row's cost. Each sequence keeps its running
  acceptance per draft position and match length; the cost of rows is measured from the
  verification passes (seconds = a + b * rows, least squares with forgetting).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


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
    """Continuations seen after n-grams in the outputs of recent requests (shared by the
    requests of one strategy), bounded: at most ``capacity`` n-grams, least recently used out.

    ``add(output)`` records, for each n-gram (``n = 1 .. max_ngram``) of a finished output,
    the ``k`` tokens that followed its last occurrence; ``propose(tokens, k)`` looks up the
    longest suffix of ``tokens`` as ``NgramIndex.propose`` does."""

    def __init__(self, max_ngram: int, k: int, capacity: int = 65536) -> None:
        self.max_ngram, self.k, self.capacity = max_ngram, k, capacity
        self.table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def add(self, output: list[int]) -> None:
        for e in range(len(output) - 1):
            follow = tuple(output[e + 1:e + 1 + self.k])
            for n in range(1, min(self.max_ngram, e + 1) + 1):
                key = tuple(output[e - n + 1:e + 1])
                self.table[key] = follow
                self.table.move_to_end(key)
        while len(self.table) > self.capacity:
            self.table.popitem(last=False)

    def propose(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        for n in range(min(self.max_ngram, len(tokens)), 0, -1):
            follow = self.table.get(tuple(tokens[len(tokens) - n:]))
            if follow:
                self.table.move_to_end(tuple(tokens[len(tokens) - n:]))
                return n, list(follow[:k])
        return 0, []


@dataclass
class RowCost:
    """The measured seconds of a pass as ``a + b * rows``: exponentially weighted least squares
    over ``(rows, seconds)`` observations, with a prior relative row cost ``prior`` (``b / (a + b)``)
    anchored at the first observation, which the measurements outweigh after a few passes."""

    prior: float = 0.25
    decay: float = 0.95  # weight of older observations per new one
    prior_weight: float = 2.0
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, w*r, w*t, w*r*r, w*r*t

    def record(self, rows: int, seconds: float) -> None:
        if seconds <= 0 or rows < 1:
            return
        if not self.sums[0]:  # the prior: a + b*rows = seconds with b = prior * (a + b), at rows and rows + 1
            b = seconds * self.prior / (1 + self.prior * (rows - 1))
            for r, t in ((rows, seconds), (rows + 1, seconds + b)):
                self._add(r, t, self.prior_weight / 2)
        self.sums = [s * self.decay for s in self.sums]
        self._add(rows, seconds, 1.0)

    def _add(self, r: float, t: float, w: float) -> None:
        for i, v in enumerate((w, w * r, w * t, w * r * r, w * r * t)):
            self.sums[i] += v

    def relative(self, batch_size: int) -> float:
        """One extra row's cost as a share of one sequence's plain step: ``b / ((a + b*B) / B)``."""
        w, sr, st, srr, srt = self.sums
        if not w:
            return self.prior
        var = srr * w - sr * sr  # > 0: the prior's two points differ in rows
        b = max(0.0, (srt * w - sr * st) / var) if var > 1e-12 else 0.0
        plain = (st - b * sr) / w + b * batch_size  # a + b * B
        return b * batch_size / plain if plain > 0 else self.prior


class DraftLength:
    """One sequence's running acceptance of free drafts: per match length ``n`` and draft
    position ``j``, an estimate of P(draft j accepted | drafts before it accepted).

    ``choose`` picks the ``k`` that maximises expected tokens per unit of cost,
    ``(1 + sum_{j<=k} prod_{i<=j} a_i) / (1 + c * k)`` with ``c`` a row's cost relative to a plain
    step; ``k = 0`` (plain) when no length beats one token per plain step. While it is not
    drafting, its estimates drift back towards the prior, so it tries again later."""

    def __init__(self, max_draft: int, max_ngram: int, prior: float = 0.6, alpha: float = 0.3,
                 recover: float = 0.01, explore_every: int = 32) -> None:
        self.prior, self.alpha, self.recover, self.explore_every = prior, alpha, recover, explore_every
        self.rates = [[prior] * max_draft for _ in range(max_ngram + 1)]  # [n][j]
        self.declined = 0  # matches in a row it did not draft from

    def choose(self, n: int, available: int, row_cost: float) -> int:
        rates = self.rates[n]
        best_k, best, expect, p = 0, 1.0, 1.0, 1.0
        for k in range(1, min(available, len(rates)) + 1):
            p *= rates[k - 1]
            expect += p
            ratio = expect / (1.0 + row_cost * k)
            if ratio > best + 1e-9:
                best_k, best = k, ratio
        if best_k == 0:
            self.rates[n] = [r + self.recover * (self.prior - r) for r in rates]
            self.declined += 1
            if self.declined >= self.explore_every:  # now and then, measure again: the costs may have changed
                best_k = min(available, len(rates), 2)
        if best_k:
            self.declined = 0
        return best_k

    def record(self, n: int, drafted: int, accepted: int) -> None:
        """A round of ``drafted`` drafts from a match of ``n`` tokens, ``accepted`` of them accepted."""
        rates = self.rates[n]
        for j in range(min(drafted, accepted + 1)):  # draft j was tested when all before it were accepted
            rates[j] += self.alpha * (float(j < accepted) - rates[j])


class LookupState:
    """A sequence's free-draft source: its n-gram index and its draft-length estimates."""

    def __init__(self, max_draft: int, max_ngram: int) -> None:
        self.index = NgramIndex(max_ngram)
        self.length = DraftLength(max_draft, max_ngram)
        self.last_n = 0  # the match length of the drafts now being verified


def free_drafts(batch: list, max_draft: int, max_ngram: int, cost: RowCost | None) -> list[list[int]]:
    """Each sequence's prompt-lookup drafts for this round (``[]``: none), at most ``max_draft``
    and never past its token limit. ``cost`` None: every draft the match gives; else as many as
    pay for their rows (``DraftLength.choose``) at the measured row cost. Sampled sequences
    weigh rows at the prior cost, so that their random streams never depend on timing (a seeded
    request gives the same output on any machine, alone or batched)."""
    out = []
    for ctx in batch:
        if ctx.lookup is None:
            ctx.lookup = LookupState(max_draft, max_ngram)
        state: LookupState = ctx.lookup
        room = min(max_draft, ctx.remaining - 1)  # the bonus token may be the last one allowed
        n, ends = state.index.match(ctx.tokens) if room > 0 else (0, [])
        k = room if cost is None or not n else state.length.choose(
            n, room, cost.relative(len(batch)) if ctx.params.greedy else cost.prior)
        state.last_n = n
        out.append(continuation(ctx.tokens, ends[-1], k) if n and k else [])
    return out
