"""The adaptive report: what the workers' profiles say now against what they said at boot.

Every profile becomes a sample; a window's throughput is the output tokens of the samples that
ended in it over its length (all workers together), its p95 latency the finished-weighted mean of
the workers' p95s. "Boot" is the first window with traffic. The report also says whether the
curve has plateaued: no strategy change for the last PLATEAU_WINDOWS windows, and their mean
throughput no different from the PLATEAU_WINDOWS windows before them (see plateau()).

    [reame] adaptive report @ 30m
      prefix cache hit-rate: 0.62 (+0.18 vs boot)
      chosen gemm kernel:   <variant>
      effective throughput: 118.4 tok/s (+41% vs boot)
      p95 latency:          312 ms (-27% vs boot)
      profiling:            converged (...)
      what each learned choice is worth (its own A/B on this traffic, ± one standard error):
        kernels, 1 row a step: int8_serialx1t vs shipped int8x2t: +41% ±3% per row (12 paired steps)
        drafting, 1+ sequences: on: +18% ±6% tokens/s vs plain decoding (48 steps)
        knobs v3 short requests: tokens per busy second +4% ±5% (kept; within the noise)

"Now vs boot" mixes what the tuner did with what the traffic did; the A/B lines do not: each
compares a choice with the shipped default on the same traffic, interleaved (kernels: the
default's exploration steps against the choice's recent ones; drafting: steps that drafted
against steps that did not; knobs: the profiles before and after the change). A gain smaller
than NOISE_SE standard errors is marked as within the noise.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from gateway.coordinator.coordinator import Decision
from gateway.coordinator.policy import METRICS
from shared.protocol import Profile

# A plateau is the absence of a trend, not of variation: throughput follows the offered load, and
# on bench/agentic.py (2-8 clients in 30 s phases) it moved ±9-12% from minute to minute for the
# whole 10 minutes in both modes, so "every window within ±5%" never held. So the mean of the
# last PLATEAU_WINDOWS windows is compared with that of the PLATEAU_WINDOWS before them: flat when
# the change is under PLATEAU_SPREAD, or within NOISE_SE standard errors of the windows' own
# variation (a two-sample test) while that variation is under TOO_NOISY; beyond it nothing is
# claimed either way.
PLATEAU_WINDOWS = 3
PLATEAU_SPREAD = 0.05
NOISE_SE = 2.0
TOO_NOISY = 0.20
MAX_SAMPLES = 100_000  # ~6 days of one worker's 5-second profiles
MAX_POINTS = 2000  # buckets in one series


@dataclass(frozen=True)
class Sample:
    at: float  # seconds since boot when the profile arrived
    seconds: float
    output_tokens: int
    finished: int
    latency_ms_p95: float
    ttft_ms_p95: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    kernel: str


@dataclass(frozen=True)
class Summary:
    start: float
    end: float
    throughput: float  # output tokens per second
    latency_ms_p95: float
    ttft_ms_p95: float
    hit_rate: float
    finished: int
    kernel: str

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Worth:
    """One learned choice against the shipped default, from its own A/B."""
    layer: str  # kernels | drafting | knobs
    what: str  # the choice, in words
    gain: float  # relative: + is better than the default
    noise: float  # one standard error of gain
    evidence: str  # what the figure stands on
    outcome: str = ""  # knobs: kept | reverted

    @property
    def within_noise(self) -> bool:
        return abs(self.gain) <= NOISE_SE * self.noise

    def line(self) -> str:
        notes = [n for n in (self.outcome, "within the noise" if self.within_noise else "") if n]
        return (f"    {self.layer}, {self.what}: {100 * self.gain:+.0f}% ±{100 * self.noise:.0f}% "
                f"({self.evidence}{'; ' + '; '.join(notes) if notes else ''})")

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "within_noise": self.within_noise}


MAX_KNOB_LINES = 4  # the latest measured knob changes the report lists


def learned_worth(sources: dict[str, dict[str, dict[str, float | str]]], history: list[Decision]) -> list[Worth]:
    """What each learned choice in force is worth, from the workers' latest profile sections (their
    kernel tuners' and draft gates' A/B figures) and the coordinator's measured knob changes."""
    found: list[Worth] = []
    several = len(sources) > 1
    for worker, sections in sorted(sources.items()):
        where = f" on {worker}" if several else ""
        kernels = sections.get("kernels", {})
        for key, choice in kernels.items():
            if not (key.startswith("ab ") and key.endswith(" choice")):
                continue
            bucket = key[3:-len(" choice")]
            found.append(Worth("kernels", f"{bucket} rows a step{where}: {choice} vs shipped "
                                          f"{kernels.get(f'ab {bucket} default', '?')} (time per row)",
                               _number(kernels.get(f"ab {bucket} gain")), _number(kernels.get(f"ab {bucket} noise")),
                               f"{_number(kernels.get(f'ab {bucket} steps')):.0f} paired steps"))
        spec = sections.get("speculative", {})
        for key, verdict in spec.items():
            # Drafting on is the learned choice (`--adaptive off` never drafts); off is the default's.
            if key.startswith("gate_") and key.endswith("+") and verdict == "on" and f"{key}_gain" in spec:
                found.append(Worth("drafting", f"{key[5:]} sequences a step{where}: on "
                                               f"(tokens/s drafting vs plain decoding)", _number(spec[f"{key}_gain"]),
                                   _number(spec.get(f"{key}_noise")), f"{_number(spec.get(f'{key}_steps')):.0f} steps"))
    measured = [d for d in history if d.kind == "change" and d.effect and "change" in d.effect]
    for d in measured[-MAX_KNOB_LINES:]:
        goal = METRICS.get(d.goal)
        sign = 1.0 if goal is None or goal.higher_is_better else -1.0
        found.append(Worth("knobs", f"v{d.version} {d.policy} on {d.slot} ({d.goal or 'goal'})",
                           sign * float(d.effect["change"]), float(d.effect.get("noise", 0.0)),
                           "profiles before vs after", d.outcome))
    return found


