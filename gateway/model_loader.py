"""Loading models on demand: a request for a model that is not in memory waits for it to load.

Concurrent first requests for one model share one load. Before a load, the residency decides
which idle models to unload to stay under the budget. A request waits at most `timeout` seconds
(the load goes on), then gets a 503 with Retry-After. How a model is loaded and unloaded (on
which worker, over which messages) is the caller's: `load(entry)` returns the bytes it holds.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

from gateway.errors import ServiceUnavailableError
from gateway.model_residency import LOADED, NoRoom, Residency
from shared.model_registry import ModelEntry

log = logging.getLogger(__name__)


class ModelLoadingError(ServiceUnavailableError):
    """The model is still loading (or does not fit beside the running ones): retry shortly."""
    code = "model_loading"


class ModelUnavailableError(ServiceUnavailableError):
    """The model's last load failed; the other models serve."""
    code = "model_unavailable"
    retry_after = 30


class ModelLoader:
    def __init__(self, residency: Residency, entries: dict[str, ModelEntry],
                 load: Callable[[ModelEntry], Awaitable[int]], unload: Callable[[str], Awaitable[None]],
                 estimate: Callable[[ModelEntry], int], timeout: float,
                 clock: Callable[[], float] = time.monotonic):
        self.residency, self.entries = residency, entries
        self._load, self._unload, self._estimate = load, unload, estimate
        self.timeout, self.clock = timeout, clock
        self._pending: dict[str, asyncio.Task] = {}  # model name → its one load in progress
        self._room = asyncio.Lock()  # one decision about the budget at a time
        self.loads = 0  # loads started (a test counts them)

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[None]:
        """Hold `name` loaded while the body runs: it is never unloaded under a running request."""
        await self.ensure(name)
        self.residency.begin(name, self.clock())
        try:
            yield
        finally:
            self.residency.end(name, self.clock())

    async def ensure(self, name: str) -> None:
        if self.residency.models[name].state == LOADED:
            return
        task = self._pending.get(name)
        if task is None:
            task = self._pending[name] = asyncio.ensure_future(self._load_once(name))
        try:
            await asyncio.wait_for(asyncio.shield(task), self.timeout)
        except asyncio.TimeoutError:
            raise ModelLoadingError(f"model {name!r} is loading; retry in a few seconds") from None

    async def unload(self, name: str) -> bool:
        """Unload now if idle (the admin's request); False when requests run on it."""
        async with self._room:
            model = self.residency.models[name]
            if model.state != LOADED or model.running:
                return False
            await self._unload_one(name, "requested")
            return True

    async def unload_expired(self) -> None:
        """Unload the models idle past their keep_alive (called on a timer)."""
        async with self._room:
            for name in self.residency.expired(self.clock()):
                await self._unload_one(name, "idle past its keep_alive")

    async def _load_once(self, name: str) -> None:
        entry = self.entries[name]
        try:
            async with self._room:
                size = self._estimate(entry)
                try:
                    victims = self.residency.make_room(name, size)
                except NoRoom as exc:
                    raise ModelLoadingError(str(exc)) from None
                for victim in victims:
                    await self._unload_one(victim, f"to make room for {name!r}")
                self.residency.loading(name, size)
            self.loads += 1
            log.info("model %s: loading %s (about %.0f MiB)", name, entry.reference, size / 2**20)
            started = self.clock()
            try:
                size = await self._load(entry)
            except Exception as exc:
                self.residency.unloaded(name, error=str(exc))
                log.error("model %s: load failed: %s", name, exc)
                raise ModelUnavailableError(f"model {name!r} could not be loaded: {exc}") from None
            log.info("model %s: loaded in %.1f s (%.0f MiB)", name, self.clock() - started, size / 2**20)
            async with self._room:
                self.residency.loaded(name, size, self.clock())
                await self._fit(name, size)
        finally:
            self._pending.pop(name, None)

    async def _fit(self, name: str, size: int) -> None:
        """A model measured larger than estimated may push the loaded ones past the budget: the
        least recently used idle others go, as they would have before its load."""
        if self.residency.used() <= self.residency.budget:
            return
        try:
            victims = self.residency.make_room(name, size)
        except NoRoom as exc:
            log.warning("model %s holds %.0f MiB, over the memory budget beside running or pinned models: %s",
                        name, size / 2**20, exc)
            return
        for victim in victims:
            await self._unload_one(victim, f"{name!r} measured {size / 2**20:.0f} MiB once loaded")

    async def _unload_one(self, name: str, why: str) -> None:
        # Marked first: a request arriving meanwhile loads it again instead of running on it.
        log.info("model %s: unloading (%s)", name, why)
        self.residency.unloaded(name)
        await self._unload(name)

    def listing(self) -> list[dict]:
        """/v1/models' view: every served model with its state and bytes held."""
        return [{"id": m.name, "state": m.state, "size": m.held, "running": m.running}
                for m in self.residency.models.values()]
