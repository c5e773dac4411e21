"""Function calling (OpenAI's ``tools``): prompt rendering, output parsing and the grammar that
forces a call (the request's ``tools`` and ``tool_choice`` are checked by ``schema``).

Format. Tool calls are written Hermes-style, the format of Qwen2.5, Hermes and many
fine-tunes::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

A chat template that knows tools (it mentions ``tools``) renders the definitions and the
history itself (transformers' ``apply_chat_template(tools=...)``). A template that does not
(SmolLM2-135M-Instruct's) gets the documented fallback: a system message listing the tools as
JSON and asking for the format above; assistant tool calls in the history are written in that
format and tool results become user messages ``<tool_response>...</tool_response>``.

Forcing. ``tool_choice`` "required" or a named function constrains the output with an
llguidance grammar: ``<tool_call>`` + a JSON object whose ``name`` is one of the allowed
functions and whose ``arguments`` match that function's ``parameters`` schema +
``</tool_call>``, laid out as ``json.dumps`` writes it. It goes through the same masking as
``response_format``, so every strategy stays lossless with respect to the constrained distribution.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)

FALLBACK_PROMPT = ("You may call one or more functions to assist with the user query. The functions are "
                   "listed as JSON inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
                   "For each function call, answer with a JSON object holding the function name and its "
                   "arguments inside <tool_call></tool_call> tags:\n"
                   '<tool_call>{{"name": <function-name>, "arguments": <args-json-object>}}</tool_call>')


# ---- rendering ----------------------------------------------------------------------------------------
def template_knows_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "tool_use" in template or any("tools" in t for t in template.values())
    return isinstance(template, str) and "tools" in template


def call_text(name: str, arguments: Any) -> str:
    return f"{OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{CLOSE}"


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages in the shape transformers' tool-aware templates read (``tool_calls`` with
    ``function.arguments`` as an object, ``tool`` messages with ``tool_call_id``)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def fallback_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The fallback for templates without tools: plain system/user/assistant messages."""
    out = []
    if tools:
        listing = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
        system = FALLBACK_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            system = messages[0]["content"] + "\n\n" + system
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(call_text(c["name"], c["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


# ---- output -------------------------------------------------------------------------------------------
def parse_calls(text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """The text outside the calls (None if empty) and OpenAI ``tool_calls`` (each call whose JSON
    has a known ``name``; a malformed call stays in the text)."""
    known = {t["name"] for t in tools}
    calls, kept, last = [], [], 0
    for match in _CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(obj, dict) and obj.get("name") in known):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
        kept.append(text[last:match.start()])
        last = match.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def forced_grammar(tools: list[dict], choice: str) -> str:
    """An llguidance Lark grammar for one call: to ``choice`` (a function name) or, for
    "required", to any of ``tools``."""
    allowed = [t for t in tools if choice == "required" or t["name"] == choice]
    variants = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in allowed]
    schema = dict(variants[0]) if len(variants) == 1 else {"anyOf": variants}
    # one layout, the one the prompt shows (json.dumps's): a free run of whitespace is never forced
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return f'start: "{OPEN}" call "{CLOSE}"\ncall: %json {json.dumps(schema)}\n'


class CallStream:
    """Streaming: splits one choice's text into content and whole tool calls. Text that may be the
    start of ``<tool_call>`` is held back; a call is emitted once its ``</tool_call>`` arrives."""

    def __init__(self, tools: list[dict]) -> None:
        self.tools, self.buffer, self.count = tools, "", 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content that can be sent now and the completed calls (``delta.tool_calls`` items)."""
        self.buffer += text
        content, calls = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = next((k for k in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                             if OPEN.startswith(self.buffer[-k:])), 0)
                cut = len(self.buffer) - keep
                content, self.buffer = content + self.buffer[:cut], self.buffer[cut:]
                return content, calls
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                content, self.buffer = content + self.buffer[:start], self.buffer[start:]
                return content, calls
            content += self.buffer[:start]
            block, self.buffer = self.buffer[start:end + len(CLOSE)], self.buffer[end + len(CLOSE):]
            _, parsed = parse_calls(block, self.tools)
            if not parsed:
                content += block
            for call in parsed:
                calls.append({"index": self.count, **call})
                self.count += 1

    def flush(self) -> str:
        """What is left at the end (an unfinished call stays text)."""
        text, self.buffer = self.buffer, ""
        return text
