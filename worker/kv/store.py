"""The host's persistent prefix-cache tier: one LMDB environment of KV-cache blocks, LRU-evicted.

Each entry is one KV block (the K/V of `block_size` tokens for every layer, `payload_bytes` raw
bytes) keyed by its 32-byte chained block hash. Several worker processes open the same directory
at once; LMDB's lock file serializes their write transactions and readers never block.

Sub-databases, all changed only inside one write transaction, so every invariant below holds at
every commit and a failed or partial write is never visible:
  blocks  key -> value (header + token ids + stored payload: worker.kv.block_format)
  lru     stamp (8-byte big-endian time_ns) + key -> b""   the access order, oldest first
  atime   key -> stamp                                     finds a key's `lru` row
  meta    b"bytes_used", b"entries" -> u64 big-endian      totals over `blocks`, host-wide
Invariants: `lru` and `atime` hold exactly the keys of `blocks`; meta bytes_used is the sum of
len(value) over `blocks` (LMDB page overhead is not counted) and stays <= budget_bytes.

Nothing read from disk is trusted: `get` checks magic, format version, model fingerprint, dtype,
lengths, token ids and a CRC, and deletes what fails (a corrupt entry is a miss, never an error).
Writes stop for the life of the process after the first persistent failure (disk full, read-only,
a map that cannot hold the budget); reads go on.

Thread safety: `get`/`contains` (request path) may run while another thread writes. Resizing the
map is only legal with no transaction open in this process, so `_MapGuard` holds resizes back
until open transactions end.
"""
from __future__ import annotations

import logging
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from shared.errors import ConfigError
from shared.private_state import make_private
from worker.kv.block_format import FORMAT_VERSION, MAGIC, BlockCodec

__all__ = ["FORMAT_VERSION", "MAGIC", "KVStore", "KVStoreUnavailable", "StoreStats", "check_key"]

log = logging.getLogger("reame.kvstore")

KEY_BYTES = 32
_TOTAL = struct.Struct(">Q")
_STAMP = struct.Struct(">Q")

_DB_NAMES = (b"blocks", b"lru", b"atime", b"meta")
_MAX_MAP_EVICTIONS_PER_TXN = 64
_RESIZE_RETRIES = 8  # each retry adopts a map another process grew; more in a row is a bug


class KVStoreUnavailable(Exception):
    """The store cannot be opened at all; the caller runs with the RAM cache only."""


@dataclass(frozen=True)
class StoreStats:
    entries: int            # host-wide, from meta
    bytes_used: int         # host-wide, from meta
    budget_bytes: int
    hits: int               # this process's counters from here on
    misses: int
    corrupt: int            # entries found invalid (and deleted)
    writes: int
    evictions: int
    write_errors: int
    writes_enabled: bool


