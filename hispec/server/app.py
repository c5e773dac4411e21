"""The FastAPI application: OpenAI's completions and chat completions, models, health, metrics.

Requests from every client join the engine's one continuous batch (see ``async_engine``).
Streaming answers are server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``; a client that goes away mid-request has its request aborted, which frees
its KV blocks. Every error is ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import asyncio
import copy
import hmac
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import ConfigError, SamplingParams
from .async_engine import AsyncEngine, EngineStoppedError, QueueFullError, RequestStream
from .metrics import Metrics
from .schema import add_api_models
from .responses import (Choice, best, chat_logprobs, completion_logprobs, echo_logprobs, join_logprobs,
                        usage)
from .protocol import SEED_RANGE, APIError, ParsedRequest, bad, check_text, parse_chat, parse_completion
from .tools import (CallStream, fallback_messages, forced_grammar, parse_calls, template_knows_tools,
                    template_messages)

API_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
MAX_BODY_BYTES = 16 * 1024 * 1024
THREAD_JSON_BYTES = 1024 * 1024  # bodies larger than this are parsed in a worker thread
MAX_CHARS_PER_TOKEN = 32  # a text this many times longer than the context is first counted on a prefix


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
    _token_texts: dict[int, str] = field(default_factory=dict)
    _decoder_copy: object = None

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
    def prompt_ids(self, req: ParsedRequest) -> list[list[int]]:
        """The token ids of each prompt (one for chat). Blocking (seconds for a huge prompt): run it
        in a worker thread."""
        if req.kind == "completion":
            return [p if isinstance(p, list) else self._encode(p, "prompt", True) for p in req.prompts]
        return [self._chat_ids(req)]

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """Tokenize ``text``; a text far longer than the context is refused after counting a prefix
        (it cannot fit, and tokenizing megabytes would only keep a core busy)."""
        if self.tokenizer is None:
            raise bad("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        ctx, limit = self.context_length, self.context_length * MAX_CHARS_PER_TOKEN
        try:
            with self.tokenizer_lock:
                if len(text) > limit:
                    head = len(self.tokenizer(text[:limit], add_special_tokens=add_special_tokens)["input_ids"])
                    if head > ctx + 16:  # the cut can change the last few tokens, never hundreds
                        raise bad(f"This model's maximum context length is {ctx} tokens, and the prompt has "
                                  f"more than {ctx} tokens", param, "context_length_exceeded")
                return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        except APIError:
            raise
        except Exception as e:  # the tokenizer refused this text
            raise bad(f"the prompt could not be tokenized: {type(e).__name__}", param) from None

    def _decoder(self):
        """The event loop's own copy of the tokenizer (for logprobs and echo): never waits behind a
        huge prompt that a worker thread tokenizes under ``tokenizer_lock``."""
        if self._decoder_copy is None:
            self._decoder_copy = copy.deepcopy(self.tokenizer)
        return self._decoder_copy

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self._decoder().decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token as text (logprobs' ``token``); ``token_id:N`` without a tokenizer, as vLLM writes it."""
        text = self._token_texts.get(token)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token}"
            else:
                text = self._decoder().decode([token])
            self._token_texts[token] = text
        return text

    def _chat_ids(self, req: ParsedRequest) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise bad("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        if not getattr(tok, "chat_template", None):
            raise bad("this model has no chat template: use /v1/completions", "messages")
        tools = req.tools if req.tool_choice not in (None, "none") else []
        try:
            with self.tokenizer_lock:
                if template_knows_tools(tok):
                    text = tok.apply_chat_template(template_messages(req.messages), add_generation_prompt=True,
                                                   tokenize=False, tools=[{"type": "function", "function": t}
                                                                          for t in tools] or None)
                else:
                    text = tok.apply_chat_template(fallback_messages(req.messages, tools), add_generation_prompt=True,
                                                   tokenize=False)
        except Exception as e:  # jinja's TemplateError and friends: the template refused the messages
            raise bad(f"the chat template rejected the messages: {e}", "messages") from None
        return self._encode(text, "messages", add_special_tokens=False)

    def grammar(self, req: ParsedRequest):
        """The compiled grammar of ``req.json_schema``, or of a forced tool call (call off the event
        loop: the first one builds the tokenizer's grammar tables, which takes seconds)."""
        param = "response_format" if req.json_schema is not None else "tool_choice"
        try:
            from ..sampling.grammar import Grammar, GrammarError, llguidance_tokenizer
        except ImportError:  # pragma: no cover - llguidance is in the server extra
            raise bad("structured output needs the llguidance package: pip install 'hispec[server]'",
                      param) from None
        if self.tokenizer is None:
            raise bad("structured output needs the model's tokenizer", param)
        with self.tokenizer_lock:
            tokenizer = llguidance_tokenizer(self.tokenizer, self.vocab_size)
        try:
            if req.json_schema is not None:
                return Grammar.json_schema(req.json_schema, tokenizer)
            return Grammar(forced_grammar(req.tools, req.tool_choice), tokenizer)
        except GrammarError as e:
            raise bad(str(e), "tools" if param == "tool_choice" else param) from None

    def sampling_params(self, req: ParsedRequest, num_prompt: int, sample: int = 0, grammar=None) -> SamplingParams:
        """The engine's parameters for sample ``sample`` (0 .. best_of - 1) of a prompt: sample j
        uses seed + j, so every choice of a seeded request is reproducible."""
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
        if max_tokens == 0:  # echo only (checked when parsing): one token is made and dropped
            max_tokens = 1
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
        seed = req.seed
        if seed is not None and sample:
            seed = seed + sample if seed + sample <= SEED_RANGE[1] else seed - sample
        logprobs = req.logprobs
        if req.best_of > req.n and logprobs is None:
            logprobs = 0  # ranking needs each token's log-probability
        try:
            return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=seed,
                                  max_new_tokens=max_tokens, stop=req.stop, ignore_eos=req.ignore_eos,
                                  logprobs=logprobs, prompt_logprobs=req.logprobs if req.echo else None,
                                  presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                  logit_bias=req.logit_bias, grammar=grammar)
        except ConfigError as e:
            raise bad(str(e)) from None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hispec")
    except PackageNotFoundError:
        return "0"


