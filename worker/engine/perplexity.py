"""Perplexity of a text, measured as llama.cpp's llama-perplexity measures it.

The text's tokens are cut into non-overlapping windows of n_ctx tokens (as many whole windows as
fit, or the first `chunks`); each window is computed from an empty cache, its first token replaced
by BOS when the vocabulary adds one, and scored only on its second half: the logits of rows
n_ctx/2 .. n_ctx-2 predict the tokens after them, so every scored token has at least n_ctx/2
tokens of context. The estimate is exp(mean NLL) and its error exp(mean NLL) times the standard
error of the NLLs (llama.cpp's `Final estimate: PPL = X +/- E`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from shared.errors import InvalidRequestError
from worker.engine.batch import RaggedBatch, StepChunk


@dataclass
class PerplexityTally:
    """Running sums of the scored tokens' negative log-likelihoods."""
    count: int = 0
    nll: float = 0.0
    nll2: float = 0.0

    def add(self, nlls: np.ndarray) -> None:
        self.count += int(nlls.shape[0])
        self.nll += float(nlls.sum(dtype=np.float64))
        self.nll2 += float(np.square(nlls, dtype=np.float64).sum())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def error(self) -> float:
        """exp(mean) times the standard error of the mean NLL (0 with fewer than two tokens)."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        if self.count < 2 or var <= 0:
            return 0.0
        return math.sqrt(var / (self.count - 1)) * self.ppl


def windows(tokens: list[int], n_ctx: int, chunks: int | None) -> list[list[int]]:
    """The non-overlapping windows to score; InvalidRequestError when fewer than two fit, as
    llama-perplexity refuses a text under 2 * n_ctx tokens."""
    if n_ctx < 4:
        raise InvalidRequestError(f"--ctx must be at least 4, got {n_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise InvalidRequestError(f"the text has {len(tokens)} tokens; perplexity with a context of {n_ctx} "
                                  f"needs at least {2 * n_ctx}")
    n = len(tokens) // n_ctx if chunks is None or chunks < 0 else min(chunks, len(tokens) // n_ctx)
    return [tokens[i * n_ctx:(i + 1) * n_ctx] for i in range(n)]


def negative_log_likelihoods(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits[i])[targets[i]] of each row, in float64 sums like llama.cpp's."""
    top = logits.max(axis=1, keepdims=True)
    shifted = logits - top
    log_sum = np.log(np.exp(shifted, dtype=np.float64).sum(axis=1))
    return log_sum - shifted[np.arange(targets.shape[0]), targets].astype(np.float64)


def window_nlls(engine, window: list[int], bos_id: int | None, step_rows: int) -> np.ndarray:
    """NLLs of a window's second half. The window runs from position 0 in the pool's first blocks,
    `step_rows` tokens per engine step: the engine must serve nothing else meanwhile."""
    n_ctx = len(window)
    first = n_ctx // 2
    ids = np.asarray(window, np.int64)
    if bos_id is not None:
        ids = ids.copy()
        ids[0] = bos_id
    table = np.arange(-(-n_ctx // engine.kv.block_size), dtype=np.int32)
    if table.shape[0] > engine.kv.num_blocks:
        raise InvalidRequestError(f"a window of {n_ctx} tokens needs {table.shape[0]} KV blocks; the pool has "
                                  f"{engine.kv.num_blocks}")
    out = []
    for lo, logits in _prompt_logits(engine, ids, table, first, step_rows):
        targets = np.asarray(window[lo + 1:lo + 1 + logits.shape[0]], np.int64)
        out.append(negative_log_likelihoods(logits[:targets.shape[0]], targets))
    return np.concatenate(out)


def _prompt_logits(engine, ids: np.ndarray, table: np.ndarray, first: int,
                   step_rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, logits of rows first.. of the step) for each step of the prompt that has rows >= first."""
    if engine.kv.window is not None:
        raise InvalidRequestError("perplexity needs every layer in the main KV pool: load with window_kv = full")
    for lo in range(0, ids.shape[0], step_rows):
        hi = min(lo + step_rows, ids.shape[0])
        rows = np.arange(max(first, lo) - lo, hi - lo, dtype=np.int64)
        chunk = StepChunk.of(ids[lo:hi], lo, table, True)
        if engine.kernels == "reference":
            batch = RaggedBatch([chunk])
            batch.logit_rows = rows.tolist()
            logits = engine.model.forward(batch, engine.kv, engine._dense, engine._logits_of_rows,
                                          engine.attention_chunk)
        else:
            tables = np.broadcast_to(table, (hi - lo, table.shape[0])).copy()
            logits = engine.model.forward_rows(ids[lo:hi], np.arange(lo, hi, dtype=np.int64), tables, rows,
                                               engine.kv, engine.attention_chunk, engine.ops.codes)
        if rows.shape[0]:
            yield lo + int(rows[0]), np.asarray(logits, np.float32)
