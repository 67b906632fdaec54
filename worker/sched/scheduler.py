"""Continuous batching: which sequences feed which tokens to the next engine step.

One token budget per step, no separate prefill and decode phases. A sequence's next chunk is
always [num_computed_tokens, num_computed_tokens + n) with
    n = min(tokens not yet computed, prefill_chunk, budget left),
so decoding is just the case "one token not yet computed" (the one sampled last step).

Each `schedule(now)`:
1. Running sequences, oldest first, get their next chunk while budget and max_batch_size allow.
   When the block pool cannot hold a chunk, the NEWEST running sequence is preempted (recompute):
   its blocks are freed, num_computed_tokens goes back to 0 (generated tokens stay and are
   recomputed like prompt), and it returns to the FRONT of the waiting queue. If the newest is
   the sequence asking, it preempts itself.
2. If nothing was preempted this step (blocks are short: admitting would only thrash), waiting
   sequences are admitted in FCFS order while budget, max_batch_size and blocks allow. The head of
   the queue is never skipped: if it does not fit, admission stops.
Sequences added between steps are admitted at the next step at the earliest.

Ordering invariant: every running sequence was added before every waiting one. Admission appends
the oldest waiting sequence; preemption moves the newest running one to the front of the queue.
So the oldest unfinished sequence is never preempted by another and gets >= 1 token each step
(each step outside the time-bounded decode-only stretches below): no starvation.

No deadlock: `add()` rejects a sequence whose prompt + max_tokens needs more blocks than the whole
pool, so a sequence running alone always fits (waiting sequences hold no blocks).

Batching window: when nothing is running and fewer than max_batch_size sequences wait, admission
is held until the oldest waiting sequence's arrival_time + batching_window_ms / 1000; the empty
batch then carries `hold_until`, the time to call `schedule()` again. Arrivals inside the window
are admitted together in one step, so one weight read serves all of them. While anything runs
there is no hold: arrivals join the next step, which pays for the weight read anyway.

Decode share (knob decode_share, s): running sequences decode one token per step, and in a step
that also feeds a prompt chunk they wait for the whole chunk. A step that fed prompt rows and took
T seconds (schedule() to update()) is followed by decode-only steps until T*s seconds have passed:
no prompt chunk, no admission, only the sequences with one token to feed. Prompts then still get at
least 1/(1+s) of the time while anything decodes, and short answers behind long prompts finish in
one such stretch instead of one token per chunk (16 tokens behind 4.5 s chunks: 72 s).

Prefix cache (optional, worker.kv.prefix_cache): a sequence being admitted first takes the blocks of
its longest cached prefix (counted as computed), so only the rest is fed; if the remainder does not
fit, the blocks are given back and admission stops as above. After each step, every newly full
block is registered under its chain hash. The scheduler itself stays free of I/O: the prefix
cache may restore blocks from disk, and it is injected (tests run without it or with RAM only).

Speculation (optional, a `drafter`): a decoding sequence (one token not yet computed) may also
feed draft tokens after it, a chunk of 1 + k tokens whose every row returns logits. Drafts take
budget only after one token is set aside for each running sequence behind it, and never take
blocks that would preempt anyone; a step that admits a sequence or feeds a prompt carries none
(_prompts_pending). update() then takes the tokens the generator emitted: the
first len - 1 of them are the accepted draft tokens, whose K/V stay; the rejected rows' K/V
are dropped (num_computed_tokens set back, the blocks past it freed), and only accepted tokens
are named in the prefix cache.

The step protocol: schedule(now) -> the engine runs the batch -> update(batch, sampled). A
non-empty batch must be updated before the next schedule(). If the engine fails, abort the
batch's sequences and call update(batch, {}).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import Callable

import numpy as np

from shared.errors import ContextLengthError, InvalidRequestError
from worker.kv.block_manager import BlockManager
from worker.kv.prefix_cache import PrefixCache
from worker.kv.sequence import Sequence, SequenceStatus
from worker.sched.tuning_state import SchedulerKnobs, TuningState


@dataclass(frozen=True, eq=False)
class ScheduledChunk:
    seq: Sequence
    start: int  # position of the first token fed; == seq.num_computed_tokens at schedule time
    num_tokens: int
    samples: bool  # the chunk ends at the last known token: the engine returns logits, we sample
    draft: tuple[int, ...] = ()  # drafted tokens fed after the known ones (num_tokens counts them)

    @property
    def token_ids(self) -> list[int]:
        known = self.num_tokens - len(self.draft)
        return self.seq.token_ids[self.start:self.start + known] + list(self.draft)


@dataclass(frozen=True, eq=False)
class ScheduledBatch:
    chunks: tuple[ScheduledChunk, ...]
    knobs: SchedulerKnobs  # in force for this whole step (the engine reads attention_chunk here)
    preempted: tuple[Sequence, ...] = ()  # newest first, in the order they were preempted
    hold_until: float | None = None  # set when admission waits for the batching window

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def __len__(self) -> int:
        return len(self.chunks)


Drafter = Callable[[Sequence, int], Tokens[int]]  # (sequence, most tokens) -> draft tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, tuning: TuningState | None = None,
                 prefix: PrefixCache | None = None, drafter: Drafter | None = None):
        self.block_manager = block_manager
        self.drafter = drafter
        self.tuning = tuning if tuning is not None else TuningState()
        self.prefix = prefix
        self._waiting: deque[Sequence] = deque()  # oldest first
        self._running: list[Sequence] = []  # oldest first
        self._seqs: dict[str, Sequence] = {}  # every unfinished sequence, by id
        self._in_flight: ScheduledBatch | None = None
        self._in_flight_at = 0.0  # when the batch in flight was scheduled
        self._decode_until = 0.0  # decode-only steps until then (decode_share)

    # ---- observation ---------------------------------------------------------------------------

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Sequence, ...]:
        return tuple(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def get(self, seq_id: str) -> Sequence | None:
        return self._seqs.get(seq_id)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    # ---- add / abort ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a fresh sequence; raise InvalidRequestError (ContextLengthError if too long)."""
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"add() takes a fresh sequence, got {seq!r}")
        if seq.seq_id in self._seqs:
            raise InvalidRequestError(f"request id {seq.seq_id!r} is already in use", param="id")
        if seq.num_tokens == 0:
            raise InvalidRequestError("the prompt has no tokens", param="prompt")
        max_tokens = seq.params.max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens!r}", param="max_tokens")
        manager = self.block_manager
        if manager.blocks_needed(seq.max_num_tokens) > manager.num_blocks:
            raise ContextLengthError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the KV "
                f"cache ({manager.num_blocks * manager.block_size} tokens)", param="max_tokens")
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)

    def abort(self, seq_id: str) -> Sequence | None:
        """Finish seq_id as FINISHED_ABORTED and free its blocks now; None if it is unknown/finished."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    # ---- schedule / update ---------------------------------------------------------------------

    def schedule(self, now: float) -> ScheduledBatch:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called before update() of the previous batch")
        knobs = self.tuning.current()  # read once: a knob change never lands mid-step
        budget = knobs.token_budget
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []

        decode_only = now < self._decode_until and any(s.num_uncomputed_tokens == 1 for s in self._running)
        # Decode-only steps hold prompts back on purpose: drafts there delay no prompt.
        drafting = self.drafter is not None and (decode_only or not self._prompts_pending(knobs))
        i = 0
        while i < len(self._running) and budget > 0 and len(chunks) < knobs.max_batch_size:
            seq = self._running[i]
            if decode_only and seq.num_uncomputed_tokens > 1:
                i += 1
                continue
            num_tokens = min(seq.num_uncomputed_tokens, knobs.prefill_chunk, budget)
            if not self._make_room(seq, num_tokens, preempted):
                break  # seq preempted itself; it was the last running sequence
            behind = min(len(self._running) - i - 1, knobs.max_batch_size - len(chunks) - 1)
            draft = self._draft(seq, num_tokens, budget - num_tokens - behind) if drafting else ()
            chunks.append(self._take(seq, num_tokens, draft))
            budget -= num_tokens + len(draft)
            i += 1

        hold_until = None
        if not preempted and not decode_only:
            hold_until = self._hold_until(knobs, now)
            if hold_until is None:
                self._admit(knobs, budget, chunks)

        batch = ScheduledBatch(tuple(chunks), knobs, tuple(preempted), hold_until)
        if chunks:
            self._in_flight, self._in_flight_at = batch, now
        return batch

    def update(self, batch: ScheduledBatch, sampled: dict[str, int | Tokens[int]],
               completed: frozenset[str] | set[str] = frozenset(),
               deferred: frozenset[str] | set[str] = frozenset(), now: float | None = None) -> list[Sequence]:
        """Advance the batch's sequences by what the engine computed; return those that finished.

        sampled maps seq_id -> token (or, for a drafted chunk, the tokens emitted: the accepted
        draft tokens, then the one sampled after them) for every chunk with samples=True (aborted
        sequences may be missing). A sampled stop token is appended, then the sequence is
        FINISHED_STOPPED; so is a sequence in `completed` (its grammar admits no further token).
        `deferred`: sampling chunks (never drafted) that sample nothing this step (their grammar
        mask was late): all but their last token count as computed, and the last is fed again next
        step (its K/V row is rewritten with the same values).
        `now`: when the step ended (the clock schedule() was given); without it no decode-only
        steps follow (decode_share).
        """
        if batch.is_empty:
            return []
        if batch is not self._in_flight:
            raise RuntimeError("update() takes the batch returned by the last schedule()")
        live = [chunk for chunk in batch.chunks if chunk.seq.status is SequenceStatus.RUNNING]
        missing = [c.seq.seq_id for c in live if c.samples and c.seq.seq_id not in sampled
                   and c.seq.seq_id not in deferred]
        if missing:  # checked before changing anything, so the caller can retry
            raise ValueError(f"no sampled token for {missing}")
        emitted = {c.seq.seq_id: _emitted(c, sampled[c.seq.seq_id]) for c in live
                   if c.samples and c.seq.seq_id not in deferred}
        self._in_flight = None
        fed_prompt = any(c.num_tokens - len(c.draft) > 1 for c in live)
        if now is not None and fed_prompt and batch.knobs.decode_share > 0:
            self._decode_until = now + batch.knobs.decode_share * max(0.0, now - self._in_flight_at)

        finished = []
        for chunk in live:
            seq = chunk.seq
            if chunk.samples and seq.seq_id in deferred:
                seq.num_computed_tokens += chunk.num_tokens - 1
                if self.prefix is not None:
                    self.prefix.commit(seq)
                self.block_manager.slide(seq)
                continue
            tokens = emitted.get(seq.seq_id, [])
            accepted = len(tokens) - 1 if chunk.draft else 0
            seq.num_computed_tokens += chunk.num_tokens - len(chunk.draft) + accepted
            for token in tokens[:-1]:  # accepted draft tokens: named by commit() below
                seq.append_token(token)
            if self.prefix is not None:
                self.prefix.commit(seq)  # reads the new blocks' window slots: before slide()
            self.block_manager.slide(seq)
            if chunk.draft:
                self.block_manager.truncate(seq, seq.num_computed_tokens)  # the rejected rows' blocks
            if not chunk.samples:
                continue
            token = tokens[-1]
            seq.append_token(token)
            if token in seq.params.stop_token_ids or seq.seq_id in completed:
                self._finish(seq, SequenceStatus.FINISHED_STOPPED)
            elif seq.num_output_tokens >= seq.params.max_tokens:
                self._finish(seq, SequenceStatus.FINISHED_LENGTH)
            else:
                continue
            finished.append(seq)
        return finished

    # ---- steps of schedule() -------------------------------------------------------------------

    def _make_room(self, seq: Sequence, num_tokens: int, preempted: list[Sequence]) -> bool:
        """Preempt newest-first until seq's chunk fits; False if seq itself had to go."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = self._running[-1]
            if victim is seq and len(self._running) == 1:
                # add() guarantees a lone sequence fits in the whole pool, so this is a bug.
                raise RuntimeError(f"{seq!r} does not fit in an otherwise empty block pool")
            self._running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _hold_until(self, knobs: SchedulerKnobs, now: float) -> float | None:
        if self._running or not self._waiting or len(self._waiting) >= knobs.max_batch_size:
            return None
        deadline = self._waiting[0].arrival_time + knobs.batching_window_ms / 1000.0
        return deadline if now < deadline else None

    def _admit(self, knobs: SchedulerKnobs, budget: int, chunks: list[ScheduledChunk]) -> None:
        # len(chunks) <= len(running) always, so capping running also caps the batch.
        while self._waiting and budget > 0 and len(self._running) < knobs.max_batch_size:
            seq = self._waiting[0]
            if self.prefix is not None:
                self.prefix.attach(seq)
            num_tokens = min(seq.num_uncomputed_tokens, knobs.prefill_chunk, budget)
            if not self.block_manager.can_allocate(seq, num_tokens):
                if self.prefix is not None:
                    self._release(seq)  # its cached blocks stay cached; it attaches again next time
                break  # FCFS: a newer sequence never passes the head of the queue
            if self.prefix is not None:
                self.prefix.admitted(seq)
            self._waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            chunks.append(self._take(seq, num_tokens))
            budget -= num_tokens

    def _prompts_pending(self, knobs: SchedulerKnobs) -> bool:
        """The next step admits a sequence or feeds part of a prompt: then it carries no drafts.
        A newcomer waits for the step in progress and then for its first step, and drafted rows
        make steps several times longer (greedy agentic traffic, 2 threads, AVX2 Zen 1: TTFT p95
        657-849 ms drafting in such steps, 479-556 ms without; off: 237-278 ms). When more wait
        than the batch has room for, some wait on whatever this step does, and the drafts that
        finish running sequences sooner also let them in sooner: drafting goes on."""
        room = knobs.max_batch_size - len(self._running)
        admits_all = 0 < len(self._waiting) <= room
        return admits_all or any(seq.num_uncomputed_tokens > 1 for seq in self._running)

    def _draft(self, seq: Sequence, num_tokens: int, room: int) -> tuple[int, ...]:
        """Draft tokens to feed after a decoding sequence's token: within `room` budget tokens,
        the tokens max_tokens still allows after the one sampled anyway, and free blocks."""
        if self.drafter is None or num_tokens != 1 or seq.num_uncomputed_tokens != 1:
            return ()
        limit = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        if limit <= 0:
            return ()
        draft = tuple(int(t) for t in self.drafter(seq, limit))[:limit]
        while draft and not self.block_manager.can_allocate(seq, 1 + len(draft)):
            draft = draft[:-1]  # drafts never preempt anyone
        return draft

    def _take(self, seq: Sequence, num_tokens: int, draft: tuple[int, ...] = ()) -> ScheduledChunk:
        self.block_manager.allocate(seq, num_tokens + len(draft))
        start = seq.num_computed_tokens
        return ScheduledChunk(seq, start, num_tokens + len(draft), samples=start + num_tokens == seq.num_tokens,
                              draft=draft)

    def _release(self, seq: Sequence) -> None:
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_named_blocks = 0

    def _free_blocks(self, seq: Sequence) -> None:
        if self.prefix is not None:
            self.prefix.release(seq)  # keeps what a later request can start from
        else:
            self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._waiting.appendleft(seq)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        self._free_blocks(seq)
        seq.status = status
        del self._seqs[seq.seq_id]


def _emitted(chunk: ScheduledChunk, sampled: int | Tokens[int]) -> list[int]:
    """A chunk's emitted tokens as a list, checked: a drafted chunk emits its accepted draft
    tokens (none of them a stop token, within max_tokens) and then one sampled token."""
    tokens = [int(sampled)] if isinstance(sampled, (int, np.integer)) else [int(t) for t in sampled]
    seq = chunk.seq
    if not 1 <= len(tokens) <= 1 + len(chunk.draft) or list(chunk.draft[:len(tokens) - 1]) != tokens[:-1]:
        raise ValueError(f"{seq.seq_id}: emitted {tokens} do not follow the draft {list(chunk.draft)}")
    if any(t in seq.params.stop_token_ids for t in tokens[:-1]):
        raise ValueError(f"{seq.seq_id}: emitted tokens go on past a stop token: {tokens}")
    if seq.num_output_tokens + len(tokens) > seq.params.max_tokens:
        raise ValueError(f"{seq.seq_id}: {len(tokens)} emitted tokens exceed max_tokens")
    return tokens
