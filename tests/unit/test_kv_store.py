"""KVStore and StoreWriter on real LMDB directories: round trips, every kind of corruption, LRU
eviction under a budget, restarts, two processes writing at once, and write failures (a map that
cannot grow, a file-size limit) that must stop writes once and leave reads working.

The value layout is re-implemented here on purpose (`_forge`), so that a change of the on-disk
format has to change this test too.
"""
from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import resource
import signal
import stat
import struct
import threading
import zlib
from concurrent.futures import ProcessPoolExecutor

import lmdb
import numpy as np
import pytest
import zstandard

from worker.kv.store import FORMAT_VERSION, KVStore, KVStoreUnavailable
from worker.kv.store_writer import StoreWriter

FP = hashlib.sha256(b"model A").digest()
OTHER_FP = hashlib.sha256(b"model B").digest()
PAYLOAD = 4096
HEADER = struct.Struct("<4sHBB32sIIII")
VALUE_BYTES = HEADER.size + 16 * 4 + PAYLOAD  # one uncompressed entry of 16 tokens


def key(i: int) -> bytes:
    return hashlib.sha256(b"block %d" % i).digest()


def tokens(i: int) -> list[int]:
    return list(range(16 * i, 16 * i + 16))


def payload(i: int, size: int = PAYLOAD) -> bytes:
    """float16 K/V-like bytes: compressible only a little, like the real thing."""
    return np.random.default_rng(i).standard_normal(size // 2).astype(np.float16).tobytes()


def open_store(path, **overrides) -> KVStore:
    options = dict(fingerprint=FP, payload_bytes=PAYLOAD, budget_bytes=64 * VALUE_BYTES)
    options.update(overrides)
    return KVStore(path, **options)


def raw_entries(path) -> dict[str, dict]:
    """Every sub-database, read with plain lmdb (the store must be closed: one open per process)."""
    env = lmdb.open(str(path), max_dbs=4)
    try:
        with env.begin() as txn:
            dbs = {name: dict(txn.cursor(db=env.open_db(name.encode(), txn=txn)))
                   for name in ("blocks", "lru", "atime", "meta")}
    finally:
        env.close()
    return dbs


def assert_consistent(path, budget: int) -> dict[bytes, bytes]:
    """The store's invariants, from a recount; returns the blocks."""
    dbs = raw_entries(path)
    blocks = dbs["blocks"]
    assert set(dbs["atime"]) == set(blocks)
    assert {row[8:]: row[:8] for row in dbs["lru"]} == dbs["atime"]
    bytes_used = sum(len(value) for value in blocks.values())
    assert struct.unpack(">Q", dbs["meta"][b"bytes_used"])[0] == bytes_used
    assert struct.unpack(">Q", dbs["meta"][b"entries"])[0] == len(blocks)
    assert bytes_used <= budget
    return blocks


def rewrite_value(path, block_key: bytes, change) -> None:
    """Replaces one stored value by change(value), keeping meta's byte count consistent."""
    env = lmdb.open(str(path), max_dbs=4)
    try:
        with env.begin(write=True) as txn:
            blocks, meta = env.open_db(b"blocks", txn=txn), env.open_db(b"meta", txn=txn)
            old = txn.get(block_key, db=blocks)
            new = change(bytearray(old))
            txn.put(block_key, bytes(new), db=blocks)
            used = struct.unpack(">Q", txn.get(b"bytes_used", db=meta))[0]
            txn.put(b"bytes_used", struct.pack(">Q", used - len(old) + len(new)), db=meta)
    finally:
        env.close()


def _forge(stored: bytes, *, code: int, raw_len: int = PAYLOAD, ids=tokens(1)) -> bytes:
    """A value with a valid header and checksum around any stored payload."""
    token_bytes = np.asarray(ids, dtype="<i4").tobytes()
    head = HEADER.pack(b"RKVB", FORMAT_VERSION, code, 1, FP, len(ids), len(stored), raw_len, 0)[:-4]
    crc = zlib.crc32(stored, zlib.crc32(token_bytes, zlib.crc32(head)))
    return head + struct.pack("<I", crc) + token_bytes + stored


# ---- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_round_trip_returns_identical_bytes(tmp_path, compression):
    store = open_store(tmp_path / "a" / "store", compression=compression)
    assert store.put(key(1), tokens(1), payload(1))
    assert store.put_many([(key(2), tokens(2), payload(2)), (key(3), tokens(3), b"\0" * PAYLOAD)]) == 2
    assert store.get(key(1), tokens(1)) == payload(1)
    assert store.get(key(2), tokens(2)) == payload(2)
    assert store.get(key(3), tokens(3)) == b"\0" * PAYLOAD
    assert store.get(key(4), tokens(4)) is None
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.writes, stats.corrupt) == (3, 1, 3, 0)
    assert stats.entries == 3
    store.close()
    stored = raw_entries(tmp_path / "a" / "store")["blocks"]
    if compression == "zstd":  # zeros shrink to almost nothing; raw float16 shrinks a little
        assert len(stored[key(3)]) < 200 and len(stored[key(1)]) < VALUE_BYTES
    else:
        assert {len(value) for value in stored.values()} == {VALUE_BYTES}


