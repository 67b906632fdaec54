"""The strategy on disk (`[tuning] state_path`/strategy.json), so a restarted gateway resumes it."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from shared.private_state import make_private

log = logging.getLogger("reame.coordinator")

FILE_NAME = "strategy.json"


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
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log.warning("coordinator: cannot read %s (%s); starting from the defaults", self.path, exc)
            return None
        return doc if isinstance(doc, dict) else None

    def save(self, doc: dict[str, Any]) -> None:
        """Write atomically (a crash leaves the old file or the new one, never half of one)."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
            tmp.chmod(0o600)
            os.replace(tmp, self.path)
        except OSError as exc:  # losing the file costs a restart its resume, never the serving
            log.warning("coordinator: cannot save the strategy to %s: %s", self.path, exc)
