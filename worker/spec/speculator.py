"""Which sequences draft, how many tokens, and from where; learned from what verification accepts.

Per sequence: drafts come from prompt lookup first, then the archive. The draft length grows by
two after a fully accepted draft and shrinks to one past the accepted run after a rejection.
Each sequence keeps a moving acceptance rate (accepted / drafted); when it falls below the
break-even rate, speculation for that sequence switches off and is retried after a back-off that
doubles on every failed retry. The same rate is kept per request class (the first tokens of the
prompt), so a new request of a class that never pays starts switched off.

Break-even, from measured step times: a step with R rows takes about base + per_row * R seconds
(a least-squares fit over recent steps). A drafted token costs one row (per_row); an accepted one
saves a token's share of a plain step, (base + per_row * B) / B with B sequences in the step. So
drafting pays while acceptance > per_row * B / (base + per_row * B). One stream on SmolLM2 (AVX2):
base is most of the step (the weight read), so even low acceptance pays; with many streams the
bar rises.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from worker.spec.archive import NgramArchive
from worker.spec.prompt_lookup import PromptLookup

log = logging.getLogger("reame.spec")

START_DRAFT = 4  # tokens drafted before a sequence has any record
RATE_WEIGHT = 0.3  # of the newest verification in a moving acceptance rate
FIRST_BACKOFF = 16  # steps a sequence waits before retrying after switching off
MAX_BACKOFF = 512
DEFAULT_BREAK_EVEN = 0.2  # until the step-time fit has data
CLASS_TOKENS = 16  # prompt tokens that name a request class


class StepCost:
    """seconds ≈ base + per_row * rows, fitted by exponentially forgetting least squares."""

    def __init__(self, forget: float = 0.98):
        self.forget = forget
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        f = self.forget
        self._n = f * self._n + 1.0
        self._x = f * self._x + rows
        self._y = f * self._y + seconds
        self._xx = f * self._xx + rows * rows
        self._xy = f * self._xy + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(base, per_row) seconds, or None while the rows seen do not vary enough to tell."""
        n = self._n
        var = self._xx - self._x * self._x / n if n else 0.0
        if n < 4 or var < 0.5 * n:  # rows must spread by ~0.7 on average
            return None
        per_row = max(0.0, (self._xy - self._x * self._y / n) / var)
        base = max(0.0, (self._y - per_row * self._x) / n)
        return base, per_row

    def break_even(self, sequences: int) -> float:
        """The acceptance rate at which drafting starts to pay in a step of this many sequences."""
        fit = self.fit()
        if fit is None:
            return DEFAULT_BREAK_EVEN
        base, per_row = fit
        plain = base + per_row * max(1, sequences)
        return per_row * max(1, sequences) / plain if plain > 0 else DEFAULT_BREAK_EVEN


@dataclass
class SequenceDrafts:
    """One sequence's drafting state."""
    lookup: PromptLookup
    klass: tuple[int, ...]
    draft_len: int = START_DRAFT
    rate: float | None = None  # moving accepted/drafted
    off_until: int = -1  # step number before which it does not draft
    backoff: int = FIRST_BACKOFF
    drafted: int = 0
    accepted: int = 0


@dataclass
class SpecCounters:
    """Cumulative since the worker started; the heartbeat carries them to /metrics."""
    spec_drafts: int = 0  # drafts verified
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_switched_off: int = 0  # sequences whose speculation switched off (each time)
    spec_from_prompt: int = 0  # drafts by source
    spec_from_archive: int = 0


