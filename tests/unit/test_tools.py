"""gateway.tools: the call parser per family (whole and streamed), the forced-call grammar, and the
prompt a template without tool support gets."""
from __future__ import annotations

import json

import llguidance
import pytest

from gateway.tools import ToolCallParser, ToolRequest, Tool, call_constraint, parse_tools, prompt_messages
from shared.errors import InvalidRequestError

NAMES = frozenset({"get_weather", "get_time"})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parse_whole(text: str, family: str = "hermes"):
    parser = ToolCallParser(family, NAMES)
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    return content + rest, [(c.name, json.loads(c.arguments)) for c in calls + more]


def parse_streamed(text: str, family: str = "hermes", step: int = 3):
    parser = ToolCallParser(family, NAMES)
    content, calls = "", []
    for i in range(0, len(text), step):
        c, found = parser.feed(text[i:i + step])
        content += c
        calls += found
    rest, more = parser.finish()
    return content + rest, [(c.name, json.loads(c.arguments)) for c in calls + more]


@pytest.mark.parametrize("parse", [parse_whole, parse_streamed])
@pytest.mark.parametrize("text, content, calls", [
    ("Hello there.", "Hello there.", []),
    (CALL, "", [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + CALL + "\n" + CALL.replace("weather", "time"), "Let me check.\n\n",
     [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),  # cut before the close tag
    ('{"name": "get_time", "arguments": {"city": "Oslo"}}', "", [("get_time", {"city": "Oslo"})]),  # generic JSON
    ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]', "",
     [("get_time", {}), ("get_weather", {})]),
    ('{"name": "unknown_tool", "arguments": {}}', '{"name": "unknown_tool", "arguments": {}}', []),
    ("a < b <tool", "a < b <tool", []),  # a partial tag that never completes is content
])
def test_hermes_and_generic_replies(parse, text, content, calls):
    assert parse(text) == (content, calls)


def test_llama3_json_call():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert parse_streamed(text, "llama3") == ("", [("get_weather", {"city": "Rome"})])


def test_content_is_released_before_the_reply_ends():
    parser = ToolCallParser("hermes", NAMES)
    assert parser.feed("The weather is fine <tool") == ("The weather is fine ", [])


def tool_request(choice: str, parallel: bool = True) -> ToolRequest:
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    return ToolRequest((Tool("get_weather", "", params), Tool("get_time", "", params)), choice, parallel)


def test_forced_call_grammar_builds_and_auto_has_none():
    assert call_constraint(tool_request("auto"), "hermes") is None
    for request in (tool_request("required"), tool_request("get_time"), tool_request("required", False)):
        for family in ("hermes", "llama3"):
            constraint = call_constraint(request, family)
            grammar = llguidance.LLMatcher.grammar_from_lark(constraint.source)
            assert llguidance.LLMatcher.validate_grammar(grammar) == ""


def test_prompt_without_template_support_lists_tools_and_writes_history():
    messages = (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "23 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
    )
    out = prompt_messages(messages, tool_request("auto"), native=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == CALL
    assert out[3]["content"] == "<tool_response>\n23 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"


def test_native_template_gets_arguments_as_objects():
    messages = ({"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},)
    assert prompt_messages(messages, None, native=True)[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


@pytest.mark.parametrize("body, param", [
    ({"tools": {}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]},
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a", "description": 3}}]}, "tools[0].function.description"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_fields(body, param):
    with pytest.raises(InvalidRequestError) as caught:
        parse_tools(body)
    assert caught.value.param == param


@pytest.mark.parametrize("parse", [parse_whole, parse_streamed])
def test_a_call_to_a_tool_not_offered_is_not_a_call(parse):
    """The model may name any function; only the offered ones come back as calls, the rest as text."""
    other = CALL.replace("get_weather", "delete_files")
    assert parse(other) == (other, [])
    assert parse("Ok.\n" + other + "\n" + CALL) == ("Ok.\n" + other + "\n", [("get_weather", {"city": "Paris"})])
    assert parse(other.removesuffix("</tool_call>")) == (other.removesuffix("</tool_call>"), [])
