"""Yardstick kernels: plain kernels the product's are tested (and benchmarked) against; no product
code calls them.

`linear` (matvec): quantized matrix × one vector, the bit-exact yardstick of the float32 matmul
variants (worker/engine/kernels/matmul_batch.py gives each row its sums in the same order); the
decode kernel before the batched ones. It multiplies one or more packed matrices (see packing.py)
by the same activation vector in one parallel launch; outputs of the listed matrices are laid
side by side in `out` (Σ padded rows).

Loop shape matters more than anything here: the innermost loop runs over the TILE outputs
of a tile with a trip count numba cannot see at compile time, which is what lets LLVM
vectorize it (a constant trip count got fully unrolled into scalar code, 3x slower), and
x is a plain vector (an extra batch loop around the inner loop made it 5x slower).

`paged_attention`: the queries of one sequence, one query head per work item, over the paged K/V
(attention.paged_attention_decode and prompt_attention give a query its bits).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from worker.engine.kernels.attention import AttentionParams, HeadGroup, KVLayer, attend_group, balanced_item
from worker.engine.kernels.half import f16_to_f32
from worker.engine.kernels.packing import (FMT_F32, FMT_Q4, LAYOUT_ROWS, M_BIAS, M_DATA, M_FMT, M_GROUP,
                                           M_K, M_LAYOUT, M_PARAM, M_SCALE, M_TILES, PARAM_F16, TILE,
                                           unit_offset)

_JIT = dict(fastmath=True, cache=True, nogil=True)


@njit(**_JIT)
def _finish_group(data, scales, scales16, meta, tile, groups, g, group, x, gacc, o):
    """o += scale[g] * gacc + bias[g] * Σ x over group g, reading factored (int8 steps × float16
    units), float16 or float32 parameters.

    One fused loop per case: a separate pass converting the parameters cost ~10% at 1 thread.
    """
    width = o.shape[0]
    at = (tile * groups + g) * width
    s0, b0 = meta[M_SCALE] + at, meta[M_BIAS] + at
    has_bias = meta[M_BIAS] >= 0
    xs = np.float32(0.0)
    if has_bias:
        for i in range(group):
            xs += x[g * group + i]
    u0 = unit_offset(meta, tile, g)
    if u0 >= 0:  # factored: int8 step × float16 unit, an exact float32 product (packing)
        s8 = data[s0:s0 + width].view(np.int8)
        su = scales16[u0:u0 + width]
        if has_bias:
            m8 = data[b0:b0 + width].view(np.int8)
            mu = scales16[u0 + width:u0 + 2 * width]
            for t in range(width):
                scale = np.float32(s8[t]) * f16_to_f32(su[t])
                o[t] += scale * gacc[t] + (np.float32(m8[t]) * f16_to_f32(mu[t])) * xs
        else:
            for t in range(width):
                o[t] += (np.float32(s8[t]) * f16_to_f32(su[t])) * gacc[t]
    elif meta[M_PARAM] == PARAM_F16:
        s16 = scales16[s0:s0 + width]
        if has_bias:
            m16 = scales16[b0:b0 + width]
            for t in range(width):
                o[t] += f16_to_f32(s16[t]) * gacc[t] + f16_to_f32(m16[t]) * xs
        else:
            for t in range(width):
                o[t] += f16_to_f32(s16[t]) * gacc[t]
    else:
        s32 = scales[s0:s0 + width]
        if has_bias:
            m32 = scales[b0:b0 + width]
            for t in range(width):
                o[t] += s32[t] * gacc[t] + m32[t] * xs
        else:
            for t in range(width):
                o[t] += s32[t] * gacc[t]


@njit(**_JIT)
def _tile_q4(data, scales, scales16, meta, tile, x, o, work):
    k = meta[M_K]
    groups = k // 32
    width = o.shape[0]
    gacc = work
    base = meta[M_DATA] + tile * (k // 2) * width
    d = data[base:base + (k // 2) * width].reshape(k // 2, width)
    for t in range(width):
        o[t] = 0.0
    for g in range(groups):
        for t in range(width):
            gacc[t] = 0.0
        for j in range(0, 16, 2):  # two byte rows (four weights) per pass: less accumulator traffic
            r0 = d[g * 16 + j]
            r1 = d[g * 16 + j + 1]
            x0 = x[g * 32 + j]
            x1 = x[g * 32 + j + 16]
            x2 = x[g * 32 + j + 1]
            x3 = x[g * 32 + j + 17]
            for t in range(width):
                v = r0[t]
                w = r1[t]
                gacc[t] += (np.float32(v & 15) * x0 + np.float32(v >> 4) * x1) + (np.float32(w & 15) * x2 + np.float32(w >> 4) * x3)
        _finish_group(data, scales, scales16, meta, tile, groups, g, 32, x, gacc, o)


@njit(**_JIT)
def _tile_q8(data, scales, scales16, meta, tile, x, o, work):
    k = meta[M_K]
    group = meta[M_GROUP]
    groups = k // group
    width = o.shape[0]
    gacc = work
    base = meta[M_DATA] + tile * k * width
    d = data[base:base + k * width].view(np.int8).reshape(k, width)
    for t in range(width):
        o[t] = 0.0
    for g in range(groups):
        for t in range(width):
            gacc[t] = 0.0
        for j in range(0, group, 4):  # four rows per pass: a quarter of the accumulator traffic
            r0 = d[g * group + j]
            r1 = d[g * group + j + 1]
            r2 = d[g * group + j + 2]
            r3 = d[g * group + j + 3]
            x0 = x[g * group + j]
            x1 = x[g * group + j + 1]
            x2 = x[g * group + j + 2]
            x3 = x[g * group + j + 3]
            for t in range(width):
                gacc[t] += (np.float32(r0[t]) * x0 + np.float32(r1[t]) * x1) + (np.float32(r2[t]) * x2 + np.float32(r3[t]) * x3)
        _finish_group(data, scales, scales16, meta, tile, groups, g, group, x, gacc, o)


@njit(**_JIT)
def _tile_f32(data, meta, tile, x, o):
    k = meta[M_K]
    width = o.shape[0]
    start = meta[M_DATA] + tile * k * width * 4
    d = data[start:start + k * width * 4].view(np.float32).reshape(k, width)
    for t in range(width):
        o[t] = 0.0
    for kk in range(k):
        row = d[kk]
        xv = x[kk]
        for t in range(width):
            o[t] += row[t] * xv


@njit(parallel=True, **_JIT)
def linear(data, scales, scales16, meta, mats, x, out, scratch):
    """out[cols of mats[i]] = W[mats[i]] @ x for every listed matrix, in one launch.

    x: float32 (K,) shared by all listed matrices; out: float32 (Σ padded rows);
    scratch: float32 (≥ Σ tiles, TILE) per-tile group sums.
    """
    n_mats = mats.shape[0]
    first_tile = np.zeros(n_mats + 1, np.int64)
    for i in range(n_mats):
        if meta[mats[i], M_LAYOUT] != LAYOUT_ROWS:
            raise ValueError("linear: matrices must be packed in LAYOUT_ROWS")
        first_tile[i + 1] = first_tile[i] + meta[mats[i], M_TILES]
    for g in prange(first_tile[n_mats]):
        i = 0
        while g >= first_tile[i + 1]:
            i += 1
        m = meta[mats[i]]
        tile = g - first_tile[i]
        o = out[g * TILE:(g + 1) * TILE]
        if m[M_FMT] == FMT_Q4:
            _tile_q4(data, scales, scales16, m, tile, x, o, scratch[g])
        elif m[M_FMT] == FMT_F32:
            _tile_f32(data, m, tile, x, o)
        else:
            _tile_q8(data, scales, scales16, m, tile, x, o, scratch[g])


# ---- attention of one sequence's queries, one query head per work item --------------------------

_ATT_JIT = dict(fastmath=True, cache=True, nogil=True)


@njit(parallel=True, **_ATT_JIT)
def paged_attention(q, k_pool, v_pool, layer, block_table, start, window, scale, chunk, out):
    """Attention of T consecutive queries of one sequence over its paged K/V.

    q: (T, n_heads*head_dim) float32 at positions start..start+T-1, whose K/V (these T tokens
    included) are already stored; block_table: int32 (>= ceil((start+T)/block_size) entries).
    Query at position p attends keys [lo, p], lo = 0 if window <= 0 else max(0, p-window+1).
    Query head h uses kv head h // (n_heads // n_kv_heads). out: (T, n_heads*head_dim) float32.
    chunk (>= 1) bounds the keys scored at once. Parallel over (T x n_heads); each item is the
    one-head case of paged_attention_decode's, so both give a query the same bits.
    """
    if chunk < 1:
        raise ValueError("paged_attention: chunk must be >= 1")
    n_kv = v_pool.shape[2]
    d = v_pool.shape[4]
    n_t = q.shape[0]
    n_heads = q.shape[1] // d
    group = n_heads // n_kv
    kv = KVLayer(k_pool, v_pool, layer)
    params = AttentionParams(window, np.float32(scale), chunk, 1)
    for item in prange(n_t * n_heads):
        h, t = balanced_item(item, n_t)  # head-major; within a head, short and long contexts alternate
        p = start + t
        lo = max(0, p - window + 1) if window > 0 else 0
        attend_group(q[t], HeadGroup(h, 1, h // group), kv, block_table, lo, p + 1, params, out[t])
