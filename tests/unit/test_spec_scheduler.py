"""Drafted chunks in the scheduler: the budget and blocks they may take, and the rollback of
rejected rows (no leaked or double-freed block, prefix names for accepted tokens only)."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from shared.hashing import extend_chain, namespace_root
from shared.sampling import SamplingParams
from worker.kv.block_manager import BlockManager
from worker.kv.prefix_cache import PrefixCache
from worker.kv.sequence import Sequence, SequenceStatus
from worker.sched.scheduler import Scheduler
from worker.sched.tuning_state import SchedulerKnobs, TuningState

STOP = 0
FINGERPRINT = b"spec-test"


def _scheduler(drafter, num_blocks=64, block_size=4, prefix=False, **knobs):
    knobs.setdefault("batching_window_ms", 0.0)
    manager = BlockManager(num_blocks, block_size)
    cache = PrefixCache(manager, FINGERPRINT) if prefix else None
    return Scheduler(manager, TuningState(SchedulerKnobs(**knobs)), cache, drafter)


def _seq(name, prompt, max_tokens=16):
    return Sequence(name, prompt, SamplingParams(max_tokens=max_tokens, stop_token_ids=(STOP,)), 0.0)


def test_a_decoding_sequence_feeds_its_draft_and_keeps_only_accepted_rows():
    scheduler = _scheduler(lambda seq, limit: [41, 42, 43, 44][:limit])
    seq = _seq("a", [1, 2, 3, 4, 5, 6])
    scheduler.add(seq)
    batch = scheduler.schedule(0.0)  # the prompt: no draft
    assert batch.chunks[0].draft == ()
    scheduler.update(batch, {"a": 40})
    batch = scheduler.schedule(0.0)
    chunk = batch.chunks[0]
    assert chunk.draft == (41, 42, 43, 44) and chunk.token_ids == [40, 41, 42, 43, 44]
    assert chunk.start == 6 and chunk.num_tokens == 5 and len(seq.block_table) == 3  # 11 tokens
    scheduler.update(batch, {"a": [41, 42, 9]})  # two accepted, then 9 instead of 43
    assert seq.output_token_ids == [40, 41, 42, 9]
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == 3
    assert scheduler.block_manager.num_free_blocks == 61
    batch = scheduler.schedule(0.0)
    scheduler.update(batch, {"a": [5]})  # nothing accepted: back to 3 blocks for 10 computed
    assert seq.num_computed_tokens == 10 and seq.output_token_ids == [40, 41, 42, 9, 5]


def test_drafts_leave_a_token_of_budget_for_every_sequence_behind_and_respect_max_tokens():
    scheduler = _scheduler(lambda seq, limit: [50] * limit, token_budget=8)
    seqs = [_seq(f"s{i}", [1, 2, 3], max_tokens=5) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule(0.0)
    scheduler.update(batch, {s.seq_id: 7 for s in seqs})
    batch = scheduler.schedule(0.0)
    assert [len(c.draft) for c in batch.chunks] == [3, 2, 0]  # 4 + 3 + 1 tokens: the last one keeps its token
    # max_tokens 5 with one token out: at most 3 drafted (the fourth token is sampled anyway).
    assert batch.num_tokens <= 8 and all(len(c.draft) <= 3 for c in batch.chunks)


def test_emitted_tokens_must_follow_the_draft():
    scheduler = _scheduler(lambda seq, limit: [41, 42])
    scheduler.add(_seq("a", [1, 2, 3]))
    scheduler.update(scheduler.schedule(0.0), {"a": 40})
    batch = scheduler.schedule(0.0)
    with pytest.raises(ValueError):
        scheduler.update(batch, {"a": [41, 99, 5]})  # 99 was never drafted
    with pytest.raises(ValueError):
        scheduler.update(batch, {"a": [41, 42, 5, 6]})  # longer than the draft + 1
    scheduler.update(batch, {"a": [41, 42, 5]})


def test_a_draft_never_takes_blocks_that_would_preempt_another_sequence():
    scheduler = _scheduler(lambda seq, limit: [50] * limit, num_blocks=4, block_size=4)
    a, b = _seq("a", [1, 2, 3], max_tokens=5), _seq("b", [1, 2, 3], max_tokens=5)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.update(scheduler.schedule(0.0), {"a": 7, "b": 7})
    scheduler.update(scheduler.schedule(0.0), {"a": 7, "b": 7})  # 5 tokens each: 2 blocks each
    batch = scheduler.schedule(0.0)
    assert not batch.preempted and [len(c.draft) for c in batch.chunks] == [2, 2]  # up to 8 tokens each


def _check_pool(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    owners = Counter()
    for seq in scheduler.running:
        assert len(seq.block_table) == manager.blocks_needed(seq.num_computed_tokens)
        assert seq.num_uncomputed_tokens >= 1
        owners.update(seq.block_table)
    for seq in scheduler.waiting:
        assert seq.block_table == []
    assert [manager.ref_count(b) for b in range(manager.num_blocks)] == [owners[b] for b in range(manager.num_blocks)]
    free = manager.free_block_ids()
    assert len(set(free)) == len(free) and set(free).isdisjoint(owners)
    assert manager.num_free_blocks + len(set(owners)) == manager.num_blocks


def _check_names(scheduler: Scheduler) -> None:
    """Every named block of a running sequence carries the chain hash of its accepted tokens, or,
    when another sequence computed the same tokens first, that sequence's block does."""
    manager = scheduler.block_manager
    bs = manager.block_size
    for seq in scheduler.running:
        named = seq.num_named_blocks
        assert named == seq.num_computed_tokens // bs
        chain = extend_chain([], seq.token_ids, bs, named, FINGERPRINT, namespace_root(b""))
        for i, block_id in enumerate(seq.block_table[:named]):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            if manager.block_hash(block_id) is None:
                holder = manager.lookup(chain[i], tokens)
                assert holder is not None and holder != block_id
            else:
                assert manager.block_hash(block_id) == chain[i]


