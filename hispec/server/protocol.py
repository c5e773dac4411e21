"""OpenAI request bodies: parsing, validation and OpenAI-style errors.

Every check raises ``APIError``, which the app turns into
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status. Types are checked
strictly (``true`` is not a number, ``"5"`` is not an integer) and each message names the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, param=param, code=code)


# ---- typed field access ----------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def get_int(body: dict, name: str, default: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(f"'{name}' must be an integer, got {_show(v)}", name)
    return v


def get_number(body: dict, name: str, default: float | None = None) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise bad(f"'{name}' must be a finite number, got {_show(v)}", name)
    return float(v)


def _show(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


# ---- the request --------------------------------------------------------------------------------
@dataclass
class ParsedRequest:
    """What the server needs from a completions or chat request (before tokenization)."""

    kind: str  # "completion" or "chat"
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: the default for the endpoint
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from (for error messages)
    prompt: str | None = None  # completions, text
    prompt_ids: list[int] | None = None  # completions, token ids
    messages: list[dict] = field(default_factory=list)  # chat, normalised {"role", "content": str}


SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what torch.Generator.manual_seed accepts
MAX_STOP = 16


def _common(body: Any, kind: str) -> dict:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is None:
        raise bad("'model' is required", "model")
    if not isinstance(model, str):
        raise bad(f"'model' must be a string, got {_show(model)}", "model")
    n = get_int(body, "n", 1)
    if n != 1:
        raise bad(f"only n=1 is supported, got n={n}", "n")
    stream = get_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise bad("'stream_options' is only allowed with stream=true", "stream_options")
        include_usage = get_bool(options, "include_usage")
    temperature = get_number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise bad(f"'temperature' must be between 0 and 2, got {temperature}", "temperature")
    top_p = get_number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad(f"'top_p' must be greater than 0 and at most 1, got {top_p}", "top_p")
    top_k = get_int(body, "top_k", 0)  # an extension (vLLM's); 0 or -1 = off
    if top_k == -1:
        top_k = 0
    if top_k < 0:
        raise bad(f"'top_k' must be -1, 0 (off) or positive, got {top_k}", "top_k")
    seed = get_int(body, "seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise bad(f"'seed' must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}", "seed")
    max_name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = get_int(body, max_name)
    if max_tokens is not None and max_tokens < 1:
        raise bad(f"'{max_name}' must be at least 1, got {max_tokens}", max_name)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP:
            raise bad(f"'stop' may hold at most {MAX_STOP} strings, got {len(stop)}", "stop")
        stops = tuple(stop)
    else:
        raise bad("'stop' must be a string or a list of strings", "stop")
    _unsupported(body, kind)
    return dict(kind=kind, model=model, stream=stream, include_usage=include_usage, max_tokens=max_tokens,
                max_tokens_param=max_name,
                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stops,
                ignore_eos=get_bool(body, "ignore_eos"))


def _unsupported(body: dict, kind: str) -> None:
    """Options that would change the answer and that this server does not implement: refuse
    them rather than silently ignore them (their neutral values are accepted)."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = get_number(body, name, 0.0)
        if v != 0.0:
            raise bad(f"'{name}' is not supported (only 0)", name)
    if body.get("logit_bias") not in (None, {}):
        raise bad("'logit_bias' is not supported", "logit_bias")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False, 0):
        raise bad("'logprobs' is not supported", "logprobs")
    if body.get("top_logprobs") not in (None, 0):
        raise bad("'top_logprobs' is not supported", "top_logprobs")
    if kind == "completion":
        if get_bool(body, "echo"):
            raise bad("'echo' is not supported", "echo")
        if get_int(body, "best_of", 1) != 1:
            raise bad("only best_of=1 is supported", "best_of")
        if body.get("suffix") not in (None, ""):
            raise bad("'suffix' is not supported", "suffix")
    else:
        for name in ("tools", "functions"):
            if body.get(name) not in (None, []):
                raise bad(f"'{name}' (function calling) is not supported", name)
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise bad("only response_format {'type': 'text'} is supported", "response_format")


def parse_completion(body: Any, vocab_size: int) -> ParsedRequest:
    fields = _common(body, "completion")
    prompt = body.get("prompt")
    req = ParsedRequest(**fields)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' is empty", "prompt")
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad_ids = [t for t in prompt if not 0 <= t < vocab_size]
        if bad_ids:
            raise bad(f"'prompt' token id {bad_ids[0]} is out of range [0, {vocab_size})", "prompt")
        req.prompt_ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad(f"only one prompt per request is supported, got {len(prompt)}", "prompt")
    elif prompt is None:
        raise bad("'prompt' is required", "prompt")
    else:
        raise bad("'prompt' must be a string, a list of token ids, or a list of one of these", "prompt")
    return req


CHAT_ROLES = {"system", "developer", "user", "assistant"}


def parse_chat(body: Any) -> ParsedRequest:
    fields = _common(body, "chat")
    messages = body.get("messages")
    if messages is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{param} must be an object with 'role' and 'content'", param)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{param}.role must be one of {', '.join(sorted(CHAT_ROLES))}, got {_show(role)}",
                      f"{param}.role")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content_text(m.get("content"), role, f"{param}.content")})
    req = ParsedRequest(**fields)
    req.messages = out
    return req


def _content_text(content: Any, role: str, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{param}: only text parts ({{'type': 'text', 'text': ...}}) are supported", param)
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{param} must be a string or a list of text parts", param)


# ---- responses ------------------------------------------------------------------------------------
def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's reasons (eos, stop, length, context) in OpenAI's words (stop, length);
    'abort' (cancelled) and 'error' pass through."""
    return {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}.get(reason, reason)
