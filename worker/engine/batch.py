"""What one engine step computes: several sequences' chunks, laid out for the forwards.

A chunk is consecutive tokens of one sequence at positions start.. whose K/V go into the blocks
of its block table (which already covers them). The fused step takes them as rows (row_arrays);
the reference set's BLAS forward as a RaggedBatch of segments.
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

    @classmethod
    def of(cls, token_ids, start: int, block_table, wants_logits: bool) -> "StepChunk":
        return cls(np.asarray(token_ids, np.int64).reshape(-1), int(start),
                   np.asarray(block_table, np.int32).reshape(-1), bool(wants_logits))

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
            self.segments.append(Segment(lo, hi, c.start, c.block_table))
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
    width = max(c.block_table.shape[0] for c in chunks)
    tables = np.zeros((tokens.shape[0], width), np.int32)
    logit_rows = []
    row = 0
    for c in chunks:
        tables[row:row + c.num_tokens, :c.block_table.shape[0]] = c.block_table
        row += c.num_tokens
        if c.wants_logits:
            logit_rows.append(row - 1)
    return tokens, positions, tables, np.array(logit_rows, np.int64)
