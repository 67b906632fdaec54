"""Scheduler: exact admissions, chunking, budget, batch size, preemption order and block ids, FCFS,
aborts, the batching window, knobs, and a seeded random workload checked every step."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from shared.config import Config
from shared.errors import ConfigError, ContextLengthError, InvalidRequestError
from shared.sampling import SamplingParams
from worker.kv.block_manager import BlockManager
from worker.kv.sequence import Sequence, SequenceStatus
from worker.sched.scheduler import ScheduledBatch, Scheduler
from worker.sched.tuning_state import SchedulerKnobs, TuningState

STOP = 0  # the stop token in these tests; sampled tokens are otherwise >= 1


def _scheduler(num_blocks: int = 64, block_size: int = 4, **knobs) -> Scheduler:
    knobs.setdefault("batching_window_ms", 0.0)
    return Scheduler(BlockManager(num_blocks, block_size), TuningState(SchedulerKnobs(**knobs)))


def _seq(name: str, num_prompt: int, max_tokens: int = 16, arrival: float = 0.0) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(STOP,))
    return Sequence(name, range(100, 100 + num_prompt), params, arrival)


def _shape(batch: ScheduledBatch) -> list[tuple[str, int, int, bool]]:
    return [(c.seq.seq_id, c.start, c.num_tokens, c.samples) for c in batch.chunks]


def _step(scheduler: Scheduler, now: float = 0.0, token: int = 7):
    """One schedule + update, sampling `token` for every chunk that samples."""
    batch = scheduler.schedule(now)
    finished = scheduler.update(batch, {c.seq.seq_id: token for c in batch.chunks if c.samples})
    return batch, finished


# ---- one sequence ------------------------------------------------------------------------------

def test_a_sequence_prefills_then_decodes_one_token_per_step_and_finishes_on_length():
    scheduler = _scheduler()
    seq = _seq("a", 5, max_tokens=3)
    scheduler.add(seq)
    assert scheduler.has_work() and seq.status is SequenceStatus.WAITING

    batch, finished = _step(scheduler, token=11)
    assert _shape(batch) == [("a", 0, 5, True)]
    assert batch.chunks[0].token_ids == [100, 101, 102, 103, 104]
    assert finished == [] and seq.status is SequenceStatus.RUNNING
    assert seq.num_computed_tokens == 5 and seq.token_ids[-1] == 11 and seq.block_table == [0, 1]

    batch, _ = _step(scheduler, token=12)
    assert _shape(batch) == [("a", 5, 1, True)] and batch.chunks[0].token_ids == [11]
    batch, finished = _step(scheduler, token=13)
    assert _shape(batch) == [("a", 6, 1, True)]
    assert finished == [seq] and seq.status is SequenceStatus.FINISHED_LENGTH
    assert seq.output_token_ids == [11, 12, 13] and seq.num_output_tokens == 3
    assert seq.block_table == [] and scheduler.block_manager.num_free_blocks == 64
    assert not scheduler.has_work() and scheduler.get("a") is None


def test_a_stop_token_is_appended_and_finishes_the_sequence():
    scheduler = _scheduler()
    seq = _seq("a", 3, max_tokens=10)
    scheduler.add(seq)
    _step(scheduler, token=9)
    _, finished = _step(scheduler, token=STOP)
    assert finished == [seq] and seq.status is SequenceStatus.FINISHED_STOPPED
    assert seq.output_token_ids == [9, STOP] and seq.is_finished
    assert scheduler.block_manager.num_free_blocks == 64


# ---- admissions, chunking, budget, batch size ---------------------------------------------------

def test_admissions_per_step_respect_max_batch_size_and_a_new_arrival_joins_the_next_step():
    scheduler = _scheduler(max_batch_size=2)
    for name in "abc":
        scheduler.add(_seq(name, 4, max_tokens=2))
    batch = scheduler.schedule(0.0)
    assert _shape(batch) == [("a", 0, 4, True), ("b", 0, 4, True)]
    scheduler.add(_seq("d", 2, max_tokens=2))  # arrives while the step runs
    scheduler.update(batch, {"a": 5, "b": 5})
    assert [s.seq_id for s in scheduler.waiting] == ["c", "d"]

    batch, finished = _step(scheduler)
    assert _shape(batch) == [("a", 4, 1, True), ("b", 4, 1, True)]  # batch full: c keeps waiting
    assert [s.seq_id for s in finished] == ["a", "b"]
    batch, _ = _step(scheduler)
    assert _shape(batch) == [("c", 0, 4, True), ("d", 0, 2, True)]


def test_a_long_prompt_is_prefilled_in_chunks_and_only_the_last_chunk_samples():
    scheduler = _scheduler(num_blocks=200, prefill_chunk=256, token_budget=512)
    seq = _seq("a", 600)
    scheduler.add(seq)
    shapes = [_shape(_step(scheduler)[0]) for _ in range(4)]
    assert shapes == [[("a", 0, 256, False)], [("a", 256, 256, False)],
                      [("a", 512, 88, True)], [("a", 600, 1, True)]]
    assert seq.num_tokens == 602 and seq.num_computed_tokens == 601
    assert len(seq.block_table) == 151  # ceil(601 / 4): exactly the computed tokens


def test_one_token_budget_is_shared_by_decodes_and_prefill_chunks():
    scheduler = _scheduler(num_blocks=200, token_budget=20, prefill_chunk=16)
    scheduler.add(_seq("a", 3))
    _step(scheduler)  # a decodes from now on
    scheduler.add(_seq("b", 40))
    scheduler.add(_seq("c", 40))
    batch, _ = _step(scheduler)
    # a's decode token first, then b gets a full chunk, c what is left of the budget
    assert _shape(batch) == [("a", 3, 1, True), ("b", 0, 16, False), ("c", 0, 3, False)]
    assert batch.num_tokens == 20
    batch, _ = _step(scheduler)
    assert _shape(batch) == [("a", 4, 1, True), ("b", 16, 16, False), ("c", 3, 3, False)]


def test_when_the_budget_runs_out_newer_running_sequences_wait_a_step():
    scheduler = _scheduler(num_blocks=200, token_budget=5, prefill_chunk=8)
    for name in "ab":
        scheduler.add(_seq(name, 8))
    assert _shape(_step(scheduler)[0]) == [("a", 0, 5, False)]
    assert _shape(_step(scheduler)[0]) == [("a", 5, 3, True), ("b", 0, 2, False)]
    assert _shape(_step(scheduler)[0]) == [("a", 8, 1, True), ("b", 2, 4, False)]
    assert _shape(_step(scheduler)[0]) == [("a", 9, 1, True), ("b", 6, 2, True)]


# ---- preemption ----------------------------------------------------------------------------------

def test_preemption_takes_the_newest_first_frees_its_blocks_and_requeues_it_at_the_front():
    scheduler = _scheduler(num_blocks=6, block_size=4)
    manager = scheduler.block_manager
    a, b, c = _seq("a", 8, 10), _seq("b", 8, 10), _seq("c", 8, 10)
    for seq in (a, b, c):
        scheduler.add(seq)
    _step(scheduler, token=1)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4, 5])

    # step 2: a's 9th token needs a third block and none is free: c, the newest, goes.
    batch, _ = _step(scheduler, token=2)
    assert batch.preempted == (c,) and _shape(batch) == [("a", 8, 1, True), ("b", 8, 1, True)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 5], [2, 3, 4], [])
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and c.token_ids[8:] == [1]  # its generated token stays

    for _ in range(3):  # steps 3-5 fit in three blocks; c cannot come back (needs 3, 0 free)
        batch, _ = _step(scheduler, token=3)
        assert [ch.seq for ch in batch.chunks] == [a, b] and batch.preempted == ()

    # step 6: a's 13th token needs a 4th block: b is now the newest running, so b goes.
    batch, _ = _step(scheduler, token=4)
    assert batch.preempted == (b,) and _shape(batch) == [("a", 12, 1, True)]
    assert a.block_table == [0, 1, 5, 4] and manager.free_block_ids() == [3, 2]
    assert scheduler.waiting == (b, c)  # b was added before c, and stays ahead of it

    finished = []
    for _ in range(4):  # steps 7-10: a alone until its 10th output token
        finished += _step(scheduler, token=5)[1]
    assert finished == [a] and manager.free_block_ids() == [2, 3, 4, 5, 1, 0]

    # step 11: b is recomputed from token 0, generated tokens included, and samples at the end
    batch, _ = _step(scheduler, token=6)
    assert _shape(batch) == [("b", 0, 13, True)]  # c (9 tokens, 3 blocks) does not fit: FCFS stop
    assert batch.chunks[0].token_ids == list(range(100, 108)) + [1, 2, 3, 3, 3]
    assert b.block_table == [2, 3, 4, 5] and b.output_token_ids == [1, 2, 3, 3, 3, 6]

    while scheduler.has_work():
        _step(scheduler, token=7)
    assert b.num_output_tokens == 10 and c.num_output_tokens == 10
    assert manager.num_free_blocks == 6


def test_a_sequence_that_is_the_newest_preempts_itself_and_older_ones_keep_their_blocks():
    scheduler = _scheduler(num_blocks=4, block_size=4)
    a, b = _seq("a", 4, 4), _seq("b", 7, 5)
    scheduler.add(a)
    scheduler.add(b)
    _step(scheduler)  # a: [0]; b: [1, 2]
    _step(scheduler)  # a's 5th token takes block 3
    batch, _ = _step(scheduler)  # b's 9th token needs a 3rd block: b is the newest
    assert batch.preempted == (b,) and _shape(batch) == [("a", 5, 1, True)]
    assert a.block_table == [0, 3] and scheduler.block_manager.free_block_ids() == [2, 1]
    assert scheduler.waiting == (b,) and scheduler.running == (a,)


def test_no_admission_in_a_step_that_preempted():
    # prefill_chunk=4 lets b's first chunk fit in the block b just gave back: re-admitting it in
    # the same step would only thrash, so admission waits a step.
    scheduler = _scheduler(num_blocks=3, block_size=4, prefill_chunk=4)
    a, b = _seq("a", 4, 5), _seq("b", 4, 5)
    scheduler.add(a)
    scheduler.add(b)
    _step(scheduler)  # a: [0], b: [1]
    batch, _ = _step(scheduler)  # a takes block 2; b needs a second block: b preempts itself
    assert batch.preempted == (b,) and _shape(batch) == [("a", 4, 1, True)]
    assert scheduler.waiting == (b,) and scheduler.block_manager.free_block_ids() == [1]
    batch, _ = _step(scheduler)
    assert _shape(batch) == [("a", 5, 1, True), ("b", 0, 4, False)] and b.block_table == [1]


# ---- FCFS, rejection, abort ------------------------------------------------------------------

def test_the_oldest_waiting_sequence_is_never_skipped_for_a_newer_one_that_fits():
    scheduler = _scheduler(num_blocks=8, block_size=4, prefill_chunk=64, token_budget=64)
    scheduler.add(_seq("a", 20, 4))  # 5 blocks
    _step(scheduler)
    scheduler.add(_seq("big", 16, 1))  # 4 blocks: only 3 free
    scheduler.add(_seq("small", 2, 1))  # would fit, must wait behind big
    batch, _ = _step(scheduler)
    assert [c.seq.seq_id for c in batch.chunks] == ["a"]
    while scheduler.get("a") is not None:
        _step(scheduler)
    batch, _ = _step(scheduler)
    assert [c.seq.seq_id for c in batch.chunks] == ["big", "small"]


def test_add_rejects_what_the_whole_pool_cannot_hold_and_accepts_an_exact_fit():
    scheduler = _scheduler(num_blocks=4, block_size=4)  # 16 tokens
    with pytest.raises(ContextLengthError) as info:
        scheduler.add(_seq("long", 10, max_tokens=7))
    assert isinstance(info.value, InvalidRequestError) and info.value.param == "max_tokens"
    assert not scheduler.has_work()

    exact = _seq("exact", 10, max_tokens=6)
    scheduler.add(exact)
    while scheduler.has_work():
        _step(scheduler)
    assert exact.status is SequenceStatus.FINISHED_LENGTH and exact.num_tokens == 16


def test_add_rejects_duplicates_empty_prompts_and_zero_max_tokens():
    scheduler = _scheduler()
    scheduler.add(_seq("a", 3))
    with pytest.raises(InvalidRequestError):
        scheduler.add(_seq("a", 3))
    with pytest.raises(InvalidRequestError):
        scheduler.add(_seq("empty", 0))
    with pytest.raises(InvalidRequestError):
        scheduler.add(_seq("none", 3, max_tokens=0))
    running = _seq("b", 3)
    running.status = SequenceStatus.RUNNING
    with pytest.raises(ValueError):
        scheduler.add(running)
    assert [s.seq_id for s in scheduler.waiting] == ["a"]


def test_abort_frees_blocks_at_once_for_running_and_waiting_sequences():
    scheduler = _scheduler(num_blocks=8, block_size=4, max_batch_size=1)
    a, b = _seq("a", 8), _seq("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    _step(scheduler)
    assert a.block_table == [0, 1]
    assert scheduler.abort("a") is a
    assert a.status is SequenceStatus.FINISHED_ABORTED and a.block_table == []
    assert scheduler.block_manager.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert scheduler.abort("b") is b and b.status is SequenceStatus.FINISHED_ABORTED
    assert scheduler.abort("b") is None and scheduler.abort("nobody") is None
    assert not scheduler.has_work()


def test_abort_while_a_step_runs_is_skipped_by_update():
    scheduler = _scheduler(num_blocks=8, block_size=4)
    a, b = _seq("a", 4), _seq("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule(0.0)
    scheduler.abort("a")
    assert scheduler.update(batch, {"b": 5}) == []  # a's token is not required
    assert a.num_computed_tokens == 0 and a.num_tokens == 4
    assert b.num_computed_tokens == 4 and b.last_token_id == 5
    assert scheduler.block_manager.num_free_blocks == 7


# ---- step protocol -------------------------------------------------------------------------------

def test_schedule_and_update_must_alternate():
    scheduler = _scheduler()
    scheduler.add(_seq("a", 4))
    batch = scheduler.schedule(0.0)
    with pytest.raises(RuntimeError):
        scheduler.schedule(0.0)
    with pytest.raises(ValueError):
        scheduler.update(batch, {})  # a's token is missing: nothing changes
    assert scheduler.get("a").num_computed_tokens == 0
    scheduler.update(batch, {"a": 5})
    with pytest.raises(RuntimeError):
        scheduler.update(batch, {"a": 5})
    assert scheduler.update(ScheduledBatch((), batch.knobs), {}) == []


# ---- batching window -----------------------------------------------------------------------------

def test_a_lone_arrival_waits_for_the_batching_window_so_a_burst_is_admitted_together():
    scheduler = _scheduler(batching_window_ms=2.0)
    scheduler.add(_seq("a", 4, arrival=10.0))
    batch = scheduler.schedule(10.0005)
    assert batch.is_empty and batch.hold_until == 10.0 + 0.002
    scheduler.add(_seq("b", 4, arrival=10.001))
    assert scheduler.update(batch, {}) == []
    assert scheduler.schedule(10.0015).hold_until == 10.002  # counted from the oldest arrival
    batch = scheduler.schedule(10.002)
    assert [c.seq.seq_id for c in batch.chunks] == ["a", "b"] and batch.hold_until is None

    scheduler.update(batch, {"a": 5, "b": 5})
    scheduler.add(_seq("c", 4, arrival=10.003))  # something runs: no hold
    batch = scheduler.schedule(10.003)
    assert [c.seq.seq_id for c in batch.chunks] == ["a", "b", "c"]


def test_no_hold_when_a_full_batch_waits_or_the_window_is_zero():
    scheduler = _scheduler(batching_window_ms=2.0, max_batch_size=2)
    scheduler.add(_seq("a", 4, arrival=0.0))
    scheduler.add(_seq("b", 4, arrival=0.0))
    assert len(scheduler.schedule(0.0)) == 2

    scheduler = _scheduler(batching_window_ms=0.0)
    scheduler.add(_seq("a", 4, arrival=0.0))
    assert len(scheduler.schedule(0.0)) == 1


# ---- knobs ---------------------------------------------------------------------------------------

def test_tuning_state_keeps_versions_and_ignores_stale_decisions():
    tuning = TuningState()
    assert tuning.current() == SchedulerKnobs() and tuning.version == 0
    # One source of defaults: the knobs start where reame.conf's dataclasses (and file) start.
    assert SchedulerKnobs() == SchedulerKnobs.from_config(Config())
    faster = SchedulerKnobs(max_batch_size=16)
    assert tuning.apply(faster, 3, "more streams") is True
    assert tuning.current() is faster and (tuning.version, tuning.reason) == (3, "more streams")
    assert tuning.apply(SchedulerKnobs(), 3, "repeat") is False
    assert tuning.apply(SchedulerKnobs(), 2, "late") is False
    assert tuning.current() is faster


@pytest.mark.parametrize("change", [
    {"max_batch_size": 0}, {"token_budget": -1}, {"prefill_chunk": 2.5}, {"attention_chunk": True},
    {"batching_window_ms": -0.1}, {"batching_window_ms": math.nan}, {"batching_window_ms": 5000.0},
    {"batching_window_ms": "2"},
])
def test_bad_knobs_are_config_errors(change):
    with pytest.raises(ConfigError):
        SchedulerKnobs(**change)


def test_apply_validates_and_a_bad_decision_changes_nothing():
    tuning = TuningState()
    bad = SchedulerKnobs()
    object.__setattr__(bad, "token_budget", 0)
    with pytest.raises(ConfigError):
        tuning.apply(bad, 1, "broken")
    with pytest.raises(ConfigError):
        tuning.apply({"token_budget": 4}, 1, "not knobs")
    with pytest.raises(ConfigError):
        tuning.apply(SchedulerKnobs(), -1, "bad version")
    assert tuning.version == 0 and tuning.current() == SchedulerKnobs()


def test_knobs_change_between_steps_and_a_smaller_batch_size_caps_the_next_batch():
    scheduler = _scheduler(max_batch_size=4)
    for name in "abcd":
        scheduler.add(_seq(name, 4))
    assert len(_step(scheduler)[0]) == 4
    smaller = SchedulerKnobs(max_batch_size=2, batching_window_ms=0.0)
    scheduler.tuning.apply(smaller, 1, "test")
    batch, _ = _step(scheduler)
    assert batch.knobs is smaller and [c.seq.seq_id for c in batch.chunks] == ["a", "b"]
    assert scheduler.num_running == 4  # c and d keep their blocks and resume when room returns


def test_a_decode_share_follows_each_prompt_chunk_step_with_decode_only_steps_for_its_share_of_time():
    """A short answer behind a long prompt: with decode_share 0.5, a 4 s prompt-chunk step is
    followed by 2 s of decode-only steps, in which nothing else is admitted or fed."""
    scheduler = _scheduler(prefill_chunk=8, token_budget=16, decode_share=0.5)
    scheduler.add(_seq("a", 4, max_tokens=50))
    batch = scheduler.schedule(0.0)
    scheduler.update(batch, {"a": 7}, now=0.1)  # a's prompt: a 0.1 s step, so 0.05 s of decoding
    scheduler.add(_seq("doc", 40, arrival=0.2))
    batch = scheduler.schedule(0.2)
    assert _shape(batch) == [("a", 4, 1, True), ("doc", 0, 8, False)]
    scheduler.update(batch, {"a": 7}, now=4.2)  # a 4 s chunk step: decode-only until 6.2
    scheduler.add(_seq("late", 4, arrival=4.3))
    for now in (4.2, 5.0, 6.1):
        batch = scheduler.schedule(now)
        assert _shape(batch)[0][0] == "a" and len(batch) == 1  # no doc chunk, no admission of "late"
        scheduler.update(batch, {"a": 7}, now=now + 0.05)
    batch = scheduler.schedule(6.2)  # the stretch is over: the doc's next chunk, and "late" comes in
    assert [c.seq.seq_id for c in batch.chunks] == ["a", "doc", "late"]
    assert batch.chunks[1].num_tokens == 8


def test_decode_only_steps_need_a_decoder_and_a_share():
    # Nothing decodes: the prompts go on at once.
    scheduler = _scheduler(prefill_chunk=8, token_budget=16, decode_share=1.0)
    scheduler.add(_seq("doc", 40))
    scheduler.update(scheduler.schedule(0.0), {}, now=4.0)
    assert _shape(scheduler.schedule(4.0)) == [("doc", 8, 8, False)]
    # Share 0 (reame.conf's): decoders only ride along in prompt-chunk steps, as before.
    scheduler = _scheduler(prefill_chunk=8, token_budget=16)
    scheduler.add(_seq("a", 4, max_tokens=50))
    scheduler.update(scheduler.schedule(0.0), {"a": 7}, now=0.1)
    scheduler.add(_seq("doc", 40))
    scheduler.update(scheduler.schedule(0.2), {"a": 7}, now=4.2)
    assert _shape(scheduler.schedule(4.2)) == [("a", 5, 1, True), ("doc", 8, 8, False)]


# ---- seeded random workload ----------------------------------------------------------------------

def _check_state(scheduler: Scheduler, order: dict[str, int], after_update: bool) -> None:
    manager = scheduler.block_manager
    owners = Counter()
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        assert 0 < seq.num_uncomputed_tokens or not after_update
        if after_update:  # exactly the blocks its computed tokens need
            assert len(seq.block_table) == manager.blocks_needed(seq.num_computed_tokens)
        owners.update(seq.block_table)
    for seq in scheduler.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert all(count == 1 for count in owners.values())  # no block owned twice
    assert [manager.ref_count(b) for b in range(manager.num_blocks)] == \
           [owners[b] for b in range(manager.num_blocks)]
    free = manager.free_block_ids()
    assert len(set(free)) == len(free) and set(free).isdisjoint(owners)
    assert manager.num_free_blocks + len(owners) == manager.num_blocks
    running = [order[s.seq_id] for s in scheduler.running]
    waiting = [order[s.seq_id] for s in scheduler.waiting]
    assert running == sorted(running) and waiting == sorted(waiting)
    assert not running or not waiting or running[-1] < waiting[0]  # FCFS across both queues


def _check_batch(batch: ScheduledBatch, manager: BlockManager, oldest_running: Sequence | None) -> None:
    knobs = batch.knobs
    assert batch.num_tokens <= knobs.token_budget and len(batch) <= knobs.max_batch_size
    for chunk in batch.chunks:
        seq = chunk.seq
        assert chunk.start == seq.num_computed_tokens and 1 <= chunk.num_tokens <= knobs.prefill_chunk
        assert chunk.samples == (chunk.start + chunk.num_tokens == seq.num_tokens)
        assert len(seq.block_table) == manager.blocks_needed(chunk.start + chunk.num_tokens)
    if oldest_running is not None:  # the oldest sequence always makes progress
        assert batch.chunks[0].seq is oldest_running


def test_a_random_workload_keeps_every_invariant_and_leaks_no_block():
    rng = random.Random(20240505)
    scheduler = _scheduler(num_blocks=40, block_size=4, max_batch_size=6, token_budget=48,
                           prefill_chunk=16, batching_window_ms=2.0)
    manager = scheduler.block_manager
    order: dict[str, int] = {}
    seqs: list[Sequence] = []
    now, step, version, rejected, holds = 0.0, 0, 0, 0, 0
    while len(order) + rejected < 1000 or scheduler.has_work():
        step += 1
        assert step < 20_000, "the workload did not drain"
        for _ in range(rng.choice((0, 0, 0, 1, 1, 2, 4))):
            if len(order) + rejected == 1000:
                break
            num_prompt = 150 if rng.random() < 0.01 else rng.randint(1, 40)
            seq = _seq(f"r{len(order) + rejected}", num_prompt, rng.randint(1, 30), arrival=now)
            if manager.blocks_needed(seq.max_num_tokens) > manager.num_blocks:
                with pytest.raises(ContextLengthError):
                    scheduler.add(seq)
                rejected += 1
                continue
            scheduler.add(seq)
            order[seq.seq_id] = len(order)
            seqs.append(seq)
        live = scheduler.running + scheduler.waiting
        if live and rng.random() < 0.03:
            scheduler.abort(rng.choice(live).seq_id)
        if step % 97 == 0:
            version += 1
            scheduler.tuning.apply(SchedulerKnobs(
                max_batch_size=rng.randint(1, 8), token_budget=rng.randint(1, 64),
                prefill_chunk=rng.randint(1, 32), batching_window_ms=rng.choice((0.0, 2.0))), version, "random")

        oldest = scheduler.running[0] if scheduler.running else None
        batch = scheduler.schedule(now)
        holds += batch.hold_until is not None
        _check_batch(batch, manager, oldest)
        _check_state(scheduler, order, after_update=False)
        if batch.chunks and rng.random() < 0.02:  # a client leaves while the step runs
            scheduler.abort(rng.choice(batch.chunks).seq.seq_id)
        # token 0 stops: about one sampled token in 25
        sampled = {c.seq.seq_id: (STOP if rng.random() < 0.04 else rng.randint(1, 50))
                   for c in batch.chunks if c.samples}
        for seq in scheduler.update(batch, sampled):
            assert seq.is_finished and seq.block_table == []
        _check_state(scheduler, order, after_update=True)
        now += 0.001

    assert len(seqs) + rejected == 1000 and rejected > 0
    assert all(seq.is_finished and seq.block_table == [] for seq in seqs)
    statuses = Counter(seq.status for seq in seqs)
    assert all(statuses[s] > 0 for s in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                                        SequenceStatus.FINISHED_ABORTED))
    assert sum(seq.num_preemptions for seq in seqs) > 0 and holds > 0
    assert sorted(manager.free_block_ids()) == list(range(40)) and manager.usage == 0.0
    for seq in seqs:
        if seq.status is SequenceStatus.FINISHED_LENGTH:
            assert seq.num_output_tokens == seq.params.max_tokens
