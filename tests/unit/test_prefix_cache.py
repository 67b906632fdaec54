"""The prefix cache's RAM tier through the scheduler: exact block ids reused, the last prompt token
always recomputed, token ids checked on a hit, LRU eviction from the tail of a chain, preemption,
no leaks; and the block-hash chain is stable across processes."""
from __future__ import annotations

import subprocess
import sys

import pytest

from shared.hashing import ZERO_HASH, block_hash, extend_chain, kv_fingerprint
from shared.sampling import SamplingParams
from worker.kv.block_manager import BlockManager
from worker.kv.prefix_cache import PrefixCache
from worker.kv.sequence import Sequence
from worker.sched.scheduler import ScheduledBatch, Scheduler
from worker.sched.tuning_state import SchedulerKnobs, TuningState

FP = kv_fingerprint(model="test", kv_dtype="float32")
BS = 4


def _scheduler(num_blocks: int = 32, **knobs) -> Scheduler:
    knobs.setdefault("batching_window_ms", 0.0)
    manager = BlockManager(num_blocks, BS)
    return Scheduler(manager, TuningState(SchedulerKnobs(**knobs)), PrefixCache(manager, FP))


def _seq(name: str, prompt: list[int], max_tokens: int = 2) -> Sequence:
    return Sequence(name, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=0.0)


def _shape(batch: ScheduledBatch) -> list[tuple[str, int, int]]:
    return [(c.seq.seq_id, c.start, c.num_tokens) for c in batch.chunks]


def _run(scheduler: Scheduler, token: int = 7) -> list[ScheduledBatch]:
    batches = []
    while scheduler.has_work():
        batch = scheduler.schedule(0.0)
        scheduler.update(batch, {c.seq.seq_id: token for c in batch.chunks if c.samples})
        batches.append(batch)
    return batches


PROMPT = list(range(100, 111))  # 11 tokens: blocks [100..103] [104..107], 3 in the last


def test_a_repeated_prompt_reuses_the_computed_blocks_and_feeds_only_the_rest():
    scheduler = _scheduler()
    first = _seq("a", PROMPT)
    scheduler.add(first)
    assert _shape(_run(scheduler)[0]) == [("a", 0, 11)]
    assert first.num_cached_tokens == 0
    manager = scheduler.block_manager
    assert manager.cached_block_ids() == [2, 1, 0]  # a's full blocks: 0, 1 and the one its output filled

    second = _seq("b", PROMPT)
    scheduler.add(second)
    batch = scheduler.schedule(0.0)
    assert _shape(batch) == [("b", 8, 3)]  # two cached blocks; tokens 8..10 are fed
    assert second.block_table[:2] == [0, 1] and second.num_cached_tokens == 8
    assert [manager.ref_count(b) for b in (0, 1)] == [1, 1]
    scheduler.update(batch, {"b": 7})
    counters = scheduler.prefix.counters
    assert counters.prefix_query_tokens == 22 and counters.prefix_hit_tokens_ram == 8


def test_the_last_prompt_token_is_always_recomputed():
    scheduler = _scheduler()
    prompt = PROMPT[:8]  # exactly two blocks
    scheduler.add(_seq("a", prompt))
    _run(scheduler)
    again = _seq("b", prompt)
    scheduler.add(again)
    batch = scheduler.schedule(0.0)
    assert _shape(batch) == [("b", 4, 4)]  # block 1 would leave nothing to feed: only block 0 is reused
    assert batch.chunks[0].samples


def test_a_shared_prefix_is_reused_up_to_where_the_prompts_differ():
    scheduler = _scheduler()
    scheduler.add(_seq("a", PROMPT))
    _run(scheduler)
    other = _seq("b", PROMPT[:6] + [900, 901, 902, 903, 904])  # differs in block 1
    scheduler.add(other)
    assert _shape(scheduler.schedule(0.0)) == [("b", 4, 7)]
    assert other.block_table[0] == 0


def test_two_running_sequences_share_blocks_and_free_them_only_when_both_are_done():
    scheduler = _scheduler()
    scheduler.add(_seq("a", PROMPT, max_tokens=8))
    _run_one = scheduler.schedule(0.0)
    scheduler.update(_run_one, {"a": 7})  # a's prompt is computed; a keeps decoding
    b = _seq("b", PROMPT, max_tokens=2)
    scheduler.add(b)
    batch = scheduler.schedule(0.0)
    assert _shape(batch) == [("a", 11, 1), ("b", 8, 3)]
    manager = scheduler.block_manager
    assert [manager.ref_count(i) for i in (0, 1)] == [2, 2]
    scheduler.update(batch, {"a": 7, "b": 7})
    _run(scheduler)
    assert manager.num_free_blocks == manager.num_blocks


def test_token_ids_are_checked_on_a_hit():
    manager = BlockManager(4, BS)
    seq = _seq("a", [1, 2, 3, 4, 5])
    manager.allocate(seq, 5)
    name = block_hash(ZERO_HASH, [1, 2, 3, 4], FP)
    assert manager.register(seq.block_table[0], name, (9, 9, 9, 9))  # a (pretend) collision
    assert manager.lookup(name, (1, 2, 3, 4)) is None
    assert manager.lookup(name, (9, 9, 9, 9)) == seq.block_table[0]


