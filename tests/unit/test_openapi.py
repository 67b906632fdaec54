"""/openapi.json describes every route of the app, and is a valid OpenAPI 3.1 document."""
from __future__ import annotations

import asyncio
from pathlib import Path

import jsonschema_rs
import pytest
import requests
import schemathesis

from gateway.anthropic_requests import parse_messages
from gateway.app import build_app
from gateway.infill import completion_infill, parse_infill
from gateway.openapi import openapi_document
from gateway.requests import parse_chat, parse_completion, parse_warm
from gateway.responses_requests import parse_responses
from gateway.state import build_state
from shared.errors import InvalidRequestError
from tests.fakes import FakeDecoder, FakeServer, FakeTemplate, FakeTokenizer, fake_config

# HEAD is GET without a body (aiohttp adds it beside every GET), so it is not documented apart.
IMPLIED = {"HEAD"}


def routes(config) -> set[tuple[str, str]]:
    state = build_state(config, FakeTokenizer(), FakeTemplate(), FakeDecoder, Path("/m/fake.gguf"))
    try:
        app = build_app(state)
        return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method not in IMPLIED}
    finally:
        asyncio.run(state.pool.close())  # its ZeroMQ socket, never bound


def operations(document: dict) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in document["paths"].items() for method in item}


@pytest.mark.parametrize("extra", ["", "api_key = k"])
def test_every_route_is_documented_and_nothing_else(tmp_path, extra):
    config = fake_config(tmp_path, extra)
    assert routes(config) == operations(openapi_document(config))


def test_document_loads_as_openapi_3_1(tmp_path):
    schema = schemathesis.openapi.from_dict(openapi_document(fake_config(tmp_path, "api_key = k")))
    loaded = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert ("POST", "/v1/chat/completions") in loaded and ("POST", "/v1/warm") in loaded and len(loaded) == 21


def test_security_follows_the_config(tmp_path):
    open_doc = openapi_document(fake_config(tmp_path))
    assert "security" not in open_doc and "401" not in open_doc["paths"]["/v1/models"]["get"]["responses"]
    keyed = openapi_document(fake_config(tmp_path, "api_key = k\nmax_n = 3"))
    assert keyed["security"] == [{"bearerAuth": []}]
    assert keyed["paths"]["/health"]["get"]["security"] == []
    assert keyed["components"]["schemas"]["CompletionRequest"]["properties"]["n"]["maximum"] == 3


def test_served_without_a_key(tmp_path):
    server = FakeServer(tmp_path, extra="api_key = k")
    try:
        r = requests.get(server.url + "/openapi.json", timeout=5)
        assert r.status_code == 200 and r.json()["openapi"] == "3.1.0"
    finally:
        server.close()


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body", [
    {"messages": HI}, {"messages": HI, "prompt": None, "model": None}, {"prompt": "x"}, {"prompt": [3, 4.0]},
    {"prompt": "x", "messages": None, "model": "m", "extra": 1},
    {}, {"messages": None, "prompt": None}, {"messages": HI, "prompt": "x"}, {"messages": []}, {"messages": "hi"},
    {"messages": [{"role": "robot", "content": "x"}]}, {"prompt": ""}, {"prompt": []}, {"prompt": ["a"]},
    {"prompt": [[3]]}, {"prompt": [-1]}, {"prompt": [1.5]}, {"prompt": [True]}, {"prompt": "x", "model": 5}, [1],
])
def test_warm_schema_accepts_exactly_what_the_handler_parses(tmp_path, body):
    schemas = openapi_document(fake_config(tmp_path))["components"]
    validator = jsonschema_rs.Draft202012Validator({"$ref": "#/components/schemas/WarmRequest", "components": schemas})
    try:
        parse_warm(body)
        parsed = True
    except InvalidRequestError:
        parsed = False
    assert validator.is_valid(body) == parsed


# ---- the request schemas and the parsers: one table, so neither has a field the other lacks ------

