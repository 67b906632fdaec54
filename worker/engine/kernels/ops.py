"""Small numba kernels used inside the fused decode step (norms, RoPE, gating, row lookup).

All write into preallocated `out` arrays; none allocates per call except where noted.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from worker.engine.kernels.fast_exp import sigmoid
from worker.engine.kernels.half import f16_to_f32
from worker.engine.kernels.packing import (FMT_F32, FMT_Q4, FMT_Q6, LAYOUT_QUADS, M_BIAS, M_DATA, M_FMT, M_GROUP, M_K,
                                           M_LAYOUT, M_PARAM, M_SCALE, PARAM_F16, PARAM_STEP8, QUAD,
                                           SIX_BIT_OFFSET, SIX_BIT_ROWS, TILE, param_position,
                                           unit_offset)

_JIT = dict(fastmath=True, cache=True, nogil=True)


@njit(**_JIT)
def rmsnorm(x, weight, eps, out):
    """out = x / rms(x) * weight; out may be x itself. The sum of squares is kept in float64."""
    ss = 0.0
    for i in range(x.shape[0]):
        ss += np.float64(x[i]) * x[i]
    inv = np.float32(1.0 / np.sqrt(ss / x.shape[0] + eps))
    for i in range(x.shape[0]):
        out[i] = x[i] * inv * weight[i]


@njit(**_JIT)
def rope(v, n_heads, head_dim, cos, sin, neox):
    """Rotate each head of v in place: element i with i + head_dim/2 (NEOX layout), or the
    adjacent pairs (2i, 2i+1) ("normal" GGUF layout)."""
    half = head_dim // 2
    stride, partner = (1, half) if neox else (2, 1)
    for h in range(n_heads):
        base = h * head_dim
        for i in range(half):
            ia = base + stride * i
            ib = ia + partner
            a = v[ia]
            b = v[ib]
            v[ia] = a * cos[i] - b * sin[i]
            v[ib] = a * sin[i] + b * cos[i]


@njit(**_JIT)
def silu_mul(gate, up, out):
    """out = silu(gate) * up = gate * sigmoid(gate) * up (vectorized: fast_exp)."""
    for i in range(out.shape[0]):
        g = gate[i]
        out[i] = g * sigmoid(g) * up[i]


_GELU_C2 = np.float32(2.0 * math.sqrt(2.0 / math.pi))
_GELU_A = np.float32(0.044715)


@njit(**_JIT)
def gelu_tanh_mul(gate, up, out):
    """out = gelu_tanh(gate) * up; 0.5 * (1 + tanh(z)) is sigmoid(2z), which vectorizes."""
    for i in range(out.shape[0]):
        g = gate[i]
        out[i] = g * sigmoid(_GELU_C2 * (g + _GELU_A * g * g * g)) * up[i]


@njit(**_JIT)
def _group_value(data, scales, scales16, param, index):
    """Group parameter `index` of a matrix whose parameters are of type param (packing.PARAM_*)."""
    if param == PARAM_STEP8:
        return np.float32(np.int8(data[index]))
    return f16_to_f32(scales16[index]) if param == PARAM_F16 else scales[index]


@njit(**_JIT)
def _code_at(quads, t, r):
    """Offset of output t's byte in code row r of a tile, in LAYOUT_ROWS or LAYOUT_QUADS
    (packing.quad_lanes: dword 4 (t // 16) + t % 4 of vector (t % 16) // 4, byte r % 4)."""
    if not quads:
        return r * TILE + t
    lane = 4 * (t // 16) + t % 4
    return (r // QUAD) * QUAD * TILE + ((t % 16) // 4) * TILE + lane * QUAD + r % QUAD


@njit(**_JIT)
def dequant_row(data, scales, scales16, meta, token, out):
    """Row `token` of a packed (n, K) matrix, dequantized into out (K,): embedding lookups."""
    k = meta[M_K]
    tile = token // TILE
    t = token % TILE
    quads = meta[M_LAYOUT] == LAYOUT_QUADS
    fmt = meta[M_FMT]
    if fmt == FMT_F32:
        start = meta[M_DATA] + tile * k * TILE * 4
        d = data[start:start + k * TILE * 4].view(np.float32).reshape(k, TILE)
        for i in range(k):
            out[i] = d[i, t]
        return
    group = meta[M_GROUP]
    groups = k // group
    param = meta[M_PARAM]
    pt = param_position(t) if quads else t  # where output t's parameters sit among the TILE
    for g in range(groups):
        at = (tile * groups + g) * TILE + pt
        sc = _group_value(data, scales, scales16, param, meta[M_SCALE] + at)
        bi = _group_value(data, scales, scales16, param, meta[M_BIAS] + at) if meta[M_BIAS] >= 0 else np.float32(0.0)
        u = unit_offset(meta, tile, g)
        if u >= 0:  # factored parameters: step × unit (packing)
            sc = sc * f16_to_f32(scales16[u + pt])
            if meta[M_BIAS] >= 0:
                bi = bi * f16_to_f32(scales16[u + TILE + pt])
        if fmt == FMT_Q4:
            base = meta[M_DATA] + tile * (k // 2) * TILE
            for j in range(16):
                v = data[base + _code_at(quads, t, g * 16 + j)]
                out[g * 32 + j] = sc * np.float32(v & 15) + bi
                out[g * 32 + j + 16] = sc * np.float32(v >> 4) + bi
        elif fmt == FMT_Q6:  # packing: per group 8 nibble rows, then 4 rows of the top 2 bits
            base = meta[M_DATA] + (tile * groups + g) * SIX_BIT_ROWS * TILE
            for j in range(group):
                nibbles = data[base + _code_at(quads, t, j % 8)] >> (4 * (j // 8))
                top = data[base + _code_at(quads, t, 8 + j % 4)] >> (2 * (j // 4))
                code = np.int32((nibbles & 15) | ((top & 3) << 4)) - SIX_BIT_OFFSET
                out[g * group + j] = sc * np.float32(code) + bi
        else:
            base = meta[M_DATA] + tile * k * TILE
            for j in range(group):
                out[g * group + j] = sc * np.float32(np.int8(data[base + _code_at(quads, t, g * group + j)])) + bi
