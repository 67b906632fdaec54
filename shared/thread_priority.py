"""A worker's background threads (the prefix store's and the draft archive's writers) yield the
CPU to its engine.

On a host with as many cores as engine threads, a writer compressing and committing K/V blocks
while a prompt is prefilled takes a core from one numba thread, and the other waits for it at
every barrier: a cold 2,202-token prompt took 7.1-7.7 s over HTTP against 5.0 s in process
(SmolLM2, 2 threads, 2 vCPU AVX2 EPYC; ~50 MB of blocks written during the prefill). At the lowest
priority the writers run in the gaps between steps; when they cannot keep up their queues fill
and blocks are dropped (a cache may forget; a request must not wait).
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("reame")

BACKGROUND_NICE = 19


def lower_this_thread(nice: int = BACKGROUND_NICE) -> None:
    """Give the calling thread the lowest CPU priority (Linux threads have their own nice value);
    where that is not possible it runs at the process's priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError) as exc:
        log.debug("thread %s keeps its CPU priority: %s", threading.current_thread().name, exc)
