"""Small helpers the benchmarks share (they run as scripts: `python bench/NAME.py`)."""
from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, chars: int = 3000) -> str:
    """The end of a log file, for error messages ('' if it does not exist)."""
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def percentile(values: list[float], q: float, empty: float = float("nan")) -> float:
    """Nearest-rank percentile, q in [0, 1]; `empty` when there are no values."""
    if not values:
        return empty
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
