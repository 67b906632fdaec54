"""KernelTuner with injected step timings: a fake engine whose step cost is a function of the
table and thread count installed when it runs, and a fake clock (no real timing anywhere)."""
from __future__ import annotations

import json
import logging
import math
import random

import pytest

from worker.engine.kernels.registry import ATTENTION, KERNELS, MATMUL, OpTable, bucket_of
from worker.engine.tuning.kernel_table_store import KernelTableStore, host_signature, reset_tables, saved_tables
from worker.engine.tuning.kernel_tuner import KernelTuner, TunerSettings, kernel_profile

CODE_TO_VARIANT = {v.code: v.variant for (op, _), v in KERNELS.items() if op == "matmul"}
CODE_TO_ATTENTION = {v.code: v.variant for (op, _), v in KERNELS.items() if op == "attention"}


def arm_of(ops, rows, threads):
    """(matmul variant, threads, attention variant) a step of `rows` rows runs with, read the way
    the fused step reads its table."""
    bucket = bucket_of(rows)
    return (CODE_TO_VARIANT[int(ops.codes[MATMUL, bucket])], threads,
            CODE_TO_ATTENTION[int(ops.codes[ATTENTION, bucket])])


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """Records every table and thread change; refuses one while a step runs."""

    def __init__(self, numerics="int8", threads=2):
        self._ops = OpTable.of(matmul=numerics)
        self.threads = threads
        self.max_threads = threads
        self.executing = False
        self.thread_calls = []
        self.table_sets = 0

    @property
    def ops(self):
        return self._ops

    @ops.setter
    def ops(self, table):
        assert not self.executing, "op table swapped inside a step"
        if table is not self._ops:
            self.table_sets += 1
        self._ops = table

    def set_threads(self, n):
        assert not self.executing, "threads changed inside a step"
        self.threads = n
        self.thread_calls.append(n)

    def arm(self, rows):
        """(matmul variant, threads, attention variant) the step of `rows` rows runs with."""
        return arm_of(self._ops, rows, self.threads)


def run(tuner, engine, clock, cost, steps, rows=1, noise=0.03, seed=1):
    """Step the tuner `steps` times; cost(arm, now) gives a step's seconds per row before noise."""
    rng = random.Random(seed)
    seen = []
    for _ in range(steps):
        tuner.before_step(rows)
        engine.executing = True
        arm = engine.arm(rows)
        seconds = cost(arm, clock.now) * rows * math.exp(rng.gauss(0.0, noise))
        engine.executing = False
        clock.now += seconds
        tuner.after_step(seconds)
        seen.append(arm)
    return seen


def make(settings=None, numerics="int8", threads=2, saved=None):
    clock, engine = FakeClock(), FakeEngine(numerics, threads)
    tuner = KernelTuner(engine, settings or TunerSettings(explore_share=0.2), clock=clock, rng=random.Random(7),
                        saved=saved)
    return tuner, engine, clock


def test_promotes_the_faster_arm_and_logs_before_and_after(caplog):
    tuner, engine, clock = make()
    cost = lambda arm, now: 0.006 if arm == ("int8_serial", 1, "tiled") else 0.010
    with caplog.at_level(logging.INFO, logger="reame.kernel_tuner"):
        run(tuner, engine, clock, cost, 2000)
    assert tuner.choices()["1"] == ("int8_serial", 1, "tiled")
    assert tuner.promotions == 1 and tuner.rollbacks == 0
    lines = [r.getMessage() for r in caplog.records if "promoted" in r.getMessage()]
    assert len(lines) == 1 and "int8x2t -> int8_serial1t" not in lines[0]
    assert "int8x2t -> int8_serialx1t" in lines[0] and "ms/row vs" in lines[0]
    event = tuner.snapshot()["events"][0]
    assert event["kind"] == "promote" and event["after_ms_per_row"] < event["before_ms_per_row"]
    # other buckets were never stepped: they keep the engine's choice
    assert tuner.choices()["33+"] == ("int8", 2, "tiled")


