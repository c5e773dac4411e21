"""One request inside the engine: its decode context, end conditions and committed text.

End conditions (EOS, stop strings, the token limit, the context limit) are applied to
committed tokens only, so every strategy ends exactly where autoregressive decoding would.
"""
from __future__ import annotations

import enum
import time
from typing import Callable

from ..decode.base import DecodeContext


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, ctx: DecodeContext, decode: Callable[[list[int]], str],
                 max_positions: int) -> None:
        self.request_id = request_id
        self.ctx = ctx
        self.prompt_ids = list(ctx.tokens)
        self.new_tokens: list[int] = []
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.prefilled = False  # its cache holds tokens[:-1] (false again after a preemption)
        self.num_cached = 0  # while not prefilled: positions of tokens[:-1] in its cache (prefill chunks done)
        self.prompt_logprob_rows: list = []  # prompt log-probabilities of the chunks done so far
        self.text = TextState(decode, ctx.params.stop)
        self.context_room = max_positions - len(self.prompt_ids)
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.prompt_logprobs: list | None = None  # set at the first prefill when the request asks
        self.scheduled_time: float | None = None  # the first prefill (perf_counter)
        self.draft_scope: str | None = None  # whose earlier outputs draft for it (the engine's SuffixStore)
        self.prefix_scope: str | None = None  # whose cached prompt blocks it may share (None: no prefix caching)
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at its first admission

    @property
    def seq_id(self) -> int:
        return self.ctx.seq_id

    @property
    def prompt_end(self) -> int:
        """The positions its prefill fills as a prompt's (all but the prompt's last token, which the
        first decode step runs); a preempted sequence's positions from here on are recomputed as
        they were decoded."""
        return len(self.prompt_ids) - 1

    def forget_cache(self) -> None:
        """Its blocks were freed (preemption): the next prefill starts from position 0."""
        self.prefilled = False
        self.num_cached = 0

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def commit(self, chunk: list[int]) -> list[int]:
        """Append committed tokens, cut at an end condition; returns the tokens kept."""
        reason, chunk = self._cut_at_end(chunk)
        self.ctx.tokens.extend(chunk)
        self.new_tokens.extend(chunk)
        if chunk and self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        if self.text.update(self.new_tokens, final=reason is not None):
            reason = "stop"
            kept = self.text.tokens_through_stop(self.new_tokens)
            chunk = chunk[:max(0, len(chunk) - (len(self.new_tokens) - len(kept)))]
            self.new_tokens = kept
        if reason is None and self.ctx.remaining <= 0:
            reason = "length" if len(self.new_tokens) >= self.ctx.params.max_new_tokens else "context"
        if reason is not None:
            self.finish(reason)
        return chunk

    def finish(self, reason: str) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()
        self.ctx.stats.new_tokens = len(self.new_tokens)

    def _cut_at_end(self, chunk: list[int]) -> tuple[str | None, list[int]]:
        params = self.ctx.params
        limit = min(params.max_new_tokens, self.context_room) - len(self.new_tokens)
        if not params.ignore_eos:
            for j, t in enumerate(chunk[:limit]):
                if t in self.ctx.eos_ids:
                    return "eos", chunk[:j + 1]
        if len(chunk) >= limit:
            return ("length" if params.max_new_tokens <= self.context_room else "context"), chunk[:limit]
        return None, chunk


class TextState:
    """Incremental detokenisation of committed tokens with stop strings.

    ``delta()`` hands out text that can no longer change: it holds back a trailing partial
    UTF-8 character and, when stop strings are set, the last ``len(longest stop) - 1`` chars.

    Each step decodes only a window of the last tokens, not all of them (which cost O(length) per
    step: ~0.3 ms at 200 tokens): the window starts at the tokens committed one update earlier
    (``prefix``), and what it adds past the text of ``tokens[prefix:read]`` is new text (the same
    start for both, so a tokenizer's handling of a leading space or of bytes split over tokens
    is the same in both). The final update decodes the whole sequence once.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]) -> None:
        self.decode, self.stops = decode, stops
        self.text = ""
        self.sent = 0
        self.safe = 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.prefix = self.read = 0  # the window starts at tokens[prefix]; tokens[:read] are in self.fixed
        self.fixed = ""

    def update(self, tokens: list[int], final: bool) -> bool:
        """Decode the committed tokens; True if a stop string appeared (the text is cut before it)."""
        self.text = self.decode(tokens) if final else self._extend(tokens)
        for s in self.stops:
            cut = self.text.find(s)
            if cut >= 0:
                self.text = self.text[:cut]
                self.safe = len(self.text)
                return True
        if final:
            self.safe = len(self.text)
        else:
            safe = len(self.text) - self.hold
            if self.text.endswith("\ufffd"):
                safe = min(safe, len(self.text.rstrip("\ufffd")))
            self.safe = max(self.safe, safe)
        return False

    def _extend(self, tokens: list[int]) -> str:
        """The text of ``tokens`` so far: ``self.fixed`` (through ``tokens[:read]``) and what the
        window adds, less a trailing partial character (it waits for the tokens that complete it;
        the window then starts where it did)."""
        if len(tokens) < self.read:  # fewer tokens than decoded (not from commit): decode afresh
            self.prefix = self.read = 0
            self.fixed = ""
        before = self.decode(tokens[self.prefix:self.read]) if self.read > self.prefix else ""
        window = self.decode(tokens[self.prefix:])
        if not window.startswith(before):  # the tokenizer rewrote earlier text (rare): decode all
            return self.decode(tokens)
        if window.endswith("\ufffd"):
            return self.fixed + window.rstrip("\ufffd")[len(before):]
        self.fixed += window[len(before):]
        self.prefix, self.read = self.read, len(tokens)
        return self.fixed

    def tokens_through_stop(self, tokens: list[int]) -> list[int]:
        """The shortest prefix of ``tokens`` whose text reaches a stop string."""
        for n in range(1, len(tokens) + 1):
            if any(s in self.decode(tokens[:n]) for s in self.stops):
                return tokens[:n]
        return tokens

    def delta(self) -> str:
        out = self.text[self.sent:self.safe]
        self.sent = max(self.sent, self.safe)
        return out