def test_put_of_a_present_key_writes_nothing_and_duplicates_count_once(tmp_path):
    store = open_store(tmp_path)
    assert store.put(key(1), tokens(1), payload(1))
    assert store.put(key(1), tokens(1), payload(9))  # present: not rewritten
    assert store.put_many([(key(1), tokens(1), payload(1)), (key(2), tokens(2), payload(2)),
                           (key(2), tokens(2), payload(2))]) == 1
    assert store.get(key(1), tokens(1)) == payload(1)
    assert store.stats().writes == 2 and store.stats().entries == 2


def test_other_token_ids_are_a_corrupt_entry_and_delete_it(tmp_path, caplog):
    store = open_store(tmp_path)
    store.put(key(1), tokens(1), payload(1))
    with caplog.at_level(logging.WARNING, logger="reame.kvstore"):
        assert store.get(key(1), tokens(2)) is None
    assert "token ids differ" in caplog.text
    assert not store.contains(key(1))
    assert store.get(key(1), tokens(1)) is None
    stats = store.stats()
    assert (stats.corrupt, stats.misses, stats.entries, stats.bytes_used) == (1, 1, 0, 0)


def test_another_fingerprint_does_not_read_the_entry(tmp_path):
    store = open_store(tmp_path)
    store.put(key(1), tokens(1), payload(1))
    store.close()
    other = open_store(tmp_path, fingerprint=OTHER_FP)
    assert other.get(key(1), tokens(1)) is None
    assert other.stats().corrupt == 1
    other.close()
    assert open_store(tmp_path).get(key(1), tokens(1)) is None


def test_programming_errors_raise(tmp_path):
    store = open_store(tmp_path)
    with pytest.raises(ValueError, match="32 bytes"):
        store.get(b"short", tokens(1))
    with pytest.raises(ValueError, match="32 bytes"):
        store.put("x" * 32, tokens(1), payload(1))
    with pytest.raises(ValueError, match="payload is 100 bytes"):
        store.put(key(1), tokens(1), b"x" * 100)


# ---- corruption ------------------------------------------------------------------------------


def _flip_last_byte(value):
    value[-1] ^= 0xFF
    return value


def _set_version(value):
    value[4:6] = struct.pack("<H", FORMAT_VERSION + 98)
    return value


def _set_magic(value):
    value[:4] = b"XXXX"
    return value


