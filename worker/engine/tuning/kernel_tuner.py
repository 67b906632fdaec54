"""Kernel variant and thread count per rows bucket, chosen by timing them on live steps.

An *arm* is one choice for one bucket of rows per step (registry.BUCKET_NAMES): a matmul variant,
a thread count and an attention variant (a step calls attention once a layer with all its rows, so
the step's bucket is its attention call's). Each bucket has an incumbent arm; the engine runs `engine.ops`, an immutable
OpTable holding every bucket's incumbent. Around each step the generator calls

    tuner.before_step(rows)    # picks the table (and threads) the step runs with
    ... engine.execute ...
    tuner.after_step(seconds)  # records what it cost

so a table is swapped only between steps: the step passes one table's codes to its whole fused
call (all its rows), and before_step refuses to run twice without an after_step.

Online A/B. A small share of steps (`explore_share`), and at least one step per
`explore_every_s` of the bucket's busy time (when steps are slow, a share of them would take
minutes), runs a candidate arm. Busy time, not wall time: counted in wall time, the first step
after any pause of a second ran a candidate, so every request arriving at an idle server had its
prompt on a trial arm. A candidate's time per row is compared with the incumbent's *recent*
steps of the same bucket (the median of the last few), as a log ratio, so slow drift (contexts
growing, a neighbour arriving) hits both sides.
Per candidate the ratios form a sliding window; once it holds `min_samples`, every
`min_samples / 2` samples:
  - a win when its median ratio beats the incumbent by more than `min_gain` and by more than
    `z` standard errors of that median (the jitter, from the MADs of the candidate's ratios and
    of the incumbent's recent steps); a win is confirmed on a fresh window, then promoted;
  - eliminated (successive elimination) when it cannot win by `min_gain` with the same
    confidence (decided from 2 samples on: a clear loser costs few slow steps); it re-enters
    after `recheck_s` (longer for a much slower arm), with fresh samples: the host may change.
Rollback. For `rollback_steps` steps after a promotion the new incumbent's time per row is
compared with the old one's before the switch; `rollback` (10%) worse beyond the jitter: undone,
and the arm banned for `ban_s`. Each promotion and rollback is one INFO line with before/after.

Budget (exploring must not cost where there is nothing to gain). A *round* ends
when every live candidate of a bucket has lost to the incumbent since its last change; each round
without a win halves that bucket's exploration (share, busy-time floor) and doubles the pauses of
its losers, down to 1/2**MAX_DECAY. Exploration returns to full when the profile drifts: the
incumbent's time per row moves by DRIFT from what it was when the bucket last settled (a neighbour
arriving, longer contexts), other processes' share of the worker's CPUs crosses between quiet and
busy (note_neighbours: a neighbour leaving barely moves a one-thread step), the worker's CPUs
change, or a promotion or rollback.

Only variants of the engine's numerics (float32 or int8 activations) are arms: they give the same
bits, so tuning never changes an output (both attention variants give every row the same bits). Threads are arms too (1 to the engine's threads): with a
busy neighbour on one of two cores, a two-thread step waits at every barrier for the thread that
shares its core, and one thread wins until the neighbour leaves.

No numba here: threads and tables go through the engine (set_threads, ops).
"""
from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from statistics import median
from typing import Callable, Protocol

from shared.config import Config
from worker.engine.kernels.registry import BUCKET_NAMES, OpTable, bucket_of, serves_bucket, variants_of

log = logging.getLogger("reame.kernel_tuner")

Arm = tuple[str, int, str]  # (matmul variant, threads, attention variant)
MAX_PAUSE = 6.0  # the longest pause of an eliminated arm, in recheck_s
CONFIRM_WITHIN = 4  # a first win lapses unless confirmed within this many min_samples of fresh steps
REFERENCE_STEPS = 5  # incumbent steps whose median is a candidate step's yardstick
CALIBRATION_ROWS = (1, 4, 16, 64)  # rows timed per bucket at start-up
# Rounds over a bucket's arms, each arm timed once a round; an arm's time is its median round. A
# neighbour that holds a core for a moment slows one round, not one arm's whole measurement: timed
# arm after arm, int8x2t once measured 84 ms a row (50x its cost) under a 3 s scan on the other
# core, and bucket 1 started on one thread (Qwen2.5-1.5B, 12-06).
CALIBRATION_ROUNDS = 3
MAX_DECAY = 4  # rounds without a win halve exploration at most this often (to 1/16)
DRIFT = 0.25  # |log| change of the incumbent's time per row (~±25%) that is a new profile
BUSY_NEIGHBOURS, QUIET_NEIGHBOURS = 0.5, 0.15  # other processes' share of the CPUs (the coordinator's bounds)