def test_a_learned_choice_is_weighed_against_the_shipped_default_on_its_own_steps():
    """The report's figure for a kernel choice: the default's re-timed steps against the choice's."""
    tuner, engine, clock = make()
    cost = lambda arm, now: 0.006 if arm == ("int8_serial", 1, "tiled") else 0.010
    assert tuner.snapshot()["buckets"]["1"]["versus_default"] is None  # nothing learned yet
    run(tuner, engine, clock, cost, 3000, noise=0.01)
    versus = tuner.snapshot()["buckets"]["1"]["versus_default"]
    assert tuner.choices()["1"] == ("int8_serial", 1, "tiled") and versus["default"] == "int8x2t"
    # the default's time per row over the choice's (1.67 here), within the 1% noise of a few steps
    assert 1 + versus["gain"] == pytest.approx(0.010 / 0.006, rel=0.05) and 0 < versus["noise"] < 0.03
    assert versus["steps"] >= 2
    flat = kernel_profile(tuner.snapshot())
    assert flat["ab 1 choice"] == "int8_serialx1t" and flat["ab 1 default"] == "int8x2t"
    assert flat["ab 1 gain"] == versus["gain"] and "ab 33+ gain" not in flat  # a bucket on its default


def test_exploration_is_a_small_share_of_steps_and_decays_while_nothing_wins():
    tuner, engine, clock = make(TunerSettings(explore_share=0.05))
    seen = run(tuner, engine, clock, lambda arm, now: 0.01, 4000)
    explored = [arm != ("int8", 2, "tiled") for arm in seen]
    assert 0.02 * 1000 < sum(explored[:1000]) < 0.08 * 1000  # the full budget while it learns
    assert sum(explored[2000:]) < 0.01 * 2000  # equal arms: rounds without a win halved it
    assert tuner.buckets[0].decay >= 2 and tuner.snapshot()["buckets"]["1"]["explore_budget"] <= 0.25


def hogged(arm, now):
    return 0.03 if arm[1] == 2 else 0.012  # a neighbour holds one of two cores


def quiet(arm, now):
    return 0.006 if arm[1] == 2 else 0.012  # ... and has gone: a one-thread step is unchanged


def _settled_under_a_hog():
    tuner, engine, clock = make(TunerSettings(explore_share=0.05))
    tuner.note_neighbours(0.02)
    run(tuner, engine, clock, lambda arm, now: 0.01, 2000)
    assert tuner.buckets[0].decay >= 1  # settled: exploring at half or less
    tuner.note_neighbours(0.8)
    run(tuner, engine, clock, hogged, 4000, seed=3)
    assert tuner.choices()["1"][1] == 1 and tuner.buckets[0].decay >= 1
    return tuner, engine, clock


def _steps_until_two_threads(tuner, engine, clock, limit=20000):
    for i in range(limit):
        run(tuner, engine, clock, quiet, 1, seed=i)
        if tuner.choices()["1"][1] == 2:
            return i
    return limit


def test_a_drift_in_step_time_brings_exploration_back():
    """A neighbour arrives: the two-thread incumbent's steps get slower (drift), the decayed
    bucket explores fully again and one thread is promoted."""
    tuner, engine, clock = make(TunerSettings(explore_share=0.05))
    run(tuner, engine, clock, lambda arm, now: 0.01, 3000)
    assert tuner.buckets[0].decay >= 1
    seen = run(tuner, engine, clock, hogged, 600, seed=2)
    assert tuner.choices()["1"][1] == 1 and seen.index(tuner.choices()["1"]) < 200


def test_a_neighbour_leaving_brings_exploration_back_within_seconds():
    """A one-thread step barely changes when the neighbour leaves: no drift to see. The profile's
    neighbour share (note_neighbours) wakes the bucket; without it the decayed pauses take ~10x longer."""
    tuner, engine, clock = _settled_under_a_hog()
    tuner.note_neighbours(0.02)
    started = clock.now
    assert _steps_until_two_threads(tuner, engine, clock) < 1000 and clock.now - started < 15.0
    unnoticed, engine2, clock2 = _settled_under_a_hog()
    assert _steps_until_two_threads(unnoticed, engine2, clock2) > 3000


