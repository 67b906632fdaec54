"""Who used the worker's CPUs (worker/cpu_share.py), from recorded /proc readings: a neighbour on
one CPU must show on that CPU while the worker is busy, not only once it idles. The hog window is
the one measured on AMD Zen 3 (0.5B decode on 2 threads, a pinned hog on CPU 1): the worker at
1.3 CPUs, the hog at 3.4 s of CPU 1's 5."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.coordinator import policy
from tests.unit.test_coordinator import DEFAULTS, profile
from worker.cpu_share import CpuShare, CpuTimes, read_other_threads


class Recorded:
    """Readings played back one sample at a time: each call of a reader returns the current one."""

    def __init__(self, readings):
        self.readings, self.at = readings, 0

    def cpu_times(self, cpus):
        return self.readings[self.at][0]

    def own(self):
        return self.readings[self.at][1]

    def threads(self):
        return self.readings[self.at][2]

    def share(self, cpus=(0, 1)) -> CpuShare:
        return CpuShare(list(cpus), self.cpu_times, self.own, self.threads)

    def next_sample(self, share: CpuShare, in_use=None):
        self.at += 1
        return share.sample(in_use)


def cpus(*busy_seconds: float, total: float = 5.0) -> list[CpuTimes]:
    return [CpuTimes(total, b, 0.0) for b in busy_seconds]


GATEWAY, HOG = (7, 7), (9, 9)  # (pid, tid) of other processes' threads
START = (cpus(0.0, 0.0, total=0.0), 0.0, {GATEWAY: (1.0, 0), HOG: (0.0, 1)})


def test_a_hog_on_one_cpu_shows_there_while_the_worker_is_busy():
    hog = (cpus(5.0, 5.0), 6.5, {GATEWAY: (1.1, 0), HOG: (3.4, 1)})
    recorded = Recorded([START, hog])
    sample = recorded.next_sample(recorded.share())
    assert abs(sample.own - 0.65) < 1e-9 and abs(sample.others - 0.35) < 1e-9
    # The even spread alone reads 0.35 on both CPUs (under the policy's 0.5); the hog's own time puts
    # it on CPU 1.
    assert abs(sample.others_each[0] - 0.35) < 1e-9 and abs(sample.others_each[1] - 0.68) < 1e-9
    [busy] = policy.propose(profile(cpu_others=sample.others, cpu_others_each=sample.others_each, threads=2),
                            DEFAULTS, DEFAULTS)
    assert busy.policy == "busy CPUs" and busy.knobs.cpus == (0,)


def test_a_quiet_host_reads_quiet_however_busy_the_worker_is():
    quiet = (cpus(4.9, 4.9), 9.7, {GATEWAY: (1.1, 0), HOG: (0.0, 1)})
    recorded = Recorded([START, quiet])
    sample = recorded.next_sample(recorded.share())
    assert all(x <= policy.QUIET_NEIGHBOURS for x in sample.others_each)
    assert policy.propose(profile(cpu_others=sample.others, cpu_others_each=sample.others_each, threads=2),
                          DEFAULTS, DEFAULTS) == []


def test_a_cpu_the_worker_left_reads_its_whole_busy_share():
    # Placed on CPU 0 only: CPU 1's busy time is all other processes', and it goes quiet when the hog leaves.
    gone = (cpus(5.0, 0.2), 4.9, {GATEWAY: (1.0, 0)})
    held = (cpus(10.0, 5.2, total=10.0), 9.8, {GATEWAY: (1.0, 0), HOG: (5.0, 1)})
    recorded = Recorded([START, gone, held])
    share = recorded.share()
    assert abs(recorded.next_sample(share, [0]).others_each[1] - 0.04) < 1e-9
    assert abs(recorded.next_sample(share, [0]).others_each[1] - 1.0) < 1e-9


def test_a_thread_born_in_the_window_counts_from_the_next_one():
    # Thread (11, 11) started during the window: its time so far is not known to be this window's.
    born = (cpus(5.0, 5.0), 9.5, {GATEWAY: (1.0, 0), HOG: (0.0, 1), (11, 11): (4.0, 1)})
    recorded = Recorded([START, born])
    assert recorded.next_sample(recorded.share()).others_each[1] < 0.1


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's /proc")
def test_other_processes_threads_are_read_from_proc():
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        threads = read_other_threads()
        assert (child.pid, child.pid) in threads  # a process's first thread has its pid
        assert not any(pid == os.getpid() for pid, _ in threads)  # never the worker's own
        assert all(seconds >= 0.0 and cpu >= 0 for seconds, cpu in threads.values())
    finally:
        child.kill()
        child.wait()


def test_a_worker_on_one_cpu_reads_no_other_threads():
    read = []
    share = CpuShare([0], lambda _: cpus(1.0), lambda: 0.0, lambda: read.append(1) or {})
    share.sample()
    assert read == []