# ---- responses ------------------------------------------------------------------------------------
class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: text that UTF-8 cannot carry (lone surrogates) goes out \\u-escaped."""

    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error_response(err: APIError) -> JSONResponse:
    return SafeJSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


class EngineStreamingResponse(StreamingResponse):
    """A streaming response that aborts its requests however the response ends (client gone,
    server cancelling its task), even before the body iterator has started."""

    def __init__(self, content, streams: list[RequestStream], engine: AsyncEngine) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams, self._engine = streams, engine

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort_unfinished(self._engine, self._streams)


def abort_unfinished(engine: AsyncEngine, streams: list[RequestStream]) -> None:
    for stream in streams:
        if not stream.finished:
            engine.abort(stream.request_id)


async def merged(choices: list[Choice]):
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

    app = FastAPI(title="hispec", summary="OpenAI-compatible API of hispec (lossless self-speculative decoding)",
                  version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  default_response_class=SafeJSONResponse)
    app.state.hispec = state

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = add_api_models(get_openapi(title=app.title, version=app.version,
                                                            summary=app.summary, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(CountRequests, metrics=state.metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(str(exc.detail), status=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):  # a bug: still answered in OpenAI's shape
        return error_response(APIError(f"internal error: {type(exc).__name__}", status=500, type="server_error"))

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
            body = json.loads(raw) if len(raw) <= THREAD_JSON_BYTES else await asyncio.to_thread(json.loads, raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        check_text(raw, body)
        return body

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
        req = parse_chat(await read_json(request), state.vocab_size)
        check_model(req)
        return await generate(request, req)

    async def generate(request: Request, req: ParsedRequest) -> Response:
        prompts = await asyncio.to_thread(state.prompt_ids, req)  # off the event loop: streams go on
        samples = req.best_of if req.kind == "completion" else req.n
        grammar = None
        if req.json_schema is not None or req.tool_choice not in (None, "none", "auto"):
            grammar = await asyncio.get_running_loop().run_in_executor(None, state.grammar, req)
        jobs = [(i, ids, state.sampling_params(req, len(ids), j, grammar)) for i, ids in enumerate(prompts)
                for j in range(samples)]
        choices = submit(jobs, req.n)
        streams = [c.stream for c in choices]
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            events = chat_events(choices, req, rid, created) if req.kind == "chat" else \
                completion_events(choices, req, rid, created)
            return EngineStreamingResponse(events, streams, state.engine)
        try:
            complete = await collect(request, choices)
        finally:
            abort_unfinished(state.engine, streams)
        if not complete:  # the client went away
            return Response(status_code=499)
        for c in choices:
            if c.stream.finish_reason == "error":
                raise APIError(f"generation failed: {c.stream.error}", status=500, type="server_error")
            if c.stream.finish_reason == "abort":
                raise APIError("the request was cancelled: the server is shutting down", status=503,
                               type="server_error", code="shutting_down")
        returned = best(choices, req.n) if samples > req.n else choices
        body = [chat_choice(c, req) if req.kind == "chat" else completion_choice(c, req) for c in returned]
        return JSONResponse({"id": rid, "object": "chat.completion" if req.kind == "chat" else "text_completion",
                             "created": created, "model": state.served_name, "choices": body,
                             "usage": usage(choices), "hispec_stats": returned[0].stream.stats})

    def submit(jobs: list[tuple[int, list[int], SamplingParams]], n: int) -> list[Choice]:
        """Queue every sequence of a request, or none (a full queue aborts those already queued)."""
        choices: list[Choice] = []
        try:
            for k, (i, ids, params) in enumerate(jobs):
                choices.append(Choice(i, ids, state.engine.submit(ids, params), index=k))
        except (QueueFullError, EngineStoppedError) as e:
            abort_unfinished(state.engine, [c.stream for c in choices])
            if isinstance(e, QueueFullError):
                raise APIError(str(e), status=429, type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(e.retry_after)}) from None
            raise APIError(str(e), status=503, type="server_error", code="shutting_down") from None
        return choices

    def completion_choice(c: Choice, req: ParsedRequest) -> dict:
        text = c.text if req.max_tokens != 0 else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(c.logprobs if req.max_tokens != 0 else [], state.token_text)
        if req.echo:
            text = prompt_text(req, c) + text
            if logprobs is not None:
                logprobs = join_logprobs(echo_logprobs(c.prompt_ids, c.prompt_logprobs or [], state.token_text),
                                         logprobs)
        return {"index": c.index, "text": text, "logprobs": logprobs,
                "finish_reason": "length" if req.max_tokens == 0 else c.stream.finish_reason}

    def chat_choice(c: Choice, req: ParsedRequest) -> dict:
        logprobs = chat_logprobs(c.logprobs, state.token_text) if req.logprobs is not None else None
        message, reason = {"role": "assistant", "content": c.text}, c.stream.finish_reason
        if req.tool_choice not in (None, "none"):
            content, calls = parse_calls(c.text, req.tools)
            if calls:
                message, reason = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": reason}

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

    def chunk(rid: str, created: int, obj: str, choice: dict | None, **extra) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": state.served_name,
                "choices": [] if choice is None else [choice]}
        body.update(extra)
        return sse(body)

    def delta_logprobs(req: ParsedRequest, delta, choice: Choice, echo: bool):
        if req.logprobs is None:
            return None
        generated = delta.logprobs or [] if req.max_tokens != 0 else []
        if req.kind == "chat":
            return chat_logprobs(generated, state.token_text)
        out = completion_logprobs(generated, state.token_text)
        if echo:
            out = join_logprobs(echo_logprobs(choice.prompt_ids, delta.prompt_logprobs or [], state.token_text), out)
        return out

    def prompt_text(req: ParsedRequest, choice: Choice) -> str:
        prompt = req.prompts[choice.prompt_index]
        return prompt if isinstance(prompt, str) else state.decode(prompt)

    async def events(choices: list[Choice], req: ParsedRequest, rid: str, created: int, obj: str, body):
        """Chunks of every choice as they come; ``body(choice, delta)`` is one choice's chunk content."""
        async for choice, delta in merged(choices):
            if delta.error:
                yield sse(APIError(f"generation failed: {delta.error}", status=500, type="server_error").body())
                yield sse("[DONE]")
                return
            echo = req.echo and not choice.echoed  # the first chunk of a choice carries the echoed prompt
            choice.echoed = True
            logprobs = delta_logprobs(req, delta, choice, echo)
            content = body(choice, delta, echo)
            if content is not None or (logprobs and (logprobs.get("tokens") or logprobs.get("content"))):
                empty = {"delta": {"content": ""}} if req.kind == "chat" else {"text": ""}
                yield chunk(rid, created, obj, {"index": choice.index, **(content or empty),
                                                "logprobs": logprobs, "finish_reason": None})
            if delta.finished:
                reason = "tool_calls" if choice.calls is not None and choice.calls.count else delta.finish_reason
                final = {"index": choice.index, **({"delta": {}} if req.kind == "chat" else {"text": ""}),
                         "logprobs": None, "finish_reason": reason}
                yield chunk(rid, created, obj, final, hispec_stats=delta.stats)
        if req.include_usage:
            yield chunk(rid, created, obj, None, usage=usage(choices))
        yield sse("[DONE]")

    async def chat_events(choices: list[Choice], req: ParsedRequest, rid: str, created: int):
        obj = "chat.completion.chunk"
        for c in choices:
            yield chunk(rid, created, obj, {"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None})

        def body(choice: Choice, delta, echo: bool):
            if req.tool_choice in (None, "none"):
                return {"delta": {"content": delta.text}} if delta.text or echo else None
            if choice.calls is None:
                choice.calls = CallStream(req.tools)
            text, calls = choice.calls.feed(delta.text)
            if delta.finished:
                text += choice.calls.flush()
            out = {"content": text} if text else {}
            if calls:
                out["tool_calls"] = calls
            return {"delta": out} if out else None

        async for event in events(choices, req, rid, created, obj, body):
            yield event

    async def completion_events(choices: list[Choice], req: ParsedRequest, rid: str, created: int):
        def body(choice: Choice, delta, echo: bool):
            text = (prompt_text(req, choice) if echo else "") + (delta.text if req.max_tokens != 0 else "")
            return {"text": text} if text or echo else None

        async for event in events(choices, req, rid, created, "text_completion", body):
            yield event

    return app