class TunableEngine(Protocol):
    """What the tuner needs of worker.engine.Engine."""
    ops: OpTable
    max_threads: int
    threads: int

    def set_threads(self, n: int) -> None: ...

    def time_matmul(self, ops: OpTable, rows: int, repeats: int = 3) -> float: ...


@dataclass(frozen=True)
class TunerSettings:
    enabled: bool = True  # False: the engine's table and threads, never a candidate
    explore_share: float = 0.05
    explore_every_s: float = 30.0  # ... and at least one candidate step per this much busy time in a
    # bucket (slow steps: a share of steps would take minutes to learn that the incumbent is the slow
    # one). Not less: a candidate prompt chunk of ~1 s on a 1.8x slower arm (int8 x 1 thread, AVX2,
    # calibration: 60 vs 33 us/row) costs 0.8 s.
    min_samples: int = 4  # candidate steps before a verdict
    max_samples: int = 48  # the sliding window of a candidate's ratios
    z: float = 3.0  # confidence, in standard errors of the median ratio
    min_gain: float = 0.03  # a candidate must be at least 3% faster
    recheck_s: float = 10.0  # an eliminated candidate re-enters after this long
    rollback_steps: int = 24  # incumbent steps after a promotion that judge it
    rollback: float = 0.10
    ban_s: float = 60.0
    calibration_s: float = 15.0

    @classmethod
    def from_config(cls, config: Config) -> "TunerSettings":
        t = config.tuning
        return cls(enabled=config.kernel_tuning, explore_share=t.kernel_explore_share, rollback=t.kernel_rollback,
                   ban_s=t.kernel_ban_seconds, calibration_s=t.kernel_calibration_seconds)

    def __post_init__(self) -> None:
        if not 0.0 <= self.explore_share <= 0.5:
            raise ValueError(f"[tuning] kernel_explore_share must be in [0, 0.5], got {self.explore_share}")
        if not 0.0 < self.rollback < 10.0:
            raise ValueError(f"[tuning] kernel_rollback must be in (0, 10), got {self.rollback}")
        if self.ban_s < 0 or self.calibration_s < 0:
            raise ValueError("[tuning] kernel_ban_seconds and kernel_calibration_seconds must be >= 0")


SHIPPED_ATTENTION = next(iter(variants_of("attention")))  # the registry's first: OpTable.of's default


def arm_name(arm: Arm) -> str:
    """"int8x2t"; "int8x2t+per_row" where the attention variant is not the shipped one."""
    return f"{arm[0]}x{arm[1]}t" + (f"+{arm[2]}" if arm[2] != SHIPPED_ATTENTION else "")


def _spread(values: list[float]) -> float:
    """Standard error of the median of values, from their MAD (robust to the odd slow step)."""
    m = median(values)
    mad = median(abs(v - m) for v in values)
    return 1.253 * 1.4826 * mad / math.sqrt(len(values))


@dataclass
class _Candidate:
    ratios: deque = field(default_factory=deque)  # log(candidate s/row ÷ incumbent reference)
    seconds: deque = field(default_factory=deque)  # its own s/row, for the logs
    paused_until: float = 0.0  # eliminated (re-enters then) or banned
    banned: bool = False
    last_step: int = -1
    confirming: bool = False  # won once; the next verdict, on fresh samples, decides
    lost_by: tuple[float, float, int] | None = None  # its last elimination: log ratio, its error, samples


@dataclass
class _Switch:
    """A promotion under watch: undone if the steps after it are slower than those before."""
    previous: Arm
    before: list[float]  # the old incumbent's recent s/row
    after: list[float] = field(default_factory=list)


class _Bucket:
    def __init__(self, index: int, incumbent: Arm, arms: list[Arm], settings: TunerSettings):
        self.index = index
        self.name = BUCKET_NAMES[index]
        self.incumbent = incumbent
        self.arms = arms
        self.recent: deque = deque(maxlen=max(REFERENCE_STEPS, settings.rollback_steps))  # incumbent s/row
        self.candidates = {arm: _Candidate(deque(maxlen=settings.max_samples), deque(maxlen=settings.max_samples))
                           for arm in arms}
        self.switch: _Switch | None = None
        self.steps = 0
        self.busy = 0.0  # seconds of its steps since a candidate last ran
        self.decay = 0  # rounds in a row without a win: exploration runs at 1/2**decay
        self.lost: set = set()  # candidates that lost in the round under way
        self.settled_at: float | None = None  # the incumbent's s/row when the last round ended
        self.before_limit: Arm | None = None  # its choice before a placement cut its threads

    def reset_candidates(self) -> None:
        for c in self.candidates.values():
            c.ratios.clear()
            c.seconds.clear()
            c.confirming = False
            c.lost_by = None  # it lost to the old incumbent