def test_a_table_never_changes_inside_a_step():
    tuner, engine, clock = make()
    run(tuner, engine, clock, lambda arm, now: 0.006 if arm[1] == 1 else 0.01, 500)  # FakeEngine asserts
    tuner.before_step(3)
    with pytest.raises(RuntimeError, match="between steps"):
        tuner.before_step(3)
    tuner.after_step(0.01)


def test_every_row_of_a_step_sees_one_table_whatever_its_bucket():
    """A step's rows share the codes array the step was given; a candidate changes only its own bucket."""
    tuner, engine, clock = make(TunerSettings(explore_share=0.5))
    run(tuner, engine, clock, lambda arm, now: 0.01, 50, rows=4)
    for _ in range(40):
        tuner.before_step(4)
        codes = engine.ops.codes.copy()
        incumbent = OpTable.of(matmul="int8").codes
        assert (codes[:, [0, 2, 3]] == incumbent[:, [0, 2, 3]]).all()
        tuner.after_step(0.04)


def test_rolls_back_a_switch_that_regresses_and_bans_it(caplog):
    tuner, engine, clock = make(TunerSettings(explore_share=0.2, ban_s=30.0))
    # int8_serial x1 looks faster while explored, then is slow once it serves every step
    cost = lambda arm, now: (0.006 if tuner.promotions == 0 else 0.015) if arm == ("int8_serial", 1, "tiled") else 0.010
    with caplog.at_level(logging.INFO, logger="reame.kernel_tuner"):
        run(tuner, engine, clock, cost, 1500)
        assert tuner.promotions == 1 and tuner.rollbacks == 1
        assert tuner.choices()["1"] == ("int8", 2, "tiled")
        rolled = [r.getMessage() for r in caplog.records if "rolled back" in r.getMessage()]
        assert len(rolled) == 1 and "banned for 30 s" in rolled[0]
        banned_at = tuner.snapshot()["events"][-1]["at"]
        # banned: the arm does not run again until the ban expires
        seen = run(tuner, engine, clock, cost, 600, seed=2)
    until = [arm for arm in seen if arm == ("int8_serial", 1, "tiled")]
    assert clock.now < banned_at + 30.0 and not until


def test_does_not_flap_between_equal_arms():
    tuner, engine, clock = make(TunerSettings(explore_share=0.2))
    run(tuner, engine, clock, lambda arm, now: 0.01, 20000, noise=0.10)
    assert tuner.promotions == 0 and tuner.rollbacks == 0


def test_a_busy_neighbour_moves_to_one_thread_and_back():
    """Two threads win on a quiet host; with a neighbour on one core, one thread wins; it returns."""
    tuner, engine, clock = make(TunerSettings(explore_share=0.1, recheck_s=5.0))
    busy = (20.0, 40.0)

    def cost(arm, now):
        neighbour = busy[0] <= now < busy[1]
        if arm[1] == 2:
            return 0.020 if neighbour else 0.007
        return 0.010

    choices = []
    while clock.now < 70.0:
        run(tuner, engine, clock, cost, 100)
        choices.append((clock.now, tuner.choices()["1"][1]))
    assert [t for now, t in choices if 15.0 < now < 20.0] and all(t == 2 for now, t in choices if now < 20.0)
    assert any(t == 1 for now, t in choices if busy[0] < now < busy[1])
    back = [now for now, t in choices if now > busy[1] and t == 2]
    assert back and back[0] - busy[1] < 30.0


def test_disabled_tuner_never_explores_nor_touches_threads():
    tuner, engine, clock = make(TunerSettings(enabled=False, explore_share=0.5))
    seen = run(tuner, engine, clock, lambda arm, now: 0.006 if arm[1] == 1 else 0.01, 2000)
    assert set(seen) == {("int8", 2, "tiled")} and engine.thread_calls == [] and tuner.promotions == 0
    tuner.calibrate(10.0)
    assert engine.thread_calls == []


