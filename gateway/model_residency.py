"""Which models are in memory, and which to unload so that another fits the host's budget.

Weights plus KV pool of every loaded (or loading) model stay under `budget` bytes. To make room
the least recently used idle model goes first; a model with requests running, or pinned, is
never unloaded; a model idle past its keep_alive is unloaded by `expired()`. Pure and
deterministic: no I/O, the clock is passed in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"


class NoRoom(Exception):
    """The model does not fit: what would have to go is running or pinned (or it is too big)."""


@dataclass
class Resident:
    name: str
    keep_alive: float  # seconds idle before it is unloaded (math.inf: pinned)
    state: str = UNLOADED
    size: int = 0  # bytes: weights + KV pool (estimated while loading, measured once loaded)
    running: int = 0  # requests in flight on it
    last_used: float = 0.0
    error: str = ""  # why its last load failed ("" = it did not)

    @property
    def held(self) -> int:
        return self.size if self.state != UNLOADED else 0


class Residency:
    def __init__(self, budget: int, keep_alive: dict[str, float]):
        """`keep_alive`: every served model's name → its keep-alive seconds (math.inf = pinned)."""
        self.budget = budget
        self.models = {name: Resident(name, seconds) for name, seconds in keep_alive.items()}

    def used(self) -> int:
        return sum(m.held for m in self.models.values())

    def make_room(self, name: str, size: int) -> list[str]:
        """The models to unload, in order, before `name` (of `size` bytes) may load. NoRoom when
        even unloading every idle, unpinned model would not be enough."""
        if size > self.budget:
            raise NoRoom(f"model {name!r} needs {size} bytes, more than the whole budget of {self.budget}")
        free = self.budget - (self.used() - self.models[name].held)
        victims = []
        idle = sorted((m for m in self.models.values()
                       if m.name != name and m.state == LOADED and m.running == 0 and math.isfinite(m.keep_alive)),
                      key=lambda m: (m.last_used, m.name))
        for model in idle:
            if free >= size:
                break
            victims.append(model.name)
            free += model.size
        if free < size:
            busy = [m.name for m in self.models.values() if m.name != name and m.held]
            raise NoRoom(f"model {name!r} ({size} bytes) does not fit the budget of {self.budget} bytes "
                         f"beside the running or pinned models {busy}")
        return victims

    def loading(self, name: str, size: int) -> None:
        model = self.models[name]
        model.state, model.size, model.error = LOADING, size, ""

    def loaded(self, name: str, size: int, now: float) -> None:
        model = self.models[name]
        model.state, model.size, model.last_used = LOADED, size, now

    def unloaded(self, name: str, error: str = "") -> None:
        model = self.models[name]
        model.state, model.error = UNLOADED, error

    def pin(self, name: str, keep_alive: float) -> None:
        self.models[name].keep_alive = keep_alive

    def begin(self, name: str, now: float) -> None:
        model = self.models[name]
        model.running += 1
        model.last_used = now

    def end(self, name: str, now: float) -> None:
        model = self.models[name]
        model.running = max(model.running - 1, 0)
        model.last_used = now

    def expired(self, now: float) -> list[str]:
        """Loaded models idle for longer than their keep_alive, least recently used first."""
        return [m.name for m in sorted(self.models.values(), key=lambda m: (m.last_used, m.name))
                if m.state == LOADED and m.running == 0 and now - m.last_used >= m.keep_alive]