CORRUPTIONS = {
    "flipped payload byte": (_flip_last_byte, "checksum mismatch"),
    "truncated value": (lambda value: value[:-100], "inconsistent"),
    "truncated header": (lambda value: value[:20], "shorter than the header"),
    "unknown format version": (_set_version, f"format version {FORMAT_VERSION + 98}"),
    "bad magic": (_set_magic, "bad magic"),
    "undecodable zstd": (lambda value: _forge(b"not a zstd frame" * 8, code=1), "compress"),
    "zstd of the wrong size": (
        lambda value: _forge(zstandard.ZstdCompressor().compress(payload(1, PAYLOAD - 2)), code=1),
        "does not declare"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupt_value_is_a_miss_counted_deleted_and_logged_once(tmp_path, caplog, corruption):
    change, reason = CORRUPTIONS[corruption]
    store = open_store(tmp_path)
    store.put_many([(key(i), tokens(i), payload(i)) for i in range(3)])
    store.close()
    rewrite_value(tmp_path, key(1), change)
    sizes = {k: len(v) for k, v in raw_entries(tmp_path)["blocks"].items()}

    store = open_store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="reame.kvstore"):
        assert store.get(key(1), tokens(1)) is None
        assert store.get(key(1), tokens(1)) is None
    assert len(caplog.records) == 1 and reason in caplog.text
    stats = store.stats()
    assert (stats.corrupt, stats.misses) == (1, 1)
    assert (stats.entries, stats.bytes_used) == (2, sum(sizes.values()) - sizes[key(1)])
    assert not store.contains(key(1))
    assert store.get(key(0), tokens(0)) == payload(0)
    store.close()
    assert set(assert_consistent(tmp_path, 64 * VALUE_BYTES)) == {key(0), key(2)}


def test_a_corrupt_value_with_a_valid_header_is_replaced_by_the_next_put(tmp_path):
    store = open_store(tmp_path)
    store.put(key(1), tokens(1), payload(1))
    store.close()
    rewrite_value(tmp_path, key(1), _set_magic)
    store = open_store(tmp_path)
    assert store.put(key(1), tokens(1), payload(1))  # the bad header is not "present"
    assert store.get(key(1), tokens(1)) == payload(1)
    assert store.stats().entries == 1
    store.close()
    assert set(assert_consistent(tmp_path, 64 * VALUE_BYTES)) == {key(1)}


# ---- eviction and restarts -------------------------------------------------------------------


def test_eviction_keeps_the_budget_and_removes_the_least_recently_used(tmp_path):
    budget = 10 * VALUE_BYTES
    store = open_store(tmp_path, compression="none", budget_bytes=budget)
    for i in range(10):
        assert store.put(key(i), tokens(i), payload(i))
    store.touch([key(0), key(3), key(99)])  # 99 is absent: ignored
    assert store.put_many([(key(10), tokens(10), payload(10)), (key(11), tokens(11), payload(11))]) == 2
    assert store.put(key(12), tokens(12), payload(12))
    present = [i for i in range(13) if store.contains(key(i))]
    assert present == [0, 3, 5, 6, 7, 8, 9, 10, 11, 12]  # 1, 2 and 4 were the oldest untouched
    stats = store.stats()
    assert (stats.entries, stats.bytes_used, stats.evictions) == (10, budget, 3)
    store.close()

    assert_consistent(tmp_path, budget)
    reopened = open_store(tmp_path, compression="none", budget_bytes=budget)
    assert (reopened.stats().entries, reopened.stats().bytes_used) == (10, budget)
    for i in range(13, 40):
        reopened.put(key(i), tokens(i), payload(i))
        assert reopened.stats().bytes_used <= budget
    assert [i for i in range(40) if reopened.contains(key(i))] == list(range(30, 40))


def test_an_lru_row_without_its_atime_row_is_deleted_not_spun_on(tmp_path, caplog):
    budget = 10 * VALUE_BYTES
    store = open_store(tmp_path, compression="none", budget_bytes=budget)
    store.put_many([(key(i), tokens(i), payload(i)) for i in range(10)])
    store.close()
    env = lmdb.open(str(tmp_path), max_dbs=4)
    with env.begin(write=True) as txn:
        lru, atime = env.open_db(b"lru", txn=txn), env.open_db(b"atime", txn=txn)
        txn.put(struct.pack(">Q", 1) + key(100), b"", db=lru)  # oldest of all, for an entry that does not exist
        txn.delete(key(0), db=atime)  # key(0)'s row (the next oldest) no longer points back
    env.close()

    store = open_store(tmp_path, compression="none", budget_bytes=budget)
    # Before the fix this put spun forever inside its write transaction: run it where a hang shows.
    done = []
    writer = threading.Thread(target=lambda: done.append(store.put(key(10), tokens(10), payload(10))), daemon=True)
    with caplog.at_level(logging.WARNING, logger="reame.kvstore"):
        writer.start()
        writer.join(10)
    assert done == [True], "the eviction loop did not finish"
    assert [i for i in range(11) if store.contains(key(i))] == list(range(1, 11))
    assert caplog.text.count("LRU row with no atime row") == 1
    store.close()
    assert_consistent(tmp_path, budget)


def test_the_store_is_owner_only(tmp_path, caplog):
    store = open_store(tmp_path / "new" / "store")
    store.put(key(1), tokens(1), payload(1))
    store.close()
    where = tmp_path / "new" / "store"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [where, *where.iterdir()]}
    assert modes == {"store": 0o700, "data.mdb": 0o600, "lock.mdb": 0o600}

    (tmp_path / "old").mkdir()
    os.chmod(tmp_path / "old", 0o755)  # as an older version left it: made private, and said
    with caplog.at_level(logging.WARNING, logger="reame.kvstore"):
        open_store(tmp_path / "old").close()
    assert stat.S_IMODE((tmp_path / "old").stat().st_mode) == 0o700
    assert f"{tmp_path / 'old'} was open to other users (mode 755" in caplog.text


def test_an_entry_larger_than_the_budget_is_skipped(tmp_path):
    store = open_store(tmp_path, compression="none", budget_bytes=VALUE_BYTES - 1)
    assert not store.put(key(1), tokens(1), payload(1))
    assert store.stats().entries == 0 and store.stats().writes_enabled


