"""Prefix reuse on the real model: a prompt that repeats a cached prefix gives exactly the tokens
it gives without any cache, whether the prefix comes from RAM, from the store after a restart,
or is recomputed because the stored copy was corrupt."""
from __future__ import annotations

import threading
import time

import lmdb
import pytest

from shared.config import EngineSection
from shared.hashing import extend_chain
from shared.sampling import SamplingParams
from tests.model.run_requests import run_requests
from worker.engine.engine import load_engine
from worker.kv.block_manager import BlockManager
from worker.kv.prefix_cache import PrefixCache
from worker.kv.prefix_setup import engine_fingerprint
from worker.kv.store import KVStore
from worker.kv.store_writer import StoreWriter
from worker.sched.generation import BatchGenerator, FinishEvent
from worker.sched.tuning_state import SchedulerKnobs, TuningState

BS = 16
# A system prompt of 100 tokens (6 full blocks) and two questions; token ids from SmolLM2's vocabulary.
SYSTEM = [1, 9690, 198] + [(i * 37) % 40000 + 200 for i in range(97)]
QUESTION_A = [2, 198, 4093, 17, 314, 3179, 282, 4649, 47, 198]
QUESTION_B = [2, 198, 4093, 17, 1073, 314, 253, 4649, 30, 3]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    return load_engine(smollm2_gguf, EngineSection(context_length=512, kv_cache_memory="64MiB"),
                       progress=lambda m: None)


def _fresh_pool(engine) -> None:
    """What a restart leaves: no K/V in the pool (and each generator or prefix cache made after
    it starts with a block manager of its own, with every block empty)."""
    engine.kv.k.fill(0)
    engine.kv.v.fill(0)


def _generator(engine, prefix: PrefixCache | None) -> BatchGenerator:
    return BatchGenerator(engine, TuningState(SchedulerKnobs(batching_window_ms=0.0)), prefix=prefix)


def _run(generator: BatchGenerator, requests: dict[str, list[int]], params=GREEDY):
    out = run_requests(generator, {rid: (prompt, params) for rid, prompt in requests.items()})
    return out.tokens, out.finished


@pytest.fixture(scope="module")
def uncached(engine):
    """Every prompt's tokens with no prefix cache at all: the yardstick."""
    _fresh_pool(engine)
    tokens, _ = _run(_generator(engine, None), {"a": SYSTEM + QUESTION_A, "b": SYSTEM + QUESTION_B})
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=42)
    sampled, _ = _run(_generator(engine, None), {"b": SYSTEM + QUESTION_B}, seeded)
    return tokens, sampled["b"]


def _store(engine, path, **kw) -> KVStore:
    return KVStore(path, fingerprint=engine_fingerprint(engine), payload_bytes=engine.kv.block_payload_bytes,
                   budget_bytes=64 << 20, dtype=engine.kv.dtype, **kw)


def _prefix(engine, store=None, restore="auto") -> PrefixCache:
    writer = StoreWriter(store) if store is not None else None
    return PrefixCache(BlockManager.for_pool(engine.kv), engine_fingerprint(engine), kv=engine.kv, store=store,
                       writer=writer, restore=restore)


def test_the_same_system_prompt_twice_reuses_its_blocks_from_ram(engine, uncached):
    _fresh_pool(engine)
    prefix = _prefix(engine)
    generator = _generator(engine, prefix)
    first, done_a = _run(generator, {"a": SYSTEM + QUESTION_A})
    second, done_b = _run(generator, {"b": SYSTEM + QUESTION_B})
    assert done_a["a"].cached_tokens == 0
    # 6 full blocks, then 8 tokens copied from a's block 6: the system prompt's last 4 and the 4
    # the questions share ([2, 198, 4093, 17]).
    assert done_b["b"].cached_tokens == 104 == len(SYSTEM) + 4
    assert first["a"] == uncached[0]["a"] and second["b"] == uncached[0]["b"]
    assert prefix.counters.prefix_hit_tokens_ram == 104

    again, done = _run(generator, {"a2": SYSTEM + QUESTION_A})
    assert again["a2"] == uncached[0]["a"]
    assert done["a2"].cached_tokens == len(SYSTEM + QUESTION_A) - 1  # all but the last: it gives the logits

    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=42)
    sampled, _ = _run(generator, {"b2": SYSTEM + QUESTION_B}, seeded)
    assert sampled["b2"] == uncached[1]
    assert generator.blocks.num_used_blocks == 0


def test_a_restarted_worker_restores_the_prefix_from_the_store(engine, uncached, tmp_path):
    _fresh_pool(engine)
    store = _store(engine, tmp_path / "store")
    prefix = _prefix(engine, store)
    _run(_generator(engine, prefix), {"a": SYSTEM + QUESTION_A})
    prefix.close()
    assert store_entries(tmp_path / "store") >= 6

    _fresh_pool(engine)  # the restart: nothing in RAM
    prefix = _prefix(engine, _store(engine, tmp_path / "store"))
    tokens, done = _run(_generator(engine, prefix), {"b": SYSTEM + QUESTION_B})
    assert done["b"].cached_tokens >= 96
    assert prefix.counters.prefix_hit_tokens_store >= 96 and prefix.counters.prefix_restores == 1
    assert tokens["b"] == uncached[0]["b"]
    prefix.close()


