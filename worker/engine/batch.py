"""What one engine step computes: several sequences' chunks, laid out for the forwards.

A chunk is consecutive tokens of one sequence at positions start.. whose K/V go into the blocks
of its block table (which already covers them). A model with a window pool (paged_kv) also needs
the window slot of each block (-1 where the sequence's queries can no longer see it). The fused
step takes chunks as rows (row_arrays); the reference set's BLAS forward as a RaggedBatch of
segments.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepChunk:
    token_ids: np.ndarray  # int64 (T,)
    start: int  # position of token_ids[0]
    block_table: np.ndarray  # int32: block i holds positions [i*block_size, (i+1)*block_size)
    wants_logits: bool  # the caller samples after this chunk: return its last token's logits
    window_table: np.ndarray | None = None  # int32, like block_table: window slot of each block

    @classmethod
    def of(cls, token_ids, start: int, block_table, wants_logits: bool, window_table=None) -> "StepChunk":
        window = None if window_table is None else np.asarray(window_table, np.int32).reshape(-1)
        return cls(np.asarray(token_ids, np.int64).reshape(-1), int(start),
                   np.asarray(block_table, np.int32).reshape(-1), bool(wants_logits), window)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class Segment:
    """One chunk's rows [lo, hi) inside a RaggedBatch."""
    lo: int
    hi: int
    start: int
    block_table: np.ndarray
    window_table: np.ndarray | None


class RaggedBatch:
    """Chunks of different lengths stacked into T rows: tokens, positions and segments."""

    def __init__(self, chunks: list[StepChunk]):
        self.tokens = np.concatenate([c.token_ids for c in chunks])
        self.positions = np.concatenate([c.start + np.arange(c.num_tokens) for c in chunks])
        self.segments: list[Segment] = []
        self.logit_rows: list[int] = []  # row whose logits each wanting chunk returns, in chunk order
        lo = 0
        for c in chunks:
            hi = lo + c.num_tokens
            self.segments.append(Segment(lo, hi, c.start, c.block_table, c.window_table))
            if c.wants_logits:
                self.logit_rows.append(hi - 1)
            lo = hi

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def row_arrays(chunks: list[StepChunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every token of every chunk as one row: tokens (R,), positions (R,), block tables
    (R, most blocks; padded with 0, never read) and the rows whose logits are wanted."""
    tokens = np.concatenate([c.token_ids for c in chunks])
    positions = np.concatenate([c.start + np.arange(c.num_tokens, dtype=np.int64) for c in chunks])
    logit_rows = []
    row = 0
    for c in chunks:
        row += c.num_tokens
        if c.wants_logits:
            logit_rows.append(row - 1)
    return tokens, positions, _row_tables(chunks, [c.block_table for c in chunks]), np.array(logit_rows, np.int64)


def window_row_tables(chunks: list[StepChunk]) -> np.ndarray:
    """Each row's window table, like row_arrays' block tables; ValueError when a chunk lacks one."""
    missing = [i for i, c in enumerate(chunks) if c.window_table is None]
    if missing:
        raise ValueError(f"this model keeps its sliding-window layers in window slots: chunk {missing[0]} "
                         "needs a window_table")
    return _row_tables(chunks, [c.window_table for c in chunks])


def _row_tables(chunks: list[StepChunk], tables: list[np.ndarray]) -> np.ndarray:
    width = max(t.shape[0] for t in tables)
    out = np.zeros((sum(c.num_tokens for c in chunks), width), np.int32)
    row = 0
    for c, t in zip(chunks, tables):
        out[row:row + c.num_tokens, :t.shape[0]] = t
        row += c.num_tokens
    return out
