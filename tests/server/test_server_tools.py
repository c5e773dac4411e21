"""Function calling (``tools``): parsing requests, rendering (the model's template or the
Hermes-style fallback), parsing tool calls from text (whole and streamed), and forced calls
(``tool_choice`` required / named) lossless in every strategy."""
from __future__ import annotations

import json

import pytest

from hispec.server.errors import APIError
from hispec.server.schema import ChatCompletionRequest, parse
from hispec.server.tools import CallStream, fallback_messages, forced_grammar, parse_calls

from tests.sampling.test_structured_output import char_gen, strict_commits  # noqa: F401  (fixtures)

PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                           "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def chat(**body):
    return parse(ChatCompletionRequest, {"model": "m", "messages": HISTORY, **body}, 100)


def valid_call(call: dict) -> bool:
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        return set(args) == {"city", "days"} and args["city"] in ("Paris", "Rome") and \
            isinstance(args["days"], int) and 1 <= args["days"] <= 9
    return call["function"]["name"] == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"})


def test_requests_with_tools_and_history_parse():
    req = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert req.tool_choice == "get_time" and [t["name"] for t in req.tools] == ["get_weather", "get_time"]
    assert req.messages[1]["tool_calls"][0]["arguments"] == {"city": "Paris", "days": 1}
    assert req.messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}
    assert chat(tools=TOOLS).tool_choice == "auto" and chat().tool_choice is None


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": {"name": "x"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_are_400(body, param):
    with pytest.raises(APIError) as e:
        chat(**body)
    assert e.value.status == 400 and e.value.param == param


def test_fallback_renders_tools_calls_and_results():
    req = chat(tools=TOOLS)
    msgs = fallback_messages(req.messages, req.tools)
    assert msgs[0]["role"] == "system" and '"name": "get_weather"' in msgs[0]["content"]
    assert "<tool_call>" in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content":
                       '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>'}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nsunny, 21 C\n</tool_response>"}
    assert [m["role"] for m in fallback_messages(req.messages, [])] == ["user", "assistant", "user"]


def test_calls_parse_from_text_and_streams():
    tools = chat(tools=TOOLS).tools
    text = 'Let me look. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n' \
           '<tool_call>{"name": "unknown", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", ' \
           '"arguments": {"city": "Rome", "days": 2}}</tool_call>'
    content, calls = parse_calls(text, tools)
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Rome", "days": 2}
    assert content.startswith("Let me look.") and "unknown" in content  # an unknown function stays text
    assert parse_calls("no calls", tools) == ("no calls", [])
    stream = CallStream(tools)
    parts = [stream.feed(text[i:i + 3]) for i in range(0, len(text), 3)]
    streamed = "".join(p[0] for p in parts) + stream.flush()
    assert [c["index"] for p in parts for c in p[1]] == [0, 1]
    assert streamed.replace(" ", "").replace("\n", "") == content.replace(" ", "").replace("\n", "")


def test_forced_call_is_lossless_in_every_strategy(char_gen, strict_commits):
    """tool_choice named / required: the grammar's output is one call that parses and validates,
    and greedy output is ``ar``'s in every strategy."""
    pytest.importorskip("llguidance")
    from hispec.config import SamplingParams
    from hispec.sampling.grammar import Grammar, llguidance_tokenizer
    from tests.sampling.test_structured_output import STRATEGIES

    tools = chat(tools=TOOLS).tools
    tokenizer = llguidance_tokenizer(char_gen.tokenizer, char_gen.model.cfg.vocab_size)
    for choice, temperature in (("required", 0.0), ("get_weather", 1.0)):
        grammar = Grammar(forced_grammar(tools, choice), tokenizer)
        if True:
            outputs = {}
            for name, spec in STRATEGIES.items():
                params = SamplingParams(temperature=temperature, seed=5, max_new_tokens=120, grammar=grammar)
                out = char_gen.generate("Call", params, name.split("-")[0], spec=spec, chat=True)
                assert out.finish_reason == "eos", (name, out.text)
                content, calls = parse_calls(out.text, tools)
                assert content is None and len(calls) == 1 and valid_call(calls[0]), (name, out.text)
                assert choice == "required" or calls[0]["function"]["name"] == choice
                outputs[name] = tuple(out.token_ids)
            if temperature == 0.0:
                assert len(set(outputs.values())) == 1, choice
