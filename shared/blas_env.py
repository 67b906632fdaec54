"""Choose OpenBLAS's kernels before numpy loads it.

Some hosts export OPENBLAS_CORETYPE=Haswell with a small OPENBLAS_L2_SIZE. On a CPU with
AVX-512 that forces 256-bit sgemm kernels and tiny blocking: prefill-shaped sgemm measured
1.65x slower here, and Reame's 512-token prefill went from ~880 to ~500 tok/s. OpenBLAS reads
these variables once, when numpy is first imported, so this must run before that; the
decision is logged by `describe()` once logging is up. Set REAME_KEEP_BLAS_ENV=1 to keep them.

OpenBLAS's threads also spin after each call for 2^OPENBLAS_THREAD_TIMEOUT cycles (default
2^28, ~0.1 s) before they sleep. Prompt chunks alternate BLAS matmuls with numba kernels on the
same cores, and a numba call right after BLAS then waits for the spinning threads: the logits
projection after a 70-token prefill took 21 ms instead of 1 ms. 2^10 cycles end the spin at
once; prefill itself was no slower (measured 160-230 ms either way). A value set by the user wins.
"""
from __future__ import annotations

import os
import sys

_OLD_CORES = {"haswell", "sandybridge", "nehalem", "core2", "penryn", "dunnington", "atom",
              "prescott", "zen", "excavator", "steamroller", "piledriver", "bulldozer", "katmai"}
_dropped: dict[str, str] = {}


def _cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return " avx512f " in f" {line.split(':', 1)[1].strip()} "
    except OSError:
        pass
    return False


BLAS_THREAD_TIMEOUT = "10"


def prefer_native_blas() -> None:
    if os.environ.get("REAME_KEEP_BLAS_ENV") == "1" or "numpy" in sys.modules:
        return
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)
    core = os.environ.get("OPENBLAS_CORETYPE", "")
    if core.lower() in _OLD_CORES and _cpu_has_avx512():
        for key in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
            if key in os.environ:
                _dropped[key] = os.environ.pop(key)


def describe() -> str:
    """One line for the start-up log: what OpenBLAS runs, and whether we changed it."""
    try:
        from threadpoolctl import threadpool_info
        info = next((i for i in threadpool_info() if i.get("user_api") == "blas"), {})
    except Exception:  # threadpoolctl missing or unable to inspect: not worth failing start-up
        info = {}
    text = f"BLAS: {info.get('internal_api', '?')} {info.get('architecture', '?')} kernels, {info.get('num_threads', '?')} threads"
    text += f", thread spin 2^{os.environ.get('OPENBLAS_THREAD_TIMEOUT', '28')} cycles"
    if _dropped:
        text += f" (ignored {', '.join(f'{k}={v}' for k, v in _dropped.items())}: slower than native on this AVX-512 CPU)"
    return text
