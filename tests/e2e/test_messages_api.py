"""POST /v1/messages and /v1/messages/count_tokens on the real model (SmolLM2), through the
official anthropic client, unchanged: a reply, its stream, a tool round trip, count_tokens, and
bad inputs in Anthropic's error envelope."""
from __future__ import annotations

import anthropic
import jsonschema
import pytest

from tests.e2e.servers import API_KEY

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the client has no temperature argument (any more): it goes in the body
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


def test_answers(claude):
    r = claude.messages.create(model="reame", max_tokens=30, messages=QUESTION, extra_body=GREEDY)
    assert r.content[0].type == "text" and "Paris" in r.content[0].text
    assert r.stop_reason == "end_turn" and 0 < r.usage.output_tokens <= 30
    total = r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert claude.messages.count_tokens(model="reame", messages=QUESTION).input_tokens == total


def test_stream_equals_non_stream(claude):
    kw = {"model": "reame", "max_tokens": 24, "messages": QUESTION, "system": [{"type": "text", "text": "Be brief."}],
          "extra_body": GREEDY}
    plain = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    # The same prompt again: its prefix came from the cache, and the stream's final usage says so.
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens


def test_stop_sequence(claude):
    r = claude.messages.create(model="reame", max_tokens=30, messages=QUESTION, stop_sequences=["Paris"],
                               extra_body=GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "Paris" and "Paris" not in r.content[0].text


def test_tool_round_trip(claude):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = {"model": "reame", "max_tokens": 60, "tools": [WEATHER], "extra_body": GREEDY,
          "tool_choice": {"type": "tool", "name": "get_weather"}}
    r = claude.messages.create(messages=ask, **kw)
    assert r.stop_reason == "tool_use"
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with claude.messages.stream(messages=ask, **kw) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(call.name, call.input)]
    answer = claude.messages.create(model="reame", max_tokens=30, tools=[WEATHER], extra_body=GREEDY, messages=[
        *ask, {"role": "assistant", "content": r.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 °C"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text.strip()


@pytest.mark.parametrize("kw, error", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, anthropic.BadRequestError),
    ({"messages": []}, anthropic.BadRequestError),
    ({"messages": QUESTION, "model": "claude-sonnet"}, anthropic.NotFoundError),
])
def test_bad_inputs(claude, kw, error):
    kw = {"model": "reame", "max_tokens": 8, **kw}
    with pytest.raises(error) as caught:
        claude.messages.create(**kw)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["message"]
