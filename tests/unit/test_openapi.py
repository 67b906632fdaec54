"""/openapi.json describes every route of the app, and is a valid OpenAPI 3.1 document."""
from __future__ import annotations

import asyncio
from pathlib import Path

import jsonschema_rs
import pytest
import requests
import schemathesis

from gateway.app import build_app
from gateway.openapi import openapi_document
from gateway.requests import parse_warm
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
