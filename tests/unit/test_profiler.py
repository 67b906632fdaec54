"""A worker's profile: what its traffic and steps looked like over one window, and the Strategy
that changes its knobs between two steps."""
from __future__ import annotations

import pytest

from gateway.coordinator import policy
from shared import protocol
from shared.errors import ConfigError
from shared.knobs import Knobs
from shared.protocol import Profile, Strategy
from tests.unit.test_worker_service import INFO, ScriptedSocket
from tests.fakes import FakeGenerator
from worker.profiler import ProfileCollector, burstiness, percentile
from worker.sched.generation import FinishEvent, StepStats, TokenEvent
from worker.sched.tuning_state import SchedulerKnobs, TuningState
from worker.service import WorkerService


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_window_of_traffic_becomes_one_profile():
    clock = Clock()
    collector = ProfileCollector("w", [0, 1], clock)
    collector.add_source("kernels", lambda: {"gemm": "i8_avx2", "speedup": 1.5, "ignored": [1]})
    collector.arrived("a", 100)
    clock.now += 0.010
    collector.arrived("b", 300)
    clock.now += 0.040
    # One step that prefills both (400 tokens) and samples their first tokens.
    collector.stepped(StepStats(2, 400, 0, 0.030), 0.035, [TokenEvent("a", 1), TokenEvent("b", 2)], 0, ["a", "b"], 30)
    clock.now += 0.010
    collector.stepped(StepStats(2, 2, 2, 0.008), 0.010, [TokenEvent("a", 3), FinishEvent("a", "stop", 100, 2),
                                                         TokenEvent("b", 4)], 1, ["b"], 32)
    clock.now += 4.94
    p = collector.profile(knobs_version=3, counters={"prefix_query_tokens": 400, "prefix_hit_tokens_ram": 96,
                                                     "kv_blocks": 512, "kv_block_tokens": 16}, preemptions=2)
    assert p.seconds == pytest.approx(5.0) and p.knobs_version == 3 and p.arrivals == 2 and p.finished == 1
    assert (p.prompt_tokens_p50, p.prompt_tokens_p95) == (100, 300)
    assert p.output_tokens_p50 == 2 and p.output_tokens == 4 and p.prefill_tokens == 400
    assert p.steps == 2 and p.batch_size_mean == 2 and p.busy_seconds == pytest.approx(0.045)
    assert p.step_ms_prefill == pytest.approx(30) and p.step_ms_decode == pytest.approx(8)
    assert p.step_ms_overhead == pytest.approx(3.5)
    assert p.queue_wait_ms_p95 == pytest.approx(15) and p.ttft_ms_p95 == pytest.approx(50)
    assert p.latency_ms_p95 == pytest.approx(60) and p.waiting_mean == 0.5 and p.kv_blocks_used_max == 32
    assert p.token_gap_ms_p95 == pytest.approx(10)  # a's and b's second tokens, one step after their first
    assert p.token_gap_ms_mean == pytest.approx(10)
    assert (p.prefix_query_tokens, p.prefix_hit_tokens, p.preemptions) == (400, 96, 2)
    assert p.sources == {"kernels": {"gemm": "i8_avx2", "speedup": 1.5}}
    assert protocol.decode(protocol.encode(p)) == p  # it crosses ZeroMQ as it is
    # The next window starts empty; counters and preemptions become increments.
    clock.now += 5
    q = collector.profile(3, {"prefix_query_tokens": 500, "prefix_hit_tokens_ram": 96}, preemptions=2)
    assert (q.arrivals, q.steps, q.prefix_query_tokens, q.prefix_hit_tokens, q.preemptions) == (0, 0, 100, 0, 0)
    assert q.token_gap_ms_p95 == 0.0
    # b's next token 2 s later (behind a long prompt chunk): the gap spans the windows.
    clock.now += 2.0
    collector.stepped(StepStats(1, 512, 1, 1.9), 2.0, [TokenEvent("b", 5)], 0, ["b"], 40)
    assert collector.profile(3, {}, preemptions=2).token_gap_ms_p95 == pytest.approx(11940)


def test_a_broken_source_costs_its_section_only():
    collector = ProfileCollector("w", [0])
    collector.add_source("bad", lambda: 1 / 0)
    assert collector.profile(0, {}, 0).sources == {}


def test_percentiles_and_burstiness():
    assert percentile([], 95) == 0 and percentile([5, 1, 3], 50) == 3 and percentile(list(range(1, 101)), 95) == 95
    assert burstiness([0, 1, 2, 3, 4]) == 0
    bursts = [10 * b + 0.001 * i for b in range(3) for i in range(10)]  # three bursts of ten
    assert burstiness(bursts) > policy.BURSTY


def strategy(version: int, reason: str, frozen: bool = False, **knobs) -> Strategy:
    """A Strategy of reame.conf's default knobs but `knobs`."""
    return Strategy(version, reason, Knobs(**knobs), frozen)


def test_a_strategy_applies_between_steps_and_a_stale_one_is_ignored():
    sock = ScriptedSocket()
    tuning = TuningState(SchedulerKnobs())
    service = WorkerService(FakeGenerator(), sock, INFO, tuning=tuning)
    service._handle(strategy(2, "short requests", max_batch_size=16, token_budget=528, batching_window_ms=4.0))
    assert tuning.version == 2 and tuning.current().max_batch_size == 16 and tuning.current().batching_window_ms == 4
    service._handle(strategy(1, "late", max_batch_size=4))
    assert tuning.current().max_batch_size == 16
    with pytest.raises(ConfigError, match="batching_window_ms"):  # out of bounds: no such Strategy is made
        strategy(3, "bad", batching_window_ms=5000.0)
    service._handle(strategy(4, "too big", token_budget=2048, prefill_chunk=1024))  # a chunk the engine is not sized for
    service._handle(strategy(5, "too many", max_batch_size=17))  # over twice the configured batch
    assert tuning.version == 2


def test_with_adaptivity_off_a_worker_keeps_its_knobs():
    tuning = TuningState(SchedulerKnobs())
    service = WorkerService(FakeGenerator(), ScriptedSocket(), INFO, tuning=tuning, adaptive=False)
    service._handle(strategy(2, "short requests", max_batch_size=16, token_budget=528, batching_window_ms=4.0))
    assert tuning.version == 0 and tuning.current() == SchedulerKnobs()


def test_freeze_and_unfreeze_reach_the_listeners_once_each():
    tuning = TuningState(SchedulerKnobs())
    service = WorkerService(FakeGenerator(), ScriptedSocket(), INFO, tuning=tuning)
    heard = []
    service.on_freeze(heard.append)
    service._handle(strategy(1, "freeze", frozen=True))
    service._handle(strategy(1, "freeze", frozen=True))  # repeated: ignored
    service._handle(strategy(2, "unfreeze"))
    assert heard == [True, False] and not service.frozen
