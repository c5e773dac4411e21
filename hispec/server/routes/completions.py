"""``POST /v1/completions``: text (or token ids) in, text out; logprobs, echo, best_of."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..async_engine import Delta
from ..deps import RequestBody, server_state
from ..generation import Format, generate
from ..responses import Choice, completion_logprobs, echo_logprobs, join_logprobs
from ..schema import CompletionRequest, ParsedRequest
from ..state import ServerState

router = APIRouter()


class CompletionFormat(Format):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"
    empty = final = {"text": ""}

    def choice(self, c: Choice) -> dict:
        req, token_text = self.req, self.state.token_text
        scored_only = req.max_tokens == 0  # echo alone: the one token made is dropped
        text = "" if scored_only else c.text
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs([] if scored_only else c.logprobs, token_text)
        if req.echo:
            text = self.prompt_text(c) + text
            if logprobs is not None:
                logprobs = join_logprobs(echo_logprobs(c.prompt_ids, c.prompt_logprobs or [], token_text), logprobs)
        return {"index": c.index, "text": text, "logprobs": logprobs,
                "finish_reason": "length" if scored_only else c.stream.finish_reason}

    def content(self, choice: Choice, delta: Delta, echo: bool) -> dict | None:
        text = (self.prompt_text(choice) if echo else "") + (delta.text if self.req.max_tokens != 0 else "")
        return {"text": text} if text or echo else None

    def logprobs(self, choice: Choice, delta: Delta, echo: bool) -> dict:
        token_text = self.state.token_text
        out = completion_logprobs(delta.logprobs or [] if self.req.max_tokens != 0 else [], token_text)
        if echo:
            out = join_logprobs(echo_logprobs(choice.prompt_ids, delta.prompt_logprobs or [], token_text), out)
        return out

    def prompt_text(self, choice: Choice) -> str:
        prompt = self.req.prompts[choice.prompt_index]
        return prompt if isinstance(prompt, str) else self.state.decode(prompt)


@router.post("/v1/completions")
async def completions(request: Request, req: ParsedRequest = Depends(RequestBody(CompletionRequest)),
                      state: ServerState = Depends(server_state)) -> Response:
    return await generate(request, state, CompletionFormat(state, req))
