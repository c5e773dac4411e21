"""The FastAPI application: OpenAI's completions and chat completions, models, health, metrics.

Requests from every client join the engine's one continuous batch (see ``async_engine``).
Streaming answers are server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``; a client that goes away mid-request has its request aborted, which frees
its KV blocks. Every error is ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import ConfigError, SamplingParams
from .async_engine import AsyncEngine, EngineStoppedError, QueueFullError, RequestStream
from .metrics import Metrics
from .protocol import APIError, ParsedRequest, bad, parse_chat, parse_completion

API_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: object  # a Hugging Face tokenizer (used under tokenizer_lock)
    model_names: tuple[str, ...]  # the first is the served name; the others are accepted aliases
    context_length: int
    vocab_size: int
    strategy: str
    api_key: str | None = None
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def metrics(self) -> Metrics:
        return self.engine.metrics

    @property
    def served_name(self) -> str:
        return self.model_names[0]

    @property
    def pool_tokens(self) -> int:
        """Positions one sequence may hold when it has the whole KV pool to itself."""
        e = self.engine.engine
        return e.blocks.num_blocks * e.block_size

    # ---- prompts ------------------------------------------------------------------------------
    def prompt_ids(self, req: ParsedRequest) -> list[int]:
        if req.prompt_ids is not None:
            return req.prompt_ids
        tok = self.tokenizer
        if tok is None:
            raise bad("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        with self.tokenizer_lock:
            if req.kind == "completion":
                return tok(req.prompt)["input_ids"]
            if not getattr(tok, "chat_template", None):
                raise bad("this model has no chat template: use /v1/completions", "messages")
            try:
                text = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # jinja's TemplateError and friends: the template refused the messages
                raise bad(f"the chat template rejected the messages: {e}", "messages") from None
            return tok(text, add_special_tokens=False)["input_ids"]

    def sampling_params(self, req: ParsedRequest, num_prompt: int) -> SamplingParams:
        ctx = self.context_length
        param = "prompt" if req.kind == "completion" else "messages"
        if num_prompt == 0:
            raise bad(f"'{param}' is empty after tokenization", param)
        if num_prompt >= ctx:
            raise bad(f"This model's maximum context length is {ctx} tokens, and the prompt has {num_prompt} "
                      f"tokens: at most {ctx - 1} fit with one new token", param, "context_length_exceeded")
        room = min(ctx, self.pool_tokens - 1) - num_prompt
        if room < 1:
            raise bad(f"the prompt has {num_prompt} tokens but the server's KV cache holds at most "
                      f"{self.pool_tokens - 1} positions per request (--kv-blocks)", param, "kv_cache_too_small")
        max_name = req.max_tokens_param
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(16, room) if req.kind == "completion" else room  # OpenAI's defaults
        elif num_prompt + max_tokens > ctx:
            raise bad(f"This model's maximum context length is {ctx} tokens. However, you requested "
                      f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                      f"completion). Reduce the prompt or '{max_name}'.", max_name, "context_length_exceeded")
        elif max_tokens > room:
            raise bad(f"the request needs {num_prompt + max_tokens + 1} positions in the KV cache but the server's "
                      f"pool holds {self.pool_tokens} (--kv-blocks); reduce '{max_name}'", max_name,
                      "kv_cache_too_small")
        try:
            return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                                  max_new_tokens=max_tokens, stop=req.stop, ignore_eos=req.ignore_eos)
        except ConfigError as e:
            raise bad(str(e)) from None


# ---- responses ------------------------------------------------------------------------------------
def error_response(err: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def usage(stream: RequestStream) -> dict:
    return {"prompt_tokens": stream.prompt_tokens, "completion_tokens": stream.completion_tokens,
            "total_tokens": stream.prompt_tokens + stream.completion_tokens}


class EngineStreamingResponse(StreamingResponse):
    """A streaming response that aborts its request however the response ends (client gone,
    server cancelling its task), even before the body iterator has started."""

    def __init__(self, content, stream: RequestStream, engine: AsyncEngine) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream, self._engine = stream, engine

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._stream.finished:
                self._engine.abort(self._stream.request_id)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


class CountRequests:
    """ASGI middleware: count API responses by endpoint and status code."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        path = scope["path"].rstrip("/")
        endpoint = path if path in API_PATHS else ("/v1/models" if path.startswith("/v1/models/") else "other")

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_http(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


# ---- the app ---------------------------------------------------------------------------------------
def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, state.engine.stop, 10.0)

    app = FastAPI(title="hispec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hispec = state
    app.add_middleware(CountRequests, metrics=state.metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(str(exc.detail), status=exc.status_code, type=kind))

    def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
            raise APIError("Incorrect or missing API key: send 'Authorization: Bearer <key>'", status=401,
                           code="invalid_api_key")

    async def read_json(request: Request):
        too_big = APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise too_big
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise too_big
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None

    def check_model(req: ParsedRequest) -> None:
        if req.model not in state.model_names:
            raise bad(f"The model '{req.model}' does not exist; this server serves '{state.served_name}'",
                      "model", "model_not_found")

    @app.get("/health")
    async def health():
        if not state.engine.alive:
            return JSONResponse({"status": "error", "error": str(state.engine.error or "engine stopped")},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": state.served_name, "object": "model", "created": state.created, "owned_by": "hispec",
                "max_model_len": state.context_length, "strategy": state.strategy}

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request):
        check_key(request)
        if model not in state.model_names:
            raise APIError(f"The model '{model}' does not exist", status=404, type="not_found_error",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        req = parse_completion(await read_json(request), state.vocab_size)
        check_model(req)
        return await generate(request, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        req = parse_chat(await read_json(request))
        check_model(req)
        return await generate(request, req)

    async def generate(request: Request, req: ParsedRequest) -> Response:
        prompt_ids = state.prompt_ids(req)
        params = state.sampling_params(req, len(prompt_ids))
        try:
            stream = state.engine.submit(prompt_ids, params)
        except QueueFullError as e:
            raise APIError(str(e), status=429, type="rate_limit_error", code="queue_full") from None
        except EngineStoppedError as e:
            raise APIError(str(e), status=503, type="server_error", code="shutting_down") from None
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            events = chat_events(stream, req, rid, created) if req.kind == "chat" else \
                completion_events(stream, req, rid, created)
            return EngineStreamingResponse(events, stream, state.engine)
        try:
            text = await collect(request, stream)
        finally:
            if not stream.finished:
                state.engine.abort(stream.request_id)
        if text is None:  # the client went away
            return Response(status_code=499)
        if stream.finish_reason == "error":
            raise APIError(f"generation failed: {stream.error}", status=500, type="server_error")
        if stream.finish_reason == "abort":
            raise APIError("the request was cancelled: the server is shutting down", status=503,
                           type="server_error", code="shutting_down")
        if req.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": stream.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": stream.finish_reason}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": state.served_name,
                             "choices": [choice], "usage": usage(stream), "hispec_stats": stream.stats})

    async def collect(request: Request, stream: RequestStream) -> str | None:
        """The whole text, or None if the client disconnected first."""
        async def read_all() -> str:
            parts = []
            while True:
                delta = await stream.get()
                parts.append(delta.text)
                if delta.finished:
                    return "".join(parts)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        reader, watcher = asyncio.create_task(read_all()), asyncio.create_task(disconnected())
        try:
            done, _ = await asyncio.wait({reader, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (reader, watcher):
                t.cancel()
        return reader.result() if reader in done else None

    def chunk(rid: str, created: int, obj: str, choice: dict | None, **extra) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": state.served_name,
                "choices": [] if choice is None else [choice]}
        body.update(extra)
        return sse(body)

    def final_events(stream: RequestStream, req: ParsedRequest, rid: str, created: int, obj: str, delta) -> list:
        if delta.error:
            return [sse(APIError(f"generation failed: {delta.error}", status=500, type="server_error").body()),
                    sse("[DONE]")]
        if req.kind == "chat":
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": delta.finish_reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": delta.finish_reason}
        out = [chunk(rid, created, obj, choice, hispec_stats=delta.stats)]
        if req.include_usage:
            out.append(chunk(rid, created, obj, None, usage=usage(stream)))
        out.append(sse("[DONE]"))
        return out

    async def chat_events(stream: RequestStream, req: ParsedRequest, rid: str, created: int):
        obj = "chat.completion.chunk"
        yield chunk(rid, created, obj, {"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None})
        while True:
            delta = await stream.get()
            if delta.text:
                yield chunk(rid, created, obj, {"index": 0, "delta": {"content": delta.text}, "logprobs": None,
                                                "finish_reason": None})
            if delta.finished:
                for event in final_events(stream, req, rid, created, obj, delta):
                    yield event
                return

    async def completion_events(stream: RequestStream, req: ParsedRequest, rid: str, created: int):
        obj = "text_completion"
        while True:
            delta = await stream.get()
            if delta.text:
                yield chunk(rid, created, obj, {"index": 0, "text": delta.text, "logprobs": None,
                                                "finish_reason": None})
            if delta.finished:
                for event in final_events(stream, req, rid, created, obj, delta):
                    yield event
                return

    return app
