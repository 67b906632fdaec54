"""gateway.structured: response_format / grammar parsing (errors name the field) and the compile
cache (one compile per distinct constraint, refusals remembered too, a slow compile refused and
its process killed, a timeout never remembered for another tenant, a share of the compiling
processes per tenant)."""
from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest

from gateway import structured
from gateway.errors import OverloadedError
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


def compile_for_test(constraint: Constraint) -> str:
    """A stand-in compiler, run in the pool's processes: "spin" burns CPU until killed, "spin N"
    for N CPU seconds, "sleep N" waits N s without CPU; anything else compiles at once."""
    word, seconds, *_ = constraint.source.split(" ") + [""]
    if word == "spin":
        until = time.process_time() + (float(seconds) if seconds else 3600.0)
        while time.process_time() < until:
            pass
    elif word == "sleep":
        time.sleep(float(seconds))
    return f"grammar of {constraint.source}"


def regex(source: str) -> Constraint:
    return Constraint("regex", source, "grammar")


@pytest.fixture
def make_cache():
    caches = []

    def make(**options) -> GrammarCache:
        cache = GrammarCache(compiler=compile_for_test, **options)
        caches.append(cache)
        return cache
    yield make
    for cache in caches:
        cache.pool.close()


def live_compilers() -> list:
    """The pool's processes still running (a killed one is gone within moments)."""
    deadline = time.monotonic() + 10
    while (alive := [p for p in multiprocessing.active_children() if p.name == "reame-grammar"]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_a_compile_over_its_cpu_limit_is_refused_and_its_process_killed(make_cache):
    cache = make_cache(timeout=0.3, processes=1)

    async def run():
        with pytest.raises(InvalidRequestError) as caught:
            await cache.compile(regex("spin"), "mallory")
        assert caught.value.code == "grammar_too_complex" and caught.value.param == "grammar"
        assert "CPU" in caught.value.message
        assert cache.pool.killed == 1
        assert live_compilers() == []  # not left burning a CPU until llguidance's fuel runs out
        assert await cache.compile(regex("a+"), "mallory") == "grammar of a+"  # a new process
    asyncio.run(run())


def test_a_timeout_is_never_remembered_for_another_tenant(make_cache):
    """Issue 41, item 4: a refusal for time was cached for every tenant."""
    cache = make_cache(timeout=0.3)

    async def run():
        for _ in range(2):
            with pytest.raises(InvalidRequestError):
                await cache.compile(regex("spin"), "mallory")
        assert cache.pool.killed == 1  # mallory's retry is refused without compiling again
        with pytest.raises(InvalidRequestError):
            await cache.compile(regex("spin"), "alice")
        assert cache.pool.killed == 2  # alice's compile was her own
    asyncio.run(run())


def test_slow_compiles_of_one_tenant_leave_room_for_the_others(make_cache):
    """Issue 41, item 4: seven slow schemas filled the compile threads, and a small valid schema
    waited in their queue until it was refused as "did not compile within 2 s", for everyone. Here
    mallory's compiles take 0.5 s of CPU each, 1.5 s in all against a 1 s limit per compile; alice's
    small schema, sent last, runs beside them (the limit counts its compile, not its wait)."""
    cache = make_cache(timeout=1.0, processes=2)

    async def run():
        async def alice():
            await asyncio.sleep(0.2)  # after mallory's are under way
            return await cache.compile(regex("[0-9]+"), "alice")
        *slow, small = await asyncio.gather(*(cache.compile(regex(f"spin 0.5 {i}"), "mallory") for i in range(3)),
                                            alice(), return_exceptions=True)
        assert small == "grammar of [0-9]+"
        assert slow == [f"grammar of spin 0.5 {i}" for i in range(3)]  # waiting for a process is not timed
        assert cache.pool.killed == 0
    asyncio.run(run())


def test_a_tenant_waiting_past_its_share_is_told_to_retry(make_cache):
    cache = make_cache(processes=2)
    cache.pool.wait_limit = 0.3

    async def run():
        first, second = await asyncio.gather(cache.compile(regex("sleep 1.5 a"), "mallory"),
                                             cache.compile(regex("sleep 1.5 b"), "mallory"), return_exceptions=True)
        assert first == "grammar of sleep 1.5 a"
        assert isinstance(second, OverloadedError) and second.status == 429
        assert await cache.compile(regex("sleep 1.5 b"), "mallory") == "grammar of sleep 1.5 b"  # not remembered
    asyncio.run(run())
