"""Who used a worker's CPUs between two samples: the worker itself, other processes, the
hypervisor; in all, and other processes on each CPU (the coordinator's busy/quiet-CPU policies
read the per-CPU figure).

Two estimates of other processes on a CPU the worker runs on, and the larger wins:
  spread  the CPU's busy time less the worker's own time, spread evenly over its CPUs (a process's
          time has no per-CPU split). It hides a neighbour while the worker is busy: a hog pinned
          to CPU 1 beside the worker's threads, the worker at 1.3 CPUs of its 2, read 0.3-0.4 on
          both CPUs, under the policy's 0.5, until the worker idled (measured on 0.5B decode,
          2026-12-06, AMD Zen 3). On the 1.5B file the placement came 66 s into a 90 s hog.
  direct  the CPU time of every other process's threads, each thread's time put on the CPU it
          last ran on (/proc/PID/task/TID/stat). A pinned neighbour is counted exactly; one that
          moves between CPUs is smeared over them, and moving the worker away from it would not
          help anyway. Reading a thread's stat file takes ~50 µs (AMD Zen 3): 50 ms a window for 1,000 threads.
          (The worker's own threads' run-queue waits were tried first: a waiting thread migrates
          before it is read, and the same hog on CPU 1 read 0.72 on CPU 0.)
A process this worker cannot see (another container's PID namespace) is left to the spread
estimate. CPUs the worker does not run on (after a placement took them away) have no time of its
own: their busy share is other processes' (how _quiet_cpus sees the neighbour leave).
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple

import psutil

PROC = "/proc"
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class CpuTimes(NamedTuple):
    total: float  # seconds of this CPU's time (every state)
    busy: float  # seconds not idle, not waiting for I/O, not stolen
    steal: float  # seconds the hypervisor ran something else


class CpuSample(NamedTuple):
    own: float  # share of the in-use CPUs' time the worker used
    others: float  # share other processes used
    steal: float  # share the hypervisor took
    others_each: list[float]  # other processes' share of each of the worker's CPUs


def read_cpu_times(cpus: list[int]) -> list[CpuTimes]:
    """Times of each CPU in `cpus` (all of the host's when psutil does not list those numbers)."""
    per_cpu = psutil.cpu_times(percpu=True)
    chosen = [per_cpu[c] for c in cpus if c < len(per_cpu)]
    if len(chosen) != len(cpus):
        chosen = per_cpu
    out = []
    for t in chosen:
        total, steal = sum(t), getattr(t, "steal", 0.0)
        out.append(CpuTimes(total, total - t.idle - getattr(t, "iowait", 0.0) - steal, steal))
    return out


def read_other_threads(proc: str = PROC) -> dict[tuple[int, int], tuple[float, int]]:
    """{(pid, tid): (CPU seconds so far, the CPU it last ran on)} of every thread of every process
    but this one that /proc shows. (Plain bytes reads: ~50 µs a thread here, half of pathlib's.)"""
    me = os.getpid()
    threads = {}
    for pid_name in _numbered(proc):
        pid = int(pid_name)
        if pid == me:
            continue
        tasks = f"{proc}/{pid_name}/task"
        for tid_name in _numbered(tasks):
            try:
                with open(f"{tasks}/{tid_name}/stat", "rb") as f:
                    stat = f.read()
                # fields after the ") " closing the thread's name: utime 14, stime 15, processor 39
                fields = stat[stat.rindex(b")") + 2:].split()
                threads[pid, int(tid_name)] = ((int(fields[11]) + int(fields[12])) / _TICKS, int(fields[36]))
            except (OSError, IndexError, ValueError):
                continue  # it ended between the listing and the read
    return threads


def _numbered(directory: str) -> list[str]:
    try:
        return [name for name in os.listdir(directory) if name.isdigit()]
    except OSError:
        return []


def _own_seconds() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


class CpuShare:
    """sample() gives the shares since the previous sample (the first: since construction)."""

    def __init__(self, cpus: list[int], cpu_times: Callable[[list[int]], list[CpuTimes]] = read_cpu_times,
                 own_seconds: Callable[[], float] = _own_seconds,
                 other_threads: Callable[[], dict[tuple[int, int], tuple[float, int]]] = read_other_threads):
        self.cpus = cpus
        self._cpu_times, self._own_seconds, self._other_threads = cpu_times, own_seconds, other_threads
        self._last = self._read()

    def _read(self):
        try:
            # One CPU: no placement can move the worker off it, so no per-CPU count is needed.
            threads = self._other_threads() if len(self.cpus) > 1 else {}
            return self._cpu_times(self.cpus), self._own_seconds(), threads
        except (psutil.Error, OSError):
            return [], 0.0, {}

    def sample(self, in_use: list[int] | None = None) -> CpuSample:
        (each, own, threads), (last_each, last_own, last_threads) = self._read(), self._last
        self._last = (each, own, threads)
        if not each or len(each) != len(last_each):
            return CpuSample(0.0, 0.0, 0.0, [])
        delta = [CpuTimes(*(a - b for a, b in zip(now, then))) for now, then in zip(each, last_each)]
        per_cpu = len(delta) == len(self.cpus)
        use = set(in_use or self.cpus)
        mine = [d for cpu, d in zip(self.cpus, delta) if cpu in use] if per_cpu else delta
        total = sum(d.total for d in mine)
        if total <= 0:
            return CpuSample(0.0, 0.0, 0.0, [])
        own_share = _share(own - last_own, total)
        others = _share(sum(d.busy for d in mine), total) - own_share
        steal = _share(sum(d.steal for d in mine), total)
        if not per_cpu:
            return CpuSample(own_share, max(0.0, others), steal, [])
        direct = {cpu: 0.0 for cpu in self.cpus}
        for key, (seconds, cpu) in threads.items():
            then = last_threads.get(key)  # a thread born in the window: its earlier time is not known
            if then is not None and cpu in direct:
                direct[cpu] += max(0.0, seconds - then[0])
        others_each = []
        for cpu, d in zip(self.cpus, delta):
            if cpu in use:
                spread = max(0.0, _share(d.busy, d.total) - own_share)
                others_each.append(max(spread, _share(direct[cpu], d.total)))
            else:
                others_each.append(_share(d.busy, d.total))
        return CpuSample(own_share, max(0.0, others), steal, others_each)


def _share(part: float, whole: float) -> float:
    return min(1.0, max(0.0, part / whole)) if whole > 0 else 0.0
