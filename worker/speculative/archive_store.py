"""The n-gram archive's host-wide tier: one LMDB environment shared by every worker of a host,
kept across restarts, LRU-evicted within a byte budget.

Sub-databases, changed only inside one write transaction:
  ngrams  model(8) + namespace (0 or 32) + context (order x int32 LE) -> entry
  lru     stamp (8-byte big-endian time_ns) + key -> b""   oldest first
  meta    b"bytes_used", b"entries" -> u64 big-endian      totals over ngrams (older versions kept no entries)
  state   model(8) -> the speculator's learned state (worker.speculative.learned; small, outside the budget)
An entry is magic b"NG", version, count of pairs, CRC32 of the pairs, the stamp of its `lru`
row, then (token int32, count uint32) pairs, most frequent first, at most MAX_CONTINUATIONS.
The environment, the LRU budget and the writer thread are the store layer's (shared.lmdb_store,
shared.write_behind), the prefix store's too.

Keys carry the first 8 bytes of the model file's SHA-256: an archive directory may hold several
models' n-grams, and one model never drafts from another's token ids. They carry the request's
cache namespace too (a digest; none for the shared one, so an archive written before namespaces
serves the shared namespace as it was): one tenant's completions never draft for another.

Reads (`get`) run on the request path and never write: an entry that fails its checks is a miss
and is queued for deletion. Writes (`submit`: counts to add) run on one daemon thread, merged with
what is stored; the first persistent failure (disk full, read-only) stops writing with one warning,
and reads go on.
"""
from __future__ import annotations

import hashlib
import logging
import struct
import zlib
from pathlib import Path
from typing import Callable

import lmdb

from shared.lmdb_store import LmdbEnv, LruBudget, StoreUnavailable
from shared.write_behind import WriteBehind

log = logging.getLogger("reame.spec")

MAGIC = b"NG"
VERSION = 1
MAX_CONTINUATIONS = 8  # the counts beyond the best few never decide a draft
NAMESPACE_BYTES = 32  # gateway.cache_namespace's digests
MAX_PENDING = 4096  # completions' count sets waiting for the writer; more are dropped
_HEADER = struct.Struct("<2sBBIQ")  # magic, version, pairs, crc32, stamp
_PAIR = struct.Struct("<iI")
_DB_NAMES = (b"ngrams", b"lru", b"meta", b"state")

Counts = dict[int, int]


class ArchiveUnavailable(StoreUnavailable):
    """The archive directory cannot be opened; drafts come from the prompt and RAM only."""


