"""Whether drafting pays at all, measured step against step.

The speculator's per-sequence rule predicts a draft's worth from a fitted step cost; at 8
streams on AVX2 (2 threads) that fit undercounts what drafted rows cost (their sampling and
attention beside the batched matmuls), and speculation lost on every workload: 0.97x on QA and
code, 0.81x on free text (bench/speculative.py). The gate checks the result instead of the model:
per batch size, decode steps in which sequences drafted and steps in which none did are timed in
tokens emitted per second; drafting continues only where it measures at least as fast. A share
of steps keeps sampling the losing side, so a verdict follows the traffic as it changes.

A verdict needs evidence to change: drafting turns on only when its median beats plain decoding
by ON_MARGIN, and off when it falls below plain, in both cases by more than NOISE_Z standard
errors of the two medians; and a verdict stands for at least FRESH new steps of the side it runs
less. Comparing bare medians flipped the verdict 251 times in 6 minutes
of agentic traffic at temperature 0.7 (+3% one moment, -1% the next: noise), so about half of
those steps drafted though drafting gained nothing.
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
ON_MARGIN = 0.03  # drafting must beat plain decoding by this much to turn on (or stay on when new)
FRESH = SAMPLES // 2  # new steps of the less-run side before a verdict may change again
NOISE_Z = 3.0  # standard errors of the rates' medians a difference must exceed to overturn a verdict


def bucket_of(sequences: int) -> int:
    return max(i for i, low in enumerate(BUCKETS) if sequences >= low) if sequences >= 1 else 0


class DraftGate:
    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random(0)
        self._rates = [(deque(maxlen=SAMPLES), deque(maxlen=SAMPLES)) for _ in BUCKETS]  # (plain, drafted)
        self._verdict: list[bool | None] = [None] * len(BUCKETS)  # drafting pays; None = not measured yet
        self._fresh = [0] * len(BUCKETS)  # steps of the less-run side since the verdict last changed

    def allow(self, sequences: int) -> bool:
        """May sequences draft in the next step, which decodes about this many?"""
        b = bucket_of(sequences)
        plain, drafted = self._rates[b]
        if len(plain) < SAMPLES or len(drafted) < SAMPLES:
            return len(drafted) <= len(plain)  # measuring: alternate the two kinds
        verdict = self._verdict[b]
        return verdict if self.rng.random() >= EXPLORE else not verdict

    def observe(self, sequences: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step (no prompt rows): whether any sequence drafted, tokens emitted, its time."""
        if sequences < 1 or seconds <= 0 or tokens < 1:  # a step whose requests all failed says nothing
            return
        b = bucket_of(sequences)
        plain_rates, drafted_rates = self._rates[b]
        (drafted_rates if drafted else plain_rates).append(tokens / seconds)
        current = self._verdict[b]
        if current is not None and drafted != current:
            self._fresh[b] += 1
        if len(plain_rates) < SAMPLES or len(drafted_rates) < SAMPLES:
            return
        if current is not None and self._fresh[b] < FRESH:
            return
        plain, spec = median(plain_rates), median(drafted_rates)
        if current is None:
            verdict = spec >= plain * (1 + ON_MARGIN)
        else:
            # A standing verdict turns over only on a difference beyond the rates' own noise: per
            # step rates vary ±10-20% (a drafted step emits 1 to max_draft+1 tokens), and between
            # near-equal sides bare medians still flipped 28 times in two minutes (SmolLM2, two
            # streams, 12-06), each flip a stretch of the slower side.
            gain = spec / plain - 1
            beyond_noise = abs(gain) > NOISE_Z * math.hypot(_median_error(plain_rates), _median_error(drafted_rates))
            verdict = (gain > ON_MARGIN and beyond_noise) if not current else not (gain < 0 and beyond_noise)
        if verdict == current:
            self._fresh[b] = 0  # judged again only on FRESH new steps: each test is a chance of a false flip
        else:
            log.info("speculation %s for steps of %d+ decoding sequences: %.0f tok/s drafting vs %.0f "
                     "without (%+.0f%%, medians of the last %d steps each)", "on" if verdict else "off",
                     BUCKETS[b], spec, plain, 100 * (spec / plain - 1), SAMPLES)
            self._verdict[b] = verdict
            self._fresh[b] = 0

    def export(self) -> list[tuple[list[float], list[float]]]:
        """Each bucket's (plain, drafted) step rates, oldest first: what a restart resumes from."""
        return [(list(plain), list(drafted)) for plain, drafted in self._rates]

    def restore(self, rates: list[tuple[list[float], list[float]]]) -> None:
        """Resume from exported rates: a bucket with enough of both kinds has its verdict at once
        (new steps push the old rates out, and exploration goes on as before)."""
        for b, (plain, drafted) in enumerate(rates[:len(BUCKETS)]):
            plain_rates, drafted_rates = self._rates[b]
            plain_rates.extend(v for v in plain if v > 0)
            drafted_rates.extend(v for v in drafted if v > 0)
            if len(plain_rates) == SAMPLES and len(drafted_rates) == SAMPLES:
                self._verdict[b] = median(drafted_rates) >= median(plain_rates) * (1 + ON_MARGIN)

    def snapshot(self) -> dict[str, str | float]:
        """Per bucket its verdict, and once measured the A/B behind it: drafting's step rate over
        plain decoding's, less one ("gate_N+_gain"), and that ratio's standard error ("_noise")."""
        out: dict[str, str | float] = {}
        for low, verdict, (plain, drafted) in zip(BUCKETS, self._verdict, self._rates):
            out[f"gate_{low}+"] = {None: "measuring", True: "on", False: "off"}[verdict]
            if verdict is not None and len(plain) >= 2 and len(drafted) >= 2:
                out[f"gate_{low}+_gain"] = round(median(drafted) / median(plain) - 1, 4)
                out[f"gate_{low}+_noise"] = round(math.hypot(_median_error(plain), _median_error(drafted)), 4)
                out[f"gate_{low}+_steps"] = float(len(plain) + len(drafted))
        return out


def _median_error(rates) -> float:
    """The relative standard error of the median of rates, from their MAD."""
    m = median(rates)
    mad = median(abs(r - m) for r in rates)
    return 1.253 * 1.4826 * mad / math.sqrt(len(rates)) / m if m > 0 else 0.0
