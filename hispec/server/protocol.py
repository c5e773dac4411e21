"""OpenAI request bodies: parsing, validation and OpenAI-style errors.

Every check raises ``APIError``, which the app turns into
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status. Types are checked
strictly (``true`` is not a number, ``"5"`` is not an integer) and each message names the field.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = dict(headers or {})
        if status == 401:
            self.headers.setdefault("WWW-Authenticate", "Bearer")

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


# ---- text ---------------------------------------------------------------------------------------------
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a UTF-16 surrogate appears in JSON


def check_text(raw: bytes, body: Any) -> None:
    """Refuse lone UTF-16 surrogates (``"\\ud800"``): JSON allows the escape, but the string is not
    text (it cannot be tokenized, nor encoded as UTF-8). Walks the body only if ``raw`` has such
    an escape; a proper pair (an emoji) is one character after parsing and passes."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str) and not _is_utf8(v):
            raise bad(f"{path or 'the body'} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                      "which is not text", path or None, "invalid_unicode")
        if isinstance(v, dict):
            for k, x in v.items():
                name = k if _is_utf8(k) else k.encode("utf-8", "backslashreplace").decode()
                stack.append((f"{path}.{name}" if path else name, x))
                if not _is_utf8(k):
                    stack.append((f"{path}.{name}" if path else name, k))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


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
    n: int = 1  # choices per prompt
    best_of: int = 1  # completions: sequences generated per prompt, the n most likely returned
    logprobs: int | None = None  # alternatives per token (None: no logprobs)
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    json_schema: dict | bool | None = None  # response_format: the output must be JSON matching it
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: text or token ids each
    messages: list[dict] = field(default_factory=list)  # chat, normalised {"role", "content": str, ...}
    tools: list[dict] = field(default_factory=list)  # chat: function definitions {"name", "parameters", ...}
    tool_choice: str | None = None  # "none", "auto", "required" or a function name (None: no tools)


SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what torch.Generator.manual_seed accepts
MAX_STOP = 16
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's chat limit; vLLM's default max_logprobs)
MAX_N = 64  # choices (n, best_of) per prompt