def test_corrupt_stored_blocks_are_recomputed_and_deleted(engine, uncached, tmp_path):
    path = tmp_path / "store"
    _fresh_pool(engine)
    prefix = _prefix(engine, _store(engine, path, compression="none"))
    _run(_generator(engine, prefix), {"a": SYSTEM + QUESTION_A})
    prefix.close()
    stored = store_entries(path)
    flipped = _flip_a_byte_in_every_entry(path)
    assert flipped == stored

    _fresh_pool(engine)
    prefix = _prefix(engine, _store(engine, path, compression="none"))
    tokens, done = _run(_generator(engine, prefix), {"b": SYSTEM + QUESTION_B})
    assert done["b"].cached_tokens == 0 and tokens["b"] == uncached[0]["b"]
    assert prefix.store.stats().corrupt >= 1
    prefix.close()
    # The corrupt blocks were deleted and the recomputed ones stored again: every block of the
    # system prompt now verifies.
    store = _store(engine, path, compression="none")
    chain = extend_chain([], SYSTEM, BS, len(SYSTEM) // BS, engine_fingerprint(engine))
    payloads = [store.get(name, tuple(SYSTEM[i * BS:(i + 1) * BS])) for i, name in enumerate(chain)]
    assert all(p is not None for p in payloads) and store.stats().corrupt == 0
    store.close()


def test_restore_never_recomputes_what_the_store_has(engine, uncached, tmp_path):
    _fresh_pool(engine)
    prefix = _prefix(engine, _store(engine, tmp_path / "store"))
    _run(_generator(engine, prefix), {"a": SYSTEM + QUESTION_A})
    prefix.close()
    _fresh_pool(engine)
    prefix = _prefix(engine, _store(engine, tmp_path / "store"), restore="never")
    tokens, done = _run(_generator(engine, prefix), {"b": SYSTEM + QUESTION_B})
    assert done["b"].cached_tokens == 0 and prefix.counters.prefix_recomputes == 1
    assert tokens["b"] == uncached[0]["b"]
    prefix.close()


def test_a_store_that_cannot_grow_stops_writing_and_serving_goes_on(engine, uncached, tmp_path, caplog):
    """A full disk, as a map that cannot hold even one block: one warning, the same tokens, and
    the RAM tier still serves the prefix."""
    _fresh_pool(engine)
    store = _store(engine, tmp_path / "store", max_map_bytes=64 << 10)
    prefix = _prefix(engine, store)
    generator = _generator(engine, prefix)
    with caplog.at_level("WARNING", logger="reame.kvstore"):
        first, _ = _run(generator, {"a": SYSTEM + QUESTION_A})
        assert prefix.writer.flush(timeout=30.0)
        second, done = _run(generator, {"b": SYSTEM + QUESTION_B})
    assert first["a"] == uncached[0]["a"] and second["b"] == uncached[0]["b"]
    assert done["b"].cached_tokens == 104  # from RAM: 6 full blocks and 8 tokens of a's block 6
    assert not store.writes_enabled and store.stats().entries == 0
    assert len([r for r in caplog.records if "writes stopped" in r.getMessage()]) == 1
    prefix.close()


# ---- reading the LMDB environment directly -------------------------------------------------------

def store_entries(path) -> int:
    env = lmdb.open(str(path), max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return txn.stat(env.open_db(b"blocks", txn=txn))["entries"]
    finally:
        env.close()


def _flip_a_byte_in_every_entry(path) -> int:
    """Flip the last byte (inside the K/V payload) of every stored block; return how many."""
    env = lmdb.open(str(path), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"blocks", txn=txn)
            items = list(txn.cursor(db))
            for key, value in items:
                data = bytearray(value)
                data[-1] ^= 0x5A
                txn.put(key, bytes(data), db=db)
    finally:
        env.close()
    return len(items)


def test_a_warm_request_waits_for_the_store_without_holding_up_the_step_loop(engine, tmp_path):
    """/v1/warm's answer waits until the store has its blocks, but other requests keep stepping
    meanwhile (the wait used to be a blocking flush inside the step: 30 s with a stuck store)."""
    _fresh_pool(engine)
    store = _store(engine, tmp_path / "store")
    commit = threading.Event()
    put_many = store.put_many
    store.put_many = lambda entries: (commit.wait(30), put_many(entries))[1]  # a store stuck on disk
    prefix = _prefix(engine, store)
    generator = _generator(engine, prefix)
    generator.add("warm", SYSTEM + QUESTION_A, SamplingParams(max_tokens=1, temperature=0.0), warm=True)
    generator.add("other", QUESTION_B, GREEDY)
    finished = {}
    while "other" not in finished:
        started = time.perf_counter()
        finished.update((e.request_id, e) for e in generator.step() if isinstance(e, FinishEvent))
        assert time.perf_counter() - started < 5.0
    assert "warm" not in finished and generator.has_work  # its blocks are not committed yet
    commit.set()
    deadline = time.monotonic() + 30
    while "warm" not in finished and time.monotonic() < deadline:
        finished.update((e.request_id, e) for e in generator.step() if isinstance(e, FinishEvent))
    assert finished["warm"].prefix_tokens == len(SYSTEM + QUESTION_A) // BS * BS
    assert not generator.has_work
    # The warm prompt's full blocks are committed ("other"'s one full block may be, too).
    assert store.stats().entries >= len(SYSTEM + QUESTION_A) // BS
    prefix.close()
