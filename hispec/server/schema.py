"""The OpenAI request bodies as pydantic models: the one schema that validates every request and
describes it in ``/openapi.json`` (for schema-driven clients and fuzzers such as schemathesis).

Types are strict (``true`` is not a number, ``"5"`` is not an integer), numbers finite, a null
field is an absent one and unknown fields are ignored, as OpenAI's server does. ``parse``
answers a body the models refuse with a 400 ``APIError`` whose ``param`` names the field
(``messages[0].role``). A valid body becomes a ``ParsedRequest``: what the server generates
from, with defaults applied and messages, prompts and tools normalised.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, WithJsonSchema,
                      WrapValidator, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from .errors import APIError, bad

SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # a 64-bit seed, signed or not (its draws: sampler.sample_key)
MAX_STOP = 16
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's chat limit; vLLM's default max_logprobs)
MAX_N = 64  # choices (n, best_of) per prompt
MAX_PROMPTS = 256
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# ---- errors -------------------------------------------------------------------------------------------
def invalid(message: str, *param: str | int) -> PydanticCustomError:
    """A validation error with this message. ``param`` extends the location of what raised it (a
    model validator names its field); ``{param}`` in the message becomes the whole location."""
    return PydanticCustomError("hispec", "{message}", {"message": message, "param": param})


def one_error(message: str) -> WrapValidator:
    """A field whose failures are one error naming the field (a union would list one per member)."""
    def wrap(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise invalid(message) from None

    return WrapValidator(wrap)


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def api_error(e: ValidationError) -> APIError:
    """The first of pydantic's errors, as OpenAI's 400 naming the field."""
    err = e.errors(include_url=False)[0]
    ctx = err.get("ctx") or {}
    param = _path(tuple(err["loc"]) + tuple(ctx.get("param", ()))) or None
    if err["type"] == "hispec":
        message = ctx["message"].replace("{param}", param or "the body")
    elif err["type"] == "missing":
        message = f"'{param}' is required"
    else:
        msg = err["msg"]
        message = f"'{param}': {msg[:1].lower()}{msg[1:]}, got {_show(err['input'])}"
    return bad(message, param)


# ---- the parts ------------------------------------------------------------------------------------------
_ANNOTATIONS = ("title", "description", "default")


def _document(schema: dict) -> None:
    """Document what validation allows beyond the types: unknown fields (ignored), and a null for
    every optional field (a null field is an absent one)."""
    schema["additionalProperties"] = True
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or {"type": "null"} in prop.get("anyOf", ()):
            continue
        if "anyOf" in prop:
            prop["anyOf"].append({"type": "null"})
            continue
        kept = {k: prop.pop(k) for k in _ANNOTATIONS if k in prop}
        schema["properties"][name] = {"anyOf": [dict(prop), {"type": "null"}], **kept}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", populate_by_name=True,
                              json_schema_extra=_document)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: Optional[str] = None
    schema_: Annotated[Union[dict[str, Any], bool], one_error("{param} must be a JSON schema (an object)")] = \
        Field(True, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = Field(None, description="with type json_schema")

    @model_validator(mode="after")
    def _needs_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise invalid("{param} must be an object with 'name' and 'schema'", "json_schema")
        return self

    def schema_of_output(self) -> dict | bool | None:
        """The JSON schema the output must match: any object for ``json_object``; None for ``text``."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.type == "json_schema" else None


def _logit_bias(value: Any, handler, info: ValidationInfo) -> dict[str, float]:
    try:
        bias = handler(value)
    except ValidationError:
        raise invalid("'logit_bias' must be an object mapping token ids to numbers") from None
    vocab_size = (info.context or {}).get("vocab_size")
    for key, v in bias.items():
        token = _token_id(key)
        if token is None:
            raise invalid(f"'logit_bias' keys must be token ids, got {_show(key)}")
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise invalid(f"'logit_bias' token id {token} is out of range [0, {vocab_size})")
        if not -100 <= v <= 100:
            raise invalid(f"'logit_bias' values must be numbers between -100 and 100, got {_show(v)}")
    return bias


def _token_id(key: str) -> int | None:
    """``"42"`` (or ``"-3"``, refused later as out of range) as an int; None if not a decimal number."""
    try:
        return int(key) if key.strip().lstrip("-").isdigit() else None
    except ValueError:  # digits int() does not read, such as superscripts
        return None


Stop = Annotated[Union[str, list[str]], one_error("'stop' must be a string or a list of strings")]
LogitBias = Annotated[dict[str, float], WrapValidator(_logit_bias)]
Ignored = Annotated[Any, WithJsonSchema({"type": "string"})]


