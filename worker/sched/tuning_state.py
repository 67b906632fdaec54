"""The scheduler's knobs, and the holder through which a coordinator changes them between steps.

Without a coordinator the defaults (reame.conf's) serve correctly. A decision arrives as a whole new
`SchedulerKnobs` with a version; the scheduler reads `current()` once at the start of each step,
so a change never lands in the middle of a batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from shared.config import Config, EngineSection, SchedulerSection
from shared.errors import ConfigError

# A window longer than this is almost surely seconds passed as milliseconds; it would stall
# every lone request, so refuse it rather than obey it.
MAX_BATCHING_WINDOW_MS = 1000.0


_SCHEDULER, _ENGINE = SchedulerSection(), EngineSection()


@dataclass(frozen=True)
class SchedulerKnobs:
    """Defaults are reame.conf's (shared.config), the one source of every default."""
    max_batch_size: int = _SCHEDULER.max_batch_size  # sequences in one step
    token_budget: int = _SCHEDULER.token_budget  # tokens (prefill chunks + decode tokens) in one step
    prefill_chunk: int = _ENGINE.prefill_chunk  # most prompt tokens one sequence feeds in one step
    batching_window_ms: float = _SCHEDULER.batching_window_ms  # how long a lone arrival may wait (Scheduler)
    attention_chunk: int = _SCHEDULER.attention_chunk  # keys per online-softmax chunk in the engine's attention

    @classmethod
    def from_config(cls, config: Config) -> "SchedulerKnobs":
        s = config.scheduler
        return cls(max_batch_size=s.max_batch_size, token_budget=s.token_budget,
                   prefill_chunk=config.engine.prefill_chunk, batching_window_ms=s.batching_window_ms,
                   attention_chunk=s.attention_chunk)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "token_budget", "prefill_chunk", "attention_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", param=name)
        window = self.batching_window_ms
        if (not isinstance(window, (int, float)) or isinstance(window, bool) or not math.isfinite(window)
                or not 0.0 <= window <= MAX_BATCHING_WINDOW_MS):
            raise ConfigError(f"batching_window_ms must be a number in [0, {MAX_BATCHING_WINDOW_MS:g}],"
                              f" got {window!r}", param="batching_window_ms")

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class TuningState:
    """The knobs in force, with the version and reason of the decision that set them."""

    def __init__(self, knobs: SchedulerKnobs | None = None):
        self._knobs = knobs if knobs is not None else SchedulerKnobs()
        if not isinstance(self._knobs, SchedulerKnobs):
            raise ConfigError(f"expected SchedulerKnobs, got {type(self._knobs).__name__}")
        self.version = 0
        self.reason = "defaults"

    def current(self) -> SchedulerKnobs:
        return self._knobs

    def apply(self, new_knobs: SchedulerKnobs, version: int, reason: str) -> bool:
        """Adopt new_knobs if version is newer than the one in force; return whether it was adopted.

        A stale or repeated version is ignored (returns False): decisions may arrive late or twice,
        and the coordinator only advises. Bad values raise ConfigError and change nothing.
        """
        if not isinstance(new_knobs, SchedulerKnobs):
            raise ConfigError(f"expected SchedulerKnobs, got {type(new_knobs).__name__}")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ConfigError(f"tuning version must be a non-negative integer, got {version!r}")
        # SchedulerKnobs validates itself on construction (dataclasses.replace too); re-run it so
        # an instance changed behind the frozen dataclass's back cannot slip through.
        new_knobs.__post_init__()
        if version <= self.version:
            return False
        self._knobs = new_knobs
        self.version = version
        self.reason = reason
        return True
