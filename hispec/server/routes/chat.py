"""``POST /v1/chat/completions``: messages in (through the model's chat template), a message out;
tool calls, whole or streamed as ``delta.tool_calls``."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..async_engine import Delta
from ..deps import RequestBody, server_state
from ..generation import Format, generate
from ..responses import Choice, chat_logprobs
from ..schema import ChatCompletionRequest, ParsedRequest
from ..state import ServerState
from ..tools import CallStream, parse_calls

router = APIRouter()


class ChatFormat(Format):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    empty = {"delta": {"content": ""}}
    final = {"delta": {}}

    @property
    def tools_on(self) -> bool:
        return self.req.tool_choice not in (None, "none")

    def choice(self, c: Choice) -> dict:
        logprobs = chat_logprobs(c.logprobs, self.state.token_text) if self.req.logprobs is not None else None
        message, reason = {"role": "assistant", "content": c.text}, c.stream.finish_reason
        if self.tools_on:
            content, calls = parse_calls(c.text, self.req.tools)
            if calls:
                message, reason = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def opening(self, choices: list[Choice]) -> list[dict]:
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for c in choices]

    def content(self, choice: Choice, delta: Delta, echo: bool) -> dict | None:
        if not self.tools_on:
            return {"delta": {"content": delta.text}} if delta.text or echo else None
        if choice.calls is None:
            choice.calls = CallStream(self.req.tools)
        text, calls = choice.calls.feed(delta.text)
        if delta.finished:
            text += choice.calls.flush()
        out = {"content": text} if text else {}
        if calls:
            out["tool_calls"] = calls
        return {"delta": out} if out else None

    def logprobs(self, choice: Choice, delta: Delta, echo: bool) -> dict:
        return chat_logprobs(delta.logprobs or [], self.state.token_text)  # chat never has max_tokens 0


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, req: ParsedRequest = Depends(RequestBody(ChatCompletionRequest)),
                           state: ServerState = Depends(server_state)) -> Response:
    return await generate(request, state, ChatFormat(state, req))
