"""OpenAI tools on the real model (SmolLM2, whose template has no tool support: Reame writes the
tool list into the system message and reads back hermes-style calls)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def ask(client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("tools", [WEATHER, TIME])
    kw.setdefault("max_tokens", 80)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="reame", **kw)


def check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_required_call_is_valid(client):
    r = ask(client, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1 and choice.message.content is None
    tool = {"get_weather": WEATHER, "get_time": TIME}[choice.message.tool_calls[0].function.name]
    check_call(choice.message.tool_calls[0], tool)


def test_named_tool_is_called(client):
    r = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
    check_call(r.choices[0].message.tool_calls[0], TIME)


def test_streamed_calls_equal_non_streamed(client):
    kw = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    plain = ask(client, **kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in ask(client, stream=True, **kw):
        for choice in chunk.choices:
            reasons += [choice.finish_reason] if choice.finish_reason else []
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": part.id, "name": "", "arguments": ""})
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
    assert reasons == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in plain]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_results_in_history_reach_the_model(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 23, "sky": "sunny"})},
    ]
    r = ask(client, messages=history, tool_choice="none", max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    assert "23" in r.choices[0].message.content


def test_tool_choice_none_answers_in_text(client):
    r = ask(client, tool_choice="none", max_tokens=12)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "nope"}}]}, "tools[0].function.parameters"),
    ({"tool_choice": {"type": "function", "function": {"name": "unknown"}}}, "tool_choice.function.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_are_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, max_tokens=4, **kw)
    assert caught.value.body["param"] == param, caught.value.body