def _number(value: float | str | None) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0


class AdaptiveReport:
    def __init__(self, boot: float, window_s: float):
        self.boot = boot  # monotonic time the gateway started
        self.window_s = window_s
        self.samples: deque[Sample] = deque(maxlen=MAX_SAMPLES)
        self.first_traffic: float | None = None
        self.sources: dict[str, dict] = {}  # worker id → its latest profile's sections (A/B figures)

    def add(self, profile: Profile, now: float) -> None:
        at = now - self.boot
        self.sources[profile.worker_id] = profile.sources
        kernels = profile.sources.get("kernels", {})
        kernel = kernels.get("gemm", "") if isinstance(kernels.get("gemm", ""), str) else ""
        self.samples.append(Sample(at, profile.seconds, profile.output_tokens, profile.finished,
                                   profile.latency_ms_p95, profile.ttft_ms_p95, profile.prefix_query_tokens,
                                   profile.prefix_hit_tokens, kernel))
        if self.first_traffic is None and profile.output_tokens:
            self.first_traffic = max(0.0, at - profile.seconds)

    def summary(self, start: float, end: float) -> Summary:
        # Samples arrive in time order: the window's are found by bisection, not by a full scan.
        lo = bisect.bisect_right(self.samples, start, key=_at)
        hi = bisect.bisect_right(self.samples, end, key=_at)
        return _summarise(start, end, list(itertools.islice(self.samples, lo, hi)))

    def boot_summary(self) -> Summary | None:
        if self.first_traffic is None:
            return None
        return self.summary(self.first_traffic, self.first_traffic + self.window_s)

    def now_summary(self, at: float) -> Summary:
        return self.summary(max(0.0, at - self.window_s), at)

    def series(self, at: float, bucket_s: float, samples: list[Sample] | None = None) -> list[Summary]:
        """One summary per bucket from boot to `at` (the dashboard's curves), in one pass over the
        samples (in arrival order): a summary per bucket over all of them took 4.25 s at the cap of
        2000 buckets x MAX_SAMPLES. `samples`: a copy of self.samples, for a caller off the event
        loop (the deque changes under it as profiles arrive)."""
        count = min(int(at // bucket_s) + 1, MAX_POINTS)
        first = max(0.0, at - count * bucket_s)
        samples = list(self.samples) if samples is None else samples
        buckets: list[list[Sample]] = [[] for _ in range(count)]
        for s in samples[bisect.bisect_right(samples, first, key=_at):]:
            if s.at > at:
                break
            buckets[min(count - 1, max(0, math.ceil((s.at - first) / bucket_s) - 1))].append(s)
        return [_summarise(first + i * bucket_s, first + (i + 1) * bucket_s, chosen)
                for i, chosen in enumerate(buckets)]

    def plateau(self, at: float, history: list[Decision], boot_wall: float) -> tuple[bool, str]:
        """(converged, why): no strategy change in the last PLATEAU_WINDOWS windows, and their mean
        throughput not moved from the PLATEAU_WINDOWS windows before them (see NOISE_SE)."""
        n, w = PLATEAU_WINDOWS, self.window_s
        if self.first_traffic is None or at - self.first_traffic < 2 * n * w:
            return False, "still profiling (too little traffic yet to judge)"
        recent_changes = [d for d in history if d.kind in ("change", "revert", "release") and d.at - boot_wall > at - n * w]
        if recent_changes:
            return False, f"still learning ({len(recent_changes)} changes in the last {_elapsed(n * w)})"
        values = [self.summary(at - (i + 1) * w, at - i * w).throughput for i in range(2 * n)]
        recent, before = values[:n], values[n:]
        now, then = sum(recent) / n, sum(before) / n
        if now <= 0 and then <= 0:
            return False, "idle"
        if then <= 0:
            return False, f"throughput still moving (traffic began in the last {_elapsed(n * w)})"
        change = (now - then) / then
        # The windows' spread around their half's mean: what the load alone moves them by.
        var = (sum((v - now) ** 2 for v in recent) + sum((v - then) ** 2 for v in before)) / (2 * n - 2)
        spread = var ** 0.5 / then
        noisy = spread > TOO_NOISY
        standard_error = (var * 2 / n) ** 0.5  # of the difference of the two means
        compared = (f"throughput {now:.1f} tok/s over the last {_elapsed(n * w)} vs {then:.1f} the "
                    f"{_elapsed(n * w)} before ({100 * change:+.0f}%; windows vary ±{100 * spread:.0f}%)")
        if abs(change) <= PLATEAU_SPREAD or (not noisy and abs(now - then) <= NOISE_SE * standard_error):
            return True, f"converged: no strategy change and {compared}"
        return False, f"{'too noisy to tell' if noisy else 'still moving'}: {compared}"

    def lines(self, at: float, history: list[Decision], boot_wall: float) -> list[str]:
        now, boot = self.now_summary(at), self.boot_summary()
        changes = [d for d in history if d.kind == "change"]
        reverted = sum(1 for d in changes if d.outcome == "reverted")
        released = sum(1 for d in history if d.kind == "release")  # a placement whose cause had gone
        worth = learned_worth(self.sources, history)
        _, plateau = self.plateau(at, history, boot_wall)
        return [
            f"[reame] adaptive report @ {_elapsed(at)}",
            f"  prefix cache hit-rate: {now.hit_rate:.2f} ({_delta_abs(now.hit_rate, boot and boot.hit_rate)} vs boot)",
            f"  chosen gemm kernel:   {now.kernel or (boot and boot.kernel) or 'fixed ([engine] kernels)'}",
            f"  effective throughput: {now.throughput:.1f} tok/s ({_delta_rel(now.throughput, boot and boot.throughput)}"
            " vs boot)",
            f"  p95 latency:          {now.latency_ms_p95:.0f} ms ({_delta_rel(now.latency_ms_p95, boot and boot.latency_ms_p95)}"
            " vs boot)",
            f"  strategy:             {len(changes)} changes, {reverted} reverted"
            f"{f', {released} released (cause gone)' if released else ''}; {plateau}",
            "  what each learned choice is worth (its own A/B on this traffic, ± one standard error):",
            *([w.line() for w in worth] or ["    nothing measured yet: every layer runs its shipped default"]),
        ]

    def as_json(self, at: float, history: list[Decision], boot_wall: float) -> dict[str, Any]:
        boot = self.boot_summary()
        converged, why = self.plateau(at, history, boot_wall)
        return {"uptime_s": round(at, 1), "window_s": self.window_s,
                "boot": boot.as_dict() if boot else None, "now": self.now_summary(at).as_dict(),
                "converged": converged, "plateau": why,
                "worth": [w.as_dict() for w in learned_worth(self.sources, history)],
                "text": "\n".join(self.lines(at, history, boot_wall))}


def _at(sample: Sample) -> float:
    return sample.at


def _summarise(start: float, end: float, chosen: list[Sample]) -> Summary:
    """The summary of the samples that arrived in (start, end]."""
    length = max(end - start, 1e-9)
    finished = sum(s.finished for s in chosen)
    weight = sum(s.finished for s in chosen if s.latency_ms_p95)
    latency = sum(s.latency_ms_p95 * s.finished for s in chosen) / weight if weight else 0.0
    ttft = sum(s.ttft_ms_p95 * s.finished for s in chosen) / weight if weight else 0.0
    queried = sum(s.prefix_query_tokens for s in chosen)
    hits = sum(s.prefix_hit_tokens for s in chosen)
    kernel = next((s.kernel for s in reversed(chosen) if s.kernel), "")
    return Summary(start, end, sum(s.output_tokens for s in chosen) / length, latency, ttft,
                   hits / queried if queried else 0.0, finished, kernel)


def _delta_abs(now: float, boot: float | None) -> str:
    return "n/a" if boot is None else f"{now - boot:+.2f}"


def _delta_rel(now: float, boot: float | None) -> str:
    if not boot:
        return "n/a"
    return f"{100 * (now - boot) / boot:+.0f}%"


def _elapsed(seconds: float) -> str:
    """30m, 1h05m, 45s."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes}m"
    return f"{minutes // 60}h{minutes % 60:02d}m"
