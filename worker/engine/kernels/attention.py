"""Paged KV cache kernels: store new keys/values, and attention over them (prefill and batched decode).

The pool is two arrays ``k_pool`` and ``v_pool`` of shape
(n_blocks, n_layers, n_kv_heads, block_size, head_dim), dtype float32 or uint16 (IEEE float16
bits: numba has no float16 scalar). A sequence owns a block table (int32 array): entry i names the
pool block that holds its tokens [i*block_size, (i+1)*block_size). Keys are stored after RoPE.
For one (block, layer, kv head) the (block_size, head_dim) slab is contiguous, so the inner loops
run over head_dim on contiguous memory and vectorize (uint16 through vcvtph2ps).

One kernel source serves both pool dtypes: element reads go through ``kv_load`` and writes
through ``kv_store_value``, which numba resolves at typing time (identity for float32, a float16
conversion for uint16).

Softmax is computed online over chunks of at most ``chunk`` keys (running max, rescaled sum and
accumulator), so no (T, context) score matrix exists: the scratch of one (query, head) item is
min(chunk, its key count) + head_dim float32. Precision: q·k dot products and the value
accumulator are float32 (they are the vectorized hot loops); the running sum of exponentials is
float64 (one add per key in an already vectorized loop, so it costs nothing and keeps long
contexts from losing small terms), and the per-chunk rescale factors are float32. exp is
fast_exp.exp_neg, which vectorizes (libm's expf is called lane by lane). No -inf is ever used
(fastmath assumes no infinities): the first chunk initializes the running max.

Scheduling: numba splits a prange statically into one contiguous range per thread, so the item
order is chosen for balance and cache reuse (see each kernel).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from worker.engine.kernels.fast_exp import exp_neg
from worker.engine.kernels.half import f16_to_f32, f32_to_f16

_JIT = dict(fastmath=True, cache=True, nogil=True)


def kv_load(x):
    """Pool element → float32 (Python fallback; inside numba the overload below is used)."""
    if isinstance(x, np.uint16):
        return np.float32(np.uint16(x).view(np.float16))
    return np.float32(x)


def kv_store_value(x, marker):
    """float value → pool element of marker's dtype (marker: the pool array or one of its elements)."""
    dtype = marker.dtype
    if dtype == np.uint16:
        return np.float32(x).astype(np.float16).view(np.uint16)
    return np.float32(x)


@overload(kv_load)
def _kv_load_impl(x):
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:
        return lambda x: f16_to_f32(x)
    return None


@overload(kv_store_value)
def _kv_store_value_impl(x, marker):
    dtype = marker.dtype if isinstance(marker, types.Array) else marker
    if dtype == types.float32:
        return lambda x, marker: np.float32(x)
    if dtype == types.uint16:
        return lambda x, marker: f32_to_f16(np.float32(x))
    return None


@njit(**_JIT)
def store_kv(k_pool, v_pool, layer, block_table, start, k, v):
    """Write k, v (T, n_kv_heads*head_dim) float32 of positions start..start+T-1 into the pool.

    Positions are mapped through block_table (int32); uint16 pools get float16 rounding (RNE).
    """
    n_kv = k_pool.shape[2]
    bs = k_pool.shape[3]
    d = k_pool.shape[4]
    for t in range(k.shape[0]):
        p = start + t
        bi = p // bs
        blk = block_table[bi]
        slot = p - bi * bs
        for kvh in range(n_kv):
            kd = k_pool[blk, layer, kvh, slot]
            vd = v_pool[blk, layer, kvh, slot]
            base = kvh * d
            for i in range(d):
                kd[i] = kv_store_value(k[t, base + i], k_pool)
                vd[i] = kv_store_value(v[t, base + i], v_pool)


@njit(**_JIT)
def _scores_run(q, rows, ks, run, scale, out, j):
    """out[j + r] = scale * q·rows[ks + r] for r < run; rows is a pool slab (block_size, d) or
    float32 keys converted from one. Four keys at a time share each load of q."""
    d = rows.shape[1]
    r = 0
    while r + 4 <= run:
        k0 = rows[ks + r]
        k1 = rows[ks + r + 1]
        k2 = rows[ks + r + 2]
        k3 = rows[ks + r + 3]
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        for i in range(d):
            qi = q[i]
            s0 += qi * kv_load(k0[i])
            s1 += qi * kv_load(k1[i])
            s2 += qi * kv_load(k2[i])
            s3 += qi * kv_load(k3[i])
        out[j + r] = s0 * scale
        out[j + r + 1] = s1 * scale
        out[j + r + 2] = s2 * scale
        out[j + r + 3] = s3 * scale
        r += 4
    while r < run:
        k0 = rows[ks + r]
        s0 = np.float32(0.0)
        for i in range(d):
            s0 += q[i] * kv_load(k0[i])
        out[j + r] = s0 * scale
        r += 1


