"""Where a worker runs: which CPUs of its NUMA node its threads use, and whether its memory is bound
to the node. Changed between steps when a Strategy says so (worker.service, on the serve loop's
thread), never beyond the CPUs the worker started with (its node's, or --cpus).

Affinity is per thread on Linux, and the engine's thread pools exist by now, so every thread of
the process is moved (os.sched_setaffinity on each task id). Memory binding sets the serve loop's
policy to its node (set_mempolicy, MPOL_BIND: per thread, and that thread is the one that
allocates) and moves the pages the process already has there (migrate_pages: weights, the KV
pool); unbinding restores the default policy (pages stay where they are). Both are Linux system
calls made through libc; elsewhere binding is refused with a clear error.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path

from shared.errors import ConfigError

log = logging.getLogger("reame.worker")

MPOL_DEFAULT, MPOL_BIND = 0, 2
MAX_NODES = 1024  # bits in the node masks passed to the kernel
_SYSCALLS = {"x86_64": (238, 256), "aarch64": (237, 238)}  # (set_mempolicy, migrate_pages)


class Placement:
    def __init__(self, node: int, cpus: list[int], numa_nodes: int = 1, pid: int | None = None):
        """cpus: what the worker was pinned to at start; every later set is a subset of it."""
        self.node = node
        self.cpus = sorted(cpus)
        self.numa_nodes = numa_nodes
        self.pid = pid if pid is not None else os.getpid()
        self.in_use = list(self.cpus)
        self.bound = False

    def apply(self, cpus: list[int], bind_memory: bool) -> bool:
        """Run on `cpus` ([]: all it started with) with memory bound or not; whether anything
        changed. ConfigError (nothing changed) for CPUs outside its set or a refused binding."""
        wanted = sorted(set(cpus)) if cpus else list(self.cpus)
        outside = sorted(set(wanted) - set(self.cpus))
        if outside:
            raise ConfigError(f"CPUs {outside} are not among this worker's {self.cpus}")
        changed = False
        if wanted != self.in_use:
            self._set_affinity(wanted)
            self.in_use = wanted
            changed = True
        if bind_memory != self.bound:
            self._bind(bind_memory)
            self.bound = bind_memory
            changed = True
        return changed

    def _set_affinity(self, cpus: list[int]) -> None:
        tasks = Path(f"/proc/{self.pid}/task")
        tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
            except OSError as exc:
                raise ConfigError(f"cannot run on CPUs {cpus}: {exc.strerror}") from None

    def _bind(self, bind: bool) -> None:
        calls = _SYSCALLS.get(platform.machine())
        if calls is None or not hasattr(os, "sched_setaffinity"):
            raise ConfigError(f"memory binding is not supported on {platform.system()} {platform.machine()}")
        set_mempolicy, migrate_pages = calls
        libc = ctypes.CDLL(None, use_errno=True)
        words = MAX_NODES // (8 * ctypes.sizeof(ctypes.c_ulong))
        mask = (ctypes.c_ulong * words)()
        if bind:
            mask[self.node // 64] = 1 << (self.node % 64)
            if libc.syscall(set_mempolicy, MPOL_BIND, mask, MAX_NODES) != 0:
                raise ConfigError(f"cannot bind memory to node {self.node}: {os.strerror(ctypes.get_errno())}")
            every = (ctypes.c_ulong * words)()
            for node in range(self.numa_nodes):
                every[node // 64] |= 1 << (node % 64)
            # Pages already on other nodes (weights, the KV pool) move to this one; a page that
            # cannot move stays, which costs speed, not correctness: reported, not fatal.
            if libc.syscall(migrate_pages, self.pid, MAX_NODES, every, mask) < 0:
                log.warning("placement: pages not moved to node %d: %s", self.node, os.strerror(ctypes.get_errno()))
        elif libc.syscall(set_mempolicy, MPOL_DEFAULT, None, 0) != 0:
            raise ConfigError(f"cannot unbind memory: {os.strerror(ctypes.get_errno())}")
