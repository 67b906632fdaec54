"""Many requests on one engine: the scheduler picks each step's chunks, the engine computes them,
each sequence samples with its own sampler, and what happened comes back as events.

The worker's serve loop (service.py) only moves messages; everything about batching is here.
One `step()` = one engine call: running sequences decode, waiting ones prefill in chunks, and
requests added since the last step join this one.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from shared.errors import InvalidRequestError, ReameError
from shared.sampling import SamplingParams, validate_params
from worker.engine.batch import StepChunk
from worker.engine.paged_kv import PagedKVCache
from worker.kv.block_manager import BlockManager
from worker.kv.prefix_cache import PrefixCache
from worker.kv.sequence import Sequence
from worker.sched.constraint import Constraints, GrammarConstraint
from worker.engine.tuning.kernel_tuner import FixedKernels, KernelTuner
from worker.sched.sampler import Sampler
from worker.sched.scheduler import ScheduledBatch, ScheduledChunk, Scheduler
from worker.sched.tuning_state import TuningState
from worker.speculative.speculator import Speculator

log = logging.getLogger("reame.generation")

WARM_TIMEOUT_S = 30.0  # a warm request's finish waits this long at most for the store's commit
WARM_POLL_S = 0.005  # how often an otherwise idle loop checks the store for them
LONE_MASK_WAIT_S = 0.05  # the longest a step of late grammar masks alone waits for one (_late_masks)


class BatchEngine(Protocol):
    """What the generator needs of worker.engine.Engine."""
    vocab_size: int
    kv: PagedKVCache

    def validate(self, prompt_ids, max_tokens: int) -> None: ...

    def execute(self, chunks: list[StepChunk], attention_chunk: int | None = None) -> list[np.ndarray | None]: ...


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    top_logits: list[tuple[int, float]] = field(default_factory=list)  # raw logits, best first (add(top_logits=k))


@dataclass(frozen=True)
class FinishEvent:
    request_id: str
    reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (RAM or store)
    prefix_tokens: int = 0  # prompt tokens whose K/V the prefix cache now holds (full blocks)


@dataclass(frozen=True)
class ErrorEvent:
    request_id: str
    error: ReameError


Event = TokenEvent | FinishEvent | ErrorEvent


@dataclass
class StepStats:
    """The last step, for logs and the tuning coordinator."""
    sequences: int = 0
    tokens: int = 0
    decode_rows: int = 0
    seconds: float = 0.0


class BatchGenerator:
    """The one generation loop: the worker's service, the CLI, benchmarks and tests all step it.

    blocks: who owns which block of the engine's KV pool (a fresh BlockManager when None; the
    prefix cache's own when one is given, so the two agree on every block).
    constraints: builds and steps the grammars of requests with `params.grammar`; without it such
    requests are refused.
    speculator: drafts tokens for decoding sequences (worker.speculative); None: no speculation.
    kernel_tuner: picks the op table and threads of each step (the worker's, from
    kernel_table_store.build_kernel_tuner); None: the engine's as loaded, never changed.

    Verification: a drafted chunk's rows each return logits (the engine gets one 1-token chunk
    per row: rows are independent, so the logits are exactly those of decoding the same tokens
    one step at a time). Row i is sampled with the request's own sampler, in order, and the draft
    is accepted while draft[i] equals the token sampled there: greedy output is unchanged token
    for token, and sampled output keeps its distribution (with a seed, even its tokens: every
    emitted token takes one draw, as without speculation). Each token is its own TokenEvent;
    emission stops at a stop token or max_tokens as it would one step at a time.
    """

    def __init__(self, engine: BatchEngine, tuning: TuningState | None = None,
                 clock: Callable[[], float] = time.monotonic, prefix: PrefixCache | None = None,
                 blocks: BlockManager | None = None, constraints: Constraints | None = None,
                 speculator: Speculator | None = None, kernel_tuner: KernelTuner | FixedKernels | None = None):
        self.engine = engine
        self.prefix = prefix
        if blocks is None:
            blocks = prefix.block_manager if prefix is not None else BlockManager.for_pool(engine.kv)
        if prefix is not None and prefix.block_manager is not blocks:
            raise ValueError("the prefix cache must name blocks of the generator's own block manager")
        self.blocks = blocks
        self.speculator = speculator
        drafter = None if speculator is None else (lambda seq, limit: speculator.propose(seq.seq_id, seq.token_ids, limit))
        self.scheduler = Scheduler(blocks, tuning, prefix, drafter)
        self.clock = clock
        self._samplers: dict[str, Sampler] = {}
        self.constraints = constraints
        self._grammars: dict[str, GrammarConstraint] = {}  # requests whose tokens follow a grammar
        self._top_logits: dict[str, int] = {}  # requests that want raw logits reported (golden tests, CLI)
        self._warm: set[str] = set()  # requests that only fill the prefix caches
        # Finished warm requests whose blocks the store has not committed yet: (ticket, deadline,
        # finished at, event). Their finish is held back, never the step loop (it once flushed the
        # store inside a step, up to 30 s).
        self._warming: list[tuple[int, float, float, FinishEvent]] = []
        self.hold_until: float | None = None  # when to step again though nothing is ready to run
        self.preemptions = 0  # sequences sent back to recompute because KV blocks ran out
        self.last_step = StepStats()
        self.kernel_tuner = kernel_tuner if kernel_tuner is not None else FixedKernels()

    # ---- requests ------------------------------------------------------------------------------

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, warm: bool = False,
            top_logits: int = 0, cache_namespace: bytes = b"", speculative: bool = True) -> None:
        """Queue a request; ReameError (nothing queued) when it cannot be served.

        warm: the request is there to fill the prefix caches; its finish waits until the store
        has committed its blocks, so the caller may rely on them being there.
        top_logits > 0: each TokenEvent also carries the raw logits of the best candidates.
        cache_namespace: the prefix blocks it may reuse and leave for reuse (shared.hashing).
        speculative: False never drafts for this request (a warm request never does)."""
        validate_params(params, self.engine.vocab_size)
        self.engine.validate(prompt_ids, params.max_tokens)
        grammar = self._compile(params) if params.grammar and not warm else None
        seq = Sequence(request_id, [int(t) for t in prompt_ids], params, self.clock(), cache_namespace)
        self.scheduler.add(seq)
        sampler = Sampler(params, self.engine.vocab_size)
        sampler.observe_prompt(seq.prompt_token_ids)
        self._samplers[request_id] = sampler
        if grammar is not None:
            self._grammars[request_id] = grammar
        if warm:
            self._warm.add(request_id)
        if top_logits > 0:
            self._top_logits[request_id] = top_logits
        # A constrained request does not draft (nor teach the archive: it is never begun): a draft would have
        # to be checked against its grammar row by row; its tokens are rarely drafts of anything anyway.
        if self.speculator is not None and speculative and not warm and grammar is None:
            self.speculator.begin(request_id, seq.token_ids, cache_namespace)

    def abort(self, request_id: str) -> FinishEvent | None:
        """Stop a request now and free its blocks; None when it is unknown or already finished."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        if self.speculator is not None:
            self.speculator.end(request_id)
        self._forget(request_id)
        return self._finish_event(seq)

    def abort_all(self) -> list[FinishEvent]:
        """Stop every request; warm ones waiting for the store finish now (their blocks are in RAM)."""
        ids = [s.seq_id for s in self.scheduler.running + self.scheduler.waiting]
        events = [event for rid in ids if (event := self.abort(rid)) is not None]
        events += [event for _, _, _, event in self._warming]
        self._warming = []
        return events

    # ---- observation ---------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._warming)

    def load(self) -> tuple[int, int]:
        """(running, waiting) sequences."""
        return self.scheduler.num_running, self.scheduler.num_waiting

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Run one engine step; return its events in order (tokens before finishes)."""
        step_started = time.perf_counter()
        warmed = self._warmed()
        if self.speculator is not None:
            self.speculator.before_step(self.scheduler.num_running)
        batch = self.scheduler.schedule(self.clock())
        self.preemptions += len(batch.preempted)
        for seq in batch.preempted:
            log.info("request %s: preempted (KV blocks ran out); it will be recomputed", seq.seq_id)
        self.hold_until = batch.hold_until
        if batch.is_empty:
            if self._warming and self.hold_until is None:
                self.hold_until = self.clock() + WARM_POLL_S
            return warmed
        chunks, spans = self._step_chunks(batch)
        # Grammar masks depend only on tokens already taken: computed while the engine runs.
        # A constrained request never drafts (add()), so it has one row here.
        constrained = [c.seq.seq_id for c in batch.chunks if c.samples and c.seq.seq_id in self._grammars]
        if constrained:
            self.constraints.request([self._grammars[r] for r in constrained])
        started = time.perf_counter()
        try:
            with self.kernel_tuner.step(batch.num_tokens):  # the op table and threads, swapped between steps
                logits = self.engine.execute(chunks, batch.knobs.attention_chunk)
        except Exception as exc:  # an engine bug fails this step's requests, never the worker
            log.exception("engine step failed (%d sequences)", len(batch))
            return self._fail(batch, exc)  # a mask being computed is dropped with its request
        deferred, failed = self._late_masks(batch, constrained)
        decoding = sum(1 for c in batch.chunks if c.num_tokens - len(c.draft) == 1)
        self.last_step = StepStats(len(batch), batch.num_tokens, decoding, time.perf_counter() - started)
        if self.prefix is not None:
            prompt_tokens = sum(c.num_tokens for c in batch.chunks if c.num_tokens > 1 and not c.draft)
            self.prefix.observe_step(prompt_tokens, self.last_step.seconds)
        events: list[Event] = []
        sampled: dict[str, list[int]] = {}
        completed: set[str] = set()  # grammars that admit no further token
        for chunk, (lo, hi) in zip(batch.chunks, spans):
            if not chunk.samples:
                continue
            seq_id = chunk.seq.seq_id
            if seq_id in failed:
                self._stop(seq_id, failed[seq_id], events)
            elif seq_id in deferred:
                continue
            elif seq_id in self._grammars:
                token = self._sample_constrained(chunk, logits[lo], self._grammars[seq_id].mask, events, completed)
                if token is not None:
                    sampled[seq_id] = [token]
            else:
                sampled[seq_id] = self._sample(chunk, logits[lo:hi], events)
        for seq in self.scheduler.update(batch, sampled, completed, deferred, now=self.clock()):
            warm = seq.seq_id in self._warm
            if self.speculator is not None:
                self.speculator.end(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)
            self._forget(seq.seq_id)
            if warm and self.prefix is not None:
                now = self.clock()
                self._warming.append((self.prefix.store_ticket(), now + WARM_TIMEOUT_S, now, self._finish_event(seq)))
            else:
                events.append(self._finish_event(seq))
        if self.speculator is not None:
            # The whole step, not the engine alone: a draft also costs its proposal (before the
            # engine), every row's sampling (8 streams, 2 threads: ~0.3 ms a row beside ~3 ms of
            # engine) and the rollback of rejected rows (in update).
            prompt_rows = sum(c.num_tokens for c in batch.chunks if not c.draft and c.num_tokens > 1)
            self.speculator.observe_step(batch.num_tokens, decoding, time.perf_counter() - step_started,
                                         emitted=sum(len(t) for t in sampled.values()),
                                         drafted=any(c.draft for c in batch.chunks), prompt_rows=prompt_rows)
        return events + warmed

    def _compile(self, params: SamplingParams) -> GrammarConstraint:
        if self.constraints is None:
            raise InvalidRequestError("this worker cannot enforce grammars", param="response_format")
        # Its matcher is built on the mask thread with its first mask: a refused grammar ends the
        # request at its first step (ErrorEvent), as the gateway has checked it already.
        return self.constraints.compile(params.grammar, params.stop_token_ids)

    def _step_chunks(self, batch: ScheduledBatch) -> tuple[list[StepChunk], list[tuple[int, int]]]:
        """The engine's chunks for a batch, and each scheduled chunk's span of them: a drafted
        chunk becomes one 1-token chunk per row, each returning its logits."""
        window_table = self.blocks.window_table
        chunks: list[StepChunk] = []
        spans = []
        for c in batch.chunks:
            # Converted once: a drafted chunk's 1 + k rows share it (a 1,500-token prompt: 94 blocks).
            table = np.asarray(c.seq.block_table, np.int32)
            window = window_table(table)
            lo = len(chunks)
            if c.draft:
                chunks += [StepChunk.of([token], c.start + i, table, True, window) for i, token in enumerate(c.token_ids)]
            else:
                chunks.append(StepChunk.of(c.token_ids, c.start, table, c.samples, window))
            spans.append((lo, len(chunks)))
        return chunks, spans

    def _sample_constrained(self, chunk: ScheduledChunk, row: np.ndarray, mask, events: list[Event],
                            completed: set[str]) -> int | None:
        """Sample one row under its grammar's mask and advance the grammar; None when the grammar
        failed (the request ends with its error, the step goes on)."""
        seq = chunk.seq
        sampler = self._samplers[seq.seq_id]
        token = sampler.sample(row, mask)
        if token not in seq.params.stop_token_ids:
            try:
                if self._grammars[seq.seq_id].advance(token):
                    completed.add(seq.seq_id)
            except ReameError as exc:
                self._stop(seq.seq_id, exc, events)
                return None
        top_logits = _top_logits(row, self._top_logits.get(seq.seq_id, 0))
        if seq.params.logprobs > 0:
            logprob, top = sampler.logprobs(row, token, seq.params.logprobs)
            events.append(TokenEvent(seq.seq_id, token, logprob, top, top_logits))
        else:
            events.append(TokenEvent(seq.seq_id, token, top_logits=top_logits))
        return token

    def _late_masks(self, batch: ScheduledBatch, constrained: list[str]) -> tuple[set[str], dict[str, ReameError]]:
        """After the engine: the constrained rows whose masks are not ready (deferred: they sample
        next step, from the same row computed again), and the requests to stop with an error (over
        their mask-time budget, or their mask failed).

        A late row costs the others nothing: they sample now, and the late one feeds its last
        token again next step (one more row of the step) instead of holding every stream of the
        worker for its mask (bench/abuse.py grammar_stall). The step waits only when it holds nobody else (all
        its rows are late constrained rows and no request waits to be admitted), and then at most
        LONE_MASK_WAIT_S, until the first mask is done: computing the same rows again and again
        would only take the CPU the masks need, while arrivals still join within that time."""
        if not constrained:
            return set(), {}
        constraints = self.constraints
        rows = {r: self._grammars[r] for r in constrained}
        late = {r for r, row in rows.items() if not constraints.ready(row)}
        if late and len(late) == len(batch.chunks) and not self.scheduler.num_waiting:
            constraints.wait([rows[r] for r in late], first=True, limit=LONE_MASK_WAIT_S)
            late = {r for r in late if not constraints.ready(rows[r])}
        failed: dict[str, ReameError] = {}
        for r, row in rows.items():
            error = constraints.over_budget(row)
            if error is None and r not in late and row.pending.exception() is not None:
                exc = row.pending.exception()
                error = exc if isinstance(exc, ReameError) else InvalidRequestError(
                    f"the grammar's mask failed: {exc}", param="response_format", code="grammar_too_complex")
            if error is not None:
                failed[r] = error
        return late - failed.keys(), failed

    def _stop(self, request_id: str, error: ReameError, events: list[Event]) -> None:
        """End a request now with `error`; the step goes on."""
        log.warning("request %s: %s", request_id, error.message)
        self.scheduler.abort(request_id)
        self._forget(request_id)
        events.append(ErrorEvent(request_id, error))

    def _sample(self, chunk: ScheduledChunk, rows: list[np.ndarray], events: list[Event]) -> list[int]:
        """Sample a chunk's rows in order while they confirm its draft; one TokenEvent each."""
        seq = chunk.seq
        sampler = self._samplers[seq.seq_id]
        want_logits = self._top_logits.get(seq.seq_id, 0)
        params = seq.params
        room = params.max_tokens - seq.num_output_tokens
        tokens: list[int] = []
        for i, row in enumerate(rows):
            token = sampler.sample(row)
            tokens.append(token)
            top_logits = _top_logits(row, want_logits)
            if params.logprobs > 0:
                logprob, top = sampler.logprobs(row, token, params.logprobs)
                events.append(TokenEvent(seq.seq_id, token, logprob, top, top_logits))
            else:
                events.append(TokenEvent(seq.seq_id, token, top_logits=top_logits))
            if (i >= len(chunk.draft) or token != chunk.draft[i] or token in params.stop_token_ids
                    or len(tokens) >= room):
                break
        if chunk.draft and self.speculator is not None:
            accepted = sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(tokens, chunk.draft)))
            self.speculator.observe(seq.seq_id, len(chunk.draft), accepted)
        return tokens

    def _forget(self, request_id: str) -> None:
        self._samplers.pop(request_id, None)
        grammar = self._grammars.pop(request_id, None)
        if grammar is not None:
            grammar.drop()
        self._warm.discard(request_id)
        self._top_logits.pop(request_id, None)

    def _finish_event(self, seq: Sequence) -> FinishEvent:
        prefix_tokens = self.prefix.cached_prompt_tokens(seq) if self.prefix is not None else 0
        return FinishEvent(seq.seq_id, seq.status.value, seq.num_prompt_tokens, seq.num_output_tokens,
                           cached_tokens=seq.num_cached_tokens, prefix_tokens=prefix_tokens)

    def _warmed(self) -> list[Event]:
        """The finishes of warm requests whose blocks the store has now committed (or that waited
        WARM_TIMEOUT_S for it: the blocks are in RAM either way)."""
        if not self._warming:
            return []
        now = self.clock()
        done, waiting = [], []
        for entry in self._warming:
            ticket, deadline, finished_at, event = entry
            if self.prefix.store_reached(ticket):
                log.info("request %s: warmed %d prompt tokens; the store has them (%.3f s after the prefill)",
                         event.request_id, event.prefix_tokens, now - finished_at)
                done.append(event)
            elif now >= deadline:
                log.warning("request %s: the prefix store did not take the warmed blocks within %.0f s",
                            event.request_id, WARM_TIMEOUT_S)
                done.append(event)
            else:
                waiting.append(entry)
        self._warming = waiting
        return done

    def heartbeat_counters(self) -> dict[str, int]:
        """For heartbeats (read from another thread, so only sizes are read): the prefix cache's
        counters and the store's size, and how the KV pool's blocks (and bytes) are used now."""
        counters = self.prefix.snapshot() if self.prefix is not None else {}
        blocks = self.blocks
        used, slots = blocks.num_used_blocks, blocks.window.num_referenced if blocks.window else 0
        kv = self.engine.kv
        counters.update(kv_blocks=blocks.num_blocks, kv_blocks_used=used, kv_blocks_cached=blocks.num_cached_blocks,
                        kv_bytes=kv.nbytes, kv_bytes_used=kv.held_bytes(used, slots))
        if self.speculator is not None:
            counters.update(vars(self.speculator.counters))
        return counters

    def _fail(self, batch: ScheduledBatch, exc: Exception) -> list[Event]:
        error = exc if isinstance(exc, ReameError) else ReameError(
            f"generation failed: {type(exc).__name__}: {exc}")
        events: list[Event] = []
        for chunk in batch.chunks:
            if self.scheduler.abort(chunk.seq.seq_id) is not None:
                if self.speculator is not None:
                    self.speculator.end(chunk.seq.seq_id)
                self._forget(chunk.seq.seq_id)
                events.append(ErrorEvent(chunk.seq.seq_id, error))
        self.scheduler.update(batch, {})
        return events


def _top_logits(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k largest raw logits as (token, logit), best first, ties by lower id."""
    if k <= 0:
        return []
    k = min(k, logits.size)
    best = np.argpartition(logits, logits.size - k)[logits.size - k:]
    best = best[np.lexsort((best, -logits[best]))]
    return [(int(i), float(logits[i])) for i in best]
