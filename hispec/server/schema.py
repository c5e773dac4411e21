"""The OpenAPI description of the API (``GET /openapi.json``): typed request bodies for
schema-driven clients and fuzzers (schemathesis), and OpenAI's error shape.

The models describe what ``protocol`` accepts; ``protocol`` stays the one validator (its
strict checks and OpenAI-style messages, naming the ``param``), so every body the schema
allows, and every body it does not, is answered by the same code.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .protocol import MAX_LOGPROBS, MAX_N, MAX_PROMPTS, MAX_STOP

Stop = Optional[Union[str, list[str]]]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI's server does


class StreamOptions(_Open):
    include_usage: Optional[bool] = None


class _Sampling(_Open):
    model: str = Field(description="the served model's name (GET /v1/models)")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = Field(None, description="only with stream=true")
    temperature: Optional[float] = Field(1.0, ge=0, le=2, description="0 = greedy")
    top_p: Optional[float] = Field(1.0, gt=0, le=1)
    top_k: Optional[int] = Field(0, ge=-1, description="extension (vLLM's): 0 or -1 = off")
    n: Optional[int] = Field(1, ge=1, le=MAX_N)
    seed: Optional[int] = Field(None, ge=-(2 ** 63), le=2 ** 64 - 1)
    stop: Stop = Field(None, description=f"a string or up to {MAX_STOP} strings")
    max_tokens: Optional[int] = Field(None, ge=0, description="at least 1 (0 only with echo)")
    presence_penalty: Optional[float] = Field(0.0, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(0.0, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = Field(None, description="token id -> bias in [-100, 100]")
    ignore_eos: Optional[bool] = Field(False, description="extension (vLLM's)")
    user: Optional[str] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        description=f"text, token ids, or a list of up to {MAX_PROMPTS} of either")
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N, description="at least n; not with stream")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="alternatives per token")
    echo: Optional[bool] = Field(False, description="return the prompt (and its logprobs) too")
    suffix: Optional[str] = Field(None, description="not supported: a non-empty suffix is refused with 400")
    response_format: Optional["ResponseFormat"] = Field(None, description="extension (vLLM's): structured output")


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = Field(None, description="null only for the assistant")
    name: Optional[str] = None
    tool_calls: Optional[list[Any]] = Field(None, description="assistant: the calls it made")
    tool_call_id: Optional[str] = Field(None, description="tool: the call this message answers")


class JsonSchemaFormat(_Open):
    name: Optional[str] = None
    schema_: Optional[Union[dict[str, Any], bool]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: Optional[JsonSchemaFormat] = Field(None, description="with type json_schema")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs=true")
    response_format: Optional[ResponseFormat] = Field(None, description="structured output (JSON)")
    tools: Optional[list[Any]] = Field(None, description="function tools {'type': 'function', 'function': {...}}")
    tool_choice: Optional[Union[str, dict[str, Any]]] = Field(
        None, description="'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody


REQUESTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
ERRORS = {"400": "invalid request", "401": "missing or wrong API key", "413": "body too large",
          "429": "the queue is full", "500": "generation failed", "503": "shutting down"}


def add_api_models(schema: dict) -> dict:
    """Put the request bodies and the error responses into FastAPI's generated ``schema``."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})

    def ref(model: type[BaseModel]) -> dict:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(js.pop("$defs", {}))
        components[model.__name__] = js
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = {"content": {"application/json": {"schema": ref(ErrorResponse)}}}
    for path, model in REQUESTS.items():
        op = schema["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(model)}}}
        op["responses"] = {"200": {"description": "the completion (JSON), or server-sent events with stream=true",
                                   "content": {"application/json": {"schema": {"type": "object"}},
                                               "text/event-stream": {"schema": {"type": "string"}}}},
                           **{code: {"description": text, **error} for code, text in ERRORS.items()}}
    return schema
