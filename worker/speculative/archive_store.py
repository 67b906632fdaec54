"""The n-gram archive's host-wide tier: one LMDB environment shared by every worker of a host,
kept across restarts, LRU-evicted within a byte budget.

Sub-databases, changed only inside one write transaction:
  ngrams  model(8) + namespace (0 or 32) + context (order x int32 LE) -> entry
  lru     stamp (8-byte big-endian time_ns) + key -> b""   oldest first
  meta    b"bytes_used" -> u64 big-endian                  sum of len(entry) over ngrams
  state   model(8) -> the speculator's learned state (worker.speculative.learned; small, outside the budget)
An entry is magic b"NG", version, count of pairs, CRC32 of the pairs, the stamp of its `lru`
row, then (token int32, count uint32) pairs, most frequent first, at most MAX_CONTINUATIONS.

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
import threading
import time
import zlib
from collections import deque
from typing import Callable
from pathlib import Path

import lmdb

from shared.errors import ConfigError
from shared.private_state import make_private
from shared.thread_priority import lower_this_thread

log = logging.getLogger("reame.spec")

MAGIC = b"NG"
VERSION = 1
MAX_CONTINUATIONS = 8  # the counts beyond the best few never decide a draft
NAMESPACE_BYTES = 32  # gateway.cache_namespace's digests
MAX_PENDING = 4096  # completions' count sets waiting for the writer; more are dropped
_HEADER = struct.Struct("<2sBBIQ")  # magic, version, pairs, crc32, stamp
_PAIR = struct.Struct("<iI")
_U64 = struct.Struct(">Q")
_DB_NAMES = (b"ngrams", b"lru", b"meta", b"state")

Counts = dict[int, int]


class ArchiveUnavailable(Exception):
    """The archive directory cannot be opened; drafts come from the prompt and RAM only."""


class ArchiveStore:
    def __init__(self, path, *, model: bytes, order: int, budget_bytes: int):
        if budget_bytes < 1 or order < 1 or len(model) < 8:
            raise ValueError(f"bad archive store: budget {budget_bytes}, order {order}, model id {model!r}")
        self.path = Path(path)
        self.model = model[:8]
        self.order = order
        self.budget_bytes = budget_bytes
        self.corrupt = self.writes = self.evictions = self.dropped = 0
        self.writes_enabled = True
        try:
            make_private(self.path, f"n-gram archive at {self.path}", log)  # it holds completions
            self._env = lmdb.open(str(self.path), map_size=2 * budget_bytes + (16 << 20), max_dbs=len(_DB_NAMES),
                                  subdir=True, mode=0o600, readahead=False, metasync=False)
            self._env.reader_check()
            with self._env.begin(write=True) as txn:
                self._ngrams, self._lru, self._meta, self._state = (self._env.open_db(n, txn=txn) for n in _DB_NAMES)
        except (lmdb.Error, OSError) as exc:
            raise ArchiveUnavailable(f"n-gram archive at {self.path} cannot be opened: {exc}") from exc
        except ConfigError as exc:  # another user's directory: not used
            raise ArchiveUnavailable(exc.message) from exc
        self._ops: deque[tuple] = deque()  # ("add", {context: counts}) | ("delete", key) | ("state", encode)
        self._cond = threading.Condition()
        self._pending = 0  # ops queued or being applied
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="reame-spec-archive", daemon=True)
        self._thread.start()

    # ---- the request path -------------------------------------------------------------------------

    def get(self, context: tuple[int, ...], namespace: bytes = b"") -> Counts | None:
        """The stored continuations of a context, or None (absent, or corrupt: then queued for deletion)."""
        key = self._key(context, namespace)
        try:
            with self._env.begin(db=self._ngrams, buffers=True) as txn:
                raw = txn.get(key)
                value = None if raw is None else bytes(raw)
        except lmdb.Error as exc:
            log.debug("n-gram archive read failed: %s", exc)
            return None
        if value is None:
            return None
        counts = _decode(value)
        if counts is None:
            self.corrupt += 1
            log.warning("n-gram archive: a corrupt entry (%d bytes) dropped", len(value))
            self._enqueue(("delete", key))
        return counts

    def submit(self, counts: dict[tuple[int, ...], Counts], namespace: bytes = b"") -> None:
        """Counts to add (one finished sequence's), written behind the request path."""
        self._enqueue(("add", {self._key(ctx, namespace): row for ctx, row in counts.items()}))

    def load_state(self) -> bytes | None:
        """The speculator's saved state for this model (worker.speculative.learned decodes and checks it)."""
        try:
            with self._env.begin(db=self._state) as txn:
                return txn.get(self.model)
        except lmdb.Error as exc:
            log.warning("n-gram archive: the speculator's state cannot be read: %s", exc)
            return None

    def save_state(self, encode: Callable[[], bytes]) -> None:
        """Replace the saved state with encode()'s, called on the writer thread."""
        self._enqueue(("state", encode))

    # ---- control ----------------------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every op queued so far is applied; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stats(self) -> dict[str, int]:
        with self._env.begin(db=self._meta) as txn:
            raw = txn.get(b"bytes_used")
            entries = txn.stat(self._ngrams)["entries"]
        return {"bytes_used": _U64.unpack(raw)[0] if raw else 0, "entries": entries, "writes": self.writes,
                "evictions": self.evictions, "corrupt": self.corrupt, "dropped": self.dropped}

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to timeout), stop the thread, close the environment."""
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self._env.close()

    # ---- the writer thread ------------------------------------------------------------------------

    def _enqueue(self, op: tuple) -> None:
        with self._cond:
            if self._closing or not self.writes_enabled:
                return
            if len(self._ops) >= MAX_PENDING:
                self.dropped += 1
                return
            self._ops.append(op)
            self._pending += 1
            self._cond.notify_all()

    def _run(self) -> None:
        lower_this_thread()  # the engine's threads come first (shared.thread_priority)
        while True:
            with self._cond:
                while not self._ops and not self._closing:
                    self._cond.wait()
                if not self._ops:
                    return
                batch = list(self._ops)
                self._ops.clear()
            try:
                if self.writes_enabled:
                    self._apply(batch)
            except lmdb.MapFullError:
                self._stop_writes("the map is full")
            except lmdb.Error as exc:
                self._stop_writes(str(exc))
            except Exception:  # a bug here must not kill the thread: the next completion tries again
                log.exception("n-gram archive: write failed")
            with self._cond:
                self._pending -= len(batch)
                self._cond.notify_all()

    def _apply(self, batch: list[tuple]) -> None:
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
        stamp = time.time_ns()
        with self._env.begin(write=True) as txn:
            used = _U64.unpack(txn.get(b"bytes_used", db=self._meta) or _U64.pack(0))[0]
            for key in deletes - merged.keys():
                used -= self._remove(txn, key)
            for key, row in merged.items():
                old = txn.get(key, db=self._ngrams)
                if old is not None:
                    stored = _decode(bytes(old)) or {}  # a corrupt entry is replaced
                    for token, count in stored.items():
                        row[token] = row.get(token, 0) + count
                    used -= self._remove(txn, key)
                value = _encode(row, stamp)
                txn.put(key, value, db=self._ngrams)
                txn.put(_U64.pack(stamp) + key, b"", db=self._lru)
                used += len(value)
                self.writes += 1
            cursor = txn.cursor(db=self._lru)
            while used > self.budget_bytes and cursor.first():
                key = bytes(cursor.key())[_U64.size:]
                cursor.delete()
                value = txn.get(key, db=self._ngrams)
                if value is not None:
                    used -= len(value)
                    txn.delete(key, db=self._ngrams)
                    self.evictions += 1
            txn.put(b"bytes_used", _U64.pack(max(0, used)), db=self._meta)
            if state is not None:
                txn.put(self.model, state(), db=self._state)

    def _remove(self, txn, key: bytes) -> int:
        """Delete an entry and its lru row; its size (0 if absent)."""
        value = txn.get(key, db=self._ngrams)
        if value is None:
            return 0
        value = bytes(value)
        if len(value) >= _HEADER.size:
            stamp = _HEADER.unpack_from(value)[4]
            txn.delete(_U64.pack(stamp) + key, db=self._lru)
        txn.delete(key, db=self._ngrams)
        return len(value)

    def _stop_writes(self, reason: str) -> None:
        if self.writes_enabled:
            self.writes_enabled = False
            log.warning("n-gram archive at %s: writes stopped (%s); it is still read", self.path, reason)

    def _key(self, context: tuple[int, ...], namespace: bytes = b"") -> bytes:
        if len(context) != self.order:
            raise ValueError(f"a context has {self.order} tokens, got {len(context)}")
        if len(namespace) not in (0, NAMESPACE_BYTES):  # not one of the gateway's: made one, never mixed up
            namespace = hashlib.sha256(namespace).digest()
        return self.model + namespace + struct.pack(f"<{self.order}i", *context)


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
