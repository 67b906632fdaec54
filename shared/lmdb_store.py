"""The store layer under the host-wide LMDB tiers (the prefix store, the n-gram archive): the
environment the host's workers share, its map, its failures, and eviction within a byte budget.
What a key and a value hold, and how a value is checked, stays each store's own.

LmdbEnv: one environment, owner-only (its entries hold users' prompts and completions).
`read(body)`/`write(body)` run body(txn) in one transaction. The map grows (doubling, up to
max_map_bytes) when a write finds it full, and a process adopts the size another one grew it to;
a resize waits until no transaction of this process is open (`_MapGuard`). The first persistent
write failure (disk full, read-only, a map that cannot grow) stops writes for the life of the
process with one warning; reads go on.

LruBudget: the entries of one sub-database within a byte budget, least recently used out first.
  lru    stamp (8-byte big-endian time_ns) + key -> b""   the use order, oldest first
  meta   b"bytes_used", b"entries" -> u64 big-endian      totals over the entries
A key's current stamp is kept in an `atime` sub-database (key -> stamp) or, in a store without
one, inside the entry's value (`stamp_in_value` reads it). Everything changes inside one write
transaction, so `lru` and the totals agree with the entries at every commit.
"""
from __future__ import annotations

import logging
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import lmdb

from shared.errors import ConfigError
from shared.private_state import make_private

_U64 = struct.Struct(">Q")
STAMP_BYTES = _U64.size
_RESIZE_RETRIES = 8  # each retry adopts a map another process grew; more in a row is a bug


class StoreUnavailable(Exception):
    """The store cannot be opened at all; the caller runs without it."""


class LmdbEnv:
    """One LMDB environment and its named sub-databases (`dbs`, in the order of db_names)."""

    def __init__(self, path, *, what: str, db_names: tuple[bytes, ...], map_bytes: int, max_map_bytes: int,
                 log: logging.Logger, unavailable: type[StoreUnavailable] = StoreUnavailable):
        self.path = Path(path)
        self.what = what  # names the store in log lines: "prefix store"
        self.max_map_bytes = max_map_bytes
        self.writes_enabled = True  # False once a write failed for good
        self.write_errors = 0
        self._log = log
        self._guard = _MapGuard()
        self._lock = threading.Lock()
        self._read_failure_logged = False
        self._env, self.dbs = self._open(db_names, min(map_bytes, max_map_bytes), unavailable)

    def read(self, body):
        """body(txn) in a read transaction whose buffers point into the map (no copies)."""
        return self._run(body, write=False)

    def write(self, body):
        """body(txn) in one write transaction, committed when body returns; MapFullError propagates."""
        return self._run(body, write=True)

    def write_or_none(self, body):
        """body's result from one write transaction (growing the map if needed), or None when the
        write failed: a persistent failure also stops writes."""
        while self.writes_enabled:
            try:
                return self.write(body)
            except lmdb.MapFullError:
                pass
            except (lmdb.Error, OSError) as exc:
                self.stop_writes(str(exc))
                return None
            if not self.grow_map():
                self.count_write_error()
                return None
        return None

    def grow_map(self) -> bool:
        """Doubles the map up to max_map_bytes; False when it is already there (or cannot grow)."""
        with self._guard.resize():
            current = self._env.info()["map_size"]
            if current >= self.max_map_bytes:
                return False
            try:
                self._env.set_mapsize(min(2 * current, self.max_map_bytes))
            except lmdb.Error as exc:
                self._log.debug("%s at %s: growing the map failed: %s", self.what, self.path, exc)
                return False
        return True

    def stop_writes(self, reason: str) -> None:
        with self._lock:
            self.write_errors += 1
            first = self.writes_enabled
            self.writes_enabled = False
        if first:
            self._log.warning("%s at %s: writes stopped: %s; serving continues", self.what, self.path, reason)

    def count_write_error(self) -> None:
        with self._lock:
            self.write_errors += 1

    def note_read_failure(self, exc: Exception) -> None:
        if not self._read_failure_logged:
            self._read_failure_logged = True
            self._log.warning("%s at %s: read failed: %s; treated as a miss", self.what, self.path, exc)

    def close(self) -> None:
        with self._guard.resize():
            self._env.close()

    def _run(self, body, write: bool):
        for _ in range(_RESIZE_RETRIES):
            try:
                with self._guard.txn(), self._env.begin(write=write, buffers=True) as txn:
                    return body(txn)
            except lmdb.MapResizedError:
                # Another process grew the map; size 0 makes LMDB adopt the size recorded on disk.
                with self._guard.resize():
                    self._env.set_mapsize(0)
        raise lmdb.MapResizedError("the map kept being resized by other processes")

    def _open(self, db_names, map_bytes: int, unavailable):
        where = f"{self.what} at {self.path}"
        env = None
        try:
            # Owner-only: the entries hold other users' prompts. The workers of a host run as one
            # user, so they still share it.
            make_private(self.path, where, self._log)
            # readahead off: reads are random single entries; metasync off: a system crash may undo
            # the last commit but never breaks the B-tree (fine for a cache, half the fsyncs).
            env = lmdb.open(str(self.path), map_size=map_bytes, max_dbs=len(db_names), subdir=True, mode=0o600,
                            lock=True, readahead=False, metasync=False)
            env.reader_check()  # frees reader slots left by crashed processes
            with env.begin(write=True) as txn:
                dbs = tuple(env.open_db(name, txn=txn) for name in db_names)
            return env, dbs
        except (lmdb.Error, OSError) as exc:
            if env is not None:
                env.close()
            raise unavailable(f"{where} cannot be opened: {exc}") from exc
        except ConfigError as exc:  # another user's directory: not used
            raise unavailable(exc.message) from exc


