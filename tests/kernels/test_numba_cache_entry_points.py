"""A kernel cache filled by one entry point loads in the next process (issue 41.8).

A cached function that calls a parallel kernel is saved without numba's note to start the
threading layer when it was compiled in a process that had loaded that kernel from the cache. A
fresh process that loaded it first died (`LLVM ERROR: Symbol not found: allocate_sched` under
`reame generate` on Gemma 3; a segfault in this two-function copy of the shape). Importing
`worker.engine`, which every entry point does before loading kernels, starts the layer first.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The engine's shape: a parallel kernel (a matmul) called by a cached serial function (a step).
KERNELS = """
import numpy as np
from numba import njit, prange

@njit(parallel=True, cache=True)
def scale(x):
    out = np.empty_like(x)
    for i in prange(x.shape[0]):
        out[i] = 2.0 * x[i]
    return out

@njit(cache=True)
def step(x):
    return scale(x).sum()
"""

# One entry point: imports the engine (its cache set-up), then calls one of the functions.
ENTRY = """
import sys
import numpy as np
import worker.engine
import cache_shape
fn = getattr(cache_shape, sys.argv[1])
print(float(np.sum(fn(np.ones(64)))))
"""


def run(tmp_path: Path, function: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "NUMBA_NUM_THREADS")}
    env["REAME_NUMBA_CACHE_BASE"] = str(tmp_path / "numba")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    return subprocess.run([sys.executable, str(tmp_path / "entry.py"), function], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_a_step_compiled_over_cached_kernels_loads_in_a_fresh_process(tmp_path):
    (tmp_path / "cache_shape.py").write_text(textwrap.dedent(KERNELS))
    (tmp_path / "entry.py").write_text(textwrap.dedent(ENTRY))
    kernels_only = run(tmp_path, "scale")  # e.g. a kernel benchmark: fills the cache with kernels
    assert kernels_only.returncode == 0, kernels_only.stderr
    first_step = run(tmp_path, "step")  # a CLI run: kernels from the cache, the step compiled
    assert first_step.returncode == 0, first_step.stderr
    worker = run(tmp_path, "step")  # a worker starting: the step itself from the cache
    assert worker.returncode == 0, f"died with {worker.returncode}: {worker.stderr[-2000:]}"
    assert worker.stdout.split() == ["128.0"]
    cached = {p.name.split("-")[0] for p in (tmp_path / "numba").rglob("*.nbi")}
    assert cached == {"cache_shape.scale", "cache_shape.step"}  # the last run loaded, not compiled
