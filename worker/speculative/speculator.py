"""Which sequences draft, how many tokens, and from where; learned from what verification accepts.

Per sequence: drafts come from prompt lookup first, then the archive. Its acceptance p is the
chance that a drafted token is confirmed given the ones before it were (a geometric model:
accepted tokens over accepted tokens plus rejections, recent drafts weighing most, starting from
its request class's record or an optimistic prior).

The draft length follows from p and measured step times. A step with R rows takes about
base + per_row * R seconds (a least-squares fit over recent decode steps). With B sequences
decoding, a token costs (base + per_row * B) / B; the j-th drafted token of a draft costs one row
and yields a token with probability p^j, so it pays while
    p^j > break_even = per_row * B / (base + per_row * B),
and the draft is k = floor(log(break_even) / log(p)) tokens (at most max_draft). When p falls
to break_even or below (k = 0), speculation for that sequence switches off, logged with both
numbers, and is retried after a back-off that doubles on every failed retry. One stream on
SmolLM2 (AVX2, 1 thread, a loaded host): base ~10 ms, per_row ~3 ms, so break-even ~0.23 and
p = 0.8 drafts 6 tokens; with 8 streams break-even is ~0.7 and only near-certain drafts pay.
"""
from __future__ import annotations

import bisect
import logging
import math
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol

from worker.speculative import learned
from worker.speculative.archive import NgramArchive
from worker.speculative.gate import DraftGate
from worker.speculative.learned import LearnedState
from worker.speculative.prompt_lookup import PromptLookup

log = logging.getLogger("reame.spec")

PRIOR = (2.0, 1.0)  # (accepted, rejections) a sequence starts from without a class record: p = 2/3
DECAY = 0.9  # weight of the older record at each verified draft
RETRY = (1.0, 1.0)  # the record a retry starts from: p = 1/2
FIRST_BACKOFF = 16  # steps a sequence waits before retrying after switching off
MAX_BACKOFF = 512
DEFAULT_BREAK_EVEN = 0.25  # until the step-time fit has data
# A drafted token must be expected to save this many times what its row costs: rows cost more
# than the fit sees (8 streams, 2 threads: k from the bare break-even drafted 4.2 tokens at 65%
# acceptance and ran 0.78x of plain decoding, though the fit predicted the step times right).
MARGIN = 1.25
# A request class is a prompt prefix of 16, 32, ... CLASS_DEPTHS * 16 tokens: a request starts
# from the record of the longest one with CLASS_EVIDENCE drafts behind it. The first 16 tokens
# alone are the chat template's and its default system prompt, shared by every chat request
# (classed by them alone, all of them fell into one class); a longer prefix names the system prompt, the
# document or the instruction, and the shorter ones still serve a prompt seen for the first time.
CLASS_BLOCK = 16
CLASS_DEPTHS = 8
CLASS_EVIDENCE = 3
MAX_CLASSES = 20_000  # class records kept (the oldest go first)
# Prompt-lookup drafts by how far back their source agrees with the sequence (PromptLookup.find):
# the longer the agreement, the likelier the copy goes on. One record per bucket of agreement
# lengths (lower bounds below), learned from every request, sets such a draft's length once it has
# AGREEMENT_EVIDENCE drafts behind it. Code editing at 1 stream (2 threads, AVX2): a fresh 2-token
# match and a 30-token copy in progress had drafted alike from the sequence's one acceptance rate
# (50-54%, mean accepted 2.5 of 5 drafted).
AGREEMENT_BUCKETS = (2, 3, 4, 6, 9, 16, 32)
AGREEMENT_DECAY = 0.98  # every request's drafts feed these records: they forget more slowly
AGREEMENT_EVIDENCE = 8
MAX_NAMESPACES = 1024  # cache namespaces whose agreement records are kept (least recently used go)
_PRIOR_AGREEMENT = ((*PRIOR, 0),) * len(AGREEMENT_BUCKETS)
PROBE_TOKENS = 4  # one-token drafts a sequence may try while its own record is this short, paying or not
SAVE_EVERY = 16  # finished sequences between saves of what was learned (learned.py; ~1 ms to snapshot)


class LearnedStore(Protocol):
    """Where what the speculator learned outlives the process (archive_store.ArchiveStore)."""

    def load_state(self) -> bytes | None: ...

    def save_state(self, encode: Callable[[], bytes]) -> None: ...


