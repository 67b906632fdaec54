"""Whether drafting pays at all, measured step against step.

The speculator's per-sequence rule predicts a draft's worth from a fitted step cost; at 8
streams on AVX2 (2 threads) that fit undercounts what drafted rows cost (their sampling and
attention beside the batched matmuls), and speculation lost on every workload: 0.97x on QA and
code, 0.81x on free text (bench/speculative.py). The gate checks the result instead of the model:
per batch size, decode steps in which sequences drafted and steps in which none did are timed in
tokens emitted per second; drafting continues only where it measures at least as fast. A share
of steps keeps sampling the losing side, so a verdict follows the traffic as it changes.

Each side's rate is its steps' tokens over their time (a ratio of sums: what throughput is), not
the median of per-step rates. A drafted step emits 1 to max_draft + 1 tokens, so its per-step
rates are skewed, and their median favoured drafting: on free text with one-token drafts accepted
half the time (Qwen2.5-Coder-1.5B, Zen 3, 12-07) the medians put drafting 41% ahead while the run
was 0.91x of plain decoding. A step the host stalled counts as at most CLIP of its side's median
step, so one stall does not decide a verdict.

A verdict needs evidence, and more of it for drafting than against it: drafting turns on only when
its rate beats plain decoding by ON_MARGIN and by more than NOISE_Z standard errors of the two
rates (a few percent inside the noise is no reason to pay for drafted rows), and off once it
measures below plain by more than OFF_Z of them (plain decoding is what `--adaptive off` runs: a
change away from it keeps its place only while it is not measured to lose). A verdict stands for
at least FRESH new steps of the side it runs less. Comparing bare medians
flipped the verdict 251 times in 6 minutes of agentic traffic at temperature 0.7 (+3% one moment,
-1% the next: noise), so about half of those steps drafted though drafting gained nothing.

Both sides are read over the same stretch of time. Once a verdict stands, the side it runs less
gets a step in ten, so its last SAMPLES steps reach ten times further back than the other side's;
comparing those two windows compared two moments of the traffic, which drifts (how many sequences
decode, how long their contexts are, what they draft). The gate flipped 4-7 times in 2.5-4.5
minutes of the 1.5B file's scenarios at temperature 0.7 (bench/adaptive.py, Zen 4, 12-07), and in a
model of it (equal sides, the traffic's rate drifting +-30% over 600 steps) 16-22 times in 6,000
steps, drafting 39% of them. So the more-run side is read from the first step of the other's
window on: both rates average the same traffic.
"""
from __future__ import annotations

import logging
import math
import random
from collections import deque
from statistics import median

log = logging.getLogger("reame.speculator")

BUCKETS = (1, 2, 4, 8)  # decoding sequences in a step: 1, 2-3, 4-7, 8+
SAMPLES = 24  # steps of each kind a verdict needs (and the window it reads)
EXPLORE = 0.1  # share of steps that run the losing side once a verdict stands
# Steps of each kind kept: the more-run side's steps over the span of the other's SAMPLES (about
# SAMPLES / EXPLORE of them), with room for the randomness of exploration.
KEPT = 3 * round(SAMPLES / EXPLORE)
ON_MARGIN = 0.03  # drafting must beat plain decoding by this much to turn on
FRESH = SAMPLES // 2  # new steps of the less-run side before a verdict may change again
NOISE_Z = 3.0  # standard errors of the two rates drafting's gain must exceed to turn it on
# ... and its loss to turn it off. On equal sides a check passes it 7% of the time, and the way
# back on needs NOISE_Z: at most a few flips an hour. At 3, drafting measured -9% +-4% at 4+
# sequences a step (agentic traffic, Qwen2.5-Coder-1.5B, Zen 4, 12-07) and stayed on.
OFF_Z = 1.5
CLIP = 3.0  # a step counts as at most this many of its side's median step time


def bucket_of(sequences: int) -> int:
    return max(i for i, low in enumerate(BUCKETS) if sequences >= low) if sequences >= 1 else 0


