"""The kernel tuner on a real engine: swapping variants and thread counts between steps never
changes a token, and calibration times the model's own matrices."""
from __future__ import annotations

import random

import pytest

from shared.config import EngineSection
from shared.sampling import SamplingParams
from tests.model.run_requests import run_requests
from worker.engine.engine import load_engine
from worker.sched.generation import BatchGenerator
from worker.engine.tuning.kernel_tuner import KernelTuner, TunerSettings
from worker.sched.tuning_state import SchedulerKnobs, TuningState


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    return load_engine(smollm2_gguf, EngineSection(context_length=512), progress=lambda m: None)


def _requests():
    rng = random.Random(3)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    return {f"r{i}": ([rng.randrange(100, 20000) for _ in range(5 + 9 * i)], params) for i in range(5)}


def test_tokens_are_the_same_whatever_the_tuner_runs(engine):
    default, threads = engine.ops, engine.threads
    fixed = run_requests(BatchGenerator(engine, TuningState(SchedulerKnobs(batching_window_ms=0.0))), _requests())
    generator = BatchGenerator(engine, TuningState(SchedulerKnobs(batching_window_ms=0.0)))
    # explore half the steps: most steps of the run swap the table or the threads
    tuner = KernelTuner(engine, TunerSettings(explore_share=0.5), rng=random.Random(1))
    generator.kernel_tuner = tuner
    tuned = run_requests(generator, _requests())
    engine.ops = default
    engine.set_threads(threads)
    assert tuned.tokens == fixed.tokens
    explored = [arm for b in tuner.snapshot()["buckets"].values() for arm in b["arms"].values()
                if not arm.get("incumbent") and arm["samples"]]
    assert explored  # candidates did run


def test_calibration_times_every_arm_within_its_budget(engine):
    default, threads = engine.ops, engine.threads
    tuner = KernelTuner(engine, TunerSettings())
    tuner.calibrate(budget_s=60.0)
    assert set(tuner.choices()) == {"1", "2-8", "9-32", "33+"}
    assert engine.threads == threads
    assert engine.time_matmul(default, 3, repeats=2) > 0
    engine.ops = default
