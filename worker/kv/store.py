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

The environment, its map and its failures, and the LRU budget are shared.lmdb_store's (the
n-gram archive's too); `get`/`contains` (request path) may run while another thread writes.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from shared.lmdb_store import LmdbEnv, LruBudget, StoreUnavailable, Totals
from worker.kv.block_format import FORMAT_VERSION, MAGIC, BlockCodec

__all__ = ["FORMAT_VERSION", "MAGIC", "KVStore", "KVStoreUnavailable", "StoreStats", "check_key"]

log = logging.getLogger("reame.kvstore")

KEY_BYTES = 32

_DB_NAMES = (b"blocks", b"lru", b"atime", b"meta")
_MAX_MAP_EVICTIONS_PER_TXN = 64


class KVStoreUnavailable(StoreUnavailable):
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
        self._lock = threading.Lock()     # the counters
        self._counts = dict.fromkeys(("hits", "misses", "corrupt", "writes", "evictions"), 0)
        self._corrupt_kept: set[bytes] = set()  # corrupt but not deletable: warn once only
        # LMDB needs room above the payload bytes for B-tree and free pages.
        max_map = max_map_bytes if max_map_bytes is not None else 2 * budget_bytes + (64 << 20)
        self._env = LmdbEnv(self.path, what="prefix store", db_names=_DB_NAMES, map_bytes=initial_map_bytes,
                            max_map_bytes=max_map, log=log, unavailable=KVStoreUnavailable)
        self._blocks, lru, atime, meta = self._env.dbs
        self._lru = LruBudget(self._blocks, lru, meta, atime_db=atime, what="prefix store", path=self.path, log=log)

    # ---- reads (request path) ------------------------------------------------------------------

    def get(self, key: bytes, token_ids) -> bytes | None:
        """The verified, uncompressed payload stored under key for exactly these token ids, or None."""
        check_key(key)
        tokens = _token_bytes(token_ids)
        try:
            found, payload, problem = self._env.read(lambda txn: self._load(txn, key, tokens))
        except lmdb.Error as exc:
            self._env.note_read_failure(exc)
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
            return self._env.read(lambda txn: txn.get(key, db=self._blocks) is not None)
        except lmdb.Error as exc:
            self._env.note_read_failure(exc)
            return False

    @property
    def writes_enabled(self) -> bool:
        """False once a write failed for good (disk full, read-only): puts are skipped from then on."""
        return self._env.writes_enabled

    def stats(self) -> StoreStats:
        try:
            totals = self._env.read(self._lru.totals)
        except lmdb.Error as exc:
            self._env.note_read_failure(exc)
            totals = Totals(0, 0)
        with self._lock:
            return StoreStats(entries=totals.entries, bytes_used=totals.bytes_used, budget_bytes=self._budget,
                              writes_enabled=self._env.writes_enabled, write_errors=self._env.write_errors,
                              **self._counts)

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
            self._env.write_or_none(lambda txn: self._lru.touch(txn, keys))

    def delete(self, key: bytes) -> None:
        check_key(key)
        self._env.write_or_none(lambda txn: self._delete_in_txn(txn, key))

    def close(self) -> None:
        self._env.close()

    # ---- reading -------------------------------------------------------------------------------

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
        if self._env.write_or_none(lambda txn: self._delete_in_txn(txn, key)) is None:
            self._corrupt_kept.add(key)

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
        if not self._env.writes_enabled or not prepared:
            return 0, 0
        try:
            absent = self._env.read(lambda txn: self._absent(txn, prepared))
        except lmdb.Error as exc:
            self._env.note_read_failure(exc)
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
        env = self._env
        while env.writes_enabled:
            try:
                written, present, evicted = env.write(lambda txn: self._put_in_txn(txn, encoded))
                self._count("writes", written)
                self._count("evictions", evicted)
                return written, present
            except lmdb.MapFullError:
                pass
            except (lmdb.Error, OSError) as exc:
                env.stop_writes(str(exc))
                return 0, 0
            if env.grow_map():
                continue
            if evicted_for_map:
                env.count_write_error()
                log.debug("prefix store at %s: map still full after evicting; %d entries not stored",
                          self.path, len(encoded))
                return 0, 0
            evicted_for_map = True
            # The budget left room but LMDB's pages used the map up. Evicting a slack below the
            # budget frees pages for the retry. It cannot help a store already below that (the map
            # is too small for the budget) nor a map too full for even the deletes (copy-on-write
            # needs pages too): both are as persistent as a full disk.
            full = f"the LMDB map is full at its maximum of {env.max_map_bytes} bytes"
            try:
                freed = self._evict_for_map(self._budget - need - max(need, self._budget // 8))
            except lmdb.MapFullError:
                env.stop_writes(f"{full}, with no page left even to evict")
                return 0, 0
            except (lmdb.Error, OSError) as exc:
                env.stop_writes(str(exc))
                return 0, 0
            if not freed:
                env.stop_writes(f"{full}, too small for the budget of {self._budget} bytes")
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
            freed, evicted = self._env.write(lambda txn: self._lru.evict_alone(txn, limit, per_txn))
            self._count("evictions", evicted)
            freed_total += freed
            per_txn = min(2 * per_txn, _MAX_MAP_EVICTIONS_PER_TXN)
            if not freed:
                return freed_total

    def _put_in_txn(self, txn, encoded) -> tuple[int, int, int]:
        totals = self._lru.totals(txn)
        written = present = evicted = 0
        for key, value in encoded:
            existing = txn.get(key, db=self._blocks)
            if existing is not None:
                if self._codec.header_problem(existing) is None:  # another process stored it meanwhile
                    present += 1
                    continue
                self._lru.remove(txn, key, totals)
            evicted += self._lru.evict(txn, self._budget - len(value), totals)[1]
            self._lru.put(txn, key, value, totals)
            written += 1
        self._lru.write_totals(txn, totals)
        return written, present, evicted

    def _delete_in_txn(self, txn, key: bytes) -> bool:
        """True once the transaction ran (the key may have been absent already)."""
        totals = self._lru.totals(txn)
        if self._lru.remove(txn, key, totals):
            self._lru.write_totals(txn, totals)
        return True

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] += n


def check_key(key) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a store key is {KEY_BYTES} bytes, got {key!r:.80}")


def _token_bytes(token_ids) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()
