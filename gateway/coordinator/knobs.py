"""The scheduler knobs as the coordinator decides them (the worker's twin is
worker.sched.tuning_state.SchedulerKnobs; the gateway may not import the worker)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from shared.config import Config
from shared.errors import ConfigError
from shared.protocol import Strategy

MAX_BATCH_GROWTH = 2  # the window-KV pool of sliding-window models holds twice the configured batch
# Bounds of what the policies choose (policy.py), and so of what an import may pin: knobs of 1 and
# a 1 s window, pinned by one tenant's strategy import, took another tenant's 1.3k-token request
# from 4.6 s to 94.6 s.
MIN_BATCH = 2
MIN_WINDOW_MS = 0.5
MAX_WINDOW_MS = 8.0
MIN_PREFILL_CHUNK = 64
MIN_ATTENTION_CHUNK = 64
MAX_CPUS = 4096
OPTIONAL = {"threads", "cpus", "bind_memory"}  # knobs added after strategies were first saved


@dataclass(frozen=True)
class Knobs:
    max_batch_size: int  # sequences in one engine step
    token_budget: int  # prompt-chunk + decode tokens in one step
    prefill_chunk: int  # most prompt tokens one sequence feeds per step
    attention_chunk: int  # keys per online-softmax chunk
    batching_window_ms: float  # how long a lone arrival may wait for company
    threads: int = 0  # threads of the engine's parallel kernels (0: every CPU of the worker)
    cpus: tuple[int, ...] = ()  # the CPUs of its node the worker runs on (empty: all it started with)
    bind_memory: bool = False  # its memory bound (and moved) to its NUMA node

    @classmethod
    def from_config(cls, config: Config) -> "Knobs":
        """The shipped defaults: what a worker runs without a coordinator."""
        s = config.scheduler
        return cls(s.max_batch_size, s.token_budget, config.engine.prefill_chunk, s.attention_chunk,
                   float(s.batching_window_ms), config.engine.threads)

    @classmethod
    def from_dict(cls, data: Any, where: str = "knobs") -> "Knobs":
        """From JSON (a persisted or imported strategy); ConfigError naming what is wrong."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected an object of knobs")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        missing = sorted(names - set(data) - OPTIONAL)
        if unknown or missing:
            raise ConfigError(f"{where}: unknown knobs {unknown}" if unknown else f"{where}: missing knobs {missing}")
        threads = data.get("threads", 0)
        if not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= 1024:
            raise ConfigError(f"{where}.threads: expected an integer in 0..1024, got {threads!r}")
        cpus = data.get("cpus", [])
        if (not isinstance(cpus, (list, tuple)) or len(cpus) > MAX_CPUS or len(set(cpus)) != len(cpus)
                or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < MAX_CPUS for c in cpus)):
            raise ConfigError(f"{where}.cpus: expected a list of distinct CPU numbers, got {cpus!r}")
        bind_memory = data.get("bind_memory", False)
        if not isinstance(bind_memory, bool):
            raise ConfigError(f"{where}.bind_memory: expected true or false, got {bind_memory!r}")
        for name in names - {"batching_window_ms"} - OPTIONAL:
            value = data[name]
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 20:
                raise ConfigError(f"{where}.{name}: expected an integer in 1..{1 << 20}, got {value!r}")
        window = data["batching_window_ms"]
        if not isinstance(window, (int, float)) or isinstance(window, bool) or not 0 <= window <= 1000:
            raise ConfigError(f"{where}.batching_window_ms: expected a number in 0..1000, got {window!r}")
        return cls(**{**data, "batching_window_ms": float(window), "threads": threads, "cpus": tuple(sorted(cpus)),
                      "bind_memory": bind_memory})

    def check_within(self, started: "Knobs", where: str = "knobs", min_batch: int = MIN_BATCH) -> None:
        """ConfigError unless a worker started with `started` can take these (its engine sized the
        window-KV pool for prefill_chunk and twice max_batch_size at start-up) and they stay
        within what the policies would choose: no floor below reame.conf's own values, where
        those are lower. min_batch: 1 for a saved strategy (the memory policy may go that low when
        the KV pool holds one sequence)."""
        floors = {"max_batch_size": min(min_batch, started.max_batch_size),
                  "prefill_chunk": min(MIN_PREFILL_CHUNK, started.prefill_chunk),
                  "token_budget": max(self.max_batch_size, min(MIN_PREFILL_CHUNK, started.token_budget)),
                  "attention_chunk": min(MIN_ATTENTION_CHUNK, started.attention_chunk)}
        for name, floor in floors.items():
            if getattr(self, name) < floor:
                raise ConfigError(f"{where}.{name}: at least {floor}, got {getattr(self, name)}")
        most_budget = MAX_BATCH_GROWTH * max(started.token_budget, started.prefill_chunk + started.max_batch_size)
        if self.token_budget > most_budget:
            raise ConfigError(f"{where}.token_budget: at most {most_budget}, got {self.token_budget}")
        most_window = max(MAX_WINDOW_MS, started.batching_window_ms)
        if self.batching_window_ms > most_window:
            raise ConfigError(f"{where}.batching_window_ms: at most {most_window:g}, got {self.batching_window_ms:g}")
        if self.prefill_chunk > started.prefill_chunk:
            raise ConfigError(f"{where}.prefill_chunk: at most {started.prefill_chunk} (the workers' "
                              f"[engine] prefill_chunk), got {self.prefill_chunk}")
        if self.max_batch_size > MAX_BATCH_GROWTH * started.max_batch_size:
            raise ConfigError(f"{where}.max_batch_size: at most {MAX_BATCH_GROWTH * started.max_batch_size} "
                              f"(twice the workers' [scheduler] max_batch_size), got {self.max_batch_size}")

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def with_(self, **changes: Any) -> "Knobs":
        return replace(self, **changes)

    def strategy(self, version: int, reason: str, frozen: bool = False) -> Strategy:
        return Strategy(version=version, reason=reason, max_batch_size=self.max_batch_size,
                        token_budget=self.token_budget, prefill_chunk=self.prefill_chunk,
                        attention_chunk=self.attention_chunk, batching_window_ms=self.batching_window_ms,
                        frozen=frozen, threads=self.threads, cpus=list(self.cpus), bind_memory=self.bind_memory)

    def describe(self, before: "Knobs | None" = None) -> str:
        """"max_batch_size 8→16, batching_window_ms 2→4" (only what changed), or every knob."""
        if before is None:
            return ", ".join(f"{k}={_show(v)}" for k, v in self.as_dict().items())
        old = before.as_dict()
        return ", ".join(f"{k} {_show(old[k])}→{_show(v)}" for k, v in self.as_dict().items() if old[k] != v)


def _show(value: Any) -> str:
    """8, 2.5, cpus "0-1"/"all", true."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) or "all"
    return f"{value:g}"