@njit(**_JIT)
def _values_run(rows, ks, run, weights, j, acc):
    """acc += Σ_r weights[j + r] · rows[ks + r] for r < run (rows as in _scores_run)."""
    d = rows.shape[1]
    r = 0
    while r + 4 <= run:
        v0 = rows[ks + r]
        v1 = rows[ks + r + 1]
        v2 = rows[ks + r + 2]
        v3 = rows[ks + r + 3]
        e0 = weights[j + r]
        e1 = weights[j + r + 1]
        e2 = weights[j + r + 2]
        e3 = weights[j + r + 3]
        for i in range(d):
            acc[i] += (e0 * kv_load(v0[i]) + e1 * kv_load(v1[i])) + (e2 * kv_load(v2[i]) + e3 * kv_load(v3[i]))
        r += 4
    while r < run:
        v0 = rows[ks + r]
        e0 = weights[j + r]
        for i in range(d):
            acc[i] += e0 * kv_load(v0[i])
        r += 1


@njit(**_JIT)
def _chunk_scores(q, k_pool, layer, kvh, table, kb, ks, nc, scale, buf):
    """buf[:nc] = scale * q·k for nc consecutive keys starting at slot ks of table block kb.

    Walks runs of keys inside one block (a contiguous (block_size, d) slab). Returns the max
    score of the chunk.
    """
    bs = k_pool.shape[3]
    j = 0
    while j < nc:
        if ks == bs:
            ks = 0
            kb += 1
        run = min(bs - ks, nc - j)
        _scores_run(q, k_pool[table[kb], layer, kvh], ks, run, scale, buf, j)
        j += run
        ks += run
    cmax = buf[0]
    for j in range(1, nc):
        cmax = max(cmax, buf[j])
    return cmax


@njit(**_JIT)
def _chunk_values(v_pool, layer, kvh, table, kb, ks, nc, weights, acc):
    """acc += sum_j weights[j] * v_j over nc consecutive keys from slot ks of table block kb."""
    bs = v_pool.shape[3]
    j = 0
    while j < nc:
        if ks == bs:
            ks = 0
            kb += 1
        run = min(bs - ks, nc - j)
        _values_run(v_pool[table[kb], layer, kvh], ks, run, weights, j, acc)
        j += run
        ks += run


@njit(**_JIT)
def _attend_one(qv, qoff, k_pool, v_pool, layer, kvh, table, lo, hi, scale, chunk, ov, ooff):
    """ov[ooff:ooff+d] = softmax(scale * q·K[lo:hi]) @ V[lo:hi] for one query head (hi > lo).

    qv[qoff:qoff+d] is the query head; K/V rows are read from kv head `kvh` of `layer` through
    `table`. Online softmax over chunks of at most `chunk` keys; scratch is
    min(chunk, hi-lo) + d float32.
    """
    bs = k_pool.shape[3]
    d = k_pool.shape[4]
    ce = min(chunk, hi - lo)
    buf = np.empty(ce + d, np.float32)
    w = buf[:ce]
    acc = buf[ce:]
    for i in range(d):
        acc[i] = 0.0
    q = qv[qoff:qoff + d]
    m = np.float32(0.0)
    total = 0.0  # float64 running sum of exponentials
    c0 = lo
    while c0 < hi:
        nc = min(chunk, hi - c0)
        kb = c0 // bs
        ks = c0 - kb * bs
        cmax = _chunk_scores(q, k_pool, layer, kvh, table, kb, ks, nc, scale, w)
        # Online softmax: rescale what was accumulated when the running max grows.
        if c0 == lo:
            m = cmax
        elif cmax > m:
            alpha = exp_neg(m - cmax)
            total *= alpha
            for i in range(d):
                acc[i] *= alpha
            m = cmax
        for j in range(nc):
            e = exp_neg(w[j] - m)
            w[j] = e
            total += e
        _chunk_values(v_pool, layer, kvh, table, kb, ks, nc, w, acc)
        c0 += nc
    inv = np.float32(1.0 / total)
    for i in range(d):
        ov[ooff + i] = acc[i] * inv


