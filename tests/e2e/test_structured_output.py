"""response_format and the grammar extension on the real model: the output follows the constraint,
ends when the grammar does, and works with streaming, logprobs, stop strings, n and batching."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import requests

from tests.e2e.servers import auth

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person called Ann, aged 31, as JSON."}]


def schema_format(schema: dict, name: str = "person") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def ask(client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="reame", **kw)


def test_json_schema_output_validates_and_stops(client):
    r = ask(client, response_format=schema_format(PERSON))
    choice = r.choices[0]
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.finish_reason == "stop"  # the grammar ended the request, not max_tokens


def test_json_object_is_an_object(client):
    r = ask(client, response_format={"type": "json_object"}, max_tokens=64, temperature=0.7, seed=3)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a free object may run past max_tokens; what came is still an object's beginning
        assert r.choices[0].message.content.startswith("{")


def test_stream_equals_non_stream(client):
    plain = ask(client, response_format=schema_format(PERSON)).choices[0].message.content
    chunks = list(ask(client, response_format=schema_format(PERSON), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_logprobs_and_n_with_a_schema(client):
    r = ask(client, response_format=schema_format(PERSON), logprobs=True, top_logprobs=2, n=2,
            temperature=0.8, seed=11)
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        entries = choice.logprobs.content
        assert entries and all(len(e.top_logprobs) == 2 for e in entries)
        assert "".join(e.token for e in entries) == choice.message.content


def test_stop_string_still_cuts(client):
    r = ask(client, response_format=schema_format(PERSON), stop=['"age"'])
    assert r.choices[0].finish_reason == "stop"
    assert '"age"' not in r.choices[0].message.content and r.choices[0].message.content.startswith("{")


def test_regex_grammar_on_completions(server):
    body = {"prompt": "The year the Berlin wall fell:", "max_tokens": 12, "temperature": 0,
            "grammar": {"type": "regex", "value": r" ?[0-9]{4}\."}}
    r = requests.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=60).json()
    assert re.fullmatch(r" ?[0-9]{4}\.", r["choices"][0]["text"]), r
    assert r["choices"][0]["finish_reason"] == "stop"


def test_lark_grammar_on_chat(client):
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    r = ask(client, messages=[{"role": "user", "content": "Is Paris in France?"}], extra_body={"grammar": lark})
    assert r.choices[0].message.content in ("The answer is yes.", "The answer is no.")
    assert r.choices[0].finish_reason == "stop"


def test_constrained_and_free_rows_in_one_batch_equal_each_alone(client):
    free = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16}
    constrained = {"response_format": schema_format(PERSON)}
    alone = [ask(client, **free).choices[0].message.content, ask(client, **constrained).choices[0].message.content]
    with ThreadPoolExecutor(4) as pool:
        batched = list(pool.map(lambda kw: ask(client, **kw).choices[0].message.content,
                                [free, constrained, free, constrained]))
    assert batched == alone * 2


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format.json_schema.name"),
    ({"response_format": schema_format({"type": "frobnicate"})}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"type": "string", "pattern": "(unclosed"})},
     "response_format.json_schema.schema"),
    ({"response_format": schema_format({"not": {"type": "string"}})}, "response_format.json_schema.schema"),
    ({"response_format": schema_format(["not", "an", "object"])}, "response_format.json_schema.schema"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
    ({"grammar": {"type": "regex", "value": "(a"}}, "grammar"),
    ({"grammar": {"type": "ebnf", "value": "x"}}, "grammar.type"),
    ({"grammar": "start: \"a\"", "response_format": {"type": "json_object"}}, "grammar"),
])
def test_bad_constraints_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, max_tokens=4, extra_body=body)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param, caught.value.body
