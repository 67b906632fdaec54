"""The n-gram archive: what followed each short context in earlier completions of this model,
with counts; a draft follows the most frequent continuation while it is a clear favourite.

Tool calls, JSON shapes and boilerplate recur across requests, not within one: the archive is
where a request drafts from what other requests produced. It is bounded (least recently used
contexts go first) and may sit in front of a host-wide store (archive_store.ArchiveStore), read
on a miss and written behind the request path.

Counts are kept per cache namespace (gateway.cache_namespace: b"" is the shared one): a draft is
another request's completion, and whether it was accepted shows in the time a step takes (and
showed in /metrics), so a request drafts only from completions of its own namespace. With one
shared store another tenant recovered a 6-digit code from someone's answer in 33 requests.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol

ORDER = 3  # context tokens: long enough to pin a JSON key or a code idiom, short enough to recur
MAX_CONTEXTS = 200_000  # ~100 bytes each in RAM: ~20 MB at most
MIN_SHARE = 0.5  # draft a continuation only while it has at least this share of its context's counts

Counts = dict[int, int]
Key = tuple[bytes, tuple[int, ...]]  # (cache namespace, context)


class ArchiveBacking(Protocol):
    """A persistent tier shared by the host's workers (archive_store.ArchiveStore)."""

    def get(self, context: tuple[int, ...], namespace: bytes = b"") -> Counts | None: ...

    def submit(self, counts: dict[tuple[int, ...], Counts], namespace: bytes = b"") -> None: ...


class NgramArchive:
    def __init__(self, order: int = ORDER, max_contexts: int = MAX_CONTEXTS, min_share: float = MIN_SHARE,
                 backing: ArchiveBacking | None = None):
        if order < 1 or max_contexts < 1 or not 0.0 < min_share <= 1.0:
            raise ValueError(f"bad archive shape: order={order}, max_contexts={max_contexts}, min_share={min_share}")
        self.order = order
        self.max_contexts = max_contexts
        self.min_share = min_share
        self.backing = backing
        self._counts: OrderedDict[Key, Counts] = OrderedDict()  # least recently used first
        self._absent: set[Key] = set()  # contexts the backing lacked (cleared by learn)
        self._lock = threading.Lock()  # learn() may run on the service thread while propose() reads
        self.num_learned = 0  # completions taken in

    def __len__(self) -> int:
        return len(self._counts)

    def learn(self, tokens: list[int], namespace: bytes = b"") -> None:
        """Count every (context, next token) of a finished sequence (prompt and completion), for
        the drafts of its namespace only."""
        n = self.order
        fresh: dict[tuple[int, ...], Counts] = {}
        for i in range(n, len(tokens)):
            ctx = tuple(tokens[i - n:i])
            nxt = tokens[i]
            row = fresh.setdefault(ctx, {})
            row[nxt] = row.get(nxt, 0) + 1
        with self._lock:
            for ctx, row in fresh.items():
                mine = self._row((namespace, ctx), create=True)
                for nxt, count in row.items():
                    mine[nxt] = mine.get(nxt, 0) + count
            self._absent.clear()
            self._evict()
            self.num_learned += 1
        if self.backing is not None and fresh:
            self.backing.submit(fresh, namespace)

    def propose(self, tokens: list[int], k: int, namespace: bytes = b"") -> list[int]:
        """Up to k tokens continuing `tokens`, each the clear favourite after the one before, from
        what completions of the same namespace produced."""
        n = self.order
        if k <= 0 or len(tokens) < n:
            return []
        ctx = tuple(tokens[-n:])
        out: list[int] = []
        with self._lock:
            while len(out) < k:
                row = self._row((namespace, ctx), create=False)
                if not row:
                    break
                best, best_count = max(row.items(), key=lambda item: (item[1], -item[0]))
                if best_count < self.min_share * sum(row.values()):
                    break
                out.append(best)
                ctx = ctx[1:] + (best,)
        return out

    def counts(self, context: tuple[int, ...], namespace: bytes = b"") -> Counts:
        """The continuations of one context with their counts (a copy)."""
        with self._lock:
            return dict(self._row((namespace, tuple(context)), create=False) or {})

    def _row(self, key: Key, create: bool) -> Counts | None:
        row = self._counts.get(key)
        if row is not None:
            self._counts.move_to_end(key)
            return row
        if self.backing is not None and key not in self._absent:
            row = self.backing.get(key[1], key[0])
            if row is None:
                self._absent.add(key)
                if len(self._absent) > self.max_contexts:
                    self._absent.clear()
        if row is None and not create:
            return None
        row = row if row is not None else {}
        self._counts[key] = row
        self._evict()
        return row

    def _evict(self) -> None:
        while len(self._counts) > self.max_contexts:
            self._counts.popitem(last=False)
