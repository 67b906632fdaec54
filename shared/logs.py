"""One log format for every Reame process: time, process role, level, message — to stderr."""
from __future__ import annotations

import logging
import sys


def setup_logging(level: str, role: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
