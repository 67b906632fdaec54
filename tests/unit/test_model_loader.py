"""Models loaded on demand and unloaded under the memory budget: the residency's choices (pure)
and the loader's single-flight loads, waits and refusals (over fake load/unload functions)."""
from __future__ import annotations

import asyncio
import math

import pytest

from gateway.model_loader import ModelLoader, ModelLoadingError, ModelUnavailableError
from gateway.model_residency import LOADED, LOADING, UNLOADED, NoRoom, Residency
from shared.model_registry import ModelEntry

MiB = 2**20


def _residency(budget=100, **keep):
    return Residency(budget, {name: keep.get(name, 300.0) for name in ("a", "b", "c")})


def test_the_least_recently_used_idle_model_makes_room_first():
    res = _residency()
    res.loaded("a", 40, now=1)
    res.loaded("b", 40, now=2)
    res.begin("a", now=3)
    res.end("a", now=4)  # a is now more recent than b
    assert res.make_room("c", 40) == ["b"]
    assert res.make_room("c", 20) == []  # 20 free already


def test_running_and_pinned_models_are_never_unloaded_to_make_room():
    res = _residency(a=math.inf)
    res.loaded("a", 40, now=1)  # pinned
    res.loaded("b", 40, now=2)
    res.begin("b", now=3)  # running
    with pytest.raises(NoRoom, match="beside the running or pinned"):
        res.make_room("c", 40)
    res.end("b", now=4)
    assert res.make_room("c", 40) == ["b"]
    with pytest.raises(NoRoom, match="more than the whole budget"):
        res.make_room("c", 101)


def test_a_loading_model_counts_against_the_budget():
    res = _residency()
    res.loading("a", 70)
    with pytest.raises(NoRoom):
        res.make_room("b", 40)


def test_idle_models_expire_after_their_keep_alive():
    res = _residency(a=10, b=math.inf, c=0)
    for name in "abc":
        res.loaded(name, 10, now=0)
    res.begin("c", now=5)
    assert res.expired(now=9) == []  # c is running, a has 1 s left, b is pinned
    res.end("c", now=9)
    assert res.expired(now=10) == ["a", "c"]  # least recently used first


class _Host:
    """Fake worker side: loads take until released, sizes come from the entry's name."""

    def __init__(self, sizes, fail=()):
        self.sizes, self.fail = sizes, set(fail)
        self.loaded: set[str] = set()
        self.events: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def load(self, entry: ModelEntry) -> int:
        self.events.append(f"load {entry.name}")
        await self.gate.wait()
        if entry.name in self.fail:
            raise FileNotFoundError(f"no such file: {entry.reference}")
        self.loaded.add(entry.name)
        return self.sizes[entry.name]

    async def unload(self, name: str) -> None:
        self.events.append(f"unload {name}")
        self.loaded.discard(name)


def _loader(host, budget, timeout=5.0, keep=300.0, estimate=None):
    """estimate: every model's size before its load (default: what its load measures)."""
    entries = {name: ModelEntry(name, f"/m/{name}.gguf") for name in host.sizes}
    residency = Residency(budget, {name: keep for name in entries})
    clock = iter(range(10**6))
    guess = (lambda e: host.sizes[e.name]) if estimate is None else (lambda e: estimate)
    return ModelLoader(residency, entries, host.load, host.unload, estimate=guess,
                       timeout=timeout, clock=lambda: float(next(clock)))


def test_concurrent_first_requests_load_once():
    async def main():
        host = _Host({"a": 10 * MiB})
        host.gate.clear()
        loader = _loader(host, budget=100 * MiB)
        waiting = [asyncio.create_task(loader.ensure("a")) for _ in range(8)]
        while not host.events:
            await asyncio.sleep(0)
        assert loader.residency.models["a"].state == LOADING
        host.gate.set()
        await asyncio.gather(*waiting)
        assert host.events == ["load a"] and loader.loads == 1
        assert loader.listing()[0] == {"id": "a", "state": LOADED, "size": 10 * MiB, "running": 0}
    asyncio.run(main())


def test_a_budget_that_fits_one_model_alternates_them():
    async def main():
        host = _Host({"a": 60, "b": 60})
        loader = _loader(host, budget=100)
        for name in ("a", "b", "a"):
            async with loader.use(name):
                assert host.loaded == {name}
        assert host.events == ["load a", "unload a", "load b", "unload b", "load a"]
        assert loader.residency.used() <= 100
    asyncio.run(main())


def test_a_model_measured_larger_than_estimated_makes_room_once_loaded():
    # Admitted on an estimate of 10 beside a, b measures 60 once loaded: used 70 > 60, so the
    # idle a goes, as it would have before b's load had its size been known.
    async def main():
        host = _Host({"a": 10, "b": 60})
        loader = _loader(host, budget=60, estimate=10)
        async with loader.use("a"):
            pass
        async with loader.use("b"):
            assert host.loaded == {"b"}
        assert host.events == ["load a", "load b", "unload a"]
        assert loader.residency.used() == 60
    asyncio.run(main())


def test_a_model_measured_over_the_budget_beside_a_running_one_stays_and_serves():
    async def main():
        host = _Host({"a": 10, "b": 60})
        loader = _loader(host, budget=60, estimate=10)
        async with loader.use("a"):  # a is running: it may not go
            async with loader.use("b"):
                assert host.loaded == {"a", "b"}
        assert host.events == ["load a", "load b"]
    asyncio.run(main())


def test_a_running_request_is_never_unloaded_under_it():
    async def main():
        host = _Host({"a": 60, "b": 60})
        loader = _loader(host, budget=100, timeout=0.05)
        async with loader.use("a"):
            with pytest.raises(ModelLoadingError) as info:
                await loader.ensure("b")  # b must wait: a is running
            assert info.value.status == 503 and info.value.retry_after
            assert not await loader.unload("a")  # nor may the admin unload it now
            assert host.loaded == {"a"}
        assert await loader.unload("a")
        await loader.ensure("b")
        assert host.loaded == {"b"}
    asyncio.run(main())


def test_a_slow_load_answers_503_and_goes_on():
    async def main():
        host = _Host({"a": 10})
        host.gate.clear()
        loader = _loader(host, budget=100, timeout=0.01)
        with pytest.raises(ModelLoadingError, match="loading"):
            await loader.ensure("a")
        host.gate.set()
        await loader.ensure("a")  # the same load, finished
        assert host.events == ["load a"]
    asyncio.run(main())


def test_a_model_that_fails_to_load_fails_alone():
    async def main():
        host = _Host({"a": 10, "bad": 10}, fail={"bad"})
        loader = _loader(host, budget=100)
        with pytest.raises(ModelUnavailableError, match="no such file: /m/bad.gguf"):
            await loader.ensure("bad")
        assert loader.residency.models["bad"].state == UNLOADED
        assert "no such file" in loader.residency.models["bad"].error
        async with loader.use("a"):
            assert host.loaded == {"a"}
    asyncio.run(main())


def test_idle_models_are_unloaded_past_keep_alive():
    async def main():
        host = _Host({"a": 10})
        loader = _loader(host, budget=100, keep=0)
        async with loader.use("a"):
            await loader.unload_expired()
            assert host.loaded == {"a"}
        await loader.unload_expired()
        assert host.loaded == set() and loader.listing()[0]["state"] == UNLOADED
    asyncio.run(main())
