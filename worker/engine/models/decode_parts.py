"""numba pieces the fused row steps of every architecture share.

A step's rows are tokens: one per decoding sequence, or the consecutive tokens of a prompt
chunk; each row carries its own position and block table, so one code path serves both.

Every dispatched op takes `mm` = (tab, ops, scratch): the MatrixTable's arrays
(packing.TableArrays), the op table's codes (registry.OpTable.codes) and the kernels' scratch pair
(RowBuffers.scratch). Buffers come as one RowBuffers record `buf`.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from worker.engine.kernels.attention import store_kv
from worker.engine.kernels.ops import rmsnorm, rope, silu_mul
from worker.engine.kernels.packing import TILE
from worker.engine.kernels.registry import ATTENTION, BUCKET_LIMITS, MATMUL, ROW, variants_of
from worker.engine.models.common import FFN_DOWN, GATE_UP, QKV

_JIT = dict(cache=True, nogil=True)

_LIMIT_1, _LIMIT_2, _LIMIT_3 = BUCKET_LIMITS


# ---- the op table's dispatch: one branch per registry entry -------------------------------------
# numba cannot call through a table of functions without making them first-class (experimental,
# and an indirect call), so each op's dispatch is a chain of small jitted branches built from the
# registry when this module loads: `call(code, *args)` tests one entry's code and otherwise hands
# on to the next entry's branch: the compares of an if/elif, before a launch of milliseconds. A new
# registry entry gets its branch here without a line changed. The pieces are not cached on their
# own (numba keys a closure's cache by pickling what it closes over): the cached functions that
# call them hold their code.
_CHAIN = dict(nogil=True)


def _branch(code, run, otherwise):
    """call(c, *args): run(*args) when c == code, else otherwise(c, *args); the last branch of a
    chain (otherwise None) runs for any code (OpTable only makes codes of registered entries)."""
    if otherwise is None:
        @njit(**_CHAIN)
        def last(c, *args):
            run(*args)
        return last

    @njit(**_CHAIN)
    def branch(c, *args):
        if c == code:
            run(*args)
        else:
            otherwise(c, *args)
    return branch


def dispatch(op, runner):
    """The jitted call(code, *args) of `op`: runner(entry)(*args) for the registry entry of op
    whose code it is; runner(entry) adapts the step's arguments to entry.fn."""
    call = None
    for entry in reversed(tuple(variants_of(op).values())):
        call = _branch(entry.code, runner(entry), call)
    return call


def _matmul_runner(entry):
    fn, slot = entry.fn, entry.scratch

    @njit(**_CHAIN)
    def run(tab, mats, x, out, scratch):
        fn(tab.data, tab.scales, tab.scales16, tab.meta, mats, x, out, scratch[slot])
    return run


def _row_runner(entry):
    fn = entry.fn

    @njit(**_CHAIN)
    def run(tab, meta_row, token, out):
        fn(tab.data, tab.scales, tab.scales16, meta_row, token, out)
    return run


def _attention_runner(entry):
    return entry.fn  # attention variants take the step's arguments as they are


_matmul_call = dispatch("matmul", _matmul_runner)
_row_call = dispatch("row", _row_runner)
_attention_call = dispatch("attention", _attention_runner)


@njit(**_JIT)
def bucket_of(rows):
    """registry.bucket_of: the op table's column for a call of `rows` rows."""
    if rows <= _LIMIT_1:
        return 0
    if rows <= _LIMIT_2:
        return 1
    if rows <= _LIMIT_3:
        return 2
    return 3


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


# ---- row b of every 2-D buffer belongs to the step's b-th token ---------------------------------

@njit(**_JIT)
def matmul(mm, mats, x, out):
    """out[b] = W @ x[b] for every row of x, each weight read once for all rows, with the
    variant the op table names for a call of x.shape[0] rows.

    Both kernels compute every row exactly as if it were alone, so batching never changes a
    sequence's logits; int8 quantizes activations per 32 (as llama.cpp does) to use VNNI
    or AVX2 integer dot products, float32 keeps them exact (the bits of the yardstick matvec); the
    serial forms give their parallel twin's bits.
    """
    tab, ops, scratch = mm
    _matmul_call(ops[MATMUL, bucket_of(x.shape[0])], tab, mats, x, out, scratch)


