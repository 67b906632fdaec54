"""The numba inference engine.

Public surface (what the worker, the CLI and the benchmarks use):

    engine = load_engine(path, EngineSection(), progress=None)   # reame.conf's [engine] (shared.config)
    engine.model_name, engine.arch, engine.n_ctx, engine.vocab_size, engine.kv (the paged pool)
    engine.validate(prompt_ids, max_tokens)            # raises InvalidRequestError / ContextLengthError
    engine.execute(chunks)                             # one step: K/V into blocks, logits of the chunks

Generation (scheduling, sampling, one request or many) is worker.sched's: the engine imports
nothing from worker/ outside worker/engine/.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from worker.engine import numba_cache


def _source_digest() -> str:
    """Hash of every engine source file (and the numba version).

    numba invalidates a cached kernel when its own file changes, but not when a function it
    calls from another file does: after such an edit (or an upgrade) the stale machine code
    was loaded and crashed (a segfault, seen here). One cache directory per engine source
    version makes that impossible.
    """
    from importlib.metadata import version
    digest = hashlib.sha256(version("numba").encode())
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# Names this version of the engine's code: numba's cache directory, and the prefix store's K/V
# fingerprint (kernels that changed may round K/V differently).
SOURCE_DIGEST = _source_digest()


def _numba_cache_dir(base: Path | None = None) -> str:
    return numba_cache.cache_dir(numba_cache.default_base() if base is None else base, SOURCE_DIGEST)


# Compiled kernels are cached on disk so a restart does not recompile (seconds, not a minute).
# numba reads this when a kernel module is imported, so it is set here, before any of them.
os.environ["REAME_NUMBA_CACHE_BASE"] = os.environ.get("REAME_NUMBA_CACHE_BASE") or os.environ.get(
    "NUMBA_CACHE_DIR", os.path.expanduser("~/.cache/reame/numba"))
os.environ["NUMBA_CACHE_DIR"] = _numba_cache_dir()
if "numba" in sys.modules:  # imported before us: numba read the variable already
    sys.modules["numba"].config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
# Before any kernel is loaded from that cache (numba_cache's doc: a cache filled by another entry
# point killed the process otherwise).
numba_cache.start_threading_layer()