class KVStore:
    def __init__(self, path, *, fingerprint: bytes, payload_bytes: int, budget_bytes: int,
                 dtype: str = "float16", compression: str = "zstd",
                 initial_map_bytes: int = 64 << 20, max_map_bytes: int | None = None):
        if budget_bytes < 1:
            raise ValueError("budget_bytes must be positive")
        self.path = Path(path)
        self._codec = BlockCodec(fingerprint=fingerprint, payload_bytes=payload_bytes, dtype=dtype,
                                 compression=compression)
        self._payload_bytes = payload_bytes
        self._budget = budget_bytes
        # LMDB needs room above the payload bytes for B-tree and free pages.
        self._max_map = max_map_bytes if max_map_bytes is not None else 2 * budget_bytes + (64 << 20)
        self._guard = _MapGuard()
        self._lock = threading.Lock()     # counters, writes_enabled, the stamp clock
        self._counts = dict.fromkeys(
            ("hits", "misses", "corrupt", "writes", "evictions", "write_errors"), 0)
        self._writes_enabled = True
        self._last_stamp = 0
        self._read_failure_logged = False
        self._corrupt_kept: set[bytes] = set()  # corrupt but not deletable: warn once only
        self._orphan_logged = False
        self._env, self._dbs = _open_env(self.path, min(initial_map_bytes, self._max_map))
        self._blocks, self._lru, self._atime, self._meta = self._dbs

    # ---- reads (request path) ------------------------------------------------------------------

    def get(self, key: bytes, token_ids) -> bytes | None:
        """The verified, uncompressed payload stored under key for exactly these token ids, or None."""
        check_key(key)
        tokens = _token_bytes(token_ids)
        try:
            found, payload, problem = self._read(lambda txn: self._load(txn, key, tokens))
        except lmdb.Error as exc:
            self._note_read_failure(exc)
            self._count("misses")
            return None
        if not found:
            self._count("misses")
            return None
        if problem is not None:
            self._discard_corrupt(key, problem)
            return None
        self._count("hits")
        return payload

    def contains(self, key: bytes) -> bool:
        """Whether an entry exists under key; not verified (a later `get` may still find it corrupt)."""
        check_key(key)
        try:
            return self._read(lambda txn: txn.get(key, db=self._blocks) is not None)
        except lmdb.Error as exc:
            self._note_read_failure(exc)
            return False

    @property
    def writes_enabled(self) -> bool:
        """False once a write failed for good (disk full, read-only): puts are skipped from then on."""
        return self._writes_enabled

    def stats(self) -> StoreStats:
        try:
            totals = self._read(lambda txn: _Totals.read(txn, self._meta))
        except lmdb.Error as exc:
            self._note_read_failure(exc)
            totals = _Totals(0, 0)
        with self._lock:
            return StoreStats(entries=totals.entries, bytes_used=totals.bytes_used, budget_bytes=self._budget,
                              writes_enabled=self._writes_enabled, **self._counts)

    # ---- writes (the StoreWriter thread) -------------------------------------------------------

    def put(self, key: bytes, token_ids, payload) -> bool:
        """True when the entry is stored afterwards (written now or already there with a valid header)."""
        written, present = self._put_items([(key, token_ids, payload)])
        return written + present == 1

    def put_many(self, items: list[tuple[bytes, list[int], bytes]]) -> int:
        """Writes the items absent from the store in one transaction; returns how many it wrote."""
        return self._put_items(items)[0]

    def touch(self, keys) -> None:
        """Marks the present ones among keys most recently used, in one write transaction."""
        keys = list(keys)
        for key in keys:
            check_key(key)
        if keys:
            self._write_small(lambda txn: self._touch_in_txn(txn, keys))

    def delete(self, key: bytes) -> None:
        check_key(key)
        self._write_small(lambda txn: self._delete_in_txn(txn, key))

    def close(self) -> None:
        with self._guard.resize():
            self._env.close()

    # ---- reading -------------------------------------------------------------------------------

    def _read(self, body):
        """body(txn) in a read transaction whose buffers point into the map (no copies)."""
        for _ in range(_RESIZE_RETRIES):
            try:
                with self._guard.txn(), self._env.begin(buffers=True) as txn:
                    return body(txn)
            except lmdb.MapResizedError:
                self._adopt_map_size()
        raise lmdb.MapResizedError("the map kept being resized by other processes")

    def _load(self, txn, key: bytes, tokens: bytes) -> tuple[bool, bytes | None, str | None]:
        value = txn.get(key, db=self._blocks)
        if value is None:
            return False, None, None
        payload, problem = self._codec.decode(value, tokens)
        return True, payload, problem

    def _discard_corrupt(self, key: bytes, problem: str) -> None:
        if key in self._corrupt_kept:
            self._count("misses")
            return
        self._count("corrupt")
        log.warning("prefix store at %s: discarded corrupt entry %s: %s", self.path, key.hex(), problem)
        if self._write_small(lambda txn: self._delete_in_txn(txn, key)) is None:
            self._corrupt_kept.add(key)

    def _note_read_failure(self, exc: Exception) -> None:
        if not self._read_failure_logged:
            self._read_failure_logged = True
            log.warning("prefix store at %s: read failed: %s; treated as a miss", self.path, exc)

    # ---- writing -------------------------------------------------------------------------------

    def _put_items(self, items) -> tuple[int, int]:
        """(written, already present) for items, after validating them."""
        prepared = []
        for key, token_ids, payload in items:
            check_key(key)
            view = memoryview(payload).cast("B")
            if len(view) != self._payload_bytes:
                raise ValueError(f"payload is {len(view)} bytes, the store holds {self._payload_bytes}")
            prepared.append((key, token_ids, view))
        if not self._writes_enabled or not prepared:
            return 0, 0
        try:
            absent = self._read(lambda txn: self._absent(txn, prepared))
        except lmdb.Error as exc:
            self._note_read_failure(exc)
            absent = prepared
        present = len(prepared) - len(absent)
        # Compressing here, before the write transaction, keeps other processes' writers unblocked.
        encoded = []
        for key, token_ids, view in absent:
            tokens = _token_bytes(token_ids)
            value = self._codec.encode(tokens, len(tokens) // 4, view)
            if len(value) <= self._budget:  # a single entry over the budget is never stored
                encoded.append((key, value))
        if not encoded:
            return 0, present
        written, present_now = self._commit_puts(encoded)
        return written, present + present_now

    def _absent(self, txn, items) -> list:
        """The items not yet stored with a valid header, first occurrence of each key only."""
        seen, absent = set(), []
        for key, token_ids, view in items:
            if key in seen:
                continue
            seen.add(key)
            value = txn.get(key, db=self._blocks)
            if value is None or self._codec.header_problem(value) is not None:
                absent.append((key, token_ids, view))
        return absent

    def _commit_puts(self, encoded: list[tuple[bytes, bytes]]) -> tuple[int, int]:
        """Writes encoded in one transaction, growing the map or evicting when it is full."""
        need = sum(len(value) for _, value in encoded)
        evicted_for_map = False
        while self._writes_enabled:
            try:
                written, present, evicted = self._write(lambda txn: self._put_in_txn(txn, encoded))
                self._count("writes", written)
                self._count("evictions", evicted)
                return written, present
            except lmdb.MapFullError:
                pass
            except (lmdb.Error, OSError) as exc:
                self._stop_writes(str(exc))
                return 0, 0
            if self._grow_map():
                continue
            if evicted_for_map:
                self._count("write_errors")
                log.debug("prefix store at %s: map still full after evicting; %d entries not stored",
                          self.path, len(encoded))
                return 0, 0
            evicted_for_map = True
            # The budget left room but LMDB's pages used the map up. Evicting a slack below the
            # budget frees pages for the retry. It cannot help a store already below that (the map
            # is too small for the budget) nor a map too full for even the deletes (copy-on-write
            # needs pages too): both are as persistent as a full disk.
            full = f"the LMDB map is full at its maximum of {self._max_map} bytes"
            try:
                freed = self._evict_for_map(self._budget - need - max(need, self._budget // 8))
            except lmdb.MapFullError:
                self._stop_writes(f"{full}, with no page left even to evict")
                return 0, 0
            except (lmdb.Error, OSError) as exc:
                self._stop_writes(str(exc))
                return 0, 0
            if not freed:
                self._stop_writes(f"{full}, too small for the budget of {self._budget} bytes")
                return 0, 0
        return 0, 0

    def _evict_for_map(self, limit: int) -> int:
        """Evicts down to limit, one entry in the first transaction and twice as many in each next.

        Freed pages become reusable only after their transaction commits, and a full map may
        have barely the pages to delete one entry (copy-on-write), so one big eviction would fail.
        Returns the bytes freed.
        """
        freed_total, per_txn = 0, 1
        while True:
            freed, evicted = self._write(lambda txn: self._evict_alone_in_txn(txn, limit, per_txn))
            self._count("evictions", evicted)
            freed_total += freed
            per_txn = min(2 * per_txn, _MAX_MAP_EVICTIONS_PER_TXN)
            if not freed:
                return freed_total

    def _write_small(self, body):
        """body's result from one write transaction (growing the map if needed), or None on failure."""
        while self._writes_enabled:
            try:
                return self._write(body)
            except lmdb.MapFullError:
                pass
            except (lmdb.Error, OSError) as exc:
                self._stop_writes(str(exc))
                return None
            if not self._grow_map():
                self._count("write_errors")
                return None
        return None

    def _write(self, body):
        """body(txn) in one write transaction, committed when body returns; MapFullError propagates."""
        for _ in range(_RESIZE_RETRIES):
            try:
                with self._guard.txn(), self._env.begin(write=True, buffers=True) as txn:
                    return body(txn)
            except lmdb.MapResizedError:
                self._adopt_map_size()
        raise lmdb.MapResizedError("the map kept being resized by other processes")

    def _put_in_txn(self, txn, encoded) -> tuple[int, int, int]:
        totals = _Totals.read(txn, self._meta)
        written = present = evicted = 0
        for key, value in encoded:
            existing = txn.get(key, db=self._blocks)
            if existing is not None:
                if self._codec.header_problem(existing) is None:  # another process stored it meanwhile
                    present += 1
                    continue
                self._remove_in_txn(txn, key, totals)
            evicted += self._evict_in_txn(txn, self._budget - len(value), totals)[1]
            txn.put(key, value, db=self._blocks)
            self._stamp_in_txn(txn, key)
            totals.add(len(value))
            written += 1
        totals.write(txn, self._meta)
        return written, present, evicted

    def _evict_alone_in_txn(self, txn, limit: int, max_entries: int) -> tuple[int, int]:
        totals = _Totals.read(txn, self._meta)
        freed, evicted = self._evict_in_txn(txn, limit, totals, max_entries)
        if evicted:  # a write of unchanged totals would still need pages of a full map
            totals.write(txn, self._meta)
        return freed, evicted

    def _evict_in_txn(self, txn, limit: int, totals: _Totals,
                      max_entries: int | None = None) -> tuple[int, int]:
        """Removes least recently used entries until bytes_used <= limit; (bytes freed, entries)."""
        freed = evicted = 0
        cursor = txn.cursor(db=self._lru)
        while totals.bytes_used > limit and evicted != max_entries and cursor.first():
            row = bytes(cursor.key())
            key = row[_STAMP.size:]
            stamp = txn.get(key, db=self._atime)
            # The row goes first, by itself: one that `atime` does not point back to (a damaged
            # store) would otherwise stay first forever, spinning inside the host-wide write lock.
            cursor.delete()
            if stamp is not None and bytes(stamp) != row[:_STAMP.size]:
                continue  # a stale duplicate: the key's own row comes later
            if stamp is None:
                self._note_orphan(key)
            size = self._remove_in_txn(txn, key, totals)
            if size:
                freed += size
                evicted += 1
        return freed, evicted

    def _note_orphan(self, key: bytes) -> None:
        if not self._orphan_logged:
            self._orphan_logged = True
            log.warning("prefix store at %s: deleted an LRU row with no atime row (key %s); "
                        "the store was damaged", self.path, key.hex())

    def _remove_in_txn(self, txn, key: bytes, totals: _Totals) -> int:
        """Deletes key from every sub-database; returns the value bytes removed (0 if absent)."""
        stamp = txn.get(key, db=self._atime)
        if stamp is not None:
            txn.delete(bytes(stamp) + key, db=self._lru)
            txn.delete(key, db=self._atime)
        value = txn.get(key, db=self._blocks)
        if value is None:
            return 0
        size = len(value)
        txn.delete(key, db=self._blocks)
        totals.remove(size)
        return size

    def _delete_in_txn(self, txn, key: bytes) -> bool:
        """True once the transaction ran (the key may have been absent already)."""
        totals = _Totals.read(txn, self._meta)
        if self._remove_in_txn(txn, key, totals):
            totals.write(txn, self._meta)
        return True

    def _touch_in_txn(self, txn, keys) -> None:
        for key in keys:
            stamp = txn.get(key, db=self._atime)
            if stamp is not None:
                txn.delete(bytes(stamp) + key, db=self._lru)
                self._stamp_in_txn(txn, key)

    def _stamp_in_txn(self, txn, key: bytes) -> None:
        with self._lock:  # strictly increasing in this process, so touch-after-put always wins
            self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
            stamp = _STAMP.pack(self._last_stamp)
        txn.put(stamp + key, b"", db=self._lru)
        txn.put(key, stamp, db=self._atime)

    # ---- the map and failures ------------------------------------------------------------------

    def _grow_map(self) -> bool:
        """Doubles the map up to max_map_bytes; False when it is already there (or cannot grow)."""
        with self._guard.resize():
            current = self._env.info()["map_size"]
            if current >= self._max_map:
                return False
            try:
                self._env.set_mapsize(min(2 * current, self._max_map))
            except lmdb.Error as exc:
                log.debug("prefix store at %s: growing the map failed: %s", self.path, exc)
                return False
        return True

    def _adopt_map_size(self) -> None:
        """Another process grew the map; size 0 makes LMDB adopt the size recorded on disk."""
        with self._guard.resize():
            self._env.set_mapsize(0)

    def _stop_writes(self, reason: str) -> None:
        with self._lock:
            self._counts["write_errors"] += 1
            first = self._writes_enabled
            self._writes_enabled = False
        if first:
            log.warning("prefix store at %s: writes stopped: %s; serving continues", self.path, reason)

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] += n


class _Totals:
    """meta's bytes_used and entries, read and written inside one write transaction."""

    def __init__(self, bytes_used: int, entries: int):
        self.bytes_used = bytes_used
        self.entries = entries

    @classmethod
    def read(cls, txn, meta_db) -> _Totals:
        def field(name: bytes) -> int:
            raw = txn.get(name, db=meta_db)
            return _TOTAL.unpack(raw)[0] if raw is not None else 0
        return cls(field(b"bytes_used"), field(b"entries"))

    def add(self, size: int) -> None:
        self.bytes_used += size
        self.entries += 1

    def remove(self, size: int) -> None:
        self.bytes_used -= size
        self.entries -= 1

    def write(self, txn, meta_db) -> None:
        txn.put(b"bytes_used", _TOTAL.pack(self.bytes_used), db=meta_db)
        txn.put(b"entries", _TOTAL.pack(self.entries), db=meta_db)


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


def _open_env(path: Path, map_bytes: int):
    env = None
    try:
        # Owner-only: the entries hold other users' prompts (their token ids, and K/V that give
        # them away). The workers of a host run as one user, so they still share it.
        make_private(path, f"prefix store at {path}", log)
        # readahead off: reads are random single blocks; metasync off: a system crash may undo the
        # last commit but never breaks the B-tree (fine for a cache, half the fsyncs).
        env = lmdb.open(str(path), map_size=map_bytes, max_dbs=len(_DB_NAMES), subdir=True, mode=0o600,
                        lock=True, readahead=False, metasync=False)
        env.reader_check()  # frees reader slots left by crashed processes
        with env.begin(write=True) as txn:
            dbs = tuple(env.open_db(name, txn=txn) for name in _DB_NAMES)
        return env, dbs
    except (lmdb.Error, OSError) as exc:
        if env is not None:
            env.close()
        raise KVStoreUnavailable(f"prefix store at {path} cannot be opened: {exc}") from exc
    except ConfigError as exc:  # another user's directory: not used
        raise KVStoreUnavailable(exc.message) from exc


def check_key(key) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a store key is {KEY_BYTES} bytes, got {key!r:.80}")


def _token_bytes(token_ids) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()
