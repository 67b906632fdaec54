"""The knobs a tuning coordinator sets on one worker, declared once: each knob's default
(reame.conf's), the bounds every reader checks, the bounds the coordinator's policies keep to,
and the form a Strategy carries (shared.protocol.Strategy.knobs is a `Knobs`, field for field).

The coordinator (gateway.coordinator) chooses them, the worker's scheduler runs the scheduler
part (worker.sched.tuning_state) and its placement the rest (worker.placement). A frame, a saved
or imported strategy and a decision the worker applies are all checked by the same
`__post_init__`, so a bound changes here and nowhere else.

The thread count is not a knob: the kernel tuner (worker.engine.tuning) decides it per rows
bucket by timing every count on live steps; the coordinator informs it through the placement
(never more threads than the CPUs it gives the worker).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from shared.config import Config, EngineSection, SchedulerSection
from shared.errors import ConfigError

# "Twice the start batch": the batch may grow to MAX_BATCH_GROWTH times reame.conf's, and the
# engine sizes the window-KV pool of sliding-window models for that many sequences at start-up.
MAX_BATCH_GROWTH = 2


def batch_ceiling(start_batch: int) -> int:
    """The most sequences a step may hold on a worker started with `start_batch`."""
    return MAX_BATCH_GROWTH * start_batch


MOST = 1 << 20  # the largest count any knob may take (a bigger one is a typo or an attack)
# A window longer than this is almost surely seconds passed as milliseconds; it would stall every
# lone request, so it is refused rather than obeyed.
MOST_WINDOW_MS = 1000.0
MAX_CPUS = 4096  # CPU numbers are below this

# What the policies choose, and so what an import may pin (Knobs.check_within): knobs of 1 and a
# 1 s window took another tenant's 1.3k-token request from 4.6 s to 94.6 s. Floors apply only
# where reame.conf's own value is higher.
MIN_BATCH = 2
MIN_WINDOW_MS = 0.5
MAX_WINDOW_MS = 8.0
MIN_PREFILL_CHUNK = 64
MIN_ATTENTION_CHUNK = 64
MIN_TOKEN_BUDGET = 64
# Decode-only time after a prompt-chunk step, as a share of it: at 1, prompts go half as fast while
# anything decodes. Beyond that a flood of decoders could all but stop new prompts.
MAX_DECODE_SHARE = 1.0
MOST_DECODE_SHARE = 8.0  # what any reader accepts (reame.conf may go past the policies' bound)
# Knobs added after strategies were first saved: a saved strategy without one gets its default.
LATER_KNOBS = ("decode_share",)

_SCHEDULER, _ENGINE = SchedulerSection(), EngineSection()


def _count(default: int) -> Any:
    return field(default=default, metadata={"low": 1, "high": MOST})


@dataclass(frozen=True)
class SchedulerKnobs:
    """What the scheduler reads at the start of each step. Defaults: reame.conf's."""
    max_batch_size: int = _count(_SCHEDULER.max_batch_size)  # sequences in one engine step
    token_budget: int = _count(_SCHEDULER.token_budget)  # prompt-chunk + decode tokens in one step
    prefill_chunk: int = _count(_ENGINE.prefill_chunk)  # most prompt tokens one sequence feeds per step
    attention_chunk: int = _count(_SCHEDULER.attention_chunk)  # keys per online-softmax chunk
    # How long a lone arrival may wait for company.
    batching_window_ms: float = field(default=_SCHEDULER.batching_window_ms,
                                      metadata={"low": 0.0, "high": MOST_WINDOW_MS})
    # Decode-only steps after each prompt-chunk step, for this share of its time (worker.sched.scheduler).
    decode_share: float = field(default=_SCHEDULER.decode_share, metadata={"low": 0.0, "high": MOST_DECODE_SHARE})

    def __post_init__(self) -> None:
        for f in fields(SchedulerKnobs):
            value, low, high = getattr(self, f.name), f.metadata["low"], f.metadata["high"]
            integer = isinstance(low, int)
            if (isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
                    or not math.isfinite(value) or not low <= value <= high):
                raise ConfigError(f"{f.name}: expected {'an integer' if integer else 'a number'} in "
                                  f"{_show(low)}..{_show(high)}, got {value!r}", param=f.name)
        object.__setattr__(self, "batching_window_ms", float(self.batching_window_ms))
        object.__setattr__(self, "decode_share", float(self.decode_share))

    @classmethod
    def from_config(cls, config: Config):
        """reame.conf's knobs: what a worker runs without a coordinator."""
        s = config.scheduler
        return cls(max_batch_size=s.max_batch_size, token_budget=s.token_budget,
                   prefill_chunk=config.engine.prefill_chunk, attention_chunk=s.attention_chunk,
                   batching_window_ms=s.batching_window_ms, decode_share=s.decode_share)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_fits(self, started: SchedulerKnobs, where: str = "knobs") -> None:
        """ConfigError unless a worker started with `started` can run these: its engine sized the
        window-KV pool for its prefill chunk and its batch ceiling at start-up."""
        if self.prefill_chunk > started.prefill_chunk:
            raise ConfigError(f"{where}.prefill_chunk: at most {started.prefill_chunk} (the workers' [engine] "
                              f"prefill_chunk), got {self.prefill_chunk}")
        if self.max_batch_size > batch_ceiling(started.max_batch_size):
            raise ConfigError(f"{where}.max_batch_size: at most {batch_ceiling(started.max_batch_size)} (twice "
                              f"the workers' [scheduler] max_batch_size), got {self.max_batch_size}")