class _Sampling(_Body):
    """What completions and chat completions share."""

    model: str = Field(description="the served model's name (GET /v1/models)")
    stream: bool = False
    stream_options: Optional[StreamOptions] = Field(None, description="only with stream=true")
    temperature: float = Field(1.0, ge=0, le=2, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="extension (vLLM's): 0 or -1 = off")
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt")
    seed: Optional[int] = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Optional[Stop] = Field(None, description=f"a string or up to {MAX_STOP} strings")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: Optional[LogitBias] = Field(None, description="token id -> bias in [-100, 100]")
    ignore_eos: bool = Field(False, description="extension (vLLM's)")
    response_format: Optional[ResponseFormat] = Field(None, description="structured output (JSON)")
    user: Optional[Ignored] = Field(None, description="the end user: with the API key, whose earlier outputs "
                                                       "may serve as free drafts (the server's suffix cache)")
    cache_salt: Optional[str] = Field(None, max_length=256,
                                      description="extension (vLLM's): the request shares cached prompt blocks "
                                                  "(prefix caching) only with requests of the same salt")

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str]) -> str | list[str]:
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise invalid(f"'stop' may hold at most {MAX_STOP} strings, got {len(stop)}")
        return stop

    @model_validator(mode="after")
    def _stream_options_with_stream(self) -> "_Sampling":
        if self.stream_options is not None and not self.stream:
            raise invalid("'stream_options' is only allowed with stream=true", "stream_options")
        return self

    def _fields(self) -> dict:
        """``ParsedRequest``'s fields that both endpoints read the same way."""
        stop = () if self.stop is None else self.stop
        return dict(model=self.model, stream=self.stream,
                    include_usage=self.stream_options is not None and self.stream_options.include_usage,
                    n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                    seed=self.seed, stop=(stop,) if isinstance(stop, str) else tuple(stop),
                    ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty,
                    logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
                    json_schema=self.response_format.schema_of_output() if self.response_format else None,
                    user=_user_of(self.user), cache_salt=self.cache_salt)


def _user_of(user: Any) -> str | None:
    """The ``user`` field as text: a string as sent, any other JSON value in canonical JSON."""
    if user is None or isinstance(user, str):
        return user
    return json.dumps(user, sort_keys=True, separators=(",", ":"))


# ---- the parsed request ----------------------------------------------------------------------------------
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
    best_of: int = 1  # sequences generated per prompt, the n most likely returned (completions' best_of; chat: n)
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
    user: str | None = None  # OpenAI's end-user id, as text (None: not sent): scopes the suffix cache
    cache_salt: str | None = None  # vLLM's: scopes the prefix cache (with the API key under --prefix-cache-per-key)


# ---- completions ------------------------------------------------------------------------------------------
Prompt = Annotated[Union[str, list[int], list[Union[str, list[int]]]],
                   one_error("'prompt' must be a string, a list of token ids, or a non-empty list of these")]


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    """The prompts of ``prompt``: one text, one list of token ids, or a list of these."""
    one = isinstance(prompt, str) or (bool(prompt) and all(isinstance(t, int) for t in prompt))
    return [prompt] if one else prompt


class CompletionRequest(_Sampling):
    prompt: Prompt = Field(description=f"text, token ids, or a list of up to {MAX_PROMPTS} of either")
    max_tokens: Optional[int] = Field(None, ge=0, description="at least 1 (0 only with echo); default 16")
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N, description="at least n; not with stream")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="alternatives per token")
    echo: bool = Field(False, description="return the prompt (and its logprobs) too")
    suffix: Optional[str] = Field(None, description="not supported: a non-empty suffix is refused with 400")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: str | list, info: ValidationInfo) -> str | list:
        prompts = _prompt_list(prompt)
        if not prompts:
            raise invalid("'prompt' must be a string, a list of token ids, or a non-empty list of these")
        if len(prompts) > MAX_PROMPTS:
            raise invalid(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        vocab_size = (info.context or {}).get("vocab_size")
        for i, p in enumerate(prompts):
            name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not p:
                raise invalid(f"'{name}' must be a non-empty string or a non-empty list of token ids")
            out_of_range = [t for t in p if vocab_size is not None and not 0 <= t < vocab_size] \
                if isinstance(p, list) else []
            if out_of_range:
                raise invalid(f"'{name}' token id {out_of_range[0]} is out of range [0, {vocab_size})")
        return prompt

    @model_validator(mode="after")
    def _consistent(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:  # echo alone scores the prompt
            raise invalid("'max_tokens' must be at least 1 (0 only with echo), got 0", "max_tokens")
        if self.best_of is not None and self.best_of < self.n:
            raise invalid(f"'best_of' must be between n ({self.n}) and {MAX_N}, got {self.best_of}", "best_of")
        if self.best_of is not None and self.stream and self.best_of > self.n:
            raise invalid("'best_of' greater than 'n' cannot be streamed", "best_of")
        if self.suffix:
            raise invalid("'suffix' is not supported: the served models have no fill-in-the-middle format", "suffix")
        return self

    def parsed(self) -> ParsedRequest:
        return ParsedRequest(kind="completion", max_tokens=self.max_tokens, **self._fields(),
                             best_of=self.best_of or self.n, logprobs=self.logprobs, echo=self.echo,
                             prompts=list(_prompt_list(self.prompt)))


# ---- chat completions -----------------------------------------------------------------------------------------
class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: Annotated[Any, WithJsonSchema({"type": "string", "description": "a JSON object"})] = "{}"

    @field_validator("arguments")
    @classmethod
    def _decoded(cls, arguments: Any) -> Any:
        try:
            return json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise invalid("{param} must be a JSON string") from None


class ToolCall(_Body):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


Content = Annotated[Union[str, list[TextPart]],
                    one_error("{param} must be a string or a list of text parts ({'type': 'text', 'text': ...})")]


class ChatMessage(_Body):
    role: Literal[CHAT_ROLES]
    content: Optional[Content] = Field(None, validate_default=True, description="null only for the assistant")
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="assistant: the calls it made")
    tool_call_id: Optional[str] = Field(None, validate_default=True,
                                        description="tool: the call this message answers")

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise invalid("{param} must be a string or a list of text parts")
        return content

    @field_validator("tool_call_id")
    @classmethod
    def _id_of_tool_message(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        if call_id is None and info.data.get("role") == "tool":
            raise invalid("{param} is required (a string) in a tool message")
        return call_id

    def normalised(self) -> dict:
        """``{"role", "tool_calls"?, "tool_call_id"?, "content": str}`` (developer -> system;
        tool calls as ``{"id", "name", "arguments": object}``)."""
        out: dict = {"role": "system" if self.role == "developer" else self.role}
        if self.role == "assistant" and self.tool_calls:
            out["tool_calls"] = [{"id": c.id or "", "name": c.function.name, "arguments": c.function.arguments}
                                 for c in self.tool_calls]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        content = self.content or ""
        out["content"] = content if isinstance(content, str) else "".join(p.text for p in content)
        return out


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="1-64 letters, digits, '_', '.' or '-'")
    description: Optional[str] = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                       description="a JSON schema of the arguments")


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef

    @model_validator(mode="before")
    @classmethod
    def _is_function(cls, tool: Any) -> Any:
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)):
            raise invalid("{param} must be {'type': 'function', 'function': {'name': ...}}")
        return tool


