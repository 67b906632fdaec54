"""gateway.structured: response_format / grammar parsing (errors name the field) and the compile
cache (one compile per distinct constraint, refusals remembered too, a slow compile refused)."""
from __future__ import annotations

import asyncio
import time

import pytest

from gateway import structured
from gateway.structured import Constraint, GrammarCache, constraint_of
from shared.errors import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_text_and_nothing_are_free():
    assert constraint_of({}) is None
    assert constraint_of({"response_format": {"type": "text"}}) is None


def test_schema_key_order_does_not_change_the_constraint():
    first = constraint_of({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    reordered = dict(reversed(list(SCHEMA.items())))
    second = constraint_of({"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": reordered}}})
    assert first == second and first.kind == "json_schema"


def test_grammar_forms():
    assert constraint_of({"grammar": 'start: "a"'}) == Constraint("lark", 'start: "a"', "grammar")
    assert constraint_of({"grammar": {"type": "regex", "value": "[0-9]+"}}) == Constraint("regex", "[0-9]+", "grammar")


@pytest.mark.parametrize("body, param", [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"grammar": "   "}, "grammar"),
    ({"grammar": "x" * (structured.MAX_GRAMMAR_CHARS + 1)}, "grammar"),
])
def test_bad_fields_are_named(body, param):
    with pytest.raises(InvalidRequestError) as caught:
        constraint_of(body)
    assert caught.value.param == param


def test_cache_compiles_once_and_remembers_refusals():
    cache = GrammarCache()
    good = constraint_of({"response_format": {"type": "json_object"}})
    bad = Constraint("json_schema", '{"type": "frobnicate"}', "response_format.json_schema.schema")

    async def run():
        first = await cache.compile(good)
        assert await cache.compile(good) == first
        for _ in range(2):
            with pytest.raises(InvalidRequestError) as caught:
                await cache.compile(bad)
            assert caught.value.param == "response_format.json_schema.schema"
    asyncio.run(run())
    assert cache.hits == 2


def test_a_compile_over_the_time_limit_is_refused(monkeypatch):
    monkeypatch.setattr(structured, "_compile", lambda constraint: time.sleep(0.5) or "never used")
    cache = GrammarCache(timeout=0.05)
    with pytest.raises(InvalidRequestError) as caught:
        asyncio.run(cache.compile(Constraint("regex", "a+", "grammar")))
    assert caught.value.code == "grammar_too_complex" and caught.value.param == "grammar"