def _common(body: Any, kind: str) -> dict:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is None:
        raise bad("'model' is required", "model")
    if not isinstance(model, str):
        raise bad(f"'model' must be a string, got {_show(model)}", "model")
    n = get_int(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise bad(f"'n' must be between 1 and {MAX_N}, got {n}", "n")
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
    echo_only = kind == "completion" and max_tokens == 0 and body.get("echo") is True  # scores the prompt
    if max_tokens is not None and max_tokens < 1 and not echo_only:
        raise bad(f"'{max_name}' must be at least 1 (0 only with echo), got {max_tokens}", max_name)
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
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        penalties[name] = get_number(body, name, 0.0)
        if not -2.0 <= penalties[name] <= 2.0:
            raise bad(f"'{name}' must be between -2 and 2, got {penalties[name]}", name)
    _unsupported(body, kind)
    return dict(kind=kind, model=model, stream=stream, include_usage=include_usage, max_tokens=max_tokens,
                max_tokens_param=max_name, n=n,
                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stops,
                ignore_eos=get_bool(body, "ignore_eos"), logprobs=_logprobs(body, kind),
                json_schema=_response_format(body), **penalties)


def _response_format(body: dict) -> dict | bool | None:
    """The JSON schema that ``response_format`` asks for: ``json_object`` is any JSON object,
    ``json_schema`` is ``json_schema.schema``; ``text`` (or none) is None."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad("response_format.json_schema must be an object with 'name' and 'schema'",
                      "response_format.json_schema")
        schema = spec.get("schema", True)
        if not isinstance(schema, (dict, bool)):
            raise bad("response_format.json_schema.schema must be a JSON schema (an object)",
                      "response_format.json_schema.schema")
        return schema
    raise bad("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format")


def _logprobs(body: dict, kind: str) -> int | None:
    """Alternatives per token, or None: completions' ``logprobs`` (an integer), chat's
    ``logprobs`` (a boolean) with ``top_logprobs``."""
    if kind == "completion":
        k = get_int(body, "logprobs")
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise bad(f"'logprobs' must be between 0 and {MAX_LOGPROBS}, got {k}", "logprobs")
        return k
    top = get_int(body, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad(f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}, got {top}", "top_logprobs")
    if not get_bool(body, "logprobs"):
        if top:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: ``{"token id": bias in [-100, 100]}``."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.strip().lstrip("-").isdigit()):
            raise bad(f"'logit_bias' keys must be token ids, got {_show(key)}", "logit_bias")
        token = int(key)
        if not 0 <= token < vocab_size:
            raise bad(f"'logit_bias' token id {token} is out of range [0, {vocab_size})", "logit_bias")
        if not (_is_number(value) and -100 <= value <= 100):
            raise bad(f"'logit_bias' values must be numbers between -100 and 100, got {_show(value)}", "logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def _unsupported(body: dict, kind: str) -> None:
    """Options that would change the answer and that this server does not implement: refuse
    them rather than silently ignore them (their neutral values are accepted)."""
    if kind == "completion":
        if body.get("suffix") not in (None, ""):
            raise bad("'suffix' is not supported: the served models have no fill-in-the-middle format", "suffix")
    else:
        if body.get("functions") not in (None, []):
            raise bad("'functions' (legacy function calling) is not supported: use 'tools'", "functions")


MAX_PROMPTS = 256


def parse_completion(body: Any, vocab_size: int) -> ParsedRequest:
    fields = _common(body, "completion")
    req = ParsedRequest(**fields, logit_bias=logit_bias(body, vocab_size), echo=get_bool(body, "echo"))
    best_of = get_int(body, "best_of")
    if best_of is not None:
        if not req.n <= best_of <= MAX_N:
            raise bad(f"'best_of' must be between n ({req.n}) and {MAX_N}, got {best_of}", "best_of")
        if req.stream and best_of > req.n:
            raise bad("'best_of' greater than 'n' cannot be streamed", "best_of")
        req.best_of = best_of
    else:
        req.best_of = req.n
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompt = [prompt]  # one prompt
    if not (isinstance(prompt, list) and prompt):
        raise bad("'prompt' must be a string, a list of token ids, or a non-empty list of these", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise bad(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt")
    for i, p in enumerate(prompt):
        param = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise bad(f"'{param}' is empty", "prompt")
        elif isinstance(p, list) and p and all(_is_int(t) for t in p):
            bad_ids = [t for t in p if not 0 <= t < vocab_size]
            if bad_ids:
                raise bad(f"'{param}' token id {bad_ids[0]} is out of range [0, {vocab_size})", "prompt")
        else:
            raise bad(f"'{param}' must be a non-empty string or a non-empty list of token ids", "prompt")
    req.prompts = list(prompt)
    return req


CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


def parse_chat(body: Any, vocab_size: int) -> ParsedRequest:
    from .tools import history_tool_calls, parse_tool_choice, parse_tools

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
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad(f"{param}.role must be one of {', '.join(sorted(CHAT_ROLES))}, got {_show(role)}",
                      f"{param}.role")
        msg = {"role": "system" if role == "developer" else role}
        if role == "assistant":
            msg["tool_calls"] = history_tool_calls(m, param)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad(f"{param}.tool_call_id is required (a string) in a tool message", f"{param}.tool_call_id")
            msg["tool_call_id"] = call_id
        msg["content"] = _content_text(m.get("content"), "assistant" if msg.get("tool_calls") else role,
                                       f"{param}.content")
        if not msg.get("tool_calls"):
            msg.pop("tool_calls", None)
        out.append(msg)
    req = ParsedRequest(**fields, logit_bias=logit_bias(body, vocab_size))
    req.messages = out
    req.tools = parse_tools(body)
    req.tool_choice = parse_tool_choice(body, req.tools)
    if req.tool_choice not in (None, "none", "auto") and req.json_schema is not None:
        raise bad("'response_format' and a forced 'tool_choice' cannot be combined", "tool_choice")
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
