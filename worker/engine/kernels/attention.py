"""Paged KV cache kernels: store new keys/values, and attention over them (batched decode, and the
queries of one sequence).

The pool is two arrays: ``k_pool`` of shape (n_blocks, n_layers, n_kv_heads, head_dim, block_size)
and ``v_pool`` of shape (n_blocks, n_layers, n_kv_heads, block_size, head_dim), dtype float32,
uint16 (IEEE float16 bits: numba has no float16 scalar) or int8 (q8_0, with its scales:
kv_q8). Keys are stored transposed per block
(key_scores explains why) and after RoPE; values as rows. A sequence owns a block table (int32
array): entry i names the pool block that holds its tokens [i*block_size, (i+1)*block_size). For
one (block, layer, kv head) both slabs are contiguous. Element reads go through ``kv_load`` and
writes through ``kv_store_value`` (kv_element), so one source serves both dtypes.

Softmax is computed online over chunks of at most ``chunk`` keys (running max, rescaled sum and
accumulator), so no (T, context) score matrix exists: the scratch of one item is bounded by
``group_scratch``. Precision: q·k dot products and the value accumulator are float32 (they
are the vectorized hot loops); the running sum of exponentials is float64 (one add per key in an
already vectorized loop, so it costs nothing and keeps long contexts from losing small terms), and
the per-chunk rescale factors are float32. exp is fast_exp.exp_neg, which vectorizes (libm's expf
is called lane by lane). No -inf is ever used (fastmath assumes no infinities): the first chunk
initializes the running max.

Scheduling: numba splits a prange statically into one contiguous range per thread, so the item
order is chosen for balance and cache reuse (see each kernel).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from worker.engine.kernels.fast_exp import exp_neg
from worker.engine.kernels.key_scores import block_scores
from worker.engine.kernels.kv_element import kv_load, kv_store_value
from worker.engine.kernels.kv_q8 import k_slab, slab_scratch, store_k_head, store_v_head, v_slab
from worker.engine.kernels.prefetch import prefetch
from worker.engine.kernels.value_sums import value_sums

__all__ = ["AttentionParams", "HeadGroup", "KVLayer", "attention_per_row", "balanced_item", "kv_load",
           "kv_store_value", "store_kv", "paged_attention_decode", "attend_group", "group_scratch", "score_width",
           "softmax_chunk", "write_head"]

_JIT = dict(fastmath=True, cache=True, nogil=True)


class KVLayer(NamedTuple):
    """One layer's K/V, as attention reads them."""
    k_pool: np.ndarray  # (n_blocks, n_layers, n_kv_heads, head_dim, block_size): keys, each block transposed
    v_pool: np.ndarray  # (n_blocks, n_layers, n_kv_heads, block_size, head_dim): values
    layer: int  # the layer's index in the pools (a window pool numbers its layers apart)


class AttentionParams(NamedTuple):
    """What a layer's queries see, and how their work is cut."""
    window: int  # keys a query sees, itself included; <= 0: every earlier key
    scale: float  # the q·k factor, float32
    chunk: int  # keys scored at once by the online softmax (>= 1)
    threads: int  # threads the step runs on: how far a kv head's query heads are split (heads_per_item)


class HeadGroup(NamedTuple):
    """Query heads first .. first + count - 1, which all read kv head kv_head (GQA)."""
    first: int
    count: int
    kv_head: int

# Blocks ahead whose K slab attend_group prefetches (it prefetches a block's V slab when it scores
# its K, for the value pass after the chunk's softmax).
PREFETCH_AHEAD = 2


@njit(**_JIT)
def balanced_item(item, n):
    """(set, index) of work item `item` when every set has n items: set-major, and within a set
    the indices alternate from both ends (0, n-1, 1, n-2, ...). numba splits a prange statically
    into one contiguous range per thread; this order gives each thread about the same share of
    every set, and of the short and the long ends of each (rows of a chunk or the tiles of a run come
    in position order, i.e. in order of cost)."""
    s = item // n
    r = item - s * n
    half = r >> 1
    return s, (half if (r & 1) == 0 else n - 1 - half)


@njit(**_JIT)
def store_kv(k_pool, v_pool, layer, block_table, start, k, v):
    """Write k, v (T, n_kv_heads*head_dim) float32 of positions start..start+T-1 into the pools.

    Positions are mapped through block_table (int32); keys go in as a column of their block's
    transposed slab. uint16 pools get float16 rounding (RNE), int8 pools q8_0 (kv_q8).
    """
    n_kv = v_pool.shape[2]
    bs = v_pool.shape[3]
    d = v_pool.shape[4]
    for t in range(k.shape[0]):
        p = start + t
        bi = p // bs
        blk = block_table[bi]
        slot = p - bi * bs
        for kvh in range(n_kv):
            store_k_head(k_pool, blk, layer, kvh, slot, k[t], kvh * d, d)
            store_v_head(v_pool, blk, layer, kvh, slot, v[t], kvh * d, d)


