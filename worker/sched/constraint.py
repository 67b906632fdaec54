"""Grammar-constrained rows of a step: one llguidance matcher per constrained request, and the
masks of all of them computed together, off the GIL, while the engine runs the step.

A mask is llguidance's bitmask (one bit per token, int32 words, bit i of word i // 32 = token i
allowed); the sampler turns the zero bits into -inf logits (Sampler.sample(mask=...)). Free rows
of the same step have no mask and cost nothing here.

When the grammar is complete and admits no further byte, the request is finished ("stop") right
after the token that completed it; while it is complete but could go on (a JSON number), the
request's end-of-generation tokens are allowed too, so the model may end it there.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np

from shared.errors import InvalidRequestError
from shared.grammar import parser_limits, token_table
from shared.vocab import end_of_generation_ids, read_vocab

log = logging.getLogger("reame.constraint")


class GrammarConstraint:
    """One request's grammar state: what it may generate next, advanced token by token."""

    def __init__(self, matcher: llguidance.LLMatcher, end_ids: tuple[int, ...]):
        self.matcher = matcher
        self.end_ids = np.asarray(end_ids, np.int64)  # the request's stop tokens, allowed once complete

    def allow_end(self, mask: np.ndarray) -> None:
        """After the mask is computed: a grammar that may stop here lets the request's own
        end-of-generation tokens through, not only the token table's EOS."""
        if self.end_ids.size and self.matcher.is_accepting():
            words = mask.view(np.uint32)
            np.bitwise_or.at(words, self.end_ids // 32, (np.uint32(1) << (self.end_ids % 32).astype(np.uint32)))

    def advance(self, token: int) -> bool:
        """Take the sampled token; True when the grammar is now complete and admits nothing more.
        Raises InvalidRequestError if the grammar broke (a budget ran out mid-generation)."""
        if not self.matcher.consume_token(token):
            raise InvalidRequestError(f"the grammar could not follow token {token}: "
                                      f"{self.matcher.get_error() or 'rejected'}", param="response_format",
                                      code="grammar_too_complex")
        return self.matcher.is_stopped()

    def error(self) -> str:
        return self.matcher.get_error()


class Constraints:
    """Builds matchers over the model's token table (read from its GGUF on first use) and computes
    a step's masks on a helper thread.

    capacity: the most rows one step samples (the scheduler's batch size)."""

    def __init__(self, vocab_source: Callable[[], llguidance.LLTokenizer], vocab_size: int, capacity: int):
        self._vocab_source = vocab_source
        self._table: llguidance.LLTokenizer | None = None
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._masks = np.full((max(capacity, 1), self._words), -1, np.int32)
        self._executor: llguidance.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None
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
        return cls(load, vocab_size, capacity)

    def compile(self, grammar: str, end_ids: tuple[int, ...]) -> GrammarConstraint:
        """A fresh matcher for one request; InvalidRequestError if llguidance refuses the grammar."""
        if self._table is None:
            self._table = self._vocab_source()
        matcher = llguidance.LLMatcher(self._table, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise InvalidRequestError(f"the grammar cannot be enforced: {matcher.get_error()}", param="response_format")
        return GrammarConstraint(matcher, end_ids)

    def start(self, rows: list[GrammarConstraint]) -> Future | None:
        """Begin computing the masks of `rows` (row i into mask i) on the helper thread; the
        caller runs the engine meanwhile and collects them with `masks(future, n)`."""
        if not rows:
            return None
        if len(rows) > self._masks.shape[0]:
            self._masks = np.full((len(rows), self._words), -1, np.int32)
        if self._thread is None:
            # One Rust thread: on a 2-core host the engine's threads need the rest.
            self._executor = llguidance.LLExecutor(num_threads=1)
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._thread.submit(self._fill, rows)

    def masks(self, future: Future | None) -> np.ndarray:
        """The masks of the rows given to `start`, in order (row i is mask i)."""
        if future is not None:
            future.result()
        return self._masks

    def _fill(self, rows: list[GrammarConstraint]) -> None:
        started = time.perf_counter()
        masks = self._masks
        pairs = [(row.matcher, i) for i, row in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(pairs, masks.ctypes.data, self._words * 4, masks.shape[0])
        for i, row in enumerate(rows):
            row.allow_end(masks[i])
        self.mask_seconds += time.perf_counter() - started
        self.masks_computed += len(rows)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
