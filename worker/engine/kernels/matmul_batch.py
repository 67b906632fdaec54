"""Quantized matrix × a few activation vectors (batched decode): each weight is read and
converted once per step, then applied to every sequence's vector.

On a CPU decode is bound by reading weights, so several sequences decoded in one step share
that read; this kernel is what continuous batching will run on. Same packed layouts as
matvec.linear; outputs of the listed matrices are laid side by side in out[b].

Status: correct for every quant type (tests/kernels), not yet used by the engine, and not yet
fast: on SmolLM2's Q/K/V + gate/up matrices, 1 thread, B=8 costs 0.93x the time of 8 separate
matvec.linear calls and B=1 4.4x one call (measured with a scratch script; the inner loops do
not vectorize as well as matvec's). Tuning it is the first step of the batching issue.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from worker.engine.kernels.half import f16_to_f32
from worker.engine.kernels.packing import (FMT_F32, FMT_Q4, M_BIAS, M_DATA, M_FMT, M_GROUP, M_HALF,
                                           M_K, M_SCALE, M_TILES, TILE)

_JIT = dict(fastmath=True, cache=True, nogil=True)
ROWS = 4  # weight rows converted per pass (a group holds 16 or 32 of them)


@njit(**_JIT)
def _finish_group(scales, scales16, meta, tile, groups, g, group, x, work, out, col0):
    """out[b, tile] += scale[g] * gacc[b] + bias[g] * Σ x[b] over group g, for every b.

    work rows: 0..B-1 accumulators, B..B+ROWS-1 converted weights, B+ROWS and B+ROWS+1 the
    group's scales and biases. Only whole rows are taken: a row of a C array stays
    contiguous, a column slice would not, and LLVM then stops vectorizing.
    """
    batch = x.shape[0]
    width = work.shape[1]
    at = (tile * groups + g) * width
    has_bias = meta[M_BIAS] >= 0
    s, m = work[batch + ROWS], work[batch + ROWS + 1]
    if meta[M_HALF]:
        for t in range(width):
            s[t] = f16_to_f32(scales16[meta[M_SCALE] + at + t])
            m[t] = f16_to_f32(scales16[meta[M_BIAS] + at + t]) if has_bias else np.float32(0.0)
    else:
        for t in range(width):
            s[t] = scales[meta[M_SCALE] + at + t]
            m[t] = scales[meta[M_BIAS] + at + t] if has_bias else np.float32(0.0)
    for b in range(x.shape[0]):
        xs = np.float32(0.0)
        if has_bias:
            for i in range(group):
                xs += x[b, g * group + i]
        o = out[b, col0:col0 + width]
        ga = work[b]
        for t in range(width):
            o[t] += s[t] * ga[t] + m[t] * xs


@njit(**_JIT)
def _apply_rows(w0, w1, w2, w3, x, i0, i1, i2, i3, work):
    """work[b] += Σ_r w_r * x[b, i_r] for the ROWS converted weight rows."""
    for b in range(x.shape[0]):
        x0, x1, x2, x3 = x[b, i0], x[b, i1], x[b, i2], x[b, i3]
        ga = work[b]
        for t in range(ga.shape[0]):
            ga[t] += (w0[t] * x0 + w1[t] * x1) + (w2[t] * x2 + w3[t] * x3)


@njit(**_JIT)
def _tile(data, scales, scales16, meta, tile, x, out, col0, work):
    k = meta[M_K]
    fmt = meta[M_FMT]
    width = work.shape[1]
    batch = x.shape[0]
    for b in range(batch):
        for t in range(width):
            out[b, col0 + t] = 0.0
    if fmt == FMT_F32:
        start = meta[M_DATA] + tile * k * width * 4
        d = data[start:start + k * width * 4].view(np.float32).reshape(k, width)
        for b in range(batch):
            for t in range(width):
                work[b, t] = 0.0
        for k0 in range(0, k - k % ROWS, ROWS):
            _apply_rows(d[k0], d[k0 + 1], d[k0 + 2], d[k0 + 3], x, k0, k0 + 1, k0 + 2, k0 + 3, work)
        for b in range(batch):
            for kk in range(k - k % ROWS, k):  # rows left over when K is not a multiple of ROWS
                for t in range(width):
                    work[b, t] += d[kk, t] * x[b, kk]
            for t in range(width):
                out[b, col0 + t] = work[b, t]
        return
    group = meta[M_GROUP]
    groups = k // group
    if fmt == FMT_Q4:
        base = meta[M_DATA] + tile * (k // 2) * width
        d = data[base:base + (k // 2) * width].reshape(k // 2, width)
    else:
        base = meta[M_DATA] + tile * k * width
        d8 = data[base:base + k * width].view(np.int8).reshape(k, width)
    w0, w1, w2, w3 = work[batch], work[batch + 1], work[batch + 2], work[batch + 3]
    for g in range(groups):
        for b in range(batch):
            for t in range(width):
                work[b, t] = 0.0
        if fmt == FMT_Q4:
            for j in range(0, 16, 2):
                r0, r1 = d[g * 16 + j], d[g * 16 + j + 1]
                for t in range(width):
                    w0[t] = np.float32(r0[t] & 15)
                    w1[t] = np.float32(r0[t] >> 4)
                    w2[t] = np.float32(r1[t] & 15)
                    w3[t] = np.float32(r1[t] >> 4)
                # byte row j holds elements j (low nibble) and j + 16 (high nibble)
                k0 = g * 32 + j
                _apply_rows(w0, w1, w2, w3, x, k0, k0 + 16, k0 + 1, k0 + 17, work)
        else:
            for j in range(0, group, ROWS):
                k0 = g * group + j
                r0, r1, r2, r3 = d8[k0], d8[k0 + 1], d8[k0 + 2], d8[k0 + 3]
                for t in range(width):
                    w0[t] = np.float32(r0[t])
                    w1[t] = np.float32(r1[t])
                    w2[t] = np.float32(r2[t])
                    w3[t] = np.float32(r3[t])
                _apply_rows(w0, w1, w2, w3, x, k0, k0 + 1, k0 + 2, k0 + 3, work)
        _finish_group(scales, scales16, meta, tile, groups, g, group, x, work, out, col0)


@njit(parallel=True, **_JIT)
def linear_batch(data, scales, scales16, meta, mats, x, out, scratch):
    """out[b, cols of mats[i]] = W[mats[i]] @ x[b] for every listed matrix and every b.

    x: float32 (B, K); out: float32 (B, Σ padded rows);
    scratch: float32 (≥ Σ tiles, B + ROWS + 2, TILE) exactly: per-tile accumulators, converted
    rows and group parameters (see _finish_group).
    """
    n_mats = mats.shape[0]
    first_tile = np.zeros(n_mats + 1, np.int64)
    for i in range(n_mats):
        first_tile[i + 1] = first_tile[i] + meta[mats[i], M_TILES]
    batch = x.shape[0]
    for g in prange(first_tile[n_mats]):
        i = 0
        while g >= first_tile[i + 1]:
            i += 1
        _tile(data, scales, scales16, meta[mats[i]], g - first_tile[i], x, out, g * TILE, scratch[g])
