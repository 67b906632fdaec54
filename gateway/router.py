"""Which worker runs a request: the one that last saw this prompt's prefix, else one on the same
host, else the least loaded.

Prefix affinity sends requests that share a beginning (a system prompt, an ongoing chat) to the
worker whose KV cache is most likely to hold it. Every host keeps one prefix store on disk that
all its workers share, so when that worker is busier than others (or gone), a worker on the same
host is the next best choice: it restores the prefix from the store instead of recomputing it.
Among equally loaded workers the one used least recently wins, so idle workers share a burst.
Affinity never outweighs load: only workers with the lightest load are chosen from. Pure and
deterministic: no I/O, no clock; the caller passes candidates with a free slot.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

PREFIX_TOKENS = 64  # tokens that make up the affinity key


def prefix_key(prompt_ids: Sequence[int], cache_namespace: bytes = b"") -> bytes:
    # A stable hash (never Python's hash(), which is salted per process). The namespace is part
    # of it: a prefix is only reusable where its own namespace's blocks are.
    head = np.asarray(prompt_ids[:PREFIX_TOKENS], dtype="<i4").tobytes()
    return hashlib.blake2b(cache_namespace + head, digest_size=16).digest()


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    active: int  # requests assigned and not finished
    capacity: int
    host: str = ""  # the machine it runs on (its prefix store is that host's); "" = unknown

    @property
    def load(self) -> float:
        return self.active / max(self.capacity, 1)


@dataclass
class _Seen:
    """Where a prefix was last sent: that worker's RAM, and its host's store."""
    worker_id: str | None  # None once the worker has left (the host's store still holds the prefix)
    host: str


class Router:
    def __init__(self, max_entries: int = 4096, affinity: bool = True):
        """`affinity = False` ([gateway] routing = least_loaded): the least loaded worker, least
        recently used first, whatever the prompt (for comparison, and for traffic without reuse)."""
        self.max_entries = max_entries
        self.affinity = affinity
        self._affinity: OrderedDict[bytes, _Seen] = OrderedDict()  # prefix key → where, LRU order
        self._order: dict[str, int] = {}  # worker id → sequence number of its last assignment
        self._sequence = 0

    def choose(self, candidates: Sequence[Candidate], key: bytes) -> str:
        if not candidates:
            raise ValueError("no candidate workers")
        lightest_load = min(c.load for c in candidates)
        lightest = [c for c in candidates if c.load == lightest_load]
        seen = self._affinity.get(key) if self.affinity else None
        if seen is not None:
            holder = next((c for c in lightest if c.worker_id == seen.worker_id), None)
            if holder is not None:
                return self._record(key, holder)
            same_host = [c for c in lightest if seen.host and c.host == seen.host]
            if same_host:
                lightest = same_host
        chosen = min(lightest, key=lambda c: (self._order.get(c.worker_id, -1), c.worker_id))
        return self._record(key, chosen)

    def forget(self, worker_id: str) -> None:
        """The worker left: its RAM is gone, its host's store is not."""
        self._order.pop(worker_id, None)
        for key, seen in list(self._affinity.items()):
            if seen.worker_id == worker_id:
                if seen.host:
                    seen.worker_id = None
                else:
                    del self._affinity[key]

    def _record(self, key: bytes, chosen: Candidate) -> str:
        self._sequence += 1
        self._order[chosen.worker_id] = self._sequence
        self._affinity[key] = _Seen(chosen.worker_id, chosen.host)
        self._affinity.move_to_end(key)
        while len(self._affinity) > self.max_entries:
            self._affinity.popitem(last=False)
        return chosen.worker_id
