"""What the engine hands back: a request's state after each step (``RequestOutput``) and a finished
generation (``GenerationOutput``, what ``Generator.generate`` and ``LLM.generate`` return)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..decode.stats import DecodeStats
from ..sampling.logprobs import TokenLogprob


@dataclass
class RequestOutput:
    """A request's state after a step: the new committed tokens/text of this step and all so far."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str  # committed text so far (stop strings cut)
    text_delta: str  # text that became final in this step
    finished: bool
    finish_reason: str | None
    stats: DecodeStats = field(repr=False)
    seconds: float = 0.0  # arrival to now
    time_to_first_token: float | None = None
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, if the request asked (params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first: None), if asked
    scheduled_at: float | None = None  # perf_counter when the request was first prefilled
    error: Exception | None = None  # what its round raised, for finish reason "error"
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not prefilled again)


@dataclass
class GenerationOutput:
    """A finished generation: one request's tokens, text, timings and decoding statistics."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # new tokens only (an end-of-sequence token included, as transformers does)
    text: str
    finish_reason: str  # "eos", "stop", "length" (max_new_tokens), "context" or "error"
    seconds: float  # from submission to finish
    time_to_first_token: float | None
    stats: DecodeStats = field(repr=False)
    error: str | None = None  # why it failed (finish reason "error"); the other requests are unaffected

    @classmethod
    def of(cls, final: RequestOutput) -> "GenerationOutput":
        """The generation a request's last ``RequestOutput`` ends."""
        error = None if final.error is None else f"{type(final.error).__name__}: {final.error}"
        return cls(final.request_id, final.prompt_token_ids, final.token_ids, final.text, final.finish_reason,
                   final.seconds, final.time_to_first_token, final.stats, error)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0
