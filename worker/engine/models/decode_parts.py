"""numba pieces the fused decode steps of every architecture share.

`tab` is a MatrixTable's arrays as one tuple, (data, scales, scales16, meta), so the steps
pass the weights around as a single argument.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from worker.engine.kernels.matvec import linear
from worker.engine.kernels.ops import rmsnorm, silu_mul
from worker.engine.kernels.packing import TILE

_JIT = dict(cache=True, nogil=True)


@njit(**_JIT)
def padded(n):
    return -(-n // TILE) * TILE


@njit(**_JIT)
def matvec(tab, mats, x, out, tiles):
    linear(tab[0], tab[1], tab[2], tab[3], mats, x, out, tiles)


@njit(**_JIT)
def split_qkv(qkv, q_rows, kv_rows):
    """Views of Q, K and V in the output of one fused Q/K/V launch (each padded to a tile)."""
    k_off = padded(q_rows)
    v_off = k_off + padded(kv_rows)
    return qkv[:q_rows], qkv[k_off:k_off + kv_rows], qkv[v_off:v_off + kv_rows]


@njit(**_JIT)
def head_norm(v, n_heads, head_dim, weight, eps):
    """RMSNorm of each head of v in place (QK-norm)."""
    for hh in range(n_heads):
        part = v[hh * head_dim:(hh + 1) * head_dim]
        rmsnorm(part, weight, eps, part)


@njit(**_JIT)
def store_kv(k_cache, v_cache, layer, pos, k, v, n_kv, head_dim):
    for hh in range(n_kv):
        k_cache[layer, hh, pos] = k[hh * head_dim:(hh + 1) * head_dim]
        v_cache[layer, hh, pos] = v[hh * head_dim:(hh + 1) * head_dim]


@njit(**_JIT)
def add_into(x, y):
    """x += y[:len(x)] (y may be padded to a whole tile)."""
    for i in range(x.shape[0]):
        x[i] += y[i]


@njit(**_JIT)
def swiglu_ffn(tab, m, x, norm_weight, eps, h, gu, act, proj, tiles):
    """x += down(silu(gate(h)) * up(h)) with h = RMSNorm(x); m holds the layer's matrix ids."""
    ff = act.shape[0]
    rmsnorm(x, norm_weight, eps, h)
    matvec(tab, m[4:6], h, gu, tiles)
    silu_mul(gu[:ff], gu[padded(ff):padded(ff) + ff], act)
    matvec(tab, m[6:7], act, proj, tiles)
    add_into(x, proj)


@njit(**_JIT)
def output_logits(tab, output, x, norm_weight, eps, h, logits, tiles):
    rmsnorm(x, norm_weight, eps, h)
    out_mat = np.empty(1, np.int64)
    out_mat[0] = output
    matvec(tab, out_mat, h, logits, tiles)