def class_keys(prompt_ids: list[int], namespace: bytes = b"") -> list[int]:
    """Keys of the prompt's prefixes of 16, 32, ... tokens (the whole prompt when shorter than 16):
    CRC32 chained block by block from the cache namespace's, with the depth in the high bits;
    stable across processes. Another namespace's record of the same prompt is another key: how
    fast a request starts drafting must not tell whether someone else sent its prompt."""
    keys, crc = [], zlib.crc32(namespace) if namespace else 0
    blocks = min(CLASS_DEPTHS, max(1, len(prompt_ids) // CLASS_BLOCK))
    for depth in range(1, blocks + 1):
        block = prompt_ids[(depth - 1) * CLASS_BLOCK:depth * CLASS_BLOCK]
        crc = zlib.crc32(struct.pack(f"<{len(block)}i", *block), crc)
        keys.append(depth << 32 | crc)
    return keys


def _decayed(record: tuple[float, float, int], accepted: int, rejected: float,
             decay: float) -> tuple[float, float, int]:
    """A (decayed accepted, decayed rejections, drafts) record after one more verified draft."""
    a, r, n = record
    return decay * a + accepted, decay * r + rejected, n + 1


def agreement_bucket(agree: int) -> int:
    """Index of the AGREEMENT_BUCKETS range holding an agreement of `agree` tokens."""
    return max(0, bisect.bisect_right(AGREEMENT_BUCKETS, agree) - 1)


def draft_length(p: float, break_even: float, most: int) -> int:
    """Tokens worth drafting at per-token acceptance p: the j with p^j > break_even."""
    if p <= break_even:
        return 0
    if p >= 1.0 or break_even <= 0.0:
        return most
    return max(1, min(most, int(math.log(break_even) / math.log(p))))


class StepCost:
    """seconds ≈ base + per_row * rows, fitted by exponentially forgetting least squares."""

    def __init__(self, forget: float = 0.995):
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

    def export(self) -> tuple[float, float, float, float, float]:
        return self._n, self._x, self._y, self._xx, self._xy

    def restore(self, sums: tuple[float, float, float, float, float]) -> None:
        self._n, self._x, self._y, self._xx, self._xy = sums

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
    klass: list[int]  # its class keys, shortest prefix first
    namespace: bytes = b""  # its cache namespace: what it drafts from and learns into
    accepted_w: float = PRIOR[0]  # decayed accepted tokens ...
    rejected_w: float = PRIOR[1]  # ... and rejections: p = accepted_w / (accepted_w + rejected_w)
    off_until: int = -1  # step number before which it does not draft
    backoff: int = FIRST_BACKOFF
    drafted: int = 0
    accepted: int = 0
    since_start: int = 0  # tokens drafted since it started or was last retried
    agreement: int = -1  # the agreement bucket of its pending prompt-lookup draft; -1: none

    @property
    def p(self) -> float:
        return self.accepted_w / (self.accepted_w + self.rejected_w)


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
    prompt only; adaptive: False keeps every draft length at max_draft and never switches off;
    memory: where class records, gate rates and the cost fit are resumed from at start and saved
    every SAVE_EVERY finished sequences (and by save()), so a restart starts as warm as it stopped."""
    max_draft: int = 8
    archive: NgramArchive | None = None
    adaptive: bool = True
    memory: LearnedStore | None = None
    cost: StepCost = field(default_factory=StepCost)
    counters: SpecCounters = field(default_factory=SpecCounters)

    def __post_init__(self) -> None:
        if self.max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {self.max_draft}")
        self._seqs: dict[str, SequenceDrafts] = {}
        self._classes: dict[int, tuple[float, float, int]] = {}  # class key -> (accepted_w, rejected_w, drafts)
        # Per cache namespace (b"": the shared one), per agreement bucket: (accepted_w, rejected_w, drafts).
        self._agreements: OrderedDict[bytes, list[tuple[float, float, int]]] = OrderedDict()
        self._step = 0
        self._sequences_per_step = 1
        # Step-level check of the per-sequence rule (adaptive only): drafting must measure faster.
        self.gate = DraftGate() if self.adaptive else None
        self._step_allowed = True
        self._finished = 0  # sequences ended, for SAVE_EVERY
        if self.memory is not None:
            self._resume()

    def before_step(self, decoding: int) -> None:
        """The next step decodes about this many sequences: may they draft in it?"""
        self._step_allowed = self.gate is None or self.gate.allow(decoding)

    # ---- a sequence's life ------------------------------------------------------------------------

    def begin(self, seq_id: str, prompt_ids: list[int], namespace: bytes = b"") -> None:
        """A sequence that may draft (requests that opted out, or constrained ones, are never
        begun: they neither draft nor teach). namespace: its cache namespace; its drafts, class
        records and agreement records are that namespace's alone."""
        keys = class_keys(prompt_ids, namespace)
        state = SequenceDrafts(PromptLookup(), keys, namespace)
        record = next((r for r in map(self._classes.get, reversed(keys)) if r is not None and r[2] >= CLASS_EVIDENCE),
                      None)
        if record is not None:  # its longest known class's record, as much weight as the prior
            total = sum(PRIOR)
            state.accepted_w, state.rejected_w = (total * w / (record[0] + record[1]) for w in record[:2])
            break_even = self._break_even()
            if self.adaptive and state.p <= break_even:
                state.off_until = self._step + FIRST_BACKOFF
                log.info("request %s: starts without speculation: its class's acceptance %.0f%% is at or below "
                         "break-even %.0f%%", seq_id, 100 * state.p, 100 * break_even)
        self._seqs[seq_id] = state

    def end(self, seq_id: str, tokens: list[int] | None = None, num_prompt: int = 0) -> None:
        """The sequence finished (tokens: all of them, the first num_prompt its prompt) or was
        aborted (None). The archive learns the completion with the context it started from, in
        its namespace: a prompt is drafted from by its own request's prompt lookup, and counting
        every prompt would cost a store lookup per prompt token on the step loop. A sequence
        never begun (`"speculative": false`, constrained, warm) teaches nothing."""
        state = self._seqs.pop(seq_id, None)
        if state is not None and state.drafted:
            log.debug("request %s: %d of %d drafted tokens accepted", seq_id, state.accepted, state.drafted)
        if state is not None and tokens is not None and self.archive is not None:
            self.archive.learn(tokens[max(0, num_prompt - self.archive.order):], state.namespace)
        self._finished += 1
        if self._finished % SAVE_EVERY == 0:
            self.save()

    # ---- each step --------------------------------------------------------------------------------

    def propose(self, seq_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to min(limit, its draft length) tokens to verify after `tokens`; [] for none."""
        state = self._seqs.get(seq_id)
        if state is None or limit <= 0 or self._step < state.off_until or not self._step_allowed:
            return []
        break_even = self._break_even()
        k = draft_length(state.p, break_even, self.max_draft) if self.adaptive else self.max_draft
        state.agreement = -1
        found = state.lookup.find(tokens)
        if found is not None:
            at, agree = found
            bucket = agreement_bucket(agree)
            a, r, n = self._agreement(state.namespace)[bucket]
            if self.adaptive and n >= AGREEMENT_EVIDENCE:  # what such drafts earned decides; no probe
                copy_k = min(limit, draft_length(a / (a + r), break_even, self.max_draft))
            else:
                copy_k = min(limit, self._probe(state, k))
            if copy_k > 0:
                state.agreement = bucket
                self.counters.spec_from_prompt += 1
                return state.lookup.read(tokens, at, copy_k)
        k = min(limit, self._probe(state, k))
        if k <= 0 or self.archive is None:
            return []
        draft = self.archive.propose(tokens, k, state.namespace)
        if draft:
            self.counters.spec_from_archive += 1
        return draft

    def _probe(self, state: SequenceDrafts, k: int) -> int:
        """k, or a one-token probe while the sequence's own record is still mostly the prior."""
        return 1 if k == 0 and self.adaptive and state.since_start < PROBE_TOKENS else k

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
        state.since_start += drafted
        rejected = 1.0 if accepted < drafted else 0.0
        if state.agreement >= 0:
            records = self._agreement(state.namespace)
            records[state.agreement] = _decayed(records[state.agreement], accepted, rejected, AGREEMENT_DECAY)
        state.accepted_w = DECAY * state.accepted_w + accepted
        state.rejected_w = DECAY * state.rejected_w + rejected
        for key in state.klass:  # popped and re-inserted: the dict's order is least recent first
            self._classes[key] = _decayed(self._classes.pop(key, (*PRIOR, 0)), accepted, rejected, DECAY)
        while len(self._classes) > MAX_CLASSES:
            del self._classes[next(iter(self._classes))]
        if not self.adaptive:
            return
        break_even = self._break_even()
        if rejected and state.p <= break_even:  # a fully confirmed draft never switches it off
            state.off_until = self._step + state.backoff
            log.info("request %s: speculation off for %d steps: acceptance %.0f%% (%d of %d drafted tokens) is at "
                     "or below break-even %.0f%%", seq_id, state.backoff, 100 * state.p, state.accepted,
                     state.drafted, 100 * break_even)
            state.backoff = min(MAX_BACKOFF, 2 * state.backoff)
            state.accepted_w, state.rejected_w = RETRY
            state.since_start = 0
            c.spec_switched_off += 1
        elif accepted == drafted:
            state.backoff = FIRST_BACKOFF

    def observe_step(self, rows: int, sequences: int, seconds: float, emitted: int = 0, drafted: bool = False,
                     prompt_rows: int = 0) -> None:
        """Every engine step: its rows, decoding sequences and time. Prompt chunks' steps stay in
        the fit: decode steps alone vary by a few rows, and on a loaded host (bench, load average
        12) their slope came out anywhere from 0 to 12 ms per row; a 512-row step pins it."""
        self._step += 1
        self.cost.observe(rows, seconds)
        if self.gate is not None and prompt_rows == 0:
            self.gate.observe(sequences, drafted, emitted, seconds)
        if sequences > 0:
            self._sequences_per_step = sequences

    def _agreement(self, namespace: bytes) -> list[tuple[float, float, int]]:
        """A namespace's agreement records (made at the prior), most recently used kept."""
        records = self._agreements.get(namespace)
        if records is None:
            records = self._agreements[namespace] = list(_PRIOR_AGREEMENT)
            while len(self._agreements) > MAX_NAMESPACES:
                self._agreements.popitem(last=False)
        self._agreements.move_to_end(namespace)
        return records

    def _break_even(self) -> float:
        """The acceptance a drafted token needs, with MARGIN (at most 1: only certain drafts)."""
        return min(1.0, MARGIN * self.cost.break_even(self._sequences_per_step))

    # ---- across restarts --------------------------------------------------------------------------

    def learned(self) -> LearnedState:
        """A copy of what should outlive this process."""
        classes = [(key, a, r, n) for key, (a, r, n) in self._classes.items()]
        # The shared namespace's agreement records outlive the process; a tenant's start again from the prior.
        return LearnedState(classes, self.gate.export() if self.gate is not None else [], self.cost.export(),
                            list(self._agreements.get(b"", _PRIOR_AGREEMENT)))

    def restore(self, state: LearnedState) -> None:
        """Start from what an earlier process learned (before any sequence begins)."""
        for key, a, r, n in state.classes[-MAX_CLASSES:]:
            self._classes[key] = (a, r, n)
        if self.gate is not None:
            self.gate.restore(state.gate)
        self.cost.restore(state.cost)
        if len(state.agreement) == len(AGREEMENT_BUCKETS):
            self._agreements[b""] = list(state.agreement)

    def save(self) -> None:
        """Hand a snapshot to the memory; it encodes and writes it behind the step loop."""
        if self.memory is not None:
            snapshot = self.learned()
            self.memory.save_state(lambda: learned.encode(snapshot))

    def _resume(self) -> None:
        blob = self.memory.load_state()
        if blob is None:
            return
        state = learned.decode(blob)
        if state is None:
            log.warning("speculation: the saved state (%d bytes) is damaged or of another version; starting fresh",
                        len(blob))
            return
        self.restore(state)
        gate = self.gate.snapshot() if self.gate is not None else {}
        fit = self.cost.fit()
        log.info("speculation resumes: %d request classes, gate %s, step cost %s", len(self._classes),
                 ", ".join(f"{k[5:]} {v}" for k, v in gate.items()) or "none",
                 f"{1e3 * fit[0]:.1f} ms + {1e3 * fit[1]:.2f} ms/row" if fit else "not fitted")

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
            "break_even": self.cost.break_even(self._sequences_per_step),
            "required_acceptance": self._break_even(),
            "step_base_s": fit[0] if fit else None,
            "step_per_row_s": fit[1] if fit else None,
            "sequences": len(self._seqs),
            "archive_contexts": len(self.archive) if self.archive is not None else 0,
            "agreement_acceptance": {low: round(a / (a + r), 3)
                                     for low, (a, r, n) in zip(AGREEMENT_BUCKETS,
                                                               self._agreements.get(b"", _PRIOR_AGREEMENT))
                                     if n >= AGREEMENT_EVIDENCE},
            **(self.gate.snapshot() if self.gate is not None else {}),
        }
