"""numba pieces the fused row steps of every architecture share.

A step's rows are tokens: one per decoding sequence, or the consecutive tokens of a prompt
chunk; each row carries its own position and block table, so one code path serves both.

`tab` is a MatrixTable's arrays as one tuple, (data, scales, scales16, meta), so the steps
pass the weights around as a single argument.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from worker.engine.kernels.attention import store_kv
from worker.engine.kernels.matmul_batch import linear_batch
from worker.engine.kernels.matmul_i8 import linear_batch_i8
from worker.engine.kernels.ops import dequant_row, rmsnorm, silu_mul
from worker.engine.kernels.packing import TILE

_JIT = dict(cache=True, nogil=True)


@njit(**_JIT)
def padded(n):
    return -(-n // TILE) * TILE


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
def add_into(x, y):
    """x += y[:len(x)] (y may be padded to a whole tile)."""
    for i in range(x.shape[0]):
        x[i] += y[i]


# ---- row b of every 2-D buffer belongs to the step's b-th sequence --------------------------------

@njit(**_JIT)
def matmul(tab, mats, x, out, scratch):
    """out[b] = W @ x[b] for every row of x, each weight read once for all rows.

    scratch is a tuple (int8 flag, float32 scratch of linear_batch, that of linear_batch_i8).
    Both kernels compute every row exactly as if it were alone, so batching never changes a
    sequence's logits; int8 quantizes activations per 32 (as llama.cpp does) to use VNNI
    or AVX2 integer dot products, float32 keeps them exact (the bits of matvec.linear).
    """
    if scratch[0]:
        linear_batch_i8(tab[0], tab[1], tab[2], tab[3], mats, x, out, scratch[2])
    else:
        linear_batch(tab[0], tab[1], tab[2], tab[3], mats, x, out, scratch[1])


@njit(**_JIT)
def rmsnorm_rows(x, weight, eps, out, rows):
    for b in range(rows):
        rmsnorm(x[b], weight, eps, out[b])


@njit(**_JIT)
def add_rows(x, y, rows):
    for b in range(rows):
        add_into(x[b], y[b])


@njit(**_JIT)
def split_qkv_rows(qkv, q_out, k_out, v_out, rows):
    """Copy each row's Q, K and V out of one fused Q/K/V launch into contiguous buffers."""
    q_rows, kv_rows = q_out.shape[1], k_out.shape[1]
    for b in range(rows):
        q, k, v = split_qkv(qkv[b], q_rows, kv_rows)
        q_out[b, :] = q
        k_out[b, :] = k
        v_out[b, :] = v


@njit(**_JIT)
def store_kv_rows(k_pool, v_pool, layer, block_tables, positions, k, v, rows):
    for b in range(rows):
        store_kv(k_pool, v_pool, layer, block_tables[b], positions[b], k[b:b + 1], v[b:b + 1])


@njit(**_JIT)
def swiglu_ffn_rows(tab, m, x, norm_weight, eps, h, gu, act, proj, scratch, rows):
    """x[b] += down(silu(gate(h)) * up(h)) with h = RMSNorm(x[b]), every row."""
    ff = act.shape[1]
    rmsnorm_rows(x, norm_weight, eps, h, rows)
    matmul(tab, m[4:6], h[:rows], gu[:rows], scratch)
    for b in range(rows):
        silu_mul(gu[b, :ff], gu[b, padded(ff):padded(ff) + ff], act[b])
    matmul(tab, m[6:7], act[:rows], proj[:rows], scratch)
    add_rows(x, proj, rows)


@njit(**_JIT)
def output_logits_rows(tab, output, x, norm_weight, eps, h, logits, scratch, logit_rows):
    """logits[i] = output @ RMSNorm(x[logit_rows[i]]): only the rows whose logits are wanted."""
    wanted = logit_rows.shape[0]
    for i in range(wanted):
        rmsnorm(x[logit_rows[i]], norm_weight, eps, h[i])
    out_mat = np.empty(1, np.int64)
    out_mat[0] = output
    matmul(tab, out_mat, h[:wanted], logits[:wanted], scratch)


@njit(**_JIT)
def embed_rows(tab, token_embd, tokens, x):
    for b in range(tokens.shape[0]):
        dequant_row(tab[0], tab[1], tab[2], tab[3][token_embd], tokens[b], x[b])
