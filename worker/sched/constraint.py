"""Grammar-constrained rows of a step: one llguidance matcher per constrained request, its masks
computed off the GIL on a helper thread (at the lowest CPU priority) while the engine runs, and a
mask-time budget per request (in CPU time).

A mask is llguidance's bitmask (one bit per token, int32 words, bit i of word i // 32 = token i
allowed); the sampler turns the zero bits into -inf logits (Sampler.sample(mask=...)). Free rows
of the same step have no mask and cost nothing here.

When the grammar is complete and admits no further byte, the request is finished ("stop") right
after the token that completed it; while it is complete but could go on (a JSON number), the
request's end-of-generation tokens are allowed too, so the model may end it there.

A mask may take long: with an ambiguous grammar llguidance's work per mask grows with the output,
and its fuel limits do not stop it (bench/abuse.py grammar_stall: 8 such rows took another
tenant's token gap from 12 to 351 ms, the step waiting for their masks). So a step never waits for a late mask while
it holds any other row (worker.sched.generation defers that row instead); the helper thread takes
the request with the least mask time so far first, so a cheap grammar is not queued behind a
costly one; and a request whose masks have taken more than MASK_BUDGET_S in all, or MASK_LIMIT_S
for one of them, is stopped with an error (code grammar_too_complex).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future

import llguidance
import numpy as np

from shared.errors import InvalidRequestError
from shared.grammar import parser_limits, token_table
from shared.thread_priority import lower_this_thread
from shared.vocab import end_of_generation_ids, read_vocab

log = logging.getLogger("reame.constraint")

# Mask time one request may use in all. Measured on SmolLM2's token table (bench/structured.py):
# a JSON-schema mask takes 0.05-0.2 ms, so 4,096 tokens of output take under a second. The
# ambiguous Lark grammar `s: s s | "a" | "b" | "ab"` (bench/abuse.py's grammar_stall), fed "a":
# 4 ms a mask at 100 tokens, 32 ms at 200, 81 ms at 300; 5 s in all after about 260 tokens.
MASK_BUDGET_S = 5.0
# One mask (or one token taken) may take this long: 500x a JSON schema's. Taking a token costs
# about a fifth of a mask with the ambiguous grammar (15 ms beside 65 ms at 200 tokens), and that
# runs on the step loop, so it counts too.
MASK_LIMIT_S = 0.1
# A mask that took longer than this is followed by a rest as long as it took, so costly grammars
# keep the mask thread busy half the time at most: a mask thread busy all the time takes time
# slices from the engine's threads, whose every barrier then waits. bench/abuse.py grammar_stall
# (two ambiguous rows running), the other tenant's gap in the attack phase, two runs each on a
# busy 2-core host: p99 67 and 60 ms with the rest, 71 and 77 ms without (p50 36, 30 / 32, 41),
# so within the noise there. JSON schema masks (0.05-0.2 ms) never rest.
REST_AFTER_S = 0.005


class GrammarConstraint:
    """One request's grammar state: what it may generate next, advanced token by token, and its
    next mask (computed on the helper thread: `pending` until it is done)."""

    def __init__(self, build: Callable[[], llguidance.LLMatcher], end_ids: tuple[int, ...], words: int):
        self._build: Callable[[], llguidance.LLMatcher] | None = build
        self._matcher: llguidance.LLMatcher | None = None
        self.end_ids = np.asarray(end_ids, np.int64)  # the request's stop tokens, allowed once complete
        self.mask = np.full(words, -1, np.int32)  # the next token's mask, once `pending` is done
        self.pending: Future | None = None  # the computation of `mask` for the current state
        self.mask_seconds = 0.0  # spent on this request's masks and taken tokens so far (finished ones)
        self.longest = 0.0  # the longest of them
        self.computing_since: float | None = None  # when the helper began the mask it computes now

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """Built on first use: on the helper thread, with the first mask (a 10,000-property schema
        takes ~1.6 s, which llguidance spends without the GIL, and the step loop must not wait for
        it). InvalidRequestError if llguidance refuses the grammar."""
        if self._matcher is None:
            matcher = self._build()
            if matcher.is_error():
                raise InvalidRequestError(f"the grammar cannot be enforced: {matcher.get_error()}",
                                          param="response_format")
            self._matcher = matcher
        return self._matcher

    def allow_end(self, mask: np.ndarray) -> None:
        """After the mask is computed: a grammar that may stop here lets the request's own
        end-of-generation tokens through, not only the token table's EOS."""
        if self.end_ids.size and self.matcher.is_accepting():
            words = mask.view(np.uint32)
            np.bitwise_or.at(words, self.end_ids // 32, (np.uint32(1) << (self.end_ids % 32).astype(np.uint32)))

    def fill(self) -> None:
        """Compute `mask` for the current state (drops the GIL)."""
        self.matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        self.allow_end(self.mask)

    def advance(self, token: int, clock: Callable[[], float] = time.thread_time) -> bool:
        """Take the sampled token; True when the grammar is now complete and admits nothing more.
        Raises InvalidRequestError if the grammar broke (a budget ran out mid-generation)."""
        self.pending = None  # the mask was for the state before this token
        started = clock()
        taken = self.matcher.consume_token(token)
        self.count(clock() - started)
        if not taken:
            raise InvalidRequestError(f"the grammar could not follow token {token}: "
                                      f"{self.matcher.get_error() or 'rejected'}", param="response_format",
                                      code="grammar_too_complex")
        return self.matcher.is_stopped()

    def error(self) -> str:
        return self.matcher.get_error()

    def count_build(self, seconds: float) -> None:
        self.mask_seconds += seconds

    def count(self, seconds: float) -> None:
        self.mask_seconds += seconds
        self.longest = max(self.longest, seconds)

    def drop(self) -> None:
        """The request ended: a mask still queued for it is not computed."""
        if self.pending is not None:
            self.pending.cancel()


class Constraints:
    """Builds matchers over the model's token table (read from its GGUF on first use) and computes
    masks on a helper thread.

    capacity: the most rows one step samples (the scheduler's batch size); the size of the array
    `masks` returns. clock: for the mask-time budget; rest: how the mask thread pauses after a
    costly mask (REST_AFTER_S) (tests pass their own)."""

    def __init__(self, vocab_source: Callable[[], llguidance.LLTokenizer], vocab_size: int, capacity: int,
                 budget: float = MASK_BUDGET_S, clock: Callable[[], float] | None = None,
                 limit: float = MASK_LIMIT_S, rest: Callable[[float], None] = time.sleep):
        self._vocab_source = vocab_source
        self._rest = rest
        self._table: llguidance.LLTokenizer | None = None
        self._table_lock = threading.Lock()
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._masks = np.full((max(capacity, 1), self._words), -1, np.int32)
        self.budget = budget
        self.limit = limit
        self.clock = clock or self._helper_cpu_seconds
        self._queue: list[tuple[float, int, GrammarConstraint, Future]] = []  # least mask time first
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._table_thread: threading.Thread | None = None  # from_gguf's early build of the table
        self._closed = False
        self.mask_seconds = 0.0  # total time spent computing masks (bench/structured.py reads it)
        self.masks_computed = 0

    @classmethod
    def from_gguf(cls, path: str, vocab_size: int, capacity: int) -> Constraints:
        def load() -> llguidance.LLTokenizer:
            started = time.perf_counter()
            vocab = read_vocab(path)
            table = token_table(vocab, sorted(end_of_generation_ids(vocab)), n_vocab=vocab_size)
            log.info("grammar token table for %s built in %.2fs (%d tokens)", vocab.source,
                     time.perf_counter() - started, table.vocab_size)
            return table
        constraints = cls(load, vocab_size, capacity)
        # Built now, beside the worker's warm-up: it is Python (it holds the GIL ~1 s on a busy host),
        # and built at the first constrained request it stalled every stream of the worker.
        constraints._table_thread = threading.Thread(target=constraints.table, name="grammar-table", daemon=True)
        constraints._table_thread.start()
        return constraints

    def compile(self, grammar: str, end_ids: tuple[int, ...]) -> GrammarConstraint:
        """One request's grammar; its matcher (and, the first time, the token table) is built with
        its first mask, on the helper thread (GrammarConstraint.matcher)."""
        def build() -> llguidance.LLMatcher:
            return llguidance.LLMatcher(self.table(), grammar, log_level=0, limits=parser_limits())
        return GrammarConstraint(build, end_ids, self._words)

    def table(self) -> llguidance.LLTokenizer:
        with self._table_lock:
            if self._table is None:
                self._table = self._vocab_source()
            return self._table

    # ---- masks ---------------------------------------------------------------------------------

    def request(self, rows: list[GrammarConstraint]) -> None:
        """Begin computing the next mask of each row that is not already being computed."""
        for row in rows:
            if row.pending is None:
                row.pending = Future()
                with self._wake:
                    heapq.heappush(self._queue, (row.mask_seconds, next(self._order), row, row.pending))
                    self._wake.notify()
        if rows and self._thread is None:
            # One thread: on a 2-core host the engine's threads need the rest.
            self._thread = threading.Thread(target=self._serve, name="grammar-masks", daemon=True)
            self._thread.start()

    def ready(self, row: GrammarConstraint) -> bool:
        return row.pending is not None and row.pending.done()

    def wait(self, rows: list[GrammarConstraint], first: bool = False, limit: float | None = None) -> None:
        """Wait until each row's mask is done (`first`: any one of them), or until a request's
        budget runs out (counted as if its mask were being computed now), or `limit` seconds."""
        pending = [row.pending for row in rows if row.pending is not None]
        if pending:
            timeout = max(min(self.budget - self.spent(row) for row in rows), 0.0)
            timeout = timeout if limit is None else min(timeout, limit)
            futures.wait(pending, timeout, futures.FIRST_COMPLETED if first else futures.ALL_COMPLETED)

    def spent(self, row: GrammarConstraint) -> float:
        """Mask time of the row's request so far, the mask being computed now included."""
        since = row.computing_since
        return row.mask_seconds + (self.clock() - since if since is not None else 0.0)

    def over_budget(self, row: GrammarConstraint) -> InvalidRequestError | None:
        """The error that stops the request when its masks took more than the budget (the mask
        being computed counts from when the helper began it, not its wait in the queue), else None."""
        since = row.computing_since
        longest = max(row.longest, self.clock() - since if since is not None else 0.0)
        if longest > self.limit:
            what = f"one of its masks took more than {self.limit * 1e3:g} ms"
        elif self.spent(row) > self.budget:
            what = f"its masks took more than {self.budget:g} s in all"
        else:
            return None
        return InvalidRequestError(f"the grammar is too complex to enforce: {what} of computation for this request",
                                   param="response_format", code="grammar_too_complex")

    def start(self, rows: list[GrammarConstraint]) -> list[GrammarConstraint]:
        """`request` the rows' masks; collect them with `masks(rows)` (row i is mask i)."""
        self.request(rows)
        return rows

    def masks(self, rows: list[GrammarConstraint]) -> np.ndarray:
        """The masks of `rows`, waited for, in order (row i is mask i)."""
        if len(rows) > self._masks.shape[0]:
            self._masks = np.full((len(rows), self._words), -1, np.int32)
        for i, row in enumerate(rows):
            if row.pending is not None:
                row.pending.result()
            self._masks[i] = row.mask
        return self._masks

    def _helper_cpu_seconds(self) -> float:
        """CPU time of the mask thread, read from either thread: the thread runs at the lowest
        priority, so the wall time of a mask on a busy host is mostly time waiting for a core."""
        thread = self._thread
        if thread is None or thread.ident is None:
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (AttributeError, OSError):  # not Linux: wall time
            return time.perf_counter()

    def _serve(self) -> None:
        # Lowest priority: a mask thread busy on a core made the engine's parallel kernels wait for
        # their thread there at every barrier (one-row steps of 0.7-1.3 s beside 7 ambiguous rows).
        lower_this_thread()
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                _, _, row, done = heapq.heappop(self._queue)
            if not done.set_running_or_notify_cancel():
                continue  # its request ended before its turn
            error: BaseException | None = None
            started = None
            try:
                self.table()  # ready long before, except right after start-up: not the request's time
                built = self.clock()
                _ = row.matcher  # built with the first mask: counts in the request's budget, not as a mask
                row.count_build(self.clock() - built)
                started = row.computing_since = self.clock()
                row.fill()
            except BaseException as exc:  # a matcher error ends that request, never the thread
                error = exc
            if started is not None:
                seconds = self.clock() - started
                row.count(seconds)
                row.computing_since = None
                self.mask_seconds += seconds
                self.masks_computed += 1
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(None)
            if started is not None and seconds > REST_AFTER_S:
                self._rest(seconds)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(5.0)  # a mask still being computed ends with the process (a daemon thread)
        if self._table_thread is not None:
            # The process must not exit while the table is being built: a daemon thread inside
            # llguidance's native code at interpreter exit crashed it (SIGSEGV, exit 139; a worker
            # stopped ~0.5 s after its start, and systemd marked the unit failed). The build
            # takes 0.3-1 s; the bound only covers a build that never ends.
            self._table_thread.join(60.0)