@njit(**_JIT)
def embed_rows(mm, token_embd, tokens, x):
    """x[b] = row tokens[b] of matrix token_embd, with the row variant of the op table."""
    tab, ops, _ = mm
    for b in range(tokens.shape[0]):
        _row_call(ops[ROW, 0], tab, tab.meta[token_embd], tokens[b], x[b])


@njit(**_JIT)
def rmsnorm_rows(x, weight, eps, out, rows):
    for b in range(rows):
        rmsnorm(x[b], weight, eps, out[b])


@njit(**_JIT)
def add_rows(x, y, rows):
    for b in range(rows):
        add_into(x[b], y[b])


@njit(**_JIT)
def qkv_rows(mm, m, buf, rows):
    """Q, K and V of every row's normed state buf.h in one launch, copied into buf.q, buf.k, buf.v."""
    matmul(mm, m[QKV], buf.h[:rows], buf.qkv[:rows])
    q_rows, kv_rows = buf.q.shape[1], buf.k.shape[1]
    for b in range(rows):
        q, k, v = split_qkv(buf.qkv[b], q_rows, kv_rows)
        buf.q[b, :] = q
        buf.k[b, :] = k
        buf.v[b, :] = v


@njit(**_JIT)
def head_norm_rows(buf, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, rows):
    for b in range(rows):
        head_norm(buf.q[b], n_heads, head_dim, q_norm, eps)
        head_norm(buf.k[b], n_kv_heads, head_dim, k_norm, eps)


@njit(**_JIT)
def rope_rows(buf, positions, cos, sin, n_heads, n_kv_heads, head_dim, neox, rows):
    """Rotate every row's queries and keys by its position: halves (NEOX) or adjacent pairs."""
    for b in range(rows):
        c, s = cos[positions[b]], sin[positions[b]]
        rope(buf.q[b], n_heads, head_dim, c, s, neox)
        rope(buf.k[b], n_kv_heads, head_dim, c, s, neox)


@njit(**_JIT)
def attention_rows(mm, buf, kv, block_tables, positions, params, rows):
    """Store every row's K/V in its blocks of kv (attention.KVLayer), then attend each query over
    its sequence (params: attention.AttentionParams) into buf.att, with the attention variant the
    op table names for a step of `rows` rows (tiled or per row: the same bits)."""
    for b in range(rows):
        store_kv(kv.k_pool, kv.v_pool, kv.layer, block_tables[b], positions[b], buf.k[b:b + 1], buf.v[b:b + 1])
    _attention_call(mm[1][ATTENTION, bucket_of(rows)], buf.q[:rows], kv, block_tables, positions, params,
                    buf.att[:rows])


@njit(**_JIT)
def swiglu_ffn_rows(mm, m, norm_weight, eps, buf, rows):
    """x[b] += down(silu(gate(h)) * up(h)) with h = RMSNorm(x[b]), every row."""
    ff = buf.act.shape[1]
    rmsnorm_rows(buf.x, norm_weight, eps, buf.h, rows)
    matmul(mm, m[GATE_UP], buf.h[:rows], buf.gu[:rows])
    for b in range(rows):
        silu_mul(buf.gu[b, :ff], buf.gu[b, padded(ff):padded(ff) + ff], buf.act[b])
    matmul(mm, m[FFN_DOWN], buf.act[:rows], buf.proj[:rows])
    add_rows(buf.x, buf.proj, rows)


@njit(**_JIT)
def output_logits_rows(mm, output, norm_weight, eps, buf, logit_rows):
    """logits[i] = output @ RMSNorm(x[logit_rows[i]]): only the rows whose logits are wanted."""
    wanted = logit_rows.shape[0]
    for i in range(wanted):
        rmsnorm(buf.x[logit_rows[i]], norm_weight, eps, buf.h[i])
    out_mat = np.empty(1, np.int64)
    out_mat[0] = output
    matmul(mm, out_mat, buf.h[:wanted], buf.logits[:wanted])
