"""What a route receives (FastAPI dependencies): the server's state, the API-key check, and a
request body read, checked and parsed (``RequestBody``).

Bodies are read by hand rather than by FastAPI so that every content type is taken as JSON (as
OpenAI's server does: ``curl -d`` sends form-urlencoded), the size limit holds before the body is
read, a large body is parsed off the event loop, and lone surrogates are refused.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import re
from typing import Any

from fastapi import Depends, Request

from .errors import APIError, bad
from .schema import ChatCompletionRequest, CompletionRequest, ParsedRequest, parse
from .state import ServerState

MAX_BODY_BYTES = 16 * 1024 * 1024
THREAD_JSON_BYTES = 1024 * 1024  # bodies larger than this are parsed in a worker thread


def server_state(request: Request) -> ServerState:
    return request.app.state.hispec


def check_key(request: Request) -> None:
    """401 unless the request carries ``Authorization: Bearer <key>`` (when the server has a key)."""
    key = server_state(request).api_key
    if key is None:
        return
    scheme, _, sent = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent.strip().encode(), key.encode()):
        raise APIError("Incorrect or missing API key: send 'Authorization: Bearer <key>'", status=401,
                       code="invalid_api_key")


class RequestBody:
    """The dependency of a generation route: the API key, then the body checked against ``model``
    (which ``openapi.document`` shows as the route's request body), for a model this server serves."""

    def __init__(self, model: type[CompletionRequest] | type[ChatCompletionRequest]) -> None:
        self.model = model

    async def __call__(self, request: Request, _: None = Depends(check_key)) -> ParsedRequest:
        state = server_state(request)
        req = parse(self.model, await read_json(request), state.vocab_size)
        if req.model not in state.model_names:
            raise bad(f"The model '{req.model}' does not exist; this server serves '{state.served_name}'",
                      "model", "model_not_found")
        return req


async def read_json(request: Request) -> Any:
    too_big = APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_big
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise too_big
    try:
        body = json.loads(raw) if len(raw) <= THREAD_JSON_BYTES else await asyncio.to_thread(json.loads, raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    check_text(raw, body)
    return body


# ---- text -------------------------------------------------------------------------------------------------
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