def test_a_frozen_tuner_keeps_its_table_until_unfrozen():
    tuner, engine, clock = make()
    faster = lambda arm, now: 0.006 if arm == ("int8_serial", 1, "tiled") else 0.010
    tuner.freeze(True)
    seen = run(tuner, engine, clock, faster, 2000)
    assert set(seen) == {("int8", 2, "tiled")} and tuner.promotions == 0
    tuner.freeze(False)
    run(tuner, engine, clock, faster, 2000)
    assert tuner.choices()["1"] == ("int8_serial", 1, "tiled")


def test_only_variants_of_the_engines_numerics_are_tried():
    tuner, engine, clock = make(numerics="float32")
    seen = run(tuner, engine, clock, lambda arm, now: 0.01, 3000)
    assert {v for v, _, _ in seen} == {"float32", "float32_serial"}


def test_a_failed_step_teaches_nothing():
    tuner, engine, clock = make()
    tuner.before_step(1)
    tuner.after_step(None)
    tuner.before_step(1)  # no "twice" error: the failed step was closed
    tuner.after_step(0.01)
    assert tuner.snapshot()["buckets"]["1"]["arms"]["int8x2t"]["samples"] == 1


def test_step_context_times_the_step_and_closes_it_on_errors():
    tuner, engine, clock = make()
    ticks = iter([1.0, 1.5])
    with tuner.step(2, timer=lambda: next(ticks)):
        pass
    assert tuner.snapshot()["buckets"]["2-8"]["arms"]["int8x2t"]["ms_per_row"] == 250.0
    with pytest.raises(ValueError):
        with tuner.step(2):
            raise ValueError("engine bug")
    tuner.before_step(2)
    tuner.after_step(0.01)


def test_calibration_starts_each_bucket_on_its_fastest_arm_within_the_budget():
    tuner, engine, clock = make()
    timed = []

    def time_matmul(ops, rows, repeats=3):
        arm = arm_of(ops, rows, engine.threads)
        timed.append(arm)
        if rows > 1:
            return rows * 1e-3
        # one row: one thread wins; the serial kernel is fastest, and fast at 2 threads too
        return {("int8", 2, "tiled"): 1.0, ("int8", 1, "tiled"): 0.6, ("int8_serial", 2, "tiled"): 0.4, ("int8_serial", 1, "tiled"): 0.5}[arm] * 1e-3

    engine.time_matmul = time_matmul
    now = [0.0]

    def timer():
        now[0] += 0.1
        return now[0]

    tuner.calibrate(budget_s=100.0, timer=timer)
    # threads are judged by the parallel kernel (the step's other loops run on them too)
    assert tuner.choices()["1"] == ("int8_serial", 1, "tiled")
    assert tuner.choices()["2-8"] == ("int8", 2, "tiled")  # ties keep the engine's choice
    assert engine.threads == 2  # restored
    timed.clear()
    now[0] = 0.0
    tuner.calibrate(budget_s=1.0, timer=timer)
    assert len(timed) < 2 * 16  # stopped at the budget, not after every bucket


def test_calibration_shrugs_off_a_neighbour_that_holds_a_core_for_a_moment():
    """The first arm timed (two threads) runs while another process holds the second core; the
    moment passes before the next round. Each arm's time is its median round, so the bucket still
    starts on two threads (timed arm after arm, the one slow measurement decided it)."""
    tuner, engine, _ = make()
    calls = [0]

    def time_matmul(ops, rows, repeats=3):
        calls[0] += 1
        per_row = {2: 0.55, 1: 1.0}[engine.threads] * 1e-3
        if calls[0] <= 2:  # the first arm's first touch and first timing: 50x, as measured on 12-06
            per_row *= 50
        return per_row * rows

    engine.time_matmul = time_matmul
    tuner.calibrate(budget_s=100.0)
    assert tuner.choices()["1"][1] == 2 and tuner.choices()["2-8"][1] == 2


