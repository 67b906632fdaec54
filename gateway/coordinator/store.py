"""The strategy on disk (Config.tuning_path/strategy.json), so a restarted gateway resumes it, and
what a saved one pins, in words (the start-up announcement and `reame strategy show`). Saved in
learned state's format (shared.saved_state); a strategy.json of an older version (the plain
document, no format fields) is still read, once, and saved in the format from then on.

Learned state belongs to one deployment (its state directory, or `[tuning] state_path`). Older
versions kept it in ~/.cache/reame/tuning, shared by every server of a user: a strategy found
there is never read, only named in a warning (LEGACY_DIRECTORY)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from shared import saved_state
from shared.private_state import make_private

log = logging.getLogger("reame.coordinator")

FILE_NAME = "strategy.json"
KIND = "reame.strategy"
VERSION = 1
LEGACY_DIRECTORY = Path("~/.cache/reame/tuning")  # the per-user default of older versions


class StrategyStore:
    def __init__(self, directory: Path | None):
        """directory None: nothing is kept (state_path = "")."""
        self.path = directory / FILE_NAME if directory is not None else None

    def load(self) -> dict[str, Any] | None:
        """The saved strategy; None when there is none or it cannot be read (then the defaults serve)."""
        if self.path is None:
            return None
        try:
            make_private(self.path.parent, "[tuning] state_path", log)  # ConfigError: another user's
        except OSError as exc:
            log.warning("coordinator: cannot check %s (%s)", self.path.parent, exc)
        if not self.path.exists():
            return None
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            log.warning("coordinator: cannot read %s (%s); starting from the defaults", self.path, exc)
            return None
        doc = saved_state.decode(data, KIND, VERSION)
        if doc is None:
            doc = saved_state.parse(data)
            if doc is None or "format" in doc:  # damaged, or of a version this one does not know
                log.warning("coordinator: %s is damaged or of another version; starting from the defaults",
                            self.path)
                return None
        return doc

    def save(self, doc: dict[str, Any]) -> None:
        """Write atomically (a crash leaves the old file or the new one, never half of one)."""
        if self.path is None:
            return
        try:
            saved_state.write_file(self.path, saved_state.encode(KIND, VERSION, doc, indent=1))
        except OSError as exc:  # losing the file costs a restart its resume, never the serving
            log.warning("coordinator: cannot save the strategy to %s: %s", self.path, exc)


def legacy_strategy(directory: Path | None, legacy: Path = LEGACY_DIRECTORY) -> Path | None:
    """The home-directory strategy an older version left, when this deployment keeps its own elsewhere."""
    old = Path(os.path.expanduser(legacy)) / FILE_NAME
    try:
        if directory is not None and old.resolve() == (Path(directory) / FILE_NAME).resolve():
            return None
        return old if old.is_file() else None
    except OSError:
        return None


def age(seconds: float) -> str:
    """"45 s", "12 min", "6.0 h", "3.2 days"."""
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 172800 else f"{seconds / 86400:.1f} days"


def describe(doc: dict[str, Any], now: float | None = None) -> list[str]:
    """A saved strategy in words: version, freeze and its age, and per worker slot the knobs it
    pins that differ from the defaults it was saved with (and why, for a placement)."""
    now = time.time() if now is None else now
    saved_at, frozen_at = doc.get("saved_at"), doc.get("frozen_at")
    head = f"strategy v{doc.get('version', 0)}"
    if isinstance(saved_at, (int, float)):
        head += f", saved {age(now - saved_at)} ago"
    if doc.get("frozen"):
        head += ", FROZEN" + (f" {age(now - frozen_at)} ago" if isinstance(frozen_at, (int, float)) else "")
    lines = [head]
    defaults = doc.get("defaults") if isinstance(doc.get("defaults"), dict) else {}
    workers = doc.get("workers") if isinstance(doc.get("workers"), dict) else {}
    for name, entry in workers.items():
        knobs = entry.get("knobs") if isinstance(entry, dict) and isinstance(entry.get("knobs"), dict) else {}
        pins = [f"{k}={_show(v)} (default {_show(defaults[k])})" for k, v in knobs.items()
                if k in defaults and defaults[k] != v and not (k == "cpus" and not v and not defaults[k])]
        lines.append(f"  {name}: v{entry.get('version', 0) if isinstance(entry, dict) else 0}: "
                     + (", ".join(pins) if pins else "the defaults"))
        cause = entry.get("cause") if isinstance(entry, dict) else None
        if isinstance(cause, dict):
            at = cause.get("at")
            lines.append(f"    placement chosen by {cause.get('policy')}"
                         + (f" {age(now - at)} ago" if isinstance(at, (int, float)) else "")
                         + f" because {cause.get('reason')}; not resumed at start (re-tested live)")
    if not workers:
        lines.append("  no worker slots (every worker runs the defaults)")
    return lines


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) or "all"
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)