class Totals:
    """meta's bytes_used and entries, read and written inside one write transaction."""

    def __init__(self, bytes_used: int, entries: int):
        self.bytes_used = bytes_used
        self.entries = entries

    @classmethod
    def read(cls, txn, meta_db) -> Totals:
        def field(name: bytes) -> int:
            raw = txn.get(name, db=meta_db)
            return _U64.unpack(raw)[0] if raw is not None else 0
        return cls(field(b"bytes_used"), field(b"entries"))

    def add(self, size: int) -> None:
        self.bytes_used += size
        self.entries += 1

    def remove(self, size: int) -> None:
        self.bytes_used -= size
        self.entries -= 1

    def write(self, txn, meta_db) -> None:
        # Never below 0: a store written before `entries` was counted starts it at 0.
        txn.put(b"bytes_used", _U64.pack(max(0, self.bytes_used)), db=meta_db)
        txn.put(b"entries", _U64.pack(max(0, self.entries)), db=meta_db)


class LruBudget:
    """Use order and totals of the entries in one sub-database; every method runs inside the
    caller's write transaction (reads: `totals` in any)."""

    def __init__(self, entries_db, lru_db, meta_db, *, atime_db=None,
                 stamp_in_value: Callable[[memoryview], int | None] | None = None,
                 what: str, path: Path, log: logging.Logger):
        if (atime_db is None) == (stamp_in_value is None):
            raise ValueError("a key's stamp is kept in an atime sub-database or in its value: exactly one")
        self._entries, self._lru, self._meta, self._atime = entries_db, lru_db, meta_db, atime_db
        self._stamp_in_value = stamp_in_value
        self._where = f"{what} at {path}"
        self._log = log
        self._lock = threading.Lock()  # the stamp clock
        self._last_stamp = 0
        self._orphan_logged = False

    def totals(self, txn) -> Totals:
        return Totals.read(txn, self._meta)

    def write_totals(self, txn, totals: Totals) -> None:
        totals.write(txn, self._meta)

    def new_stamp(self) -> int:
        """Strictly increasing in this process, so a touch after a put always wins."""
        with self._lock:
            self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
            return self._last_stamp

    def put(self, txn, key: bytes, value: bytes, totals: Totals, stamp: int | None = None) -> None:
        """Stores a new entry as the most recently used one. A store keeping stamps in its values
        encodes `stamp` (from new_stamp) into value first."""
        txn.put(key, value, db=self._entries)
        self._stamp(txn, key, self.new_stamp() if stamp is None else stamp)
        totals.add(len(value))

    def touch(self, txn, keys) -> None:
        """Marks the present ones among keys most recently used (stores with an atime sub-database)."""
        for key in keys:
            stamp = txn.get(key, db=self._atime)
            if stamp is not None:
                txn.delete(bytes(stamp) + key, db=self._lru)
                self._stamp(txn, key, self.new_stamp())

    def remove(self, txn, key: bytes, totals: Totals) -> int:
        """Deletes key's entry and its use-order rows; returns the value bytes removed (0 if absent)."""
        stamp = self._stamp_of(txn, key)
        if stamp is not None:
            txn.delete(_U64.pack(stamp) + key, db=self._lru)
        if self._atime is not None:
            txn.delete(key, db=self._atime)
        value = txn.get(key, db=self._entries)
        if value is None:
            return 0
        size = len(value)
        txn.delete(key, db=self._entries)
        totals.remove(size)
        return size

    def evict(self, txn, limit: int, totals: Totals, max_entries: int | None = None) -> tuple[int, int]:
        """Removes least recently used entries until bytes_used <= limit; (bytes freed, entries)."""
        freed = evicted = 0
        cursor = txn.cursor(db=self._lru)
        while totals.bytes_used > limit and evicted != max_entries and cursor.first():
            row = bytes(cursor.key())
            key = row[STAMP_BYTES:]
            stamp = self._stamp_of(txn, key)
            # The row goes first, by itself: one its key does not point back to (a damaged store)
            # would otherwise stay first forever, spinning inside the host-wide write lock.
            cursor.delete()
            if stamp is not None and _U64.pack(stamp) != row[:STAMP_BYTES]:
                continue  # a stale duplicate: the key's own row comes later
            if stamp is None:
                self._note_orphan(key)
            size = self.remove(txn, key, totals)
            if size:
                freed += size
                evicted += 1
        return freed, evicted

    def evict_alone(self, txn, limit: int, max_entries: int) -> tuple[int, int]:
        """evict in a transaction of its own; totals are written only when something went."""
        totals = self.totals(txn)
        freed, evicted = self.evict(txn, limit, totals, max_entries)
        if evicted:  # a write of unchanged totals would still need pages of a full map
            self.write_totals(txn, totals)
        return freed, evicted

    def _stamp(self, txn, key: bytes, stamp: int) -> None:
        packed = _U64.pack(stamp)
        txn.put(packed + key, b"", db=self._lru)
        if self._atime is not None:
            txn.put(key, packed, db=self._atime)

    def _stamp_of(self, txn, key: bytes) -> int | None:
        if self._atime is not None:
            raw = txn.get(key, db=self._atime)
            return _U64.unpack(raw)[0] if raw is not None else None
        value = txn.get(key, db=self._entries)
        return self._stamp_in_value(value) if value is not None else None

    def _note_orphan(self, key: bytes) -> None:
        if not self._orphan_logged:
            self._orphan_logged = True
            self._log.warning("%s: deleted an LRU row with no atime row (key %s has no stamp); "
                              "the store was damaged", self._where, key.hex())


class _MapGuard:
    """Transactions run together; a map resize waits until none is open in this process.

    LMDB allows set_mapsize only with no transaction active in the process: remapping under an
    open one would leave its buffers pointing at unmapped memory. Resizes are rare, so waiting
    transactions simply queue behind one.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._open = 0
        self._resizing = False

    @contextmanager
    def txn(self):
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._open += 1
        try:
            yield
        finally:
            with self._cond:
                self._open -= 1
                if not self._open:
                    self._cond.notify_all()

    @contextmanager
    def resize(self):
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._open:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()