class KernelTuner:
    """One per engine, stepped by the thread that calls engine.execute (numba threads are per
    calling thread). `clock` gives seconds for pauses and bans; `rng` decides exploration."""

    def __init__(self, engine: TunableEngine, settings: TunerSettings = TunerSettings(),
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 saved: Callable[[dict], None] | None = None):
        self.engine = engine
        self.settings = settings
        self.clock = clock
        self.rng = rng or random.Random(0)
        self._save = saved
        self.numerics = engine.ops.numerics("matmul")
        variants = variants_of("matmul", self.numerics)
        attentions = variants_of("attention")
        self.max_threads = max(1, int(engine.threads))
        start, start_attention = engine.ops.names("matmul"), engine.ops.names("attention")

        def arms_of(bucket: int) -> list[Arm]:
            """The variants that differ from the others on some call of the bucket's size, at each
            thread count, with each attention variant that does."""
            names = [n for n, v in variants.items() if serves_bucket(v, bucket) or n == start[bucket]]
            kinds = [start_attention[bucket]]
            if serves_bucket(attentions[kinds[0]], bucket):  # else it runs as another variant: nothing to try
                kinds += [a for a, v in attentions.items() if serves_bucket(v, bucket) and a != kinds[0]]
            return [(n, t, a) for a in kinds for n in names for t in range(self.max_threads, 0, -1)]

        self.buckets = [_Bucket(b, (start[b], self.max_threads, start_attention[b]), arms_of(b), settings)
                        for b in range(len(BUCKET_NAMES))]
        # What `--adaptive off` runs: the report weighs each learned choice against it.
        self.defaults = {b.name: b.incumbent for b in self.buckets}
        self._tables: dict[tuple[str, ...], OpTable] = {}
        self._step: tuple[_Bucket, Arm, bool, int] | None = None
        self.events: list[dict] = []  # promotions and rollbacks, newest last (snapshot)
        self.promotions = 0
        self.rollbacks = 0
        self.frozen = False  # a frozen strategy (POST /admin/strategy/freeze): no exploration, no change
        self.thread_limit = self.max_threads  # CPUs the worker may run on (the coordinator's placement)
        self._load: str | None = None  # "busy" | "quiet": other processes on the worker's CPUs, last heard
        self._wake_reason: str | None = None  # set from the profile thread, acted on between steps
        self._install(engine.threads)

    def note_neighbours(self, others: float) -> None:
        """Other processes' share of the worker's CPUs in the last profile window (any thread):
        crossing between quiet and busy is a drift, and every bucket explores fully again."""
        load = "busy" if others >= BUSY_NEIGHBOURS else "quiet" if others <= QUIET_NEIGHBOURS else self._load
        if load != self._load:
            if self._load is not None:
                self._wake_reason = f"other processes now use {100 * others:.0f}% of the worker's CPUs ({load})"
            self._load = load

    def _wake(self, bucket: "_Bucket", reason: str) -> None:
        """Explore at the full budget again; paused losers come back at once (banned arms stay out)."""
        if bucket.decay:
            log.info("kernel tuner: bucket %s rows: exploring again (was at 1/%d): %s", bucket.name,
                     2 ** bucket.decay, reason)
        bucket.decay, bucket.settled_at = 0, None
        bucket.lost.clear()
        now = self.clock()
        for c in bucket.candidates.values():
            if not c.banned and c.paused_until > now:
                c.paused_until = now

    def freeze(self, frozen: bool) -> None:
        """Stop (or resume) exploring; the choices in force stay. Called between steps."""
        if frozen != self.frozen:
            log.info("kernel tuning %s", "frozen: the current table stays" if frozen else "resumed")
        self.frozen = frozen

    def limit_threads(self, cpus: int) -> None:
        """The worker now runs on `cpus` CPUs (the coordinator moved it): arms with more threads
        than that stop being tried, and a bucket whose choice has more moves to the same variant
        at `cpus` threads (two threads time-sharing one CPU wait on each other at every barrier:
        the placement that caused it lost 47-98% on AVX2). Raising the limit again restores the
        choice the cut replaced (the cut outlives its cause otherwise: after a neighbour left,
        one-thread arms forced by the placement were still the choice 90 s later and ran at 0.70x
        of --adaptive off, Qwen2.5-1.5B, 12-06); the measurements go on from there. Between steps."""
        cpus = max(1, min(int(cpus), self.max_threads))
        if cpus == self.thread_limit:
            return
        self.thread_limit = cpus
        for bucket in self.buckets:
            self._wake(bucket, f"the worker now runs on {cpus} CPU{'s' if cpus > 1 else ''}")
            variant, threads, attention = bucket.incumbent
            target = None
            if threads > cpus:
                bucket.before_limit = bucket.before_limit or bucket.incumbent
                target = (variant, cpus, attention)
            elif bucket.before_limit is not None and bucket.before_limit[1] <= cpus:
                target, bucket.before_limit = bucket.before_limit, None
            if target is not None and target != bucket.incumbent:
                bucket.incumbent = target
                bucket.recent.clear()  # timings of the old arm say nothing about the new one
                bucket.switch = None
                bucket.reset_candidates()
                log.info("bucket %s rows: %s -> %s: the worker now runs on %d CPU%s", bucket.name,
                         arm_name((variant, threads, attention)), arm_name(bucket.incumbent), cpus,
                         "s" if cpus > 1 else "")
        self._install(self.buckets[0].incumbent[1])

    # ---- the step hooks ------------------------------------------------------------------------

    def before_step(self, rows: int) -> None:
        """Choose this step's table and threads (between steps: the engine is idle)."""
        if self._step is not None:
            raise RuntimeError("KernelTuner.before_step called twice without after_step: a table may "
                               "only change between steps")
        if self._wake_reason is not None:
            reason, self._wake_reason = self._wake_reason, None
            for b in self.buckets:
                self._wake(b, reason)
        bucket = self.buckets[bucket_of(max(1, rows))]
        arm, exploring = bucket.incumbent, False
        budget = 0.5 ** bucket.decay
        if (self.settings.enabled and not self.frozen and bucket.switch is None and len(bucket.recent) >= REFERENCE_STEPS
                and (self.rng.random() < self.settings.explore_share * budget
                     or bucket.busy >= self.settings.explore_every_s / budget)):
            candidate = self._candidate(bucket)
            if candidate is not None:
                arm, exploring = candidate, True
                bucket.busy = 0.0
        self._step = (bucket, arm, exploring, max(1, rows))
        self._install(arm[1], bucket.index, arm)

    def after_step(self, seconds: float | None) -> None:
        """Record the step's cost and act on what the measurements now say (None: the step
        failed; nothing is learned from it)."""
        if self._step is None:
            return  # a tuner attached mid-step
        bucket, arm, exploring, rows = self._step
        self._step = None
        if seconds is None:
            self._install(bucket.incumbent[1])
            return
        per_row = seconds / rows
        bucket.steps += 1
        now = self.clock()
        if exploring:
            reference = median(list(bucket.recent)[-REFERENCE_STEPS:])
            c = bucket.candidates[arm]
            c.ratios.append(math.log(max(per_row, 1e-12) / max(reference, 1e-12)))
            c.seconds.append(per_row)
            c.last_step = bucket.steps
            if self.settings.enabled:
                self._judge(bucket, arm, c, now, reference)
            self._install(bucket.incumbent[1])  # the next step starts on the incumbent's table again
            return
        bucket.recent.append(per_row)
        bucket.busy += seconds
        if bucket.settled_at is not None and len(bucket.recent) >= REFERENCE_STEPS:
            now_s = median(list(bucket.recent)[-REFERENCE_STEPS:])
            if abs(math.log(max(now_s, 1e-12) / max(bucket.settled_at, 1e-12))) > DRIFT:
                self._wake(bucket, f"its time per row moved {1e3 * bucket.settled_at:.3f} -> {1e3 * now_s:.3f} ms")
        if bucket.switch is not None:
            bucket.switch.after.append(per_row)
            if len(bucket.switch.after) >= self.settings.rollback_steps:
                self._check_switch(bucket, now)

    @contextmanager
    def step(self, rows: int, timer: Callable[[], float] = time.perf_counter):
        """`with tuner.step(rows): engine.execute(...)`: before_step, the step, after_step with its time."""
        self.before_step(rows)
        started = timer()
        try:
            yield
        except BaseException:
            self.after_step(None)
            raise
        self.after_step(timer() - started)

    # ---- decisions -----------------------------------------------------------------------------

    def _candidate(self, bucket: _Bucket) -> Arm | None:
        """The live candidate sampled least recently (None: nothing to try)."""
        now = self.clock()
        best = None
        for arm, c in bucket.candidates.items():
            if arm == bucket.incumbent or arm[1] > self.thread_limit:
                continue
            if c.paused_until > now:
                continue
            if c.paused_until:  # back from elimination or a ban: fresh evidence only
                c.paused_until, c.banned, c.confirming = 0.0, False, False
                c.ratios.clear()
                c.seconds.clear()
            if best is None or c.last_step < bucket.candidates[best].last_step:
                best = arm
        return best

    def _judge(self, bucket: _Bucket, arm: Arm, c: _Candidate, now: float, reference: float) -> None:
        """A verdict every min_samples / 2 new samples (not after each: every test is a chance of
        a false win), over the candidate's window."""
        s = self.settings
        n = len(c.ratios)
        early = n < s.min_samples  # only a loss can be decided this early (it costs a pause, no more)
        if n < 2 or (not early and (n - s.min_samples) % max(1, s.min_samples // 2)):
            return
        ratios = list(c.ratios)
        m = median(ratios)
        # The jitter: the larger of the candidate's spread and the incumbent's own (a window of 8
        # can show a small MAD by chance; the incumbent's recent steps are more).
        inc = [math.log(max(v, 1e-12)) for v in bucket.recent]
        sigma = max(_spread(ratios) * math.sqrt(n),
                    _spread(inc) * math.sqrt(len(inc)) * math.sqrt(1 + 1 / REFERENCE_STEPS))
        se = sigma / math.sqrt(n)
        gain = math.log(1.0 - s.min_gain)
        wins = not early and m < gain and m + s.z * se < 0.0
        if wins and c.confirming:
            self._promote(bucket, arm, c, m, se)
        elif wins:
            # A win is confirmed on fresh samples before it counts: two independent windows
            # must agree, which keeps equal arms from trading places on a lucky window. The fresh
            # window grows until it decides (noisy hosts need more samples), within a limit.
            c.confirming = True
            c.ratios.clear()
            c.seconds.clear()
        elif c.confirming and n >= CONFIRM_WITHIN * s.min_samples:
            c.confirming = False
        elif m - s.z * se > gain:
            # A loser k times slower than the incumbent waits recheck_s x k / 3 (1 to MAX_PAUSE x):
            # what its re-checks cost stays bounded (on a swamped host a two-thread step took 10-20x
            # a one-thread one), while a 2x loser comes back within recheck_s once a neighbour
            # leaves. Not longer per repeated loss: that delayed noticing a neighbour by 16 s.
            pause = s.recheck_s * min(MAX_PAUSE, max(1.0, math.exp(m) / 3.0)) * 2 ** bucket.decay
            c.paused_until, c.confirming = now + pause, False
            c.lost_by = (m, se, n)
            self._lost(bucket, arm)
            c.ratios.clear()
            c.seconds.clear()
            log.debug("kernel tuner: bucket %s rows: %s eliminated (%+.0f%% ±%.0f%% vs %s) for %.0f s",
                      bucket.name, arm_name(arm), 100 * math.expm1(m), 100 * se, arm_name(bucket.incumbent),
                      pause)

    def _lost(self, bucket: _Bucket, arm: Arm) -> None:
        """A candidate lost; when every live one has, the round ends and exploration halves."""
        bucket.lost.add(arm)
        live = {a for a in bucket.candidates if a != bucket.incumbent and a[1] <= self.thread_limit
                and not bucket.candidates[a].banned}
        if not live <= bucket.lost:
            return
        bucket.lost.clear()
        if bucket.recent:
            bucket.settled_at = median(list(bucket.recent)[-REFERENCE_STEPS:])
        if bucket.decay < MAX_DECAY:
            bucket.decay += 1
            log.debug("kernel tuner: bucket %s rows: %s held a round; exploring at 1/%d", bucket.name,
                      arm_name(bucket.incumbent), 2 ** bucket.decay)

    def _promote(self, bucket: _Bucket, arm: Arm, c: _Candidate, m: float, se: float) -> None:
        before = list(bucket.recent)
        paired = len(c.ratios)
        previous = bucket.incumbent
        after_s = median(list(c.seconds))
        before_s = after_s / math.exp(m)
        bucket.incumbent = arm
        bucket.switch = _Switch(previous, before)
        bucket.recent.clear()
        bucket.reset_candidates()
        self._wake(bucket, f"{arm_name(arm)} was promoted")
        self.promotions += 1
        self._event("promote", bucket, previous, arm, before_s, after_s, paired)
        log.info("kernel tuner: bucket %s rows: %s -> %s promoted: %.3f ms/row vs %.3f ms/row (%+.1f%% ±%.1f%%, "
                 "%d paired steps)", bucket.name, arm_name(previous), arm_name(arm), 1e3 * after_s, 1e3 * before_s,
                 100 * math.expm1(m), 100 * se, paired)

    def _check_switch(self, bucket: _Bucket, now: float) -> None:
        switch = bucket.switch
        bucket.switch = None
        if len(switch.before) < REFERENCE_STEPS:
            self._saved()
            return
        before, after = median(switch.before), median(switch.after)
        ratios = [math.log(max(a, 1e-12) / max(before, 1e-12)) for a in switch.after]
        worse = math.log(after / before) if before > 0 else 0.0
        jitter = _spread(ratios) + _spread([math.log(max(b, 1e-12) / before) for b in switch.before])
        if worse > math.log(1.0 + self.settings.rollback) and worse > self.settings.z * jitter:
            promoted = bucket.incumbent
            bucket.incumbent = switch.previous
            bucket.recent.clear()
            bucket.reset_candidates()
            self._wake(bucket, f"{arm_name(promoted)} was rolled back")
            banned = bucket.candidates[promoted]
            banned.paused_until, banned.banned = now + self.settings.ban_s, True
            self.rollbacks += 1
            self._install(bucket.incumbent[1])
            self._event("rollback", bucket, promoted, switch.previous, before, after, len(switch.after))
            log.info("kernel tuner: bucket %s rows: rolled back %s -> %s: %.3f ms/row over %d steps after the "
                     "switch vs %.3f ms/row before (%+.1f%% > %.0f%%); %s banned for %.0f s", bucket.name,
                     arm_name(promoted), arm_name(switch.previous), 1e3 * after, len(switch.after), 1e3 * before,
                     100 * math.expm1(worse), 100 * self.settings.rollback, arm_name(promoted), self.settings.ban_s)
        else:
            log.debug("kernel tuner: bucket %s rows: %s kept (%+.1f%% after the switch)", bucket.name,
                      arm_name(bucket.incumbent), 100 * math.expm1(worse))
        self._saved()

    def _event(self, kind: str, bucket: _Bucket, old: Arm, new: Arm, before_s: float, after_s: float,
               steps: int) -> None:
        self.events.append({"kind": kind, "bucket": bucket.name, "from": arm_name(old), "to": arm_name(new),
                            "before_ms_per_row": round(1e3 * before_s, 4), "after_ms_per_row": round(1e3 * after_s, 4),
                            "steps": steps, "at": self.clock()})
        del self.events[:-50]

    # ---- tables and threads --------------------------------------------------------------------

    def _install(self, threads: int, bucket: int | None = None, arm: Arm | None = None) -> None:
        """Point the engine at the incumbents' table (one bucket's variants those of `arm` when
        given) and set its threads; both take effect at the next execute."""
        arms = [b.incumbent for b in self.buckets]
        if bucket is not None:
            arms[bucket] = arm
        key = (tuple(a[0] for a in arms), tuple(a[2] for a in arms))
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = OpTable.of(matmul=key[0], attention=key[1])
        self.engine.ops = table
        if threads != self.engine.threads:
            self.engine.set_threads(threads)

    def choices(self) -> dict[str, Arm]:
        """Each bucket's incumbent: {bucket name: (matmul variant, threads, attention variant)}."""
        return {b.name: b.incumbent for b in self.buckets}

    def adopt(self, choices: dict[str, list | tuple]) -> bool:
        """Start from saved choices (from table_store); False (nothing changed) when one names a
        variant or thread count this engine does not have. A choice saved before attention was
        tuned, [variant, threads], keeps the bucket's attention variant."""
        by_name = {b.name: b for b in self.buckets}
        wanted = {}
        for name, arm in choices.items():
            if name not in by_name or len(arm) not in (2, 3):
                return False
            attention = str(arm[2]) if len(arm) == 3 else by_name[name].incumbent[2]
            arm = (str(arm[0]), int(arm[1]), attention)
            if arm not in by_name[name].candidates:
                return False
            wanted[name] = arm
        for name, arm in wanted.items():
            by_name[name].incumbent = arm
        self._install(self.buckets[0].incumbent[1])
        return True

    def _saved(self) -> None:
        if self._save is not None:
            self._save(self.choices())

    def verify(self, timer: Callable[[], float] = time.perf_counter) -> None:
        """Re-time, before trusting it, each adopted choice of fewer threads than the engine has
        against the same variant on every thread: fewer threads win while a neighbour holds a core
        and lose once it has gone (a table learned under a 45 s CPU hog kept later servers on one
        thread). The saved choice stays only if it still wins by min_gain. A few matmul
        timings per such bucket (CALIBRATION_ROWS); the online A/B goes on either way."""
        if not self.settings.enabled:
            return
        original, changed = self.engine.threads, False
        for bucket, rows in zip(self.buckets, CALIBRATION_ROWS):
            saved = bucket.incumbent
            full = (saved[0], self.max_threads, saved[2])
            if saved[1] >= self.max_threads or full not in bucket.candidates:
                continue
            timings = {}
            for arm in (saved, full):
                self.engine.set_threads(arm[1])
                table = OpTable.of(matmul=arm[0], attention=arm[2])
                self.engine.time_matmul(table, rows, repeats=1)  # first touch
                timings[arm] = self.engine.time_matmul(table, rows, repeats=5) / rows
            kept = timings[saved] < timings[full] * (1.0 - self.settings.min_gain)
            if not kept:
                bucket.incumbent, changed = full, True
            log.info("kernel tuner: bucket %s rows: the saved %s %s (%.0f us/row vs %.0f us/row for %s at start)",
                     bucket.name, arm_name(saved), "still wins" if kept else f"is dropped for {arm_name(full)}",
                     1e6 * timings[saved], 1e6 * timings[full], arm_name(full))
        self.engine.set_threads(original)
        self._install(self.buckets[0].incumbent[1])
        if changed:
            self._saved()

    # ---- start-up calibration ------------------------------------------------------------------

    def calibrate(self, budget_s: float | None = None, timer: Callable[[], float] = time.perf_counter) -> None:
        """Time every arm of every bucket on one layer's matmuls (engine.time_matmul) and start on
        the fastest; stops at the budget (the buckets not reached keep the engine's choice).
        Matmuls say nothing of attention: only arms with the bucket's attention variant are
        timed, and the online A/B weighs the others. Progress and the result go to the log."""
        budget = self.settings.calibration_s if budget_s is None else budget_s
        if not self.settings.enabled or budget <= 0:
            return
        started = timer()
        deadline = started + budget
        original = self.engine.threads
        for bucket, rows in zip(self.buckets, CALIBRATION_ROWS):
            arms = [a for a in bucket.arms if a[2] == bucket.incumbent[2]]
            rounds: dict[Arm, list[float]] = {arm: [] for arm in arms}
            for round_ in range(CALIBRATION_ROUNDS):
                for arm in arms:
                    if timer() > deadline:
                        break
                    if arm[1] != self.engine.threads:
                        self.engine.set_threads(arm[1])
                    table = OpTable.of(matmul=arm[0], attention=arm[2])
                    if round_ == 0:
                        self.engine.time_matmul(table, rows, repeats=1)  # first touch: caches, page faults
                    rounds[arm].append(self.engine.time_matmul(table, rows, repeats=2) / rows)
            timings = {arm: median(times) for arm, times in rounds.items() if len(times) == CALIBRATION_ROUNDS}
            if len(timings) < len(arms):
                log.info("kernel calibration: out of time (%.0f s) at bucket %s rows; the rest keep %s", budget,
                         bucket.name, arm_name(bucket.incumbent))
                break
            # The thread count also runs the step's other parallel loops (attention, norms), which
            # a serial matmul does not exercise: judge threads by the parallel variants alone.
            parallel = {a: t for a, t in timings.items() if not a[0].endswith("_serial")} or timings
            threads = min(parallel, key=parallel.get)[1]
            at_threads = {a: t for a, t in timings.items() if a[1] == threads}
            best = min(at_threads, key=at_threads.get)
            # Only a clear win replaces the engine's default: calibration is a short measurement.
            if timings[best] < timings[bucket.incumbent] * (1.0 - self.settings.min_gain):
                bucket.incumbent = best
            log.info("kernel calibration: bucket %s rows (%d rows): %s; start on %s (%.0f s so far)", bucket.name,
                     rows, ", ".join(f"{arm_name(a)} {1e6 * t:.0f} us/row" for a, t in timings.items()),
                     arm_name(bucket.incumbent), timer() - started)
        self._install(original)
        self._saved()

    # ---- what the worker profile reports -------------------------------------------------------

    def snapshot(self) -> dict:
        """Choices, per-arm timings (median ms per row of the recent window) and the recent
        promotions and rollbacks, as plain JSON-able values."""
        now = self.clock()
        buckets = {}
        for b in self.buckets:
            arms = {}
            for arm, c in b.candidates.items():
                if arm == b.incumbent:
                    arms[arm_name(arm)] = {"ms_per_row": round(1e3 * median(b.recent), 4) if b.recent else None,
                                           "incumbent": True, "samples": len(b.recent)}
                else:
                    arms[arm_name(arm)] = {"ms_per_row": round(1e3 * median(c.seconds), 4) if c.seconds else None,
                                           "samples": len(c.ratios),
                                           "paused_s": round(max(0.0, c.paused_until - now), 1),
                                           "banned": c.banned and c.paused_until > now}
            buckets[b.name] = {"choice": arm_name(b.incumbent), "variant": b.incumbent[0],
                               "threads": b.incumbent[1], "attention": b.incumbent[2], "steps": b.steps, "watching_switch": b.switch is not None,
                               "explore_budget": 0.5 ** b.decay,
                               "arms": arms, "versus_default": self._versus_default(b)}
        return {"enabled": self.settings.enabled, "numerics": self.numerics, "buckets": buckets,
                "promotions": self.promotions, "rollbacks": self.rollbacks, "events": list(self.events)}


    def _versus_default(self, bucket: _Bucket) -> dict | None:
        """What the bucket's choice is worth against the shipped default, from the default's own
        exploration steps (each paired with the choice's recent steps, as every candidate is): the
        default's time per row over the choice's, less one, with the standard error of that median.
        None while the choice is the default or the default has not been re-timed since."""
        default = self.defaults[bucket.name]
        c = bucket.candidates.get(default)
        if bucket.incumbent == default or c is None:
            return None
        if len(c.ratios) >= 2:  # being re-timed now
            m, se, n = median(c.ratios), _spread(list(c.ratios)), len(c.ratios)
        elif c.lost_by is not None:  # its last elimination (the window is cleared then)
            m, se, n = c.lost_by
        else:
            return None
        return {"default": arm_name(default), "gain": round(math.expm1(m), 4), "noise": round(se, 4), "steps": n}


class FixedKernels:
    """No tuner: the engine's table and threads as loaded (the CLI, tests, `kernels = fixed` callers),
    the threads capped by the CPUs the coordinator places the worker on (given the engine)."""

    def __init__(self, engine: TunableEngine | None = None):
        self.engine = engine
        self.max_threads = max(1, int(engine.threads)) if engine is not None else 0

    def step(self, rows: int):
        return nullcontext()

    def freeze(self, frozen: bool) -> None:
        pass  # nothing here ever changes

    def note_neighbours(self, others: float) -> None:
        pass  # nothing here explores

    def limit_threads(self, cpus: int) -> None:
        """The worker now runs on `cpus` CPUs: no more threads than that, and back to the loaded
        count when it has them again (two threads time-sharing one CPU wait on each other at
        every barrier). Between steps, on the thread that runs them."""
        if self.engine is not None:
            threads = max(1, min(int(cpus), self.max_threads))
            self.engine.set_threads(threads)
            log.info("threads: %d of the %d it loaded with: the worker now runs on %d CPU%s", threads,
                     self.max_threads, cpus, "s" if cpus != 1 else "")

    def snapshot(self) -> dict:
        return {"enabled": False}


def kernel_profile(snapshot: dict) -> dict[str, float | str]:
    """A snapshot as the worker profile's flat "kernels" section: the matmul choice per rows
    bucket ("gemm", what the adaptive report prints), the promotion and rollback counts, and per
    bucket whose choice is not the default, its A/B against it ("ab <bucket> ...": the default's
    arm, the gain, its standard error and the paired steps behind them)."""
    if not snapshot.get("enabled"):
        return {"gemm": "fixed"}
    choices = " ".join(f"{name}:{bucket['choice']}" for name, bucket in snapshot["buckets"].items())
    flat: dict[str, float | str] = {"gemm": choices, "promotions": float(snapshot["promotions"]),
                                    "rollbacks": float(snapshot["rollbacks"])}
    for name, bucket in snapshot["buckets"].items():
        versus = bucket.get("versus_default")
        if versus:
            flat[f"ab {name} choice"] = bucket["choice"]
            flat[f"ab {name} default"] = versus["default"]
            for key in ("gain", "noise", "steps"):
                flat[f"ab {name} {key}"] = float(versus[key])
    return flat
