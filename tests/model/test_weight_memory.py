"""The engine keeps one resident copy of the weights (issue 35.4): once packed, the GGUF file's
mapped pages leave the process's resident set, and steps never read them again."""
from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import EngineSection
from shared.sampling import SamplingParams
from tests.model.run_requests import run_requests
from worker.engine.engine import load_engine
from worker.sched.generation import BatchGenerator
from worker.sched.tuning_state import SchedulerKnobs, TuningState

SMAPS = Path("/proc/self/smaps")


def mapping_rss_bytes(address: int) -> int:
    """Rss of the mapping of /proc/self/smaps that contains `address`."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        first = line.split(" ", 1)[0]
        if "-" in first and all(c in "0123456789abcdef-" for c in first):
            lo, hi = (int(part, 16) for part in first.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds address {address:#x}")


@pytest.mark.skipif(not SMAPS.exists(), reason="needs Linux's /proc/self/smaps")
@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_file_pages_leave_the_resident_set_once_packed(smollm2_gguf, kernels):
    engine = load_engine(smollm2_gguf, EngineSection(kernels=kernels, context_length=256), progress=lambda m: None)
    address = engine.gguf.mapped_address()
    size = smollm2_gguf.stat().st_size
    # Packing read every byte of the file; without the release all of it stays resident.
    assert mapping_rss_bytes(address) < size // 100
    generator = BatchGenerator(engine, TuningState(SchedulerKnobs(batching_window_ms=0.0)))
    out = run_requests(generator, {"a": ([1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0))})
    assert len(out.tokens["a"]) == 4
    assert mapping_rss_bytes(address) < size // 100  # a step reads only the packed weights