@njit(parallel=True, **_JIT)
def paged_attention(q, k_pool, v_pool, layer, block_table, start, window, scale, chunk, out):
    """Attention of T consecutive queries of one sequence over its paged K/V.

    q: (T, n_heads*head_dim) float32 at positions start..start+T-1, whose K/V (these T tokens
    included) are already stored; block_table: int32 (>= ceil((start+T)/block_size) entries).
    Query at position p attends keys [lo, p], lo = 0 if window <= 0 else max(0, p-window+1).
    Query head h uses kv head h // (n_heads // n_kv_heads). out: (T, n_heads*head_dim) float32.
    chunk (>= 1) bounds the keys scored at once. Parallel over (T x n_heads).
    """
    if chunk < 1:
        raise ValueError("paged_attention: chunk must be >= 1")
    n_kv = k_pool.shape[2]
    d = k_pool.shape[4]
    n_t = q.shape[0]
    n_heads = q.shape[1] // d
    group = n_heads // n_kv
    sc = np.float32(scale)
    for item in prange(n_t * n_heads):
        # Head-major; within a head, t alternates short/long contexts (0, T-1, 1, T-2, ...) so
        # the static split of the item range gives each thread a similar amount of work.
        h = item // n_t
        r = item - h * n_t
        half = r >> 1
        t = half if (r & 1) == 0 else n_t - 1 - half
        p = start + t
        lo = max(0, p - window + 1) if window > 0 else 0
        _attend_one(q[t], h * d, k_pool, v_pool, layer, h // group, block_table, lo, p + 1, sc, chunk,
                    out[t], h * d)


@njit(parallel=True, **_JIT)
def paged_attention_decode(q, k_pool, v_pool, layer, block_tables, positions, window, scale, chunk, out):
    """One query for each of B sequences sharing the pool (batched decode).

    q: (B, n_heads*head_dim) float32; block_tables: int32 (B, max_blocks), row b padded with
    anything past its used blocks; positions: int64 (B,), position of each query (keys
    0..positions[b] stored); out: (B, n_heads*head_dim). Same masking and GQA as
    paged_attention. chunk >= 1. Parallel over (B x kv heads): the query heads of one kv head
    share each read and float16 conversion of its K/V (_attend_group). With fewer than 4 such items
    (one sequence of a model with 1-3 kv heads) each query head is its own item, so both threads
    work; a head's arithmetic is the same either way, so a row's result never depends on B.
    """
    if chunk < 1:
        raise ValueError("paged_attention_decode: chunk must be >= 1")
    n_kv = k_pool.shape[2]
    d = k_pool.shape[4]
    n_b = q.shape[0]
    n_heads = q.shape[1] // d
    group = n_heads // n_kv
    per_item = group if n_b * n_kv >= 4 else 1
    n_sets = n_heads // per_item
    sc = np.float32(scale)
    for item in prange(n_b * n_sets):
        # Head-set-major (all sequences of head set 0, then set 1, ...): numba splits the range
        # statically into one contiguous part per thread, so each thread gets ~n_sets/threads
        # sets of EVERY sequence and the work stays balanced whatever the mix of context lengths
        # (sequence-major order gave one thread all the long sequences: up to 2x slower).
        # Within a set, rows alternate from both ends (0, B-1, 1, B-2, ...): the rows of a prompt
        # chunk come in position order, and a contiguous half of them would be all the short or
        # all the long contexts (with one kv head, Gemma's prefill ran 1:3 between the threads).
        hs = item // n_b
        r = item - hs * n_b
        half = r >> 1
        b = half if (r & 1) == 0 else n_b - 1 - half
        p = positions[b]
        lo = max(0, p - window + 1) if window > 0 else 0
        h0 = hs * per_item
        _attend_group(q[b], h0, per_item, k_pool, v_pool, layer, h0 // group, block_tables[b], lo, p + 1, sc,
                      chunk, out[b])


# ---- several query heads over one kv head (GQA) -------------------------------------------------

@njit(**_JIT)
def group_scratch_size(heads, keys, block_size, d):
    """float32 elements _attend_group needs: scores and accumulators per head, one block of K
    and of V as float32, the running maxima."""
    return heads * (keys + d + 1) + 2 * block_size * d


@njit(**_JIT)
def _slab_to_f32(slab, ks, run, dst):
    """dst[:run] = the pool rows slab[ks:ks + run] as float32 (one conversion per element)."""
    d = slab.shape[1]
    for r in range(run):
        src = slab[ks + r]
        row = dst[r]
        for i in range(d):
            row[i] = kv_load(src[i])


