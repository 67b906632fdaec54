"""Which worker runs a request: the one that last saw this prompt's prefix, else the least loaded.

Prefix affinity sends requests that share a beginning (a system prompt, an ongoing chat) to
the worker whose KV cache is most likely to hold it. Among equally loaded workers the one
used least recently wins, so idle workers share a burst. Pure and deterministic: no I/O, no
clock; the caller passes candidates with a free slot.
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

    @property
    def load(self) -> float:
        return self.active / max(self.capacity, 1)


class Router:
    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._affinity: OrderedDict[bytes, str] = OrderedDict()  # prefix key → worker id, LRU order
        self._order: dict[str, int] = {}  # worker id → sequence number of its last assignment
        self._sequence = 0

    def choose(self, candidates: Sequence[Candidate], key: bytes) -> str:
        if not candidates:
            raise ValueError("no candidate workers")
        by_id = {c.worker_id: c for c in candidates}
        lightest = min(c.load for c in candidates)
        affine = self._affinity.get(key)
        if affine in by_id and by_id[affine].load <= lightest:
            chosen = affine
        else:
            chosen = min((c for c in candidates if c.load == lightest),
                         key=lambda c: (self._order.get(c.worker_id, -1), c.worker_id)).worker_id
        self._record(key, chosen)
        return chosen

    def forget(self, worker_id: str) -> None:
        self._order.pop(worker_id, None)
        for key in [k for k, w in self._affinity.items() if w == worker_id]:
            del self._affinity[key]

    def _record(self, key: bytes, worker_id: str) -> None:
        self._sequence += 1
        self._order[worker_id] = self._sequence
        self._affinity[key] = worker_id
        self._affinity.move_to_end(key)
        while len(self._affinity) > self.max_entries:
            self._affinity.popitem(last=False)