def test_attention_variants_are_arms_of_the_buckets_they_serve(caplog):
    """Prompt-sized steps A/B the attention variants like the matmuls: the faster one is promoted,
    and the table the engine runs carries it in that bucket only. One-row steps have no attention
    arm to try (the tiled variant runs as per_row there: the same code timed twice)."""
    tuner, engine, clock = make()
    assert {arm[2] for arm in tuner.buckets[0].arms} == {"tiled"}
    assert {arm[2] for arm in tuner.buckets[2].arms} == {"tiled", "per_row"}
    cost = lambda arm, now: 0.006 if arm[2] == "per_row" else 0.010
    with caplog.at_level(logging.INFO, logger="reame.kernel_tuner"):
        run(tuner, engine, clock, cost, 2000, rows=16)
    assert tuner.choices()["9-32"][2] == "per_row" and tuner.choices()["2-8"][2] == "tiled"
    assert engine.arm(16)[2] == "per_row" and engine.arm(4)[2] == "tiled"
    assert "+per_row promoted" in caplog.text
    assert tuner.snapshot()["buckets"]["9-32"]["attention"] == "per_row"


def test_a_choice_saved_before_attention_was_tuned_keeps_the_buckets_attention():
    tuner, engine, _ = make()
    assert tuner.adopt({"1": ["int8_serial", 1], "9-32": ["int8", 1]})
    assert tuner.choices()["1"] == ("int8_serial", 1, "tiled")
    assert tuner.choices()["9-32"] == ("int8", 1, "tiled")
    assert not tuner.adopt({"9-32": ["int8", 1, "no_such_attention"]})


def test_saved_table_reloads_for_the_same_key_only(tmp_path):
    parts = {"cpu": "AMD EPYC", "cpu_flags": "abc", "model_sha256": "m1", "reame": "0.1.0", "engine_code": "e",
             "numerics": "int8", "threads": "2"}
    store = KernelTableStore(tmp_path, parts)
    tuner, engine, clock = make(saved=store.save)
    run(tuner, engine, clock, lambda arm, now: 0.006 if arm == ("int8_serial", 1, "tiled") else 0.010, 2000)
    assert tuner.choices()["1"] == ("int8_serial", 1, "tiled")
    assert store.load()["1"] == ["int8_serial", 1, "tiled"]  # saved once the switch was confirmed

    restarted, engine2, _ = make()
    assert restarted.adopt(KernelTableStore(tmp_path, parts).load())
    assert restarted.choices() == tuner.choices()
    assert CODE_TO_VARIANT[int(engine2.ops.codes[MATMUL, 0])] == "int8_serial"
    assert KernelTableStore(tmp_path, {**parts, "model_sha256": "m2"}).load() is None
    assert KernelTableStore(tmp_path, {**parts, "cpu_flags": "other"}).load() is None
    assert not restarted.adopt({"1": ["float32", 2]})  # not an arm of an int8 engine

    [(path, record)] = saved_tables(tmp_path)
    assert record["key"] == parts
    path.write_text("{not json")
    assert store.load() is None
    assert reset_tables(tmp_path) == 1 and saved_tables(tmp_path) == []


def test_host_signature_reads_the_cpu_model_and_hashes_the_flags():
    info = "processor : 0\nmodel name : AMD EPYC 7R13\nflags : sse avx2 fma\n\nprocessor : 1\nmodel name : X\n"
    sig = host_signature(info)
    assert sig["cpu"] == "AMD EPYC 7R13"
    assert sig["cpu_flags"] == host_signature("model name : AMD EPYC 7R13\nflags : fma avx2 sse\n")["cpu_flags"]
    assert sig["cpu_flags"] != host_signature("model name : AMD EPYC 7R13\nflags : sse avx2\n")["cpu_flags"]


def test_snapshot_is_plain_json():
    tuner, engine, clock = make()
    run(tuner, engine, clock, lambda arm, now: 0.006 if arm == ("int8_serial", 1, "tiled") else 0.010, 1500)
    snap = json.loads(json.dumps(tuner.snapshot()))
    assert snap["enabled"] and snap["numerics"] == "int8"
    assert snap["buckets"]["1"]["choice"] == "int8_serialx1t"
    assert set(snap["buckets"]["1"]["arms"]) == {"int8x2t", "int8x1t", "int8_serialx2t", "int8_serialx1t"}