class ArchiveStore:
    def __init__(self, path, *, model: bytes, order: int, budget_bytes: int):
        if budget_bytes < 1 or order < 1 or len(model) < 8:
            raise ValueError(f"bad archive store: budget {budget_bytes}, order {order}, model id {model!r}")
        self.path = Path(path)
        self.model = model[:8]
        self.order = order
        self.budget_bytes = budget_bytes
        self.corrupt = self.writes = self.evictions = 0
        map_bytes = 2 * budget_bytes + (16 << 20)  # room for B-tree and free pages; never grown
        self._env = LmdbEnv(self.path, what="n-gram archive", db_names=_DB_NAMES, map_bytes=map_bytes,
                            max_map_bytes=map_bytes, log=log, unavailable=ArchiveUnavailable)
        self._ngrams, lru, meta, self._state = self._env.dbs
        self._lru = LruBudget(self._ngrams, lru, meta, stamp_in_value=_stamp, what="n-gram archive", path=self.path,
                              log=log)
        # ("add", {key: counts}) | ("delete", key) | ("state", encode)
        self._queue: WriteBehind[tuple] = WriteBehind(self._apply, name="reame-spec-archive", what="n-gram archive",
                                                      log=log, max_pending_ops=MAX_PENDING)
        self._thread = self._queue.thread

    # ---- the request path -------------------------------------------------------------------------

    def get(self, context: tuple[int, ...], namespace: bytes = b"") -> Counts | None:
        """The stored continuations of a context, or None (absent, or corrupt: then queued for deletion)."""
        key = self._key(context, namespace)
        try:
            value = self._env.read(lambda txn: _copy(txn.get(key, db=self._ngrams)))
        except lmdb.Error as exc:
            self._env.note_read_failure(exc)
            return None
        if value is None:
            return None
        counts = _decode(value)
        if counts is None:
            self.corrupt += 1
            log.warning("n-gram archive: a corrupt entry (%d bytes) dropped", len(value))
            self._submit(("delete", key))
        return counts

    def submit(self, counts: dict[tuple[int, ...], Counts], namespace: bytes = b"") -> None:
        """Counts to add (one finished sequence's), written behind the request path."""
        self._submit(("add", {self._key(ctx, namespace): row for ctx, row in counts.items()}))

    def load_state(self) -> bytes | None:
        """The speculator's saved state for this model (worker.speculative.learned decodes and checks it)."""
        try:
            return self._env.read(lambda txn: _copy(txn.get(self.model, db=self._state)))
        except lmdb.Error as exc:
            log.warning("n-gram archive: the speculator's state cannot be read: %s", exc)
            return None

    def save_state(self, encode: Callable[[], bytes]) -> None:
        """Replace the saved state with encode()'s, called on the writer thread."""
        self._submit(("state", encode))

    # ---- control ----------------------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every op queued so far is applied; False on timeout."""
        return self._queue.flush(timeout)

    def stats(self) -> dict[str, int]:
        def read(txn):  # entries from the B-tree: an archive written before meta counted them
            return self._lru.totals(txn).bytes_used, txn.stat(self._ngrams)["entries"]
        bytes_used, entries = self._env.read(read)
        return {"bytes_used": bytes_used, "entries": entries, "writes": self.writes,
                "evictions": self.evictions, "corrupt": self.corrupt, "dropped": self._queue.dropped}

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to timeout), stop the thread, close the environment."""
        self._queue.close(timeout)
        self._env.close()

    # ---- the writer thread ------------------------------------------------------------------------

    def _submit(self, op: tuple) -> None:
        if self._env.writes_enabled:
            self._queue.enqueue(op)

    def _apply(self, batch: list[tuple]) -> None:
        if not self._env.writes_enabled:
            return
        merged: dict[bytes, Counts] = {}
        deletes: set[bytes] = set()
        state = None  # only the newest of the batch's saved states is written
        for op in batch:
            if op[0] == "delete":
                deletes.add(op[1])
                continue
            if op[0] == "state":
                state = op[1]
                continue
            for key, row in op[1].items():
                mine = merged.setdefault(key, {})
                for token, count in row.items():
                    mine[token] = mine.get(token, 0) + count
        try:
            writes, evictions = self._env.write(lambda txn: self._write_in_txn(txn, merged, deletes, state))
        except lmdb.MapFullError:
            self._env.stop_writes("the map is full")
            return
        except (lmdb.Error, OSError) as exc:
            self._env.stop_writes(str(exc))
            return
        self.writes += writes
        self.evictions += evictions

    def _write_in_txn(self, txn, merged: dict[bytes, Counts], deletes: set[bytes], state) -> tuple[int, int]:
        """(entries written, entries evicted); leaves merged as it was, so a retried transaction adds once."""
        totals = self._lru.totals(txn)
        for key in deletes - merged.keys():
            self._lru.remove(txn, key, totals)
        for key, fresh in merged.items():
            row = dict(fresh)
            old = txn.get(key, db=self._ngrams)
            if old is not None:
                for token, count in (_decode(bytes(old)) or {}).items():  # a corrupt entry is replaced
                    row[token] = row.get(token, 0) + count
                self._lru.remove(txn, key, totals)
            stamp = self._lru.new_stamp()
            self._lru.put(txn, key, _encode(row, stamp), totals, stamp)
        evicted = self._lru.evict(txn, self.budget_bytes, totals)[1]
        self._lru.write_totals(txn, totals)
        if state is not None:
            txn.put(self.model, state(), db=self._state)
        return len(merged), evicted

    def _key(self, context: tuple[int, ...], namespace: bytes = b"") -> bytes:
        if len(context) != self.order:
            raise ValueError(f"a context has {self.order} tokens, got {len(context)}")
        if len(namespace) not in (0, NAMESPACE_BYTES):  # not one of the gateway's: made one, never mixed up
            namespace = hashlib.sha256(namespace).digest()
        return self.model + namespace + struct.pack(f"<{self.order}i", *context)


def _copy(value) -> bytes | None:
    """A value read through the map, copied out before its transaction ends."""
    return None if value is None else bytes(value)


def _stamp(value) -> int | None:
    """The stamp of an entry's `lru` row, kept in its header."""
    return _HEADER.unpack_from(value)[4] if len(value) >= _HEADER.size else None


def _encode(row: Counts, stamp: int) -> bytes:
    best = sorted(row.items(), key=lambda item: (-item[1], item[0]))[:MAX_CONTINUATIONS]
    pairs = b"".join(_PAIR.pack(token, min(count, 0xFFFFFFFF)) for token, count in best)
    return _HEADER.pack(MAGIC, VERSION, len(best), zlib.crc32(pairs), stamp) + pairs


def _decode(value: bytes) -> Counts | None:
    """The counts of a stored entry; None when any check fails."""
    if len(value) < _HEADER.size:
        return None
    magic, version, n, crc, _ = _HEADER.unpack_from(value)
    pairs = value[_HEADER.size:]
    if magic != MAGIC or version != VERSION or len(pairs) != n * _PAIR.size or zlib.crc32(pairs) != crc:
        return None
    return {token: count for token, count in _PAIR.iter_unpack(pairs)}
