"""The n-gram archive's LMDB tier: counts merge across writes, survive a restart, are shared with
another process, stay within their budget (least recently written first out), and a corrupt
entry is a miss that gets deleted."""
from __future__ import annotations

import subprocess
import sys

import lmdb

from tests.conftest import REPO_ROOT
from worker.speculative.archive import NgramArchive
from worker.speculative.archive_store import ArchiveStore

MODEL = bytes(range(32))


def _store(path, budget=1 << 20):
    return ArchiveStore(path, model=MODEL, order=3, budget_bytes=budget)


def test_counts_merge_and_survive_a_restart(tmp_path):
    store = _store(tmp_path)
    archive = NgramArchive(order=3, backing=store)
    archive.learn([1, 2, 3, 4, 1, 2, 3, 4])
    archive.learn([1, 2, 3, 5])
    assert store.flush()
    assert store.get((1, 2, 3)) == {4: 2, 5: 1}
    store.close()

    again = _store(tmp_path)
    fresh = NgramArchive(order=3, backing=again)  # a restarted worker: nothing in RAM
    assert fresh.propose([9, 1, 2, 3], 4) == [4, 1, 2, 3]
    fresh.learn([7, 1, 2, 3, 5])
    assert again.flush()
    assert again.get((1, 2, 3)) == {4: 2, 5: 2}
    assert again.stats()["entries"] == 5
    again.close()


def test_another_process_reads_what_this_one_wrote(tmp_path):
    store = _store(tmp_path)
    NgramArchive(order=3, backing=store).learn([10, 11, 12, 13, 14, 15])
    assert store.flush()
    code = ("import sys; from worker.speculative.archive import NgramArchive;"
            " from worker.speculative.archive_store import ArchiveStore;"
            f"s = ArchiveStore(sys.argv[1], model=bytes(range(32)), order=3, budget_bytes=1 << 20);"
            "print(NgramArchive(order=3, backing=s).propose([0, 10, 11, 12], 3)); s.close()")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[13, 14, 15]"
    store.close()


def test_another_model_never_sees_these_ngrams(tmp_path):
    store = _store(tmp_path)
    NgramArchive(order=3, backing=store).learn([1, 2, 3, 4])
    store.close()
    other = ArchiveStore(tmp_path, model=bytes(32), order=3, budget_bytes=1 << 20)
    assert other.get((1, 2, 3)) is None
    other.close()


def test_the_budget_evicts_the_least_recently_written_contexts(tmp_path):
    store = _store(tmp_path, budget=5 * 24)  # five one-continuation entries (16-byte header + 8)
    for first in range(8):
        store.submit({(first, 0, 0): {1: 1}})
        assert store.flush()
    stats = store.stats()
    assert stats["bytes_used"] <= 5 * 24 and stats["entries"] == 5 and stats["evictions"] == 3
    assert store.get((0, 0, 0)) is None and store.get((7, 0, 0)) == {1: 1}
    store.submit({(3, 0, 0): {2: 1}})  # rewritten: young again
    store.submit({(8, 0, 0): {1: 1}})
    assert store.flush()
    assert store.get((3, 0, 0)) == {1: 1, 2: 1} and store.get((4, 0, 0)) is None
    store.close()


def test_a_corrupt_entry_is_a_miss_and_is_deleted(tmp_path):
    store = _store(tmp_path)
    store.submit({(1, 2, 3): {4: 9}, (5, 6, 7): {8: 1}})
    assert store.flush()
    store.close()
    env = lmdb.open(str(tmp_path), max_dbs=3, subdir=True)
    db = env.open_db(b"ngrams")
    key = MODEL[:8] + (1).to_bytes(4, "little") + (2).to_bytes(4, "little") + (3).to_bytes(4, "little")
    with env.begin(write=True, db=db) as txn:
        value = bytearray(txn.get(key))
        value[-1] ^= 0xFF  # a flipped bit in a count
        txn.put(key, bytes(value))
    env.close()

    store = _store(tmp_path)
    assert store.get((1, 2, 3)) is None and store.corrupt == 1
    assert store.flush()
    assert store.stats()["entries"] == 1 and store.get((5, 6, 7)) == {8: 1}
    store.close()


def test_the_archive_writer_runs_at_the_lowest_cpu_priority(tmp_path):
    import os

    store = _store(tmp_path)
    store.submit({(1, 2, 3): {4: 1}})
    assert store.flush()  # the thread has written it, so it has lowered itself first
    assert os.getpriority(os.PRIO_PROCESS, store._thread.native_id) == 19
    store.close()


def test_a_namespace_reads_only_its_own_counts_and_the_shared_keys_are_unchanged(tmp_path):
    """Keys carry the cache namespace; the shared one's keys are as before namespaces (an archive
    written then still drafts for it)."""
    alice, mallory = b"a" * 32, b"m" * 32
    store = _store(tmp_path)
    NgramArchive(order=3, backing=store).learn([1, 2, 3, 4], alice)
    NgramArchive(order=3, backing=store).learn([1, 2, 3, 5])
    assert store.flush()
    assert store.get((1, 2, 3), alice) == {4: 1} and store.get((1, 2, 3)) == {5: 1}
    assert store.get((1, 2, 3), mallory) is None
    assert store._key((1, 2, 3)) == MODEL[:8] + bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0])
    store.close()
    fresh = NgramArchive(order=3, backing=_store(tmp_path))  # restarted: only the store knows
    assert fresh.propose([1, 2, 3], 1, mallory) == [] and fresh.propose([1, 2, 3], 1, alice) == [4]
    fresh.backing.close()


def test_a_map_grown_by_another_process_is_adopted_by_reads_and_writes(tmp_path, caplog):
    """A worker with a larger archive_budget (or a large saved state) grows the file past this
    process's map: LMDB then refuses this process's transactions until it adopts the new size.
    Before the store layer, reads missed, stats() raised and writes stopped for good."""
    store = _store(tmp_path)  # 1 MiB budget: an 18 MiB map
    store.submit({(1, 2, 3): {4: 1}})
    assert store.flush()
    code = ("import sys; from worker.speculative.archive_store import ArchiveStore;"
            "s = ArchiveStore(sys.argv[1], model=bytes(range(32)), order=3, budget_bytes=64 << 20);"
            "s.submit({(5, 6, 7): {8: 1}}); s.save_state(lambda: bytes(24 << 20)); s.close()")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert store.get((5, 6, 7)) == {8: 1}
    store.submit({(1, 2, 3): {4: 1}})
    assert store.flush()
    assert store.get((1, 2, 3)) == {4: 2} and store.stats()["entries"] == 2
    assert "writes stopped" not in caplog.text
    store.close()