@dataclass
class Speculator:
    """max_draft: the most tokens drafted per sequence and step; archive: None drafts from the
    prompt only; adaptive: False keeps every draft length at max_draft and never switches off."""
    max_draft: int = 8
    archive: NgramArchive | None = None
    adaptive: bool = True
    cost: StepCost = field(default_factory=StepCost)
    counters: SpecCounters = field(default_factory=SpecCounters)

    def __post_init__(self) -> None:
        if self.max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {self.max_draft}")
        self._seqs: dict[str, SequenceDrafts] = {}
        self._classes: dict[tuple[int, ...], float] = {}  # class -> moving acceptance rate
        self._step = 0
        self._sequences_per_step = 1

    # ---- a sequence's life ------------------------------------------------------------------------

    def begin(self, seq_id: str, prompt_ids: list[int]) -> None:
        """A sequence that may draft (requests that opted out are never begun)."""
        klass = tuple(prompt_ids[:CLASS_TOKENS])
        state = SequenceDrafts(PromptLookup(), klass, draft_len=min(START_DRAFT, self.max_draft))
        rate = self._classes.get(klass)
        if self.adaptive and rate is not None and rate < self._break_even():
            state.off_until = self._step + FIRST_BACKOFF
            log.info("request %s: starts without speculation: its class accepts %.0f%% of drafts (break-even %.0f%%)",
                     seq_id, 100 * rate, 100 * self._break_even())
        self._seqs[seq_id] = state

    def end(self, seq_id: str, tokens: list[int] | None = None) -> None:
        """The sequence finished (tokens: all of them, to learn from) or was aborted (None)."""
        state = self._seqs.pop(seq_id, None)
        if state is not None and state.drafted:
            log.debug("request %s: %d of %d drafted tokens accepted", seq_id, state.accepted, state.drafted)
        if tokens is not None and self.archive is not None:
            self.archive.learn(tokens)

    # ---- each step --------------------------------------------------------------------------------

    def propose(self, seq_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to min(limit, its draft length) tokens to verify after `tokens`; [] for none."""
        state = self._seqs.get(seq_id)
        if state is None or limit <= 0 or self._step < state.off_until:
            return []
        k = min(limit, state.draft_len if self.adaptive else self.max_draft)
        draft = state.lookup.propose(tokens, k)
        if draft:
            self.counters.spec_from_prompt += 1
            return draft
        if self.archive is not None:
            draft = self.archive.propose(tokens, k)
            if draft:
                self.counters.spec_from_archive += 1
        return draft

    def observe(self, seq_id: str, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens was verified; the first `accepted` of them matched."""
        if drafted <= 0:
            return
        c = self.counters
        c.spec_drafts += 1
        c.spec_drafted_tokens += drafted
        c.spec_accepted_tokens += accepted
        state = self._seqs.get(seq_id)
        if state is None:
            return
        state.drafted += drafted
        state.accepted += accepted
        share = accepted / drafted
        state.rate = share if state.rate is None else (1 - RATE_WEIGHT) * state.rate + RATE_WEIGHT * share
        old = self._classes.get(state.klass)
        self._classes[state.klass] = share if old is None else (1 - RATE_WEIGHT) * old + RATE_WEIGHT * share
        if not self.adaptive:
            return
        if accepted == drafted:
            state.draft_len = min(self.max_draft, state.draft_len + 2)
            state.backoff = FIRST_BACKOFF
        else:
            state.draft_len = max(1, min(self.max_draft, accepted + 1))
        break_even = self._break_even()
        if state.drafted >= 8 and state.rate < break_even:
            state.off_until = self._step + state.backoff
            log.info("request %s: speculation off for %d steps: acceptance %.0f%% is below break-even %.0f%%",
                     seq_id, state.backoff, 100 * state.rate, 100 * break_even)
            state.backoff = min(MAX_BACKOFF, 2 * state.backoff)
            state.rate = None  # the retry starts afresh
            state.drafted = state.accepted = 0
            state.draft_len = 2
            c.spec_switched_off += 1

    def observe_step(self, rows: int, sequences: int, seconds: float, measured: bool = True) -> None:
        """Every engine step: its rows, decoding sequences and time; the step-cost fit takes
        only `measured` ones (decode and draft rows alone)."""
        self._step += 1
        if measured:
            self.cost.observe(rows, seconds)
        if sequences > 0:
            self._sequences_per_step = sequences

    def _break_even(self) -> float:
        return self.cost.break_even(self._sequences_per_step)

    # ---- reporting --------------------------------------------------------------------------------

    def stats(self) -> dict:
        """For the worker's profile: counters, acceptance, mean accepted length, the step-cost fit."""
        c = self.counters
        fit = self.cost.fit()
        return {
            **vars(c),
            "acceptance_rate": c.spec_accepted_tokens / c.spec_drafted_tokens if c.spec_drafted_tokens else 0.0,
            "mean_accepted_length": c.spec_accepted_tokens / c.spec_drafts if c.spec_drafts else 0.0,
            "mean_draft_length": c.spec_drafted_tokens / c.spec_drafts if c.spec_drafts else 0.0,
            "break_even": self._break_even(),
            "step_base_s": fit[0] if fit else None,
            "step_per_row_s": fit[1] if fit else None,
            "sequences": len(self._seqs),
            "archive_contexts": len(self.archive) if self.archive is not None else 0,
        }