def test_delete_removes_the_entry_and_its_bytes(tmp_path):
    store = open_store(tmp_path, compression="none")
    store.put_many([(key(i), tokens(i), payload(i)) for i in range(3)])
    store.delete(key(1))
    store.delete(key(1))
    assert not store.contains(key(1))
    assert (store.stats().entries, store.stats().bytes_used) == (2, 2 * VALUE_BYTES)


def test_entries_and_totals_survive_a_restart(tmp_path):
    store = open_store(tmp_path)
    store.put_many([(key(i), tokens(i), payload(i)) for i in range(5)])
    before = store.stats()
    store.close()
    store = open_store(tmp_path)
    after = store.stats()
    assert after.entries == 5 and after.bytes_used == before.bytes_used > 0
    assert all(store.get(key(i), tokens(i)) == payload(i) for i in range(5))
    assert (after.hits, after.writes) == (0, 0)  # counters are this process's own


# ---- two processes ---------------------------------------------------------------------------

CONCURRENT = dict(budget_bytes=24 * VALUE_BYTES, initial_map_bytes=64 << 10)


def _write_range(path, first: int, last: int, barrier) -> None:
    """One worker process: batches, single puts, touches, reads and deletes over [first, last)."""
    warnings = _Recorder()
    logging.getLogger("reame.kvstore").addHandler(warnings)
    store = open_store(path, **CONCURRENT)
    barrier.wait(timeout=60)
    for start in range(first, last, 4):
        batch = range(start, min(start + 4, last))
        store.put_many([(key(i), tokens(i), payload(i)) for i in batch])
        store.put(key(start), tokens(start), payload(start))
        store.touch([key(i) for i in range(first, start, 7)])
        found = store.get(key(start - 2), tokens(start - 2))
        assert found is None or found == payload(start - 2)
        if start % 12 == 0:
            store.delete(key(start + 1))
    stats = store.stats()
    store.close()
    assert stats.writes_enabled and stats.corrupt == 0 and stats.write_errors == 0
    assert warnings.messages == []  # no read or write ever failed, whatever the other process did


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_two_processes_writing_at_once_keep_every_invariant(tmp_path):
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    children = [context.Process(target=_write_range, args=(tmp_path, first, last, barrier))
                for first, last in ((0, 80), (40, 120))]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=60)
    assert [child.exitcode for child in children] == [0, 0]

    blocks = assert_consistent(tmp_path, CONCURRENT["budget_bytes"])
    assert len(blocks) >= 10
    store = open_store(tmp_path, **CONCURRENT)
    for block_key in blocks:
        i = next(i for i in range(120) if key(i) == block_key)
        assert store.get(block_key, tokens(i)) == payload(i)
    assert store.stats().corrupt == 0


# ---- write failures --------------------------------------------------------------------------


