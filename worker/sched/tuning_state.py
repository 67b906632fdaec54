"""The scheduler's knobs, and the holder through which a coordinator changes them between steps.

Without a coordinator the defaults (reame.conf's) serve correctly. A decision arrives as a whole new
`SchedulerKnobs` with a version; the scheduler reads `current()` once at the start of each step,
so a change never lands in the middle of a batch.
"""
from __future__ import annotations

from shared.errors import ConfigError
from shared.knobs import SchedulerKnobs

__all__ = ["SchedulerKnobs", "TuningState"]  # SchedulerKnobs is declared, with its bounds, in shared.knobs


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
