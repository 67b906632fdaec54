"""Small helpers the benchmarks share (they run as scripts: `python bench/NAME.py`). Servers are
started with tests/harness.py, the same harness the e2e tests use."""
from __future__ import annotations

import sys


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float, empty: float = float("nan")) -> float:
    """Nearest-rank percentile, q in [0, 1]; `empty` when there are no values."""
    if not values:
        return empty
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
