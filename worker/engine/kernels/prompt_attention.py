"""Attention of runs of consecutive query rows of one sequence (prompt chunks, speculative
verification rows) over the paged KV cache, a tile of rows at a time.

paged_attention_decode makes one work item of each (row, kv head): every row streams its whole
context's K/V from L2/L3 and converts it from float16 again, so a 512-row chunk at 2,000 tokens of
context reads each K/V block 512 times. Here an item is (tile of up to `tile` consecutive rows, kv
head): each K/V block is loaded once per tile and, while it is in L1, scored against (and summed
into) every query head of every row of the tile.

Bits: a row's result is bit-identical to paged_attention_decode's for that row, whatever tile it
falls in. Per head the arithmetic is the same calls in the same order: scores of whole blocks
(block_scores: one head's scores do not depend on the heads computed beside it), the same online
softmax chunks (c0 = lo, lo + chunk, ... cut at the row's own end; attention.softmax_chunk, the
one function both kernels call) and value sums key by key in order (value_sums: each head's
accumulator is the same chain of multiply-adds however the heads are grouped, and a run split at
a block edge only stores and reloads it). Keys past a row's end (the causal mask) and before its
window are scored for the tile's sake but never read for that row. Speculative decoding's greedy
equality and batched == alone rely on this.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from worker.engine.kernels.attention import (AttentionParams, HeadGroup, KVLayer, balanced_item, group_scratch,
                                             heads_per_item, paged_attention_decode, score_width, softmax_chunk,
                                             write_head)
from worker.engine.kernels.key_scores import block_scores
from worker.engine.kernels.kv_q8 import k_slab, slab_scratch, v_slab
from worker.engine.kernels.value_sums import value_sums

__all__ = ["PROMPT_TILE", "attention_tiled", "row_runs", "paged_attention_runs"]

_JIT = dict(fastmath=True, cache=True, nogil=True)

# Rows per tile. Scores of a tile take tile × group × (chunk + tile) float32 (16 × 3 × 544 × 4 =
# 104 KiB for SmolLM2 with 512-key chunks): they stay in L2 while each block stays in L1.
PROMPT_TILE = 16


@njit(**_JIT)
def row_runs(block_tables, positions, rows, block_size):
    """Row bounds of the runs among the first `rows` rows: run i is rows runs[i]..runs[i+1]-1.

    Row b+1 continues row b's run when its position is the next one and its block table agrees
    with row b's on every block row b reads (so the run's last row's table serves all its rows).
    Rows of different sequences, or decode rows, end up in runs of one. int64 (n_runs + 1,)."""
    bounds = np.empty(rows + 1, np.int64)
    n = 0
    bounds[0] = 0
    for b in range(1, rows):
        same = positions[b] == positions[b - 1] + 1
        if same:
            for i in range(positions[b - 1] // block_size + 1):
                if block_tables[b, i] != block_tables[b - 1, i]:
                    same = False
                    break
        if not same:
            n += 1
            bounds[n] = b
    n += 1
    bounds[n] = rows
    return bounds[:n + 1]


@njit(**_JIT)
def _row_lo(p, window):
    return max(0, p - window + 1) if window > 0 else 0


@njit(**_JIT)
def attention_tiled(q, kv, block_tables, positions, params, out):
    """The registry's "tiled" attention (arguments: decode_parts.attention_rows): runs of
    consecutive rows of one sequence (prompt chunks, verification rows) take paged_attention_runs,
    which reads each K/V block once per tile instead of once per row; a step of decode rows only
    takes paged_attention_decode. Both give every row the same bits. Runs are found here, from the
    positions and tables every step already passes: finding them costs ~1 µs a row against
    ~0.5 ms for attending a row over 2,000 keys."""
    rows = q.shape[0]
    runs = row_runs(block_tables, positions, rows, kv.v_pool.shape[3])
    if runs.shape[0] - 1 == rows:
        paged_attention_decode(q, kv.k_pool, kv.v_pool, kv.layer, block_tables, positions, params.window,
                               params.scale, params.chunk, out, params.threads)
    else:
        paged_attention_runs(q, kv.k_pool, kv.v_pool, kv.layer, block_tables, positions, runs, params.window,
                             params.scale, params.chunk, PROMPT_TILE, out, params.threads)


@njit(parallel=True, **_JIT)
def paged_attention_runs(q, k_pool, v_pool, layer, block_tables, positions, runs, window, scale, chunk, tile,
                         out, threads=1):
    """paged_attention_decode's result for every row (the same bits), with the rows of each run
    computed a tile at a time.

    q, block_tables, positions, out: as paged_attention_decode's (one row per query); runs: row
    bounds from row_runs (consecutive positions of one sequence, tables agreeing on what each row
    reads). chunk >= 1 keys per online-softmax chunk; tile >= 1 rows per tile. Items are (tile,
    kv head), its query heads split only as far as `threads` need (attention.heads_per_item).
    """
    if chunk < 1 or tile < 1:
        raise ValueError("paged_attention_runs: chunk and tile must be >= 1")
    n_kv = v_pool.shape[2]
    d = v_pool.shape[4]
    n_heads = q.shape[1] // d
    group = n_heads // n_kv
    n_runs = runs.shape[0] - 1
    n_tiles = 0
    for i in range(n_runs):
        n_tiles += -(-(runs[i + 1] - runs[i]) // tile)
    starts = np.empty(n_tiles + 1, np.int64)
    at = 0
    for i in range(n_runs):
        for r in range(runs[i], runs[i + 1], tile):
            starts[at] = r
            at += 1
    starts[n_tiles] = runs[n_runs]
    ends = np.empty(n_tiles, np.int64)
    at = 0
    for i in range(n_runs):
        for r in range(runs[i], runs[i + 1], tile):
            ends[at] = min(r + tile, runs[i + 1])
            at += 1
    per_item = heads_per_item(n_tiles, n_kv, group, threads)
    n_sets = n_heads // per_item
    kv = KVLayer(k_pool, v_pool, layer)
    params = AttentionParams(window, np.float32(scale), chunk, threads)
    for item in prange(n_tiles * n_sets):
        hs, t = balanced_item(item, n_tiles)  # as in paged_attention_decode
        h0 = hs * per_item
        r0, r1 = starts[t], ends[t]
        _attend_tile(q, r0, r1, HeadGroup(h0, per_item, h0 // group), kv, block_tables[r1 - 1], positions, params,
                     out)


@njit(**_JIT)
def _attend_tile(q, r0, r1, group, kv, table, positions, params, out):
    """The query heads of HeadGroup `group` (all on its kv head) of rows r0..r1-1, consecutive
    positions of one sequence whose blocks `table` names. Tile head x = (row r0 + x // ph, head
    h0 + x % ph), h0 and ph the group's first head and count."""
    k_pool, v_pool, layer = kv
    h0, ph, kvh = group
    window, scale, chunk = params.window, params.scale, params.chunk
    bs = v_pool.shape[3]
    d = v_pool.shape[4]
    n = r1 - r0
    heads = n * ph
    longest = 0
    for rr in range(n):
        p = positions[r0 + rr]
        longest = max(longest, p + 1 - _row_lo(p, window))
    # A chunk's keys over the tile: from the earliest row start to the latest row end, rows'
    # starts differing by at most n - 1 (consecutive positions).
    width = score_width(min(chunk, longest) + n - 1, bs)
    total, scores, acc, m, qt = group_scratch(heads, width, d)
    k_scratch, v_scratch = slab_scratch(k_pool), slab_scratch(v_pool)  # q8_0 pools decode a block there
    for rr in range(n):
        for hh in range(ph):
            src = q[r0 + rr, (h0 + hh) * d:(h0 + hh + 1) * d]
            dst = qt[(rr * ph + hh) * d:(rr * ph + hh + 1) * d]
            for i in range(d):
                dst[i] = src[i]
    j = 0
    while True:
        # Chunk j of every row: keys [lo + j·chunk, min(lo + (j+1)·chunk, p + 1)), empty when
        # the row has fewer chunks; the tile scores the blocks of their union.
        first_key, last_end = -1, -1
        for rr in range(n):
            p = positions[r0 + rr]
            s = _row_lo(p, window) + j * chunk
            if s <= p:
                first_key = s if first_key < 0 else min(first_key, s)
                last_end = max(last_end, min(s + chunk, p + 1))
        if last_end < 0:
            break
        kb0 = first_key // bs
        kb1 = (last_end - 1) // bs
        base = kb0 * bs  # scores[x, c] belongs to key base + c
        for b in range(kb0, kb1 + 1):
            block_scores(k_slab(k_pool, table[b], layer, kvh, k_scratch), qt, 0, scale, scores, (b - kb0) * bs,
                         heads)
        for rr in range(n):
            p = positions[r0 + rr]
            s = _row_lo(p, window) + j * chunk
            if s <= p:
                e = min(s + chunk, p + 1)
                for hh in range(ph):
                    softmax_chunk(scores[rr * ph + hh, s - base:e - base], j == 0, m, total, acc, rr * ph + hh)
        for b in range(kb0, kb1 + 1):
            _tile_values(v_slab(v_pool, table[b], layer, kvh, v_scratch), b * bs, positions[r0:r1], ph, params, j,
                         scores, base, acc)
        j += 1
    for rr in range(n):
        for hh in range(ph):
            write_head(acc, total, rr * ph + hh, out[r0 + rr], (h0 + hh) * d)