def test_a_variant_is_an_arm_only_where_some_call_has_its_minimum_rows():
    # int8_blocked runs as int8 up to ROW_BLOCK (32) rows: an arm in the 33+ bucket only
    tuner, engine, clock = make()
    arms = {b.name: {variant for variant, _, _ in b.arms} for b in tuner.buckets}
    assert "int8_blocked" in arms["33+"]
    assert all("int8_blocked" not in arms[name] for name in ("1", "2-8", "9-32"))
    assert all({"int8", "int8_serial"} <= a for a in arms.values())


def _config(tmp_path, **tuning):
    from shared.config import parse_config
    lines = [f"state_path = {tmp_path / 'state'}"] + [f"{k} = {v}" for k, v in tuning.items()]
    return parse_config("[tuning]\n" + "\n".join(lines) + "\n", str(tmp_path / "reame.conf"))


class _GGUF:
    def fingerprint(self):
        return "cd" * 32


def test_worker_tuner_off_when_kernels_fixed_or_not_adaptive(tmp_path):
    from worker.engine.tuning.kernel_table_store import build_kernel_tuner
    from worker.engine.tuning.kernel_tuner import FixedKernels
    for tuning in ({"kernels": "fixed"}, {"adaptive": "false"}):
        engine = FakeEngine()
        before = engine.ops
        assert isinstance(build_kernel_tuner(_config(tmp_path, **tuning), engine), FixedKernels)
        assert engine.ops is before and engine.thread_calls == []


def test_without_a_tuner_the_placement_caps_the_threads_it_was_loaded_with(tmp_path):
    """kernels = fixed: [engine] threads stay, but never more than the CPUs the coordinator's
    placement leaves (the tuner, when on, is the one decider; here nothing decides)."""
    from worker.engine.tuning.kernel_table_store import build_kernel_tuner
    engine = FakeEngine(threads=2)
    fixed = build_kernel_tuner(_config(tmp_path, kernels="fixed"), engine)
    fixed.note_neighbours(0.9)  # nothing here explores, so a neighbour changes nothing
    fixed.limit_threads(1)
    fixed.limit_threads(4)  # the CPUs are back: the threads it was loaded with, no more
    assert engine.thread_calls == [1, 2]


def test_worker_tuner_calibrates_once_then_starts_on_the_saved_table(tmp_path):
    from worker.engine.tuning.kernel_table_store import build_kernel_tuner
    config = _config(tmp_path)
    calls = []

    def time_matmul(ops, rows, repeats=3):
        calls.append(rows)
        arm = arm_of(ops, rows, engine.threads)
        return {2: 1.0, 1: 0.6}[arm[1]] * (0.8 if arm[0] == "int8_serial" else 1.0) * rows * 1e-3

    engine = FakeEngine()
    engine.gguf, engine.time_matmul = _GGUF(), time_matmul
    tuner = build_kernel_tuner(config, engine)
    assert calls and all(arm == ("int8_serial", 1, "tiled") for arm in tuner.choices().values())

    calls.clear()
    engine = FakeEngine()
    engine.gguf, engine.time_matmul = _GGUF(), time_matmul
    restarted = build_kernel_tuner(config, engine)
    assert restarted.choices() == tuner.choices()  # no calibration: the saved table
    # ... whose one-thread choices were re-timed against two threads once each (and still win)
    assert sorted(set(calls)) == [1, 4, 16, 64] and len(calls) == 4 * 2 * 2


