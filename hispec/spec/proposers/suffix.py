"""A suffix cache over recent outputs (SuffixDecoding, arXiv 2411.04975, simplified): the
continuations that followed each n-gram in the outputs of recent requests, bounded in entries (least
recently used out), for what recurs across requests rather than within one. ``SuffixStore`` keeps one
per scope (a client: the server's API key and ``user``), bounded in scopes too; the engine adds each
finished request's output to its scope's cache (through ``spec.policy.SpecPolicy``), and a sequence
drafts from it where its match is longer than prompt lookup's (``proposers.lookup``).
"""
from __future__ import annotations

from collections import OrderedDict

from ...config import SpecConfig


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
    def for_spec(cls, spec: SpecConfig | None, entries: int, scopes: int) -> "SuffixStore | None":
        """A store for the free drafts of a strategy run with ``spec`` (its lookup length and
        draft count); None when it has none (no spec, ``lookup_max_draft`` 0) or ``entries`` is 0."""
        if spec is None or not entries or spec.lookup_max_draft < 1:
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