@njit(**_JIT)
def _tile_values(slab, key0, tile_positions, ph, params, j, scores, base, acc):
    """acc += softmax weights · values of one V block (keys key0..key0+block_size-1) for each tile
    row (at tile_positions, ph heads each) in its part of chunk j inside it. Rows that take the
    whole block share one value_sums call (each row is loaded and converted once for all their
    heads); rows with part of it (a chunk or window edge, the causal end) get their own."""
    bs = slab.shape[0]
    n = tile_positions.shape[0]
    rr = 0
    while rr < n:
        a, z = _run_in_block(tile_positions[rr], params, j, key0, bs)
        if a >= z:
            rr += 1
        elif a == key0 and z == key0 + bs:
            r2 = rr + 1
            while r2 < n:
                a2, z2 = _run_in_block(tile_positions[r2], params, j, key0, bs)
                if a2 != key0 or z2 != key0 + bs:
                    break
                r2 += 1
            value_sums(slab, 0, bs, scores[rr * ph:r2 * ph], key0 - base, acc[rr * ph:r2 * ph], (r2 - rr) * ph)
            rr = r2
        else:
            value_sums(slab, a - key0, z - a, scores[rr * ph:(rr + 1) * ph], a - base, acc[rr * ph:(rr + 1) * ph], ph)
            rr += 1


@njit(**_JIT)
def _run_in_block(p, params, j, key0, bs):
    """The keys [a, z) of the block starting at key0 that the row at position p reads in its
    chunk j (a >= z: none)."""
    s = _row_lo(p, params.window) + j * params.chunk
    e = min(s + params.chunk, p + 1)
    return max(s, key0), min(e, key0 + bs)