@dataclass(frozen=True)
class Knobs(SchedulerKnobs):
    """The scheduler knobs and where the worker runs: everything a Strategy sets."""
    cpus: tuple[int, ...] = ()  # the CPUs of its node the worker runs on (empty: all it started with)
    bind_memory: bool = False  # its memory bound (and moved) to its NUMA node

    def __post_init__(self) -> None:
        super().__post_init__()
        cpus = self.cpus
        if (not isinstance(cpus, (list, tuple)) or len(set(cpus)) != len(cpus)
                or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < MAX_CPUS for c in cpus)):
            raise ConfigError(f"cpus: expected a list of distinct CPU numbers, got {cpus!r}", param="cpus")
        object.__setattr__(self, "cpus", tuple(sorted(cpus)))
        if not isinstance(self.bind_memory, bool):
            raise ConfigError(f"bind_memory: expected true or false, got {self.bind_memory!r}", param="bind_memory")

    @classmethod
    def from_dict(cls, data: Any, where: str = "knobs") -> Knobs:
        """From JSON (a persisted or imported strategy); ConfigError naming what is wrong. A
        "threads" entry (strategies saved when the coordinator still chose threads) is dropped:
        the kernel tuner decides the thread count."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected an object of knobs")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names - {"threads"})
        missing = sorted({f.name for f in fields(SchedulerKnobs)} - set(data) - set(LATER_KNOBS))
        if unknown or missing:
            raise ConfigError(f"{where}: unknown knobs {unknown}" if unknown else f"{where}: missing knobs {missing}")
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc.message}") from None

    @property
    def scheduler(self) -> SchedulerKnobs:
        return SchedulerKnobs(**{f.name: getattr(self, f.name) for f in fields(SchedulerKnobs)})

    def with_(self, **changes: Any) -> Knobs:
        return replace(self, **changes)

    def check_within(self, started: SchedulerKnobs, where: str = "knobs", min_batch: int = MIN_BATCH) -> None:
        """ConfigError unless a worker started with `started` can take these (check_fits) and they stay
        within what the policies would choose: no floor above reame.conf's own values. min_batch:
        1 for a saved strategy (the memory policy may go that low when the KV pool holds one
        sequence)."""
        floors = {"max_batch_size": min(min_batch, started.max_batch_size),
                  "prefill_chunk": min(MIN_PREFILL_CHUNK, started.prefill_chunk),
                  "token_budget": max(self.max_batch_size, min(MIN_TOKEN_BUDGET, started.token_budget)),
                  "attention_chunk": min(MIN_ATTENTION_CHUNK, started.attention_chunk)}
        for name, floor in floors.items():
            if getattr(self, name) < floor:
                raise ConfigError(f"{where}.{name}: at least {floor}, got {getattr(self, name)}")
        most_budget = batch_ceiling(max(started.token_budget, started.prefill_chunk + started.max_batch_size))
        if self.token_budget > most_budget:
            raise ConfigError(f"{where}.token_budget: at most {most_budget}, got {self.token_budget}")
        most_window = max(MAX_WINDOW_MS, started.batching_window_ms)
        if self.batching_window_ms > most_window:
            raise ConfigError(f"{where}.batching_window_ms: at most {most_window:g}, got {self.batching_window_ms:g}")
        most_share = max(MAX_DECODE_SHARE, started.decode_share)
        if self.decode_share > most_share:
            raise ConfigError(f"{where}.decode_share: at most {most_share:g}, got {self.decode_share:g}")
        self.check_fits(started, where)

    def describe(self, before: Knobs | None = None) -> str:
        """"max_batch_size 8→16, batching_window_ms 2→4" (only what changed), or every knob."""
        if before is None:
            return ", ".join(f"{k}={_show(v)}" for k, v in self.as_dict().items())
        old = before.as_dict()
        return ", ".join(f"{k} {_show(old[k])}→{_show(v)}" for k, v in self.as_dict().items() if old[k] != v)


def _show(value: Any) -> str:
    """8, 2.5, 1048576, cpus "0,1"/"all", true."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) or "all"
    return str(value) if isinstance(value, int) else f"{value:g}"
