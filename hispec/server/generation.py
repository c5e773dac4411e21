"""One generation request, from parsed body to response, for both completions and chat.

Requests from every client join the engine's one continuous batch (see ``async_engine``). A
request makes one engine sequence per prompt and sample (``Choice``); its answer is one JSON
body, or server-sent events in OpenAI's chunk format ending with ``data: [DONE]``. A client that
goes away mid-request has its sequences aborted, which frees their KV blocks. What differs
between the endpoints (object names, a choice's fields, a chunk's content) is the route's
``Format``.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..config import SamplingParams
from .async_engine import AsyncEngine, Delta, EngineStoppedError, QueueFullError
from .errors import APIError
from .responses import Choice, best, usage
from .schema import ParsedRequest
from .state import ServerState


class Format:
    """How one endpoint writes its answers; made per request, with the server's state and the request."""

    object: str  # the whole answer's "object"
    chunk_object: str  # each streamed chunk's "object"
    id_prefix: str
    empty: dict  # a chunk's content when it carries only log-probabilities
    final: dict  # the content of a choice's last chunk

    def __init__(self, state: ServerState, req: ParsedRequest) -> None:
        self.state, self.req = state, req

    def choice(self, c: Choice) -> dict:
        """One finished choice of the JSON answer."""
        raise NotImplementedError

    def opening(self, choices: list[Choice]) -> list[dict]:
        """Chunks sent before any text."""
        return []

    def content(self, choice: Choice, delta: Delta, echo: bool) -> dict | None:
        """A chunk's content for ``delta`` (None: nothing to send)."""
        raise NotImplementedError

    def logprobs(self, choice: Choice, delta: Delta, echo: bool) -> dict:
        """A chunk's log-probabilities for ``delta`` (called when the request asked for them)."""
        raise NotImplementedError


async def generate(request: Request, state: ServerState, fmt: Format) -> Response:
    req = fmt.req
    prompts = await asyncio.to_thread(state.prompt_ids, req)  # off the event loop: streams go on
    grammar = None
    if req.json_schema is not None or req.tool_choice not in (None, "none", "auto"):
        grammar = await asyncio.get_running_loop().run_in_executor(None, state.grammar, req)
    jobs = [(i, ids, state.sampling_params(req, len(ids), j, grammar)) for i, ids in enumerate(prompts)
            for j in range(req.best_of)]
    auth = request.headers.get("authorization")
    choices = submit(state.engine, jobs, state.draft_scope(auth, req.user), state.cache_scope(auth, req.cache_salt))
    rid, created = fmt.id_prefix + uuid.uuid4().hex, int(time.time())
    if req.stream:
        return EngineStreamingResponse(events(state, fmt, choices, rid, created), choices, state.engine)
    try:
        complete = await collect(request, choices)
    finally:
        abort_unfinished(state.engine, choices)
    if not complete:  # the client went away
        return Response(status_code=499)
    for c in choices:
        if c.stream.finish_reason == "error":
            raise APIError(f"generation failed: {c.stream.error}", status=500, type="server_error")
        if c.stream.finish_reason == "abort":
            raise APIError("the request was cancelled: the server is shutting down", status=503,
                           type="server_error", code="shutting_down")
    returned = best(choices, req.n) if req.best_of > req.n else choices
    return JSONResponse({"id": rid, "object": fmt.object, "created": created, "model": state.served_name,
                         "choices": [fmt.choice(c) for c in returned], "usage": usage(choices),
                         "hispec_stats": returned[0].stream.stats})


def submit(engine: AsyncEngine, jobs: list[tuple[int, list[int], SamplingParams]],
           draft_scope: str | None = None, cache_scope: str = "") -> list[Choice]:
    """Queue every sequence of a request, or none (a full queue aborts those already queued).
    ``draft_scope``: the client's scope of the engine's suffix cache (``ServerState.draft_scope``);
    ``cache_scope``: of its prefix cache (``ServerState.cache_scope``)."""
    choices: list[Choice] = []
    try:
        for k, (i, ids, params) in enumerate(jobs):
            choices.append(Choice(i, ids, engine.submit(ids, params, draft_scope, cache_scope), index=k))
    except (QueueFullError, EngineStoppedError) as e:
        abort_unfinished(engine, choices)
        if isinstance(e, QueueFullError):
            raise APIError(str(e), status=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        raise APIError(str(e), status=503, type="server_error", code="shutting_down") from None
    return choices


def abort_unfinished(engine: AsyncEngine, choices: list[Choice]) -> None:
    for c in choices:
        if not c.stream.finished:
            engine.abort(c.stream.request_id)


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Delta]]:
    """``(choice, delta)`` from every choice's stream as they come, until all have finished."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        while True:
            delta = await choice.stream.get()
            queue.put_nowait((choice, delta))
            if delta.finished:
                return

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        for _ in range(len(choices)):
            while True:
                choice, delta = await queue.get()
                yield choice, delta
                if delta.finished:
                    break
    finally:
        for t in tasks:
            t.cancel()


async def collect(request: Request, choices: list[Choice]) -> bool:
    """Read every choice to its end; False if the client disconnected first."""
    async def read_all() -> None:
        async for choice, delta in merged(choices):
            choice.add(delta)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    reader, watcher = asyncio.create_task(read_all()), asyncio.create_task(disconnected())
    try:
        done, _ = await asyncio.wait({reader, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (reader, watcher):
            t.cancel()
    if reader in done:
        reader.result()
        return True
    return False


# ---- streaming ----------------------------------------------------------------------------------------------
def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def events(state: ServerState, fmt: Format, choices: list[Choice], rid: str, created: int
                 ) -> AsyncIterator[str]:
    """Chunks of every choice as they come, then the usage (if asked) and ``[DONE]``."""
    req = fmt.req

    def chunk(choice: dict | None, **extra) -> str:
        return sse({"id": rid, "object": fmt.chunk_object, "created": created, "model": state.served_name,
                    "choices": [] if choice is None else [choice], **extra})

    for opening in fmt.opening(choices):
        yield chunk(opening)
    async for choice, delta in merged(choices):
        if delta.error:
            yield sse(APIError(f"generation failed: {delta.error}", status=500, type="server_error").body())
            yield sse("[DONE]")
            return
        echo = req.echo and not choice.echoed  # the first chunk of a choice carries the echoed prompt
        choice.echoed = True
        logprobs = fmt.logprobs(choice, delta, echo) if req.logprobs is not None else None
        content = fmt.content(choice, delta, echo)
        if content is not None or (logprobs and (logprobs.get("tokens") or logprobs.get("content"))):
            yield chunk({"index": choice.index, **(content or fmt.empty), "logprobs": logprobs,
                         "finish_reason": None})
        if delta.finished:
            reason = "tool_calls" if choice.calls is not None and choice.calls.count else delta.finish_reason
            yield chunk({"index": choice.index, **fmt.final, "logprobs": None, "finish_reason": reason},
                        hispec_stats=delta.stats)
    if req.include_usage:
        yield chunk(None, usage=usage(choices))
    yield sse("[DONE]")


class EngineStreamingResponse(StreamingResponse):
    """A streaming response that aborts its requests however the response ends (client gone,
    server cancelling its task), even before the body iterator has started."""

    def __init__(self, content, choices: list[Choice], engine: AsyncEngine) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._choices, self._engine = choices, engine

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort_unfinished(self._engine, self._choices)