class NamedFunction(_Body):
    name: str


class ToolChoiceFunction(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[Union[Literal["none", "auto", "required"], ToolChoiceFunction],
                       one_error("'tool_choice' must be 'none', 'auto', 'required' or "
                                 "{'type': 'function', 'function': {'name': ...}}")]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, description="the older name of max_completion_tokens")
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs=true")
    tools: Optional[list[Tool]] = Field(None, description="function tools {'type': 'function', 'function': {...}}")
    tool_choice: Optional[ToolChoice] = Field(
        None, description="'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}; needs tools")
    functions: Optional[list[Any]] = Field(None, description="legacy function calling: not supported, use tools")

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[Tool]) -> list[Tool]:
        seen = set()
        for i, t in enumerate(tools):
            if t.function.name in seen:
                raise invalid(f"tools[{i}].function.name '{t.function.name}' is defined twice", i, "function", "name")
            seen.add(t.function.name)
        return tools

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if self.functions:
            raise invalid("'functions' (legacy function calling) is not supported: use 'tools'", "functions")
        choice, names = self.tool_choice, {t.function.name for t in self.tools or []}
        if not names and choice not in (None, "none"):
            raise invalid("'tool_choice' needs 'tools'", "tool_choice")
        if isinstance(choice, ToolChoiceFunction) and choice.function.name not in names:
            raise invalid(f"tool_choice names function {choice.function.name!r}, which is not in 'tools'",
                          "tool_choice")
        if names and self.forced_tool() and self.response_format is not None and \
                self.response_format.schema_of_output() is not None:
            raise invalid("'response_format' and a forced 'tool_choice' cannot be combined", "tool_choice")
        return self

    def forced_tool(self) -> bool:
        return self.tool_choice not in (None, "none", "auto")

    def parsed(self) -> ParsedRequest:
        max_name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        tools = [{"name": t.function.name, **({"description": t.function.description} if t.function.description
                                               else {}), "parameters": t.function.parameters}
                 for t in self.tools or []]
        choice = self.tool_choice
        if tools:
            choice = "auto" if choice is None else choice if isinstance(choice, str) else choice.function.name
        else:
            choice = None
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return ParsedRequest(kind="chat", max_tokens=getattr(self, max_name), max_tokens_param=max_name,
                             **self._fields(), best_of=self.n, logprobs=logprobs,
                             messages=[m.normalised() for m in self.messages], tools=tools, tool_choice=choice)


# ---- parsing ------------------------------------------------------------------------------------------------
def parse(model: type[CompletionRequest] | type[ChatCompletionRequest], body: Any, vocab_size: int
          ) -> ParsedRequest:
    """A request body (parsed JSON) checked against ``model``; raises a 400 ``APIError``."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body, context={"vocab_size": vocab_size}).parsed()
    except ValidationError as e:
        raise api_error(e) from None