@njit(parallel=True, **_JIT)
def paged_attention_decode(q, k_pool, v_pool, layer, block_tables, positions, window, scale, chunk, out, threads=1):
    """One query for each of B sequences sharing the pool (batched decode).

    q: (B, n_heads*head_dim) float32; block_tables: int32 (B, max_blocks), row b padded with
    anything past its used blocks; positions: int64 (B,), position of each query (keys
    0..positions[b] stored); out: (B, n_heads*head_dim). The query at position p attends keys
    [lo, p], lo = 0 if window <= 0 else max(0, p-window+1); query head h uses kv head
    h // (n_heads // n_kv_heads). chunk (>= 1) bounds the keys scored at once. Parallel over (B x kv heads): the query heads of one kv head
    share each read and float16 conversion of its K/V (attend_group). Where those items would
    leave a thread idle or unevenly loaded (one sequence of a model with 1-3 kv heads), a kv
    head's query heads are split into a few items (heads_per_item of `threads`, the threads the
    step runs on: numba's get_num_threads inside a kernel keeps it from being cached); a head's
    arithmetic is the same either way, so a row's result never depends on B or the thread count.
    """
    if chunk < 1:
        raise ValueError("paged_attention_decode: chunk must be >= 1")
    n_kv = v_pool.shape[2]
    d = v_pool.shape[4]
    n_b = q.shape[0]
    n_heads = q.shape[1] // d
    group = n_heads // n_kv
    per_item = heads_per_item(n_b, n_kv, group, threads)
    n_sets = n_heads // per_item
    kv = KVLayer(k_pool, v_pool, layer)
    params = AttentionParams(window, np.float32(scale), chunk, threads)
    for item in prange(n_b * n_sets):
        # Head-set-major (all sequences of head set 0, then set 1, ...): numba splits the range
        # statically into one contiguous part per thread, so each thread gets ~n_sets/threads
        # sets of EVERY sequence and the work stays balanced whatever the mix of context lengths
        # (sequence-major order gave one thread all the long sequences: up to 2x slower).
        # Within a set, rows alternate from both ends (0, B-1, 1, B-2, ...): the rows of a prompt
        # chunk come in position order, and a contiguous half of them would be all the short or
        # all the long contexts (with one kv head, Gemma's prefill ran 1:3 between the threads).
        hs, b = balanced_item(item, n_b)
        p = positions[b]
        lo = max(0, p - window + 1) if window > 0 else 0
        h0 = hs * per_item
        attend_group(q[b], HeadGroup(h0, per_item, h0 // group), kv, block_tables[b], lo, p + 1, params, out[b])


@njit(**_JIT)
def attention_per_row(q, kv, block_tables, positions, params, out):
    """The registry's "per_row" attention: paged_attention_decode for every row, whatever runs of
    one sequence the rows hold (arguments: decode_parts.attention_rows)."""
    paged_attention_decode(q, kv.k_pool, kv.v_pool, kv.layer, block_tables, positions, params.window, params.scale,
                           params.chunk, out, params.threads)


@njit(**_JIT)
def heads_per_item(n_b, n_kv, group, threads):
    """Query heads of one kv head that one work item attends together (a divisor of `group`):
    the most that still gives every thread its share. Together they read each K/V row once; apart,
    once per head, and at depth that is the cost: Qwen2.5-1.5B (6 query heads per kv head, 2 kv
    heads) decoding one sequence at depth 8k split per head read its KV 6 times and ran at 7.4
    tok/s (the weights alone allow ~17). Shares are even when the items divide among the threads,
    or close enough when each thread has 4 or more."""
    per_item = group
    while per_item > 1:
        items = n_b * n_kv * (group // per_item)
        if items % threads == 0 or items >= 4 * threads:
            return per_item
        per_item -= 1
        while group % per_item:
            per_item -= 1
    return 1


# ---- several query heads over one kv head (GQA) -------------------------------------------------

@njit(**_JIT)
def score_width(keys, block_size):
    """Scores kept per head for a chunk of `keys` keys: whole blocks, from the one holding the
    chunk's first key (at any slot) to the one holding its last."""
    return (keys // block_size + 2) * block_size


@njit(**_JIT)
def _group_values(kv, heads, table, c0, nc, weights, acc, v_scratch):
    """acc[hh] += Σ_j weights[hh, ks + j] v_j over the nc keys from key c0 (ks: its slot in its
    block) for the heads of HeadGroup `heads` (value_sums: each value row read and converted once
    for all of them)."""
    bs = kv.v_pool.shape[3]
    kb = c0 // bs
    ks = c0 - kb * bs
    w0 = ks
    j = 0
    while j < nc:
        if ks == bs:
            ks = 0
            kb += 1
        run = min(bs - ks, nc - j)
        value_sums(v_slab(kv.v_pool, table[kb], kv.layer, heads.kv_head, v_scratch), ks, run, weights, w0 + j, acc,
                   heads.count)
        j += run
        ks += run


@njit(**_JIT)
def attend_group(qv, group, kv, table, lo, hi, params, ov):
    """ov[h·d:(h+1)·d] = softmax(scale · q_h·K[lo:hi]) @ V[lo:hi] for the query heads h of
    HeadGroup `group`, which all read its kv head, over the KVLayer kv through block table
    `table` (hi > lo; params: AttentionParams, whose window the caller applied in lo).

    Online softmax per head over chunks of at most params.chunk keys; the heads share every read
    and float16 conversion of K and V (key_scores, value_sums). A chunk's scores are computed for
    whole blocks (key_scores): scores[hh, x] belongs to key kb0·block_size + x, kb0 the block of
    the chunk's first key. Scratch: group_scratch (one allocation)."""
    k_pool, v_pool, layer = kv
    h0, heads, kvh = group
    scale, chunk = params.scale, params.chunk
    bs = v_pool.shape[3]
    d = v_pool.shape[4]
    total, scores, acc, m, _ = group_scratch(heads, score_width(min(chunk, hi - lo), bs), d)
    k_scratch, v_scratch = slab_scratch(k_pool), slab_scratch(v_pool)  # q8_0 pools decode a block there
    qoff = h0 * d
    last = (hi - 1) // bs  # the table's entries past it may be anything: never prefetched
    for b in range(lo // bs, min(lo // bs + PREFETCH_AHEAD, last + 1)):
        prefetch(k_pool[table[b], layer, kvh])
    c0 = lo
    while c0 < hi:
        nc = min(chunk, hi - c0)
        kb = c0 // bs
        ks = c0 - kb * bs
        for b in range(kb, (c0 + nc - 1) // bs + 1):
            if b + PREFETCH_AHEAD <= last:
                prefetch(k_pool[table[b + PREFETCH_AHEAD], layer, kvh])
            prefetch(v_pool[table[b], layer, kvh])
            block_scores(k_slab(k_pool, table[b], layer, kvh, k_scratch), qv, qoff, scale, scores, (b - kb) * bs,
                         heads)
        for hh in range(heads):
            softmax_chunk(scores[hh, ks:ks + nc], c0 == lo, m, total, acc, hh)
        _group_values(kv, group, table, c0, nc, scores, acc, v_scratch)
        c0 += nc
    for hh in range(heads):
        write_head(acc, total, hh, ov, (h0 + hh) * d)


# ---- the per-head steps both attention kernels share (prompt_attention calls them too) ----------

@njit(**_JIT)
def group_scratch(heads, width, d):
    """One allocation (each costs ~0.4 µs, as much as the attention of a short context) holding the
    scratch of `heads` query heads: running sums (float64), scores (heads, width), accumulators
    (heads, d) and running maxima, float32; then `heads`·d float32 for the caller (gathered queries).
    Both kernels take their scratch from here so every per-head call sees the same array types."""
    raw = np.empty(heads + (heads * (width + 2 * d + 1) + 1) // 2, np.float64)
    total = raw[:heads]
    buf = raw[heads:].view(np.float32)
    at = heads * width
    scores = buf[:at].reshape((heads, width))
    acc = buf[at:at + heads * d].reshape((heads, d))
    at += heads * d
    m = buf[at:at + heads]
    at += heads
    extra = buf[at:at + heads * d]
    total[:] = 0.0
    acc[:] = 0.0
    return total, scores, acc, m, extra


@njit(**_JIT)
def softmax_chunk(w, first, m, total, acc, hh):
    """One chunk of head hh's online softmax: w (the chunk's scores) becomes exp(w - running max),
    their sum joins total[hh]; when the chunk raises the running max m[hh], what total[hh] and
    acc[hh] hold so far is rescaled first. `first`: the head's first chunk, which sets the max.

    A row's bits depend on this code: every attention kernel calls this one function."""
    nc = w.shape[0]
    cmax = w[0]
    for j in range(1, nc):
        cmax = max(cmax, w[j])
    if first:
        m[hh] = cmax
    elif cmax > m[hh]:
        alpha = exp_neg(m[hh] - cmax)
        total[hh] *= alpha
        a = acc[hh]
        for i in range(a.shape[0]):
            a[i] *= alpha
        m[hh] = cmax
    mh = m[hh]
    t = total[hh]
    for j in range(nc):
        e = exp_neg(w[j] - mh)
        w[j] = e
        t += e
    total[hh] = t


@njit(**_JIT)
def write_head(acc, total, hh, ov, base):
    """ov[base:base + d] = acc[hh] / total[hh]: head hh's finished attention output."""
    inv = np.float32(1.0 / total[hh])
    for i in range(acc.shape[1]):
        ov[base + i] = acc[hh, i] * inv
