"""POST /v1/responses on the real model (SmolLM2), through the official openai client, unchanged:
a response, its stream, a function call round trip, previous_response_id resuming from the
prefix cache, text.format with a schema, and bad inputs."""
from __future__ import annotations

import json
import secrets

import jsonschema
import openai
import pytest

QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}
BLOCK = 16  # [engine] kv_block_size: the prefix cache finds whole blocks


def test_answers(client):
    r = client.responses.create(model="reame", input=QUESTION, temperature=0, max_output_tokens=30)
    assert r.status == "completed" and "Paris" in r.output_text
    assert r.usage.input_tokens > 10 and 0 < r.usage.output_tokens <= 30


def test_stream_equals_non_stream(client):
    kw = {"model": "reame", "input": QUESTION, "instructions": "Be brief.", "temperature": 0, "max_output_tokens": 24}
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == plain.output_text == final.output_text


def test_previous_response_id_resumes_from_the_prefix_cache(client):
    # A first turn no earlier test sent: nothing of it past the template's system prompt is cached.
    first = client.responses.create(model="reame", temperature=0, max_output_tokens=20,
                                    input=f"Remember the code {secrets.token_hex(4)}. What is 2 + 2?")
    second = client.responses.create(model="reame", temperature=0, max_output_tokens=20,
                                     input="And 3 + 3?", previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 2
    # The conversation is rendered as it was: every whole block of the first prompt is found again.
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // BLOCK * BLOCK > first.usage.input_tokens_details.cached_tokens
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["And 3 + 3?"]


def test_a_resumed_turn_finds_the_previous_answer_in_the_cache(client):
    # The previous turn's prompt and its answer were computed by the worker (all but the last
    # token sampled, whose K/V nobody computed); rendered again as the next turn's history they
    # must be the same tokens, so the whole of them comes from the prefix cache, answer included.
    previous = None
    for turn, question in enumerate(("Tell me about Paris in three sentences.", "And about Rome?",
                                      "Which of the two is older?")):
        r = client.responses.create(model="reame", temperature=0, max_output_tokens=40, previous_response_id=previous,
                                    input=f"{question} (conversation {secrets.token_hex(4)})" if turn == 0 else question)
        if previous is not None:
            cached = r.usage.input_tokens_details.cached_tokens
            assert cached >= last.usage.input_tokens + last.usage.output_tokens - 1, (turn, cached, last.usage)
        last, previous = r, r.id


def test_function_call_round_trip(client):
    r = client.responses.create(model="reame", input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                max_output_tokens=60)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    streamed = list(client.responses.create(model="reame", input="What is the weather in Paris?", tools=[WEATHER],
                                            tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                            max_output_tokens=60, stream=True))
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments and streamed[-1].type == "response.completed"
    answer = client.responses.create(model="reame", previous_response_id=r.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=30, input=[{"type": "function_call_output",
                                                                   "call_id": call.call_id, "output": "Sunny, 24 °C"}])
    assert answer.output_text.strip() and answer.usage.input_tokens_details.cached_tokens > 0


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.responses.create(model="reame", input="Name a city and its country as JSON.", temperature=0,
                                max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("kw, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input[0].content[0].type"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
])
def test_bad_inputs(client, kw, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="reame", **kw)
    assert caught.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