def test_empty_blocks_go_first_then_named_ones_least_recently_used_tail_first():
    manager = BlockManager(6, BS)
    scheduler = Scheduler(manager, TuningState(SchedulerKnobs(batching_window_ms=0.0)), PrefixCache(manager, FP))
    scheduler.add(_seq("a", list(range(1, 10)), max_tokens=1))  # 9 tokens: blocks 0, 1 named, 2 not
    _run(scheduler)
    assert manager.free_block_ids() == [3, 4, 5, 2, 1, 0]  # empty FIFO, then the LRU: a's tail first
    assert manager.cached_block_ids() == [2, 1, 0]  # block 2: its one computed token, kept as partial

    b = _seq("b", list(range(50, 66)), max_tokens=1)  # 16 tokens: the empty blocks first
    scheduler.add(b)
    batch = scheduler.schedule(0.0)
    assert b.block_table == [3, 4, 5, 2] and manager.num_evictions == 1  # the partial block went first
    scheduler.update(batch, {"b": 7})
    assert manager.cached_block_ids() == [1, 0, 2, 5, 4, 3]

    c = _seq("c", list(range(200, 207)), max_tokens=1)  # 7 tokens: evicts a's chain, tail first
    scheduler.add(c)
    batch = scheduler.schedule(0.0)
    assert c.block_table == [1, 0]
    scheduler.update(batch, {"c": 7})
    assert c.num_cached_tokens == 0 and manager.num_evictions == 3
    assert c.block_table == [] and manager.free_block_ids() == [2, 5, 4, 3, 0, 1]  # c's partial block 0 is kept


def test_a_preempted_sequence_gets_its_own_blocks_back_from_the_cache():
    scheduler = _scheduler(num_blocks=6, token_budget=64)
    a = _seq("a", list(range(1, 13)), max_tokens=8)  # 12 tokens: 3 blocks, grows to 5
    b = _seq("b", list(range(40, 49)), max_tokens=8)  # 9 tokens: 3 blocks
    scheduler.add(a)
    scheduler.add(b)
    batches = _run(scheduler)
    assert b.num_preemptions >= 1
    resumed = next(batch for batch in batches if any(c.seq is b and c.start > 0 and c.num_tokens > 1
                                                       for c in batch.chunks))
    chunk = next(c for c in resumed.chunks if c.seq is b)
    # a's growth evicted b's chain tail first; its head block came back from the cache.
    assert chunk.start == 4
    assert scheduler.block_manager.num_free_blocks == 6


def test_no_blocks_leak_over_many_requests_with_shared_prefixes():
    import random
    rng = random.Random(5)
    scheduler = _scheduler(num_blocks=24, max_batch_size=4, token_budget=32, prefill_chunk=8)
    system = list(range(300, 318))
    for n in range(200):
        tail = [rng.randrange(1000, 1010) for _ in range(rng.randrange(1, 9))]
        scheduler.add(_seq(f"r{n}", system + tail, max_tokens=rng.randrange(1, 6)))
        if n % 3 == 0:
            for _ in range(rng.randrange(1, 4)):
                if scheduler.has_work():
                    batch = scheduler.schedule(0.0)
                    scheduler.update(batch, {c.seq.seq_id: rng.randrange(1, 50) for c in batch.chunks if c.samples})
    _run(scheduler)
    manager = scheduler.block_manager
    assert manager.num_free_blocks == 24 and all(manager.ref_count(i) == 0 for i in range(24))
    counters = scheduler.prefix.counters
    assert counters.prefix_hit_tokens_ram >= 100 * 16  # most requests found the system prompt's 4 blocks


# ---- the hash chain ------------------------------------------------------------------------------

def test_the_chain_depends_on_parent_tokens_and_fingerprint():
    tokens = list(range(8))
    chain = extend_chain([], tokens, 4, 2, FP)
    assert chain[0] == block_hash(ZERO_HASH, tokens[:4], FP)
    assert chain[1] == block_hash(chain[0], tokens[4:], FP)
    assert block_hash(ZERO_HASH, tokens[4:], FP) != chain[1]  # same tokens, other parent
    assert block_hash(chain[0], tokens[4:], kv_fingerprint(model="test", kv_dtype="float16")) != chain[1]
    assert extend_chain(list(chain[:1]), tokens, 4, 2, FP) == chain  # extending continues the chain
    with pytest.raises(ValueError):
        extend_chain([], tokens, 4, 3, FP)


def test_the_chain_is_the_same_in_another_process():
    code = ("from shared.hashing import extend_chain, kv_fingerprint;"
            "fp = kv_fingerprint(model='test', kv_dtype='float32');"
            "print(','.join(h.hex() for h in extend_chain([], list(range(100, 111)), 4, 2, fp)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    here = ",".join(h.hex() for h in extend_chain([], PROMPT, 4, 2, FP))
    assert out.stdout.strip() == here


def test_cache_namespaces_never_share_blocks():
    """The same prompt in two namespaces (two tenants, or two cache_salts): nothing is reused across
    them, everything within one; the shared namespace (b"") roots its chain at ZERO_HASH as before."""
    scheduler = _scheduler()
    tenant_a, tenant_b = b"a" * 32, b"b" * 32

    def cached(name: str, namespace: bytes) -> int:
        seq = Sequence(name, PROMPT, SamplingParams(max_tokens=2), 0.0, cache_namespace=namespace)
        scheduler.add(seq)
        _run(scheduler)
        return seq.num_cached_tokens

    assert cached("a1", tenant_a) == 0
    assert cached("b1", tenant_b) == 0  # a's blocks are in RAM, but not b's to find
    assert cached("shared", b"") == 0
    assert cached("a2", tenant_a) == 8 and cached("b2", tenant_b) == 8 and cached("shared2", b"") == 8
    shared = Sequence("s", PROMPT, SamplingParams(max_tokens=2), 0.0)
    assert extend_chain([], PROMPT, BS, 2, FP)[0] == block_hash(ZERO_HASH, PROMPT[:BS], FP)
    assert shared.cache_namespace == b""