def test_a_saved_one_thread_table_learned_under_a_hog_is_dropped_at_a_start_without_it(tmp_path, caplog):
    """Issue 37: one thread wins while a neighbour holds the other core, and loses once it is gone;
    a table saved meanwhile is re-timed at the next start, not trusted."""
    from worker.engine.tuning.kernel_table_store import build_kernel_tuner
    config = _config(tmp_path)
    hog = [True]

    def time_matmul(ops, rows, repeats=3):
        threads = engine.threads
        per_row = {2: 3.0, 1: 1.0}[threads] if hog[0] else {2: 0.55, 1: 1.0}[threads]
        return per_row * rows * 1e-3

    engine = FakeEngine()
    engine.gguf, engine.time_matmul = _GGUF(), time_matmul
    learned = build_kernel_tuner(config, engine)  # calibrated with the hog there
    assert all(threads == 1 for _, threads, _ in learned.choices().values())

    hog[0] = False
    engine = FakeEngine()
    engine.gguf, engine.time_matmul = _GGUF(), time_matmul
    with caplog.at_level(logging.INFO, "reame.kernel_tuner"):
        restarted = build_kernel_tuner(config, engine)
    assert all(threads == 2 for _, threads, _ in restarted.choices().values())
    assert "the saved int8x1t is dropped for int8x2t" in caplog.text and engine.threads == 2
    [(_, record)] = saved_tables(tmp_path / "state")
    assert all(threads == 2 for _, threads, _ in record["choices"].values())  # what the next start adopts


def test_a_worker_moved_to_fewer_cpus_runs_no_more_threads_than_cpus(caplog):
    """The coordinator's placement left one CPU: two threads would time-share it at every barrier."""
    tuner, engine, clock = make(TunerSettings(explore_share=0.3))
    two_threads_faster = lambda arm, now: 0.006 if arm[1] == 2 else 0.010
    run(tuner, engine, clock, two_threads_faster, 500)
    assert tuner.choices()["1"][1] == 2
    with caplog.at_level(logging.INFO, "reame.kernel_tuner"):
        tuner.limit_threads(1)
    assert all(arm[1] == 1 for arm in tuner.choices().values()) and engine.threads == 1
    assert "the worker now runs on 1 CPU" in caplog.text
    seen = run(tuner, engine, clock, two_threads_faster, 2000)  # 2 threads still "measure" faster
    assert {threads for _, threads, _ in seen} == {1}
    one_thread_choice = tuner.choices()
    tuner.limit_threads(2)  # the CPU is back: the choices the cut replaced are back at once
    assert tuner.choices() == {name: (variant, 2, attention) for name, (variant, _, attention) in one_thread_choice.items()}
    assert engine.threads == 2
    run(tuner, engine, clock, two_threads_faster, 3000)
    assert tuner.choices()["1"][1] == 2


def test_a_choice_of_one_thread_made_on_two_cpus_is_not_undone_by_a_placement():
    """Only what the cut replaced comes back: a bucket that chose one thread itself keeps it."""
    tuner, engine, clock = make(TunerSettings(explore_share=0.3))
    run(tuner, engine, clock, lambda arm, now: 0.006 if arm == ("int8_serial", 1, "tiled") else 0.010, 2000)
    assert tuner.choices()["1"] == ("int8_serial", 1, "tiled")
    tuner.limit_threads(1)
    tuner.limit_threads(2)
    assert tuner.choices()["1"] == ("int8_serial", 1, "tiled") and tuner.choices()["33+"] == ("int8", 2, "tiled")


def test_a_step_after_an_idle_pause_runs_the_incumbent_and_slow_steps_still_get_candidates():
    # No share-based exploration: only the busy-time rule can pick a candidate here.
    tuner, engine, clock = make(TunerSettings(explore_share=0.0, explore_every_s=30.0))
    incumbent = engine.arm(1)
    run(tuner, engine, clock, lambda arm, now: 0.010, steps=10)  # 0.1 s of busy time
    for _ in range(5):
        clock.now += 60.0  # the server idles for a minute; a request arrives
        assert run(tuner, engine, clock, lambda arm, now: 0.010, steps=1) == [incumbent]
    # 1-second steps: about one candidate per 30 s of them
    seen = run(tuner, engine, clock, lambda arm, now: 1.0, steps=150)
    assert 3 <= sum(arm != incumbent for arm in seen) <= 7