class DraftGate:
    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random(0)
        # (plain, drafted) steps: (tokens emitted, seconds, the bucket's step count when it ran),
        # most recent KEPT of each
        self._steps = [(deque(maxlen=KEPT), deque(maxlen=KEPT)) for _ in BUCKETS]
        self._count = [0] * len(BUCKETS)
        self._verdict: list[bool | None] = [None] * len(BUCKETS)  # drafting pays; None = not measured yet
        self._fresh = [0] * len(BUCKETS)  # steps of the less-run side since the verdict last changed

    def allow(self, sequences: int) -> bool:
        """May sequences draft in the next step, which decodes about this many?"""
        b = bucket_of(sequences)
        plain, drafted = self._steps[b]
        if len(plain) < SAMPLES or len(drafted) < SAMPLES:
            return len(drafted) <= len(plain)  # measuring: alternate the two kinds
        verdict = self._verdict[b]
        return verdict if self.rng.random() >= EXPLORE else not verdict

    def observe(self, sequences: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step (no prompt rows): whether any sequence drafted, tokens emitted, its time."""
        if sequences < 1 or seconds <= 0 or tokens < 1:  # a step whose requests all failed says nothing
            return
        b = bucket_of(sequences)
        plain_steps, drafted_steps = self._steps[b]
        self._count[b] += 1
        (drafted_steps if drafted else plain_steps).append((tokens, seconds, self._count[b]))
        current = self._verdict[b]
        if current is not None and drafted != current:
            self._fresh[b] += 1
        if len(plain_steps) < SAMPLES or len(drafted_steps) < SAMPLES:
            return
        if current is not None and self._fresh[b] < FRESH:
            return
        span = same_span(plain_steps, drafted_steps)
        plain, spec, gain, noise = compare(*span)
        # Per-step token counts and times vary ±10-20% and more (a drafted step emits 1 to
        # max_draft+1 tokens); between near-equal sides bare medians flipped 28 times in two
        # minutes (SmolLM2, two streams, 12-06), each flip a stretch on the slower side.
        verdict = not gain < -OFF_Z * noise if current else _turns_on(gain, noise)
        if verdict == current:
            self._fresh[b] = 0  # judged again only on FRESH new steps: each test is a chance of a false flip
        else:
            log.info("speculation %s for steps of %d+ decoding sequences: %.0f tok/s drafting vs %.0f "
                     "without (%+.0f%% ±%.0f%%, tokens over time of %d drafted and %d plain steps of the same "
                     "stretch)", "on" if verdict else "off", BUCKETS[b], spec, plain, 100 * gain, 100 * noise,
                     len(span[1]), len(span[0]))
            self._verdict[b] = verdict
            self._fresh[b] = 0

    def export(self) -> list[tuple[list[tuple[int, float]], list[tuple[int, float]]]]:
        """Each bucket's (plain, drafted) steps as (tokens, seconds), the last SAMPLES of each,
        oldest first: what a restart resumes from."""
        return [([(t, s) for t, s, _ in list(plain)[-SAMPLES:]], [(t, s) for t, s, _ in list(drafted)[-SAMPLES:]])
                for plain, drafted in self._steps]

    def restore(self, steps: list[tuple[list[tuple[int, float]], list[tuple[int, float]]]]) -> None:
        """Resume from exported steps: a bucket with enough of both kinds has its verdict at once
        (new steps push the old ones out, and exploration goes on as before). The restored steps
        count as one stretch of time (step count 0): each side's are read whole."""
        for b, (plain, drafted) in enumerate(steps[:len(BUCKETS)]):
            plain_steps, drafted_steps = self._steps[b]
            plain_steps.extend((t, s, 0) for t, s in plain[-SAMPLES:] if t >= 1 and s > 0)
            drafted_steps.extend((t, s, 0) for t, s in drafted[-SAMPLES:] if t >= 1 and s > 0)
            if len(plain_steps) == SAMPLES and len(drafted_steps) == SAMPLES:
                self._verdict[b] = _turns_on(*compare(plain_steps, drafted_steps)[2:])

    def snapshot(self) -> dict[str, str | float]:
        """Per bucket its verdict, and once measured the A/B behind it: drafting's rate over plain
        decoding's, less one ("gate_N+_gain"), and that ratio's standard error ("_noise")."""
        out: dict[str, str | float] = {}
        for low, verdict, (plain, drafted) in zip(BUCKETS, self._verdict, self._steps):
            out[f"gate_{low}+"] = {None: "measuring", True: "on", False: "off"}[verdict]
            if verdict is not None and len(plain) >= 2 and len(drafted) >= 2:
                plain, drafted = same_span(plain, drafted)
                _, _, gain, noise = compare(plain, drafted)
                out[f"gate_{low}+_gain"] = round(gain, 4)
                out[f"gate_{low}+_noise"] = round(noise, 4)
                out[f"gate_{low}+_steps"] = float(len(plain) + len(drafted))
        return out


def _turns_on(gain: float, noise: float) -> bool:
    """Drafting turns on (or, resumed, starts on) only on a gain clearly beyond the noise."""
    return gain > ON_MARGIN and gain > NOISE_Z * noise


def same_span(plain_steps, drafted_steps) -> tuple[list, list]:
    """Both sides' steps from the first of either side's last SAMPLES on (see the module's doc):
    the less-run side's SAMPLES, and every step the other ran in the same stretch."""
    start = min(steps[-min(SAMPLES, len(steps))][2] for steps in (plain_steps, drafted_steps))
    return [s for s in plain_steps if s[2] >= start], [s for s in drafted_steps if s[2] >= start]


def compare(plain_steps, drafted_steps) -> tuple[float, float, float, float]:
    """(plain tok/s, drafting tok/s, drafting's gain over plain, that gain's standard error)."""
    (plain, plain_error), (spec, spec_error) = rate(plain_steps), rate(drafted_steps)
    return plain, spec, spec / plain - 1, math.hypot(plain_error, spec_error)


def rate(steps) -> tuple[float, float]:
    """(tokens per second over steps, its relative standard error); a step is (tokens, seconds,
    ...). Each step's time counts as at most CLIP times the steps' median; the error is the ratio
    estimator's, sum over steps of (tokens - rate * seconds)^2, from the steps' own spread."""
    limit = CLIP * median(step[1] for step in steps)
    tokens = [float(step[0]) for step in steps]
    seconds = [min(step[1], limit) for step in steps]
    n = len(steps)
    r = sum(tokens) / sum(seconds)
    if n < 2:
        return r, 0.0
    spread = sum((t - r * s) ** 2 for t, s in zip(tokens, seconds)) / (n - 1)
    return r, math.sqrt(spread / n) / (sum(tokens) / n)
