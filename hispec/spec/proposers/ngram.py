"""Prompt lookup (Saxena 2023; transformers' ``prompt_lookup_num_tokens``, vLLM's ``ngram`` proposer):
the last ``n`` tokens of prompt + output so far (``n = max_ngram .. 1``, longest first) are looked up
in the earlier text; the tokens that followed their most recent earlier occurrence are the drafts.
Much of what users ask for (summaries, answers from given text, edits, code) repeats the prompt or
earlier output. ``NgramIndex`` keeps, per sequence, where each n-gram last ended (a few distinct
continuations each, for token trees), updated as tokens are committed: O(max_ngram) dictionary
operations per token.
"""
from __future__ import annotations


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