@njit(**_JIT)
def _group_scores(qv, h0, heads, k_pool, layer, kvh, table, kb, ks, nc, scale, keys, scores):
    """scores[hh, :nc] = scale * q_{h0+hh}·k for nc consecutive keys from slot ks of table block kb.

    With several heads, each block's run of keys is converted to float32 once (into `keys`) and
    read by every head; one head reads the pool directly. Both go through _scores_run, and the
    conversion is exact, so a head's scores have the same bits either way."""
    bs = k_pool.shape[3]
    d = k_pool.shape[4]
    j = 0
    while j < nc:
        if ks == bs:
            ks = 0
            kb += 1
        run = min(bs - ks, nc - j)
        slab = k_pool[table[kb], layer, kvh]
        if heads == 1:
            _scores_run(qv[h0 * d:(h0 + 1) * d], slab, ks, run, scale, scores[0], j)
        else:
            _slab_to_f32(slab, ks, run, keys)
            for hh in range(heads):
                _scores_run(qv[(h0 + hh) * d:(h0 + hh + 1) * d], keys, 0, run, scale, scores[hh], j)
        j += run
        ks += run


@njit(**_JIT)
def _group_values(v_pool, layer, kvh, table, kb, ks, nc, heads, weights, values, acc):
    """acc[hh] += Σ_j weights[hh, j] v_j over nc consecutive keys from slot ks of table block kb,
    each block's run of values converted to float32 once for the whole group (as _group_scores)."""
    bs = v_pool.shape[3]
    j = 0
    while j < nc:
        if ks == bs:
            ks = 0
            kb += 1
        run = min(bs - ks, nc - j)
        slab = v_pool[table[kb], layer, kvh]
        if heads == 1:
            _values_run(slab, ks, run, weights[0], j, acc[0])
        else:
            _slab_to_f32(slab, ks, run, values)
            for hh in range(heads):
                _values_run(values, 0, run, weights[hh], j, acc[hh])
        j += run
        ks += run


@njit(**_JIT)
def _attend_group(qv, h0, heads, k_pool, v_pool, layer, kvh, table, lo, hi, scale, chunk, ov):
    """ov[h·d:(h+1)·d] = softmax(scale · q_h·K[lo:hi]) @ V[lo:hi] for the query heads
    h = h0 .. h0+heads-1, which all read kv head `kvh` (hi > lo).

    The same online softmax as _attend_one, per head; the heads share every read and float16
    conversion of K and V. Scratch: one allocation (each one costs ~0.4 µs, as much as the
    attention of a short context) of group_scratch_size(heads, min(chunk, hi-lo), block_size, d)
    float32 plus `heads` float64 (the running sums of exponentials)."""
    bs = k_pool.shape[3]
    d = k_pool.shape[4]
    ce = min(chunk, hi - lo)
    raw = np.empty(heads + (group_scratch_size(heads, ce, bs, d) + 1) // 2, np.float64)
    total = raw[:heads]
    buf = raw[heads:].view(np.float32)
    at = heads * ce
    scores = buf[:at].reshape((heads, ce))
    acc = buf[at:at + heads * d].reshape((heads, d))
    at += heads * d
    keys = buf[at:at + bs * d].reshape((bs, d))
    at += bs * d
    values = buf[at:at + bs * d].reshape((bs, d))
    at += bs * d
    m = buf[at:at + heads]
    total[:] = 0.0
    acc[:] = 0.0
    c0 = lo
    while c0 < hi:
        nc = min(chunk, hi - c0)
        kb = c0 // bs
        ks = c0 - kb * bs
        _group_scores(qv, h0, heads, k_pool, layer, kvh, table, kb, ks, nc, scale, keys, scores)
        for hh in range(heads):
            w = scores[hh]
            cmax = w[0]
            for j in range(1, nc):
                cmax = max(cmax, w[j])
            # Online softmax: rescale what was accumulated when the running max grows.
            if c0 == lo:
                m[hh] = cmax
            elif cmax > m[hh]:
                alpha = exp_neg(m[hh] - cmax)
                total[hh] *= alpha
                a = acc[hh]
                for i in range(d):
                    a[i] *= alpha
                m[hh] = cmax
            mh = m[hh]
            t = total[hh]
            for j in range(nc):
                e = exp_neg(w[j] - mh)
                w[j] = e
                t += e
            total[hh] = t
        _group_values(v_pool, layer, kvh, table, kb, ks, nc, heads, scores, values, acc)
        c0 += nc
    for hh in range(heads):
        inv = np.float32(1.0 / total[hh])
        base = (h0 + hh) * d
        for i in range(d):
            ov[base + i] = acc[hh, i] * inv
