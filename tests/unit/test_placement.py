"""Where a worker runs (worker.placement): the CPU-set and memory-binding knobs applied on this
host (a child process's threads are moved, so pytest's own affinity is left alone), the serve
loop applying a Strategy's placement between steps, and the profile's per-CPU neighbour shares."""
from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from shared.errors import ConfigError
from shared.knobs import Knobs
from shared.protocol import Strategy
from tests.fakes import FakeGenerator
from tests.unit.test_worker_service import INFO, ScriptedSocket
from worker.placement import Placement
from worker.profiler import ProfileCollector
from worker.service import WorkerService

CPUS = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="moving a worker between CPUs needs two of them")


@pytest.fixture
def child():
    """A process with several threads, standing in for a worker whose engine pools have started."""
    code = "import threading, time\nfor _ in range(3): threading.Thread(target=time.sleep, args=(60,)).start()\n" \
           "print('ready', flush=True)\ntime.sleep(60)\n"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    yield process
    process.kill()
    process.wait()


def affinities(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


@needs_two_cpus
def test_the_cpu_set_moves_every_thread_and_grows_back(child):
    placement = Placement(0, CPUS, pid=child.pid)
    assert len(os.listdir(f"/proc/{child.pid}/task")) == 4
    assert placement.apply([CPUS[-1]], bind_memory=False) is True
    assert affinities(child.pid) == {frozenset([CPUS[-1]])} and placement.in_use == [CPUS[-1]]
    assert placement.apply([CPUS[-1]], bind_memory=False) is False  # nothing to do
    assert placement.apply([], bind_memory=False) is True  # [] = every CPU it started with
    assert affinities(child.pid) == {frozenset(CPUS)}


def test_cpus_beyond_the_workers_own_are_refused(child):
    placement = Placement(0, CPUS[:1], pid=child.pid)
    with pytest.raises(ConfigError, match="not among this worker's"):
        placement.apply([CPUS[0], 4095], bind_memory=False)
    assert placement.in_use == CPUS[:1]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the test reads the policy with x86_64's get_mempolicy")
def test_memory_binding_sets_and_clears_the_policy():
    # In a child: the policy belongs to the calling thread, and pytest's must stay the default.
    code = textwrap.dedent("""
        import ctypes, os
        from worker.placement import Placement
        libc = ctypes.CDLL(None, use_errno=True)
        def mode():
            m = ctypes.c_int(-1)
            assert libc.syscall(239, ctypes.byref(m), None, 0, None, 0) == 0, os.strerror(ctypes.get_errno())
            return m.value
        p = Placement(0, sorted(os.sched_getaffinity(0)))
        before = mode()
        p.apply([], bind_memory=True)
        bound = mode()
        p.apply([], bind_memory=False)
        print(before, bound, mode(), p.bound)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "2", "0", "False"]  # MPOL_DEFAULT, MPOL_BIND, MPOL_DEFAULT


def strategy(version: int, **placement) -> Strategy:
    return Strategy(version=version, reason="busy CPUs: test", knobs=Knobs(**placement))


class ThreadsEngine:
    """What FixedKernels needs of an engine: its thread count, and a record of each change."""

    def __init__(self, threads: int):
        self.threads, self.set = threads, []

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.set.append(n)


@needs_two_cpus
def test_the_serve_loop_applies_a_strategys_placement_between_steps(child, caplog):
    from worker.engine.tuning.kernel_tuner import FixedKernels
    from worker.sched.tuning_state import SchedulerKnobs, TuningState

    placement = Placement(0, CPUS, pid=child.pid)
    service = WorkerService(FakeGenerator(), ScriptedSocket(), INFO, tuning=TuningState(SchedulerKnobs()),
                            placement=placement)
    cpu_counts = []  # what the kernel tuner, the one decider of threads, is told (KernelTuner.limit_threads)
    service.on_cpus(cpu_counts.append)
    engine = ThreadsEngine(len(CPUS))
    service.on_cpus(FixedKernels(engine).limit_threads)  # without a tuner: [engine] threads, capped
    with caplog.at_level(logging.INFO, "reame.worker"):
        service._handle(strategy(1, cpus=[CPUS[0]]))
    assert affinities(child.pid) == {frozenset([CPUS[0]])} and engine.set == [1]  # one thread per CPU left
    assert cpu_counts == [1]
    assert any(f"runs on CPUs {CPUS[0]} (was {','.join(map(str, CPUS))})" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.WARNING, "reame.worker"):
        service._handle(strategy(2, cpus=[4095]))
    assert placement.in_use == [CPUS[0]] and "placement unchanged" in caplog.text
    service._handle(strategy(3))  # the defaults again: every CPU, the threads it started with
    assert affinities(child.pid) == {frozenset(CPUS)} and engine.set == [1, len(CPUS)]
    assert cpu_counts == [1, len(CPUS)]
    ignoring = WorkerService(FakeGenerator(), ScriptedSocket(), INFO, tuning=TuningState(SchedulerKnobs()),
                             placement=Placement(0, CPUS, pid=child.pid), adaptive=False)
    ignoring._handle(strategy(4, cpus=[CPUS[0]]))  # --adaptive off: strategies change nothing
    assert ignoring.placement.in_use == CPUS and affinities(child.pid) == {frozenset(CPUS)}


def test_the_profile_says_where_the_worker_runs_and_who_else_uses_each_cpu():
    placement = Placement(0, CPUS)
    placement.in_use = CPUS[:1]  # as after a strategy, without moving pytest
    collector = ProfileCollector("h/node0/1", CPUS, placement=placement)
    busy = 0
    for _ in range(2_000_000):  # some CPU time of our own, so the window is not empty
        busy += 1
    profile = collector.profile(0, {}, 0)
    assert profile.cpus == CPUS and profile.cpus_in_use == CPUS[:1] and profile.numa_nodes == 1
    assert len(profile.cpu_others_each) == len(CPUS) and all(0.0 <= x <= 1.0 for x in profile.cpu_others_each)
    assert profile.memory_bound is False
