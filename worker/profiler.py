"""What a worker's traffic and steps look like, summed up every `[tuning] profile_interval` as a
`shared.protocol.Profile` for the tuning coordinator.

The serve loop (one thread) records arrivals and steps; the pulse thread takes the profile. Both
go through one lock, held only for list appends and the swap of the window, never for a step.
Other components (the kernel tuner, speculative decoding) add a section of their own with
`add_source(name, fn)`: `fn()` returns a flat dict of numbers or strings, read from the pulse
thread, so it must be safe to call while the engine steps.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from shared.protocol import Profile
from worker.cpu_share import CpuShare
from worker.placement import Placement
from worker.sched.generation import Event, FinishEvent, StepStats, TokenEvent

log = logging.getLogger("reame.worker")

SourceValue = float | str


@dataclass
class _Request:
    arrived: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class _Phase:
    """The steps of one kind (with prompt rows, or decode rows only) and the rows they held."""
    steps: int = 0
    seconds: float = 0.0  # the engine's, without scheduling and sampling
    prompt_rows: int = 0
    decode_rows: int = 0

    def add(self, stats: StepStats) -> None:
        self.steps += 1
        self.seconds += stats.seconds
        self.prompt_rows += stats.tokens - stats.decode_rows
        self.decode_rows += stats.decode_rows


@dataclass
class _Window:
    """Everything recorded since the last profile."""
    started: float
    arrivals: list[float] = field(default_factory=list)  # times
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)  # of finished requests
    queue_wait: list[float] = field(default_factory=list)  # seconds
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    token_gaps: list[float] = field(default_factory=list)  # seconds between two tokens of a request
    prefill: _Phase = field(default_factory=_Phase)
    decode: _Phase = field(default_factory=_Phase)
    steps: int = 0
    busy: float = 0.0  # wall seconds of the steps
    overhead_seconds: float = 0.0  # of which outside the engine
    sequences: int = 0
    waiting_sum: int = 0
    kv_used_max: int = 0
    generated: int = 0


class ProfileCollector:
    def __init__(self, worker_id: str, cpus: list[int], clock: Callable[[], float] = time.monotonic,
                 placement: Placement | None = None):
        """placement: where the worker runs now (worker.placement), when a strategy may move it."""
        self.worker_id = worker_id
        self.cpus = list(cpus)
        self.placement = placement
        self.clock = clock
        self._lock = threading.Lock()
        self._window = _Window(clock())
        self._requests: dict[str, _Request] = {}
        self._sources: dict[str, Callable[[], dict[str, SourceValue]]] = {}
        self._failed_sources: set[str] = set()
        self._last_counters: dict[str, int] = {}
        self._preemptions_seen = 0
        self._cpu = CpuShare(self.cpus)

    def add_source(self, name: str, fn: Callable[[], dict[str, SourceValue]]) -> None:
        """Add a section to every profile (e.g. "kernels": KernelTuner.snapshot)."""
        self._sources[name] = fn

    # ---- the serve loop's side ---------------------------------------------------------------

    def arrived(self, request_id: str, prompt_tokens: int) -> None:
        now = self.clock()
        with self._lock:
            self._requests[request_id] = _Request(now)
            self._window.arrivals.append(now)
            self._window.prompt_tokens.append(prompt_tokens)

    def stepped(self, stats: StepStats, wall_seconds: float, events: list[Event], waiting: int,
                scheduled: list[str], kv_used: int) -> None:
        """One generator step: its stats, its wall time (engine + scheduling + sampling), its events,
        the requests still queued after it and those it ran."""
        now = self.clock()
        with self._lock:
            w = self._window
            if stats.tokens:
                w.steps += 1
                w.busy += wall_seconds
                w.sequences += stats.sequences
                (w.prefill if stats.tokens > stats.decode_rows else w.decode).add(stats)
                w.overhead_seconds += max(0.0, wall_seconds - stats.seconds)
                w.waiting_sum += waiting
                w.kv_used_max = max(w.kv_used_max, kv_used)
            for request_id in scheduled:
                request = self._requests.get(request_id)
                if request is not None and request.scheduled is None:
                    request.scheduled = now - wall_seconds
                    w.queue_wait.append(request.scheduled - request.arrived)
            for event in events:
                request = self._requests.get(event.request_id)
                if isinstance(event, TokenEvent):
                    w.generated += 1
                    if request is not None and request.first_token is None:
                        request.first_token = now
                        w.ttft.append(now - request.arrived)
                    elif request is not None:
                        w.token_gaps.append(now - request.last_token)
                    if request is not None:
                        request.last_token = now
                elif request is not None:
                    del self._requests[event.request_id]
                    if isinstance(event, FinishEvent):
                        w.output_tokens.append(event.completion_tokens)
                        w.latency.append(now - request.arrived)

    def forget(self, request_id: str) -> None:
        """A request that was refused or aborted before any step."""
        with self._lock:
            self._requests.pop(request_id, None)

    # ---- the pulse thread's side -------------------------------------------------------------

    def profile(self, knobs_version: int, counters: dict[str, int], preemptions: int, threads: int = 0) -> Profile:
        """The profile of the window that ends now; a new window starts."""
        now = self.clock()
        with self._lock:
            w, self._window = self._window, _Window(now)
        delta = {k: v - self._last_counters.get(k, 0) for k, v in counters.items()}
        self._last_counters = dict(counters)
        new_preemptions, self._preemptions_seen = preemptions - self._preemptions_seen, preemptions
        in_use = list(self.placement.in_use) if self.placement is not None else list(self.cpus)
        busy, others, steal, others_each = self._cpu.sample(in_use)
        hits = delta.get("prefix_hit_tokens_ram", 0) + delta.get("prefix_hit_tokens_store", 0)
        return Profile(
            worker_id=self.worker_id, seconds=max(now - w.started, 1e-6), knobs_version=knobs_version,
            arrivals=len(w.arrivals), finished=len(w.latency),
            prompt_tokens_p50=percentile(w.prompt_tokens, 50), prompt_tokens_p95=percentile(w.prompt_tokens, 95),
            output_tokens_p50=percentile(w.output_tokens, 50), output_tokens_p95=percentile(w.output_tokens, 95),
            burstiness=burstiness(w.arrivals),
            queue_wait_ms_p50=1000 * percentile(w.queue_wait, 50), queue_wait_ms_p95=1000 * percentile(w.queue_wait, 95),
            ttft_ms_p95=1000 * percentile(w.ttft, 95), latency_ms_p95=1000 * percentile(w.latency, 95),
            token_gap_ms_p95=1000 * percentile(w.token_gaps, 95),
            token_gap_ms_mean=1000 * _mean(sum(w.token_gaps), len(w.token_gaps)),
            steps=w.steps, busy_seconds=w.busy, batch_size_mean=_mean(w.sequences, w.steps),
            prefill_tokens=w.prefill.prompt_rows, output_tokens=w.generated,
            step_ms_prefill=1000 * _mean(w.prefill.seconds, w.prefill.steps),
            step_ms_decode=1000 * _mean(w.decode.seconds, w.decode.steps),
            step_ms_overhead=1000 * _mean(w.overhead_seconds, w.steps),
            decoders_waiting_on_prefill=_mean(w.prefill.decode_rows, w.prefill.steps),
            waiting_mean=_mean(w.waiting_sum, w.steps), preemptions=max(0, new_preemptions),
            kv_blocks=counters.get("kv_blocks", 0), kv_blocks_used_max=w.kv_used_max,
            kv_block_tokens=counters.get("kv_block_tokens", 0),
            prefix_query_tokens=max(0, delta.get("prefix_query_tokens", 0)), prefix_hit_tokens=max(0, hits),
            prefix_hit_tokens_store=max(0, delta.get("prefix_hit_tokens_store", 0)),
            store_evictions=max(0, delta.get("store_evictions", 0)),
            cpus=self.cpus, cpu_busy=busy, cpu_others=others, cpu_steal=steal, threads=threads,
            cpus_in_use=in_use, cpu_others_each=[round(x, 4) for x in others_each],
            numa_nodes=self.placement.numa_nodes if self.placement is not None else 1,
            memory_bound=self.placement.bound if self.placement is not None else False,
            sources=self._read_sources())

    def _read_sources(self) -> dict[str, dict[str, SourceValue]]:
        sections = {}
        for name, fn in self._sources.items():
            try:
                section = fn()
                sections[name] = {str(k): (v if isinstance(v, str) else float(v)) for k, v in section.items()
                                  if isinstance(v, (int, float, str)) and not isinstance(v, bool)
                                  and (isinstance(v, str) or math.isfinite(v))}
            except Exception:
                # A broken section costs that section, never the profile (nor the heartbeats beside it).
                if name not in self._failed_sources:
                    self._failed_sources.add(name)
                    log.exception("profile: the %r section failed; profiles go without it", name)
        return sections


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile by nearest rank (0 for no values): no interpolation, so a p95 is a value seen."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def burstiness(times: list[float]) -> float:
    """Coefficient of variation of the gaps between arrivals: ~1 for Poisson arrivals, ≫1 for bursts,
    0 for evenly spaced ones (and for fewer than three arrivals, too few to tell)."""
    if len(times) < 3:
        return 0.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = sum(gaps) / len(gaps)
    if mean <= 0:
        return 0.0
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    return math.sqrt(var) / mean


def _mean(total: float, count: int) -> float:
    return total / count if count else 0.0
