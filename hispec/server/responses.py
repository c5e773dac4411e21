"""Pieces of OpenAI responses: the choices of a request and their log-probabilities.

A request makes one engine sequence per prompt and sample (``n``, or ``best_of`` for
completions); each is a ``Choice``. Choice ``index`` is ``prompt_index * n + j`` (vLLM's
numbering), so a list of prompts reads back in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..sampling.logprobs import TokenLogprob
from .async_engine import Delta, RequestStream


@dataclass
class Choice:
    """One generated sequence and what it has produced so far."""

    prompt_index: int
    prompt_ids: list[int]
    stream: RequestStream
    index: int = 0
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    echoed: bool = False  # streaming: the echoed prompt has been sent
    calls: Any = None  # streaming with tools: the choice's CallStream

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs += delta.logprobs or []
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


def best(choices: list[Choice], n: int) -> list[Choice]:
    """``best_of``: per prompt, the ``n`` sequences with the highest cumulative log-probability
    (vLLM's rule), numbered ``prompt_index * n + j``."""
    out = []
    for p in sorted({c.prompt_index for c in choices}):
        ranked = sorted((c for c in choices if c.prompt_index == p), key=lambda c: -c.cumulative_logprob)
        for j, c in enumerate(ranked[:n]):
            c.index = p * n + j
            out.append(c)
    return out


def usage(choices: list[Choice]) -> dict:
    """Prompt tokens once per prompt (``prompt_tokens_details.cached_tokens``: of them, found in the
    prefix cache, as OpenAI reports its prompt caching); completion tokens of every sequence made."""
    prompts = {c.prompt_index: c.stream.prompt_tokens for c in choices}
    cached = {c.prompt_index: c.stream.cached_tokens for c in choices}
    prompt = sum(prompts.values())
    completion = sum(c.stream.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


# ---- log-probabilities ------------------------------------------------------------------------------
def completion_logprobs(entries: list[TokenLogprob | None], token_text: Callable[[int], str],
                        start_offset: int = 0) -> dict:
    """The completions format: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the chosen
    token and the top alternatives, as a dict text -> logprob: tokens whose text is the same
    share one key), ``text_offset``."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = start_offset
    for e in entries:
        if e is None:
            continue
        text = token_text(e.token)
        tokens.append(text)
        token_logprobs.append(e.logprob)
        alternatives = {text: e.logprob}
        for t, v in e.top:  # most likely first: tokens with the same text keep the highest value
            alternatives[token_text(t)] = max(v, alternatives.get(token_text(t), v))
        top.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], entries: list[TokenLogprob | None], token_text: Callable[[int], str]
                  ) -> dict:
    """``completion_logprobs`` of an echoed prompt: its first token has no log-probability (null)."""
    out = completion_logprobs([e for e in entries if e is not None], token_text)
    if entries and entries[0] is None:
        first = token_text(prompt_ids[0])
        out["tokens"].insert(0, first)
        out["token_logprobs"].insert(0, None)
        out["top_logprobs"].insert(0, None)
        out["text_offset"] = [0] + [o + len(first) for o in out["text_offset"]]
    return out


def join_logprobs(a: dict, b: dict) -> dict:
    """Two completions-format blocks one after the other (echoed prompt, then completion)."""
    end = (a["text_offset"][-1] + len(a["tokens"][-1])) if a["tokens"] else 0
    return {"tokens": a["tokens"] + b["tokens"], "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
            "top_logprobs": a["top_logprobs"] + b["top_logprobs"],
            "text_offset": a["text_offset"] + [end + o for o in b["text_offset"]]}


def chat_logprobs(entries: list[TokenLogprob], token_text: Callable[[int], str]) -> dict:
    """The chat format: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``."""
    def item(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                        for e in entries], "refusal": None}