def test_a_map_that_cannot_grow_stops_writes_once_and_reads_go_on(tmp_path, caplog):
    store = open_store(tmp_path, compression="none", budget_bytes=1 << 30,
                       initial_map_bytes=1 << 20, max_map_bytes=1 << 20)
    with caplog.at_level(logging.WARNING, logger="reame.kvstore"):
        stored = 0
        while stored < 1000 and store.put(key(stored), tokens(stored), payload(stored)):
            stored += 1
        assert 10 < stored < 1000
        errors = store.stats().write_errors
        assert not store.put(key(5000), tokens(5000), payload(1))
        assert store.put_many([(key(5001), tokens(5001), payload(1))]) == 0
        store.touch([key(0)])
        store.delete(key(0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "writes stopped" in warnings[0] and str(tmp_path) in warnings[0]
    assert "serving continues" in warnings[0]
    stats = store.stats()
    assert not stats.writes_enabled and stats.write_errors == errors  # no disk touched after the stop
    assert all(store.get(key(i), tokens(i)) == payload(i) for i in range(stored))


def test_a_file_size_limit_stops_writes_once_and_reads_go_on(tmp_path, caplog):
    store = open_store(tmp_path, compression="none", budget_bytes=1 << 30)
    store.put_many([(key(i), tokens(i), payload(i)) for i in range(4)])
    data_bytes = (tmp_path / "data.mdb").stat().st_size
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (data_bytes + (256 << 10), old_limit[1]))
    try:
        with caplog.at_level(logging.WARNING, logger="reame.kvstore"):
            results = [store.put(key(i), tokens(i), payload(i)) for i in range(4, 200)]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert results[0] and not results[-1]
    assert len(caplog.records) == 1 and "writes stopped" in caplog.text
    assert not store.stats().writes_enabled
    assert all(store.get(key(i), tokens(i)) == payload(i) for i in range(4))


def test_a_path_that_cannot_be_created_is_unavailable():
    with pytest.raises(KVStoreUnavailable, match="/proc/reame-store"):
        open_store("/proc/reame-store/kv")


# ---- the writer thread -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_process():
    """A second process (spawned once for the module) to run store operations in."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield lambda fn, *args: pool.submit(fn, *args).result(timeout=60)


def _read_in_another_process(path, ids: list[int]) -> list[bool]:
    store = open_store(path)
    try:
        return [store.get(key(i), tokens(i)) == payload(i) for i in ids]
    finally:
        store.close()


def _fill_in_another_process(path, ids: list[int]) -> int:
    store = open_store(path)
    try:
        return store.put_many([(key(i), tokens(i), payload(i)) for i in ids])
    finally:
        store.close()


def test_a_map_grown_by_another_process_is_adopted_by_readers_and_writers(tmp_path, other_process, caplog):
    store = open_store(tmp_path, initial_map_bytes=64 << 10)
    assert store.put(key(0), tokens(0), payload(0))
    assert other_process(_fill_in_another_process, tmp_path, list(range(1, 61))) == 60
    with caplog.at_level(logging.WARNING, logger="reame.kvstore"):
        assert store.get(key(50), tokens(50)) == payload(50)  # past the end of this process's map
        assert store.put(key(100), tokens(100), payload(100))
    assert caplog.records == []
    assert store.stats().entries == 62


class _GatedStore:
    """A real store whose writes wait for a gate, so a test controls what is still queued."""

    def __init__(self, store: KVStore, fail_first: bool = False):
        self.store = store
        self.gate = threading.Event()
        self.fail_first = fail_first

    def put_many(self, items):
        self.gate.wait(10)
        if self.fail_first:
            self.fail_first = False
            raise RuntimeError("injected failure")
        return self.store.put_many(items)

    def touch(self, keys):
        self.store.touch(keys)

    def delete(self, key_):
        self.store.delete(key_)


def test_writer_flush_makes_entries_visible_to_another_process(tmp_path, other_process):
    store = open_store(tmp_path)
    writer = StoreWriter(store)
    assert all(writer.submit(key(i), tokens(i), payload(i)) for i in range(20))
    writer.touch([key(0)])
    writer.delete(key(19))
    assert writer.flush(timeout=10)
    assert writer.pending_bytes == 0
    assert other_process(_read_in_another_process, tmp_path, list(range(20))) == [True] * 19 + [False]
    writer.close()


def test_writer_drops_over_max_pending_bytes_and_close_flushes(tmp_path):
    gated = _GatedStore(open_store(tmp_path))
    writer = StoreWriter(gated, max_pending_bytes=2 * PAYLOAD)
    assert writer.submit(key(0), tokens(0), payload(0))
    assert writer.submit(key(1), tokens(1), bytearray(payload(1)))
    assert not writer.submit(key(2), tokens(2), payload(2))
    assert writer.dropped == 1 and writer.pending_bytes == 2 * PAYLOAD
    assert not writer.flush(timeout=0.05)
    gated.gate.set()
    writer.close(timeout=10)
    assert not writer._thread.is_alive()
    assert [gated.store.contains(key(i)) for i in range(3)] == [True, True, False]
    assert not writer.submit(key(3), tokens(3), payload(3))  # closed


def test_writer_logs_a_failure_and_keeps_going(tmp_path, caplog):
    gated = _GatedStore(open_store(tmp_path), fail_first=True)
    gated.gate.set()
    writer = StoreWriter(gated)
    with caplog.at_level(logging.ERROR, logger="reame.kvstore"):
        writer.submit(key(0), tokens(0), payload(0))
        assert writer.flush(timeout=10)
        writer.submit(key(1), tokens(1), payload(1))
        assert writer.flush(timeout=10)
    assert "injected failure" in caplog.text
    assert [gated.store.contains(key(i)) for i in range(2)] == [False, True]
    writer.close()


def test_the_writer_thread_runs_at_the_lowest_cpu_priority(tmp_path):
    """Beside a 2-thread engine on 2 cores it must take no core from a step (shared.thread_priority)."""
    import os

    writer = StoreWriter(open_store(tmp_path))
    assert writer.submit(key(0), tokens(0), payload(0))
    assert writer.flush(timeout=10)  # the thread has written it, so it has lowered itself first
    assert os.getpriority(os.PRIO_PROCESS, writer._thread.native_id) == 19
    writer.close()