class ReadLog(dict):
    """A body that notes every key the parser looks up (nested objects are plain dicts)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def _parse_completion(body):
    return completion_infill(body, parse_completion(body, max_n=4))


PARSERS = {  # schema → the whole parse of that route's body, as gateway.routes runs it
    "ChatCompletionRequest": lambda body: parse_chat(body, max_n=4),
    "CompletionRequest": _parse_completion,
    "InfillRequest": lambda body: parse_infill(body, max_n=4),
    "WarmRequest": parse_warm,
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# A body that sets every field (a valid value each), so that every branch that reads a field runs.
EVERY_FIELD = {
    "model": "m", "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.1,
    "frequency_penalty": 0.1, "repetition_penalty": 1.1, "logit_bias": {"3": 1}, "seed": 1, "n": 2, "stop": ["x"],
    "stream": True, "stream_options": {"include_usage": True}, "user": "u", "cache_salt": "s", "speculative": False,
    "max_tokens": 3, "response_format": {"type": "json_object"},
}
BODIES = {
    "ChatCompletionRequest": {**EVERY_FIELD, "messages": HI, "tools": [TOOL], "tool_choice": "auto",
                              "parallel_tool_calls": False, "max_completion_tokens": 2, "logprobs": True,
                              "top_logprobs": 2},
    "CompletionRequest": {**EVERY_FIELD, "prompt": "def f():", "logprobs": 2, "suffix": "\n", "echo": False},
    "InfillRequest": {**EVERY_FIELD, "input_prefix": "a", "input_suffix": "b", "prompt": "c", "n_predict": 2,
                      "input_extra": [{"filename": "x.py", "text": "y"}], "logprobs": 1},
    "WarmRequest": {"model": "m", "messages": HI, "cache_salt": "s"},
}

MINIMAL = {"ChatCompletionRequest": {"messages": HI}, "CompletionRequest": {"prompt": "x"}, "InfillRequest": {},
           "WarmRequest": {"prompt": [3]}}


def _documented(schemas: dict, name: str) -> set[str]:
    schema = schemas[name]
    return set(schema["properties"]).union(*(set(branch["properties"]) for branch in schema.get("oneOf", [])))


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_field_a_parser_reads_is_in_the_document(tmp_path, name):
    """gateway.requests reads bodies through the tables gateway.openapi describes; a field read
    around them (a new body.get in a parser, gateway.tools or gateway.structured) fails here."""
    schemas = openapi_document(fake_config(tmp_path))["components"]["schemas"]
    for body in (BODIES[name], MINIMAL[name]):
        logged = ReadLog(body)
        PARSERS[name](logged)
        assert logged.read - _documented(schemas, name) == set()
        assert set(body) <= logged.read  # every field given was looked at


BAD_VALUES = ({"x": 1}, [{"x": 1}], "x", "", 1.5, -1, True, 10 ** 9, [])


def _refused_values_are_refused(name: str, validator, fields: set[str], base: dict, parse) -> None:
    """For every field and every BAD_VALUES value the schema refuses in `base`, the parser refuses it too."""
    assert validator.is_valid(base)
    tried = 0
    for field in sorted(fields):
        for value in BAD_VALUES:
            body = {**base, field: value}
            if validator.is_valid(body):
                continue
            tried += 1
            with pytest.raises(InvalidRequestError):
                parse(body)
                pytest.fail(f"{name}: {field} = {value!r} parsed, but the document refuses it")
    assert tried >= len(fields)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_documented_field_is_checked_by_its_parser(tmp_path, name):
    """A value the document refuses for a field, the parser refuses too (a 400): no field is in the
    document but not read, or read more loosely than it says."""
    schemas = openapi_document(fake_config(tmp_path))["components"]["schemas"]
    validator = jsonschema_rs.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                                    "components": {"schemas": schemas}})
    _refused_values_are_refused(name, validator, _documented(schemas, name), BODIES[name], PARSERS[name])


AGENT_APIS = {  # path → (a valid body, the parse): the Anthropic and Responses bodies are described loosely
    "/v1/messages": ({"max_tokens": 5, "messages": HI}, lambda body: parse_messages(body, max_n=4)),
    "/v1/messages/count_tokens": ({"messages": HI}, lambda body: parse_messages(body, max_n=4, count_only=True)),
    "/v1/responses": ({"input": "hi"}, parse_responses),
}


@pytest.mark.parametrize("path", sorted(AGENT_APIS))
def test_the_agent_apis_documented_fields_are_checked_by_their_parsers(tmp_path, path):
    """gateway.openapi_apis lists a few fields of each body by hand; each is checked as listed."""
    schema = openapi_document(fake_config(tmp_path))["paths"][path]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    base, parse = AGENT_APIS[path]
    _refused_values_are_refused(path, jsonschema_rs.Draft202012Validator(schema), set(schema["properties"]),
                                base, parse)