def test_a_random_workload_with_drafts_keeps_the_pool_and_the_prefix_names_consistent():
    rng = random.Random(2112)
    scheduler = _scheduler(lambda seq, limit: [rng.randint(1, 6) for _ in range(rng.randint(0, limit))],
                           num_blocks=48, block_size=4, prefix=True, max_batch_size=6, token_budget=40,
                           prefill_chunk=16)
    seqs, drafted_steps = [], 0
    for step in range(3000):
        if len(seqs) < 400 and rng.random() < 0.4:
            seq = _seq(f"r{len(seqs)}", [rng.randint(1, 6) for _ in range(rng.randint(1, 30))], rng.randint(1, 40))
            scheduler.add(seq)
            seqs.append(seq)
        batch = scheduler.schedule(step * 0.001)
        sampled = {}
        for chunk in batch.chunks:
            if not chunk.samples:
                continue
            drafted_steps += bool(chunk.draft)
            seq, emitted = chunk.seq, []
            room = seq.params.max_tokens - seq.num_output_tokens
            for i in range(len(chunk.draft) + 1):  # small vocabulary: drafts are often right
                token = STOP if rng.random() < 0.02 else rng.randint(1, 6)
                emitted.append(token)
                if i >= len(chunk.draft) or token != chunk.draft[i] or token == STOP or len(emitted) >= room:
                    break
            sampled[seq.seq_id] = emitted
        if batch.chunks and rng.random() < 0.02:
            scheduler.abort(rng.choice(batch.chunks).seq.seq_id)
        for seq in scheduler.update(batch, sampled):
            assert seq.block_table == []
        _check_pool(scheduler)
        _check_names(scheduler)
    while scheduler.has_work():
        batch = scheduler.schedule(9.0)
        scheduler.update(batch, {c.seq.seq_id: STOP for c in batch.chunks if c.samples})
    assert drafted_steps > 500
    assert scheduler.block_manager.num_free_blocks == 48
    for seq in seqs:
        assert seq.num_output_tokens <= seq.params.max_tokens
        if seq.status is SequenceStatus.FINISHED_LENGTH:
            assert seq.num_output_tokens == seq.params.max_tokens
        if seq.status is SequenceStatus.FINISHED_STOPPED:
            assert seq.output_token_ids.count(STOP) == 1 and seq.output_token_ids[-1] == STOP


def test_a_step_that_admits_a_sequence_or_feeds_a_prompt_carries_no_drafts():
    scheduler = _scheduler(lambda seq, limit: [50] * limit, prefill_chunk=4, max_batch_size=2)
    a = _seq("a", [1, 2, 3])
    scheduler.add(a)
    scheduler.update(scheduler.schedule(0.0), {"a": 7})
    scheduler.add(_seq("b", [1, 2, 3, 4, 5, 6]))  # two chunks of prompt
    batch = scheduler.schedule(0.0)  # admits b: a decodes without a draft
    assert [(c.seq.seq_id, c.num_tokens, c.draft) for c in batch.chunks] == [("a", 1, ()), ("b", 4, ())]
    scheduler.update(batch, {"a": 7})
    batch = scheduler.schedule(0.0)  # b's prompt goes on: still no draft
    assert [(c.seq.seq_id, c.num_tokens, c.draft) for c in batch.chunks] == [("a", 1, ()), ("b", 2, ())]
    scheduler.update(batch, {"a": 7, "b": 7})
    scheduler.add(_seq("c", [1, 2, 3]))  # the batch is full: c cannot come in, so drafting goes on
    batch = scheduler.schedule(0.0)
    assert [c.seq.seq_id for c in batch.chunks] == ["a", "b"] and all(c.draft for c in batch.chunks)
