"""Paged KV cache kernels (worker/engine/kernels/attention.py) against float64 numpy math.

Pools are filled with NaN everywhere a kernel must not read (other layers, unused blocks, slots
past the stored context, padding of block tables), so a wrong block, layer, slot or a look into
the future shows up as NaN instead of a plausible number.

Tolerance: scores and the value accumulator are float32 (dot products of <= 256 terms, sums of
<= 20 weighted rows) and exp is a ~3e-7-relative polynomial; with unit-scale data that is ~1e-6
relative error on each output, which is a convex combination of value rows. The tests allow
2e-5 * max|V| (20x margin), far below what any indexing or masking mistake produces.
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from tests.kernels.yardsticks import paged_attention
from worker.engine.kernels.attention import (AttentionParams, HeadGroup, KVLayer, attend_group, heads_per_item,
                                             kv_load, kv_store_value, paged_attention_decode, store_kv)
from worker.engine.kernels.half import f16_to_f32, f32_to_f16

N_LAYERS = 2
LAYER = 1
F16_NAN = np.uint16(0x7E00)


# ---------------------------------------------------------------------------------------------
# helpers


def _as_f64(pool: np.ndarray) -> np.ndarray:
    if pool.dtype == np.uint16:
        return pool.view(np.float16).astype(np.float64)
    return pool.astype(np.float64)


def _encode(x: np.ndarray, dtype) -> np.ndarray:
    """float32 values → pool dtype (float16 bits for uint16)."""
    if dtype == np.uint16:
        return x.astype(np.float16).view(np.uint16)
    return x.astype(np.float32)


def _nan_pool(n_blocks, n_kv, block_size, d, dtype, keys=False):
    """A NaN-filled pool: K pools hold each block transposed, (head_dim, block_size)."""
    shape = (n_blocks, N_LAYERS, n_kv) + ((d, block_size) if keys else (block_size, d))
    pool = np.empty(shape, dtype)
    pool[...] = F16_NAN if dtype == np.uint16 else np.nan
    return pool


def _key_rows(k_pool):
    """A view of a K pool indexed like a V pool: [block, layer, kv head, slot, dim]."""
    return np.swapaxes(k_pool, 3, 4)


def _fill(pool, table, n_tokens, rng):
    """Random unit-scale K/V for positions [0, n_tokens) of LAYER through table; returns them (f32)."""
    _, _, n_kv, bs, d = pool.shape
    vals = rng.standard_normal((n_tokens, n_kv, d)).astype(np.float32)
    for p in range(n_tokens):
        pool[table[p // bs], LAYER, :, p % bs, :] = _encode(vals[p], pool.dtype)
    return vals


def reference(q, k_pool, v_pool, layer, table, start, window, scale):
    """float64 attention: gather K/V through the block table, causal + window mask, GQA, softmax."""
    n_t = q.shape[0]
    _, _, n_kv, bs, d = v_pool.shape
    n_heads = q.shape[1] // d
    group = n_heads // n_kv
    n_ctx = start + n_t
    pos = np.arange(n_ctx)
    blocks = np.asarray(table)[pos // bs]
    keys = _as_f64(_key_rows(k_pool)[blocks, layer, :, pos % bs, :])  # (S, KVH, D)
    values = _as_f64(v_pool[blocks, layer, :, pos % bs, :])
    out = np.zeros((n_t, n_heads * d))
    for t in range(n_t):
        p = start + t
        lo = max(0, p - window + 1) if window > 0 else 0
        for h in range(n_heads):
            qh = q[t, h * d:(h + 1) * d].astype(np.float64)
            s = keys[lo:p + 1, h // group] @ qh * scale
            w = np.exp(s - s.max())
            w /= w.sum()
            out[t, h * d:(h + 1) * d] = w @ values[lo:p + 1, h // group]
    return out


# (n_heads, n_kv_heads, head_dim): GQA ratios 1 and 3, head_dim 64 and 256 (value_sums' vector
# code), and 40 (its plain loop).
SHAPES = [(4, 4, 64), (6, 2, 64), (2, 2, 256), (3, 1, 256), (2, 1, 40)]
DTYPES = [np.float32, np.uint16]


# ---------------------------------------------------------------------------------------------
# paged_attention against the float64 reference


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h%d-kv%d-d%d" % s)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_matches_reference(dtype, shape, block_size, window):
    n_heads, n_kv, d = shape
    rng = np.random.default_rng([DTYPES.index(dtype), SHAPES.index(shape), block_size, window])
    scale = 1.0 / np.sqrt(d)
    for n_t in (1, 7):
        for start in (0, 13):
            n_ctx = start + n_t
            used = -(-n_ctx // block_size)
            n_blocks = used + 5
            table = rng.permutation(n_blocks)[:used].astype(np.int32)  # shuffled, non-contiguous
            k_pool = _nan_pool(n_blocks, n_kv, block_size, d, dtype, keys=True)
            v_pool = _nan_pool(n_blocks, n_kv, block_size, d, dtype)
            _fill(_key_rows(k_pool), table, n_ctx, rng)
            vals = _fill(v_pool, table, n_ctx, rng)
            # Scaled up so softmax is far from uniform and the running max moves between chunks.
            q = (3.0 * rng.standard_normal((n_t, n_heads * d))).astype(np.float32)
            expected = reference(q, k_pool, v_pool, LAYER, table, start, window, scale)
            tol = 2e-5 * np.abs(vals).max()
            for chunk in (1, 3, 16, 1000):
                out = np.full((n_t, n_heads * d), np.nan, np.float32)
                paged_attention(q, k_pool, v_pool, LAYER, table, start, window, scale, chunk, out)
                np.testing.assert_allclose(out, expected, rtol=0, atol=tol,
                                           err_msg=f"T={n_t} start={start} chunk={chunk}")


def test_paged_attention_long_context_many_chunks():
    """A longer context (several hundred keys, many blocks and chunks, a window inside it)."""
    rng = np.random.default_rng(7)
    n_heads, n_kv, d, bs = 9, 3, 64, 16
    start, n_t = 600, 5
    used = -(-(start + n_t) // bs)
    table = rng.permutation(used + 3)[:used].astype(np.int32)
    for dtype in DTYPES:
        k_pool = _nan_pool(used + 3, n_kv, bs, d, dtype, keys=True)
        v_pool = _nan_pool(used + 3, n_kv, bs, d, dtype)
        _fill(_key_rows(k_pool), table, start + n_t, rng)
        vals = _fill(v_pool, table, start + n_t, rng)
        q = (3.0 * rng.standard_normal((n_t, n_heads * d))).astype(np.float32)
        for window in (0, 100):
            expected = reference(q, k_pool, v_pool, LAYER, table, start, window, 0.125)
            for chunk in (7, 64, 4096):
                out = np.zeros((n_t, n_heads * d), np.float32)
                paged_attention(q, k_pool, v_pool, LAYER, table, start, window, 0.125, chunk, out)
                np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5 * np.abs(vals).max())


# ---------------------------------------------------------------------------------------------
# batched decode


@njit
def _decode_from_njit(q, k_pool, v_pool, layer, block_tables, positions, window, scale, chunk, out):
    paged_attention_decode(q, k_pool, v_pool, layer, block_tables, positions, window, scale, chunk, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 1, 256)], ids=lambda s: "h%d-kv%d-d%d" % s)
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("chunk", [3, 1000])
def test_decode_equals_per_sequence_attention(dtype, shape, window, chunk):
    n_heads, n_kv, d = shape
    bs = 4
    lengths = [1, 4, 5, 23, 9, 16]  # keys stored per sequence; the query sits at length - 1
    rng = np.random.default_rng(11)
    used = [-(-n // bs) for n in lengths]
    max_blocks = max(used) + 2
    n_blocks = sum(used) + 4  # the last 4 blocks stay NaN and serve as padding
    perm = rng.permutation(n_blocks).astype(np.int32)
    garbage = perm[sum(used):]
    tables = np.empty((len(lengths), max_blocks), np.int32)
    at = 0
    for b, n in enumerate(used):
        tables[b] = rng.choice(garbage, max_blocks)
        tables[b, :n] = perm[at:at + n]
        at += n
    k_pool = _nan_pool(n_blocks, n_kv, bs, d, dtype, keys=True)
    v_pool = _nan_pool(n_blocks, n_kv, bs, d, dtype)
    for b, n in enumerate(lengths):
        _fill(_key_rows(k_pool), tables[b], n, rng)
        _fill(v_pool, tables[b], n, rng)
    positions = np.array([n - 1 for n in lengths], np.int64)
    q = (3.0 * rng.standard_normal((len(lengths), n_heads * d))).astype(np.float32)
    scale = 1.0 / np.sqrt(d)

    out = np.full(q.shape, np.nan, np.float32)
    paged_attention_decode(q, k_pool, v_pool, LAYER, tables, positions, window, scale, chunk, out)
    for b in range(len(lengths)):
        single = np.full((1, q.shape[1]), np.nan, np.float32)
        paged_attention(q[b:b + 1], k_pool, v_pool, LAYER, tables[b], int(positions[b]), window, scale, chunk,
                        single)
        # Same per-head routine on the same inputs: equal up to (at most) instruction-order noise.
        np.testing.assert_allclose(out[b], single[0], rtol=1e-6, atol=1e-6, err_msg=f"sequence {b}")
        expected = reference(q[b:b + 1], k_pool, v_pool, LAYER, tables[b], int(positions[b]), window, scale)
        np.testing.assert_allclose(out[b], expected[0], rtol=0, atol=1e-4)

    from_njit = np.full(q.shape, np.nan, np.float32)
    _decode_from_njit(q, k_pool, v_pool, LAYER, tables, positions, window, scale, chunk, from_njit)
    np.testing.assert_allclose(from_njit, out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 1, 256), (12, 2, 64), (6, 2, 40)],
                         ids=lambda s: "h%d-kv%d-d%d" % s)
@pytest.mark.parametrize("bs", [4, 16, 7], ids=lambda b: f"block{b}")
def test_a_decode_row_has_the_same_bits_alone_and_in_any_batch(dtype, shape, bs):
    # Small batches give each query head its own item and read the pool directly; larger ones
    # share each K/V read and conversion among the heads of a kv head (in calls of at most 4
    # heads: 6 per kv head here takes two). A row must not notice which. Block sizes: 4 and 16
    # take key_scores' vector code, 7 its plain loop.
    n_heads, n_kv, d = shape
    n = 8
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 40, n)
    used = [-(-int(x) // bs) for x in lengths]
    tables = np.zeros((n, max(used)), np.int32)
    at = 0
    for b, u in enumerate(used):
        tables[b, :u] = np.arange(at, at + u)
        at += u
    k_pool = _nan_pool(at, n_kv, bs, d, dtype, keys=True)
    v_pool = _nan_pool(at, n_kv, bs, d, dtype)
    for b in range(n):
        _fill(_key_rows(k_pool), tables[b], int(lengths[b]), rng)
        _fill(v_pool, tables[b], int(lengths[b]), rng)
    positions = (lengths - 1).astype(np.int64)
    q = (3.0 * rng.standard_normal((n, n_heads * d))).astype(np.float32)

    def run(rows, chunk=16):
        out = np.full((len(rows), q.shape[1]), np.nan, np.float32)
        paged_attention_decode(q[rows], k_pool, v_pool, LAYER, tables[rows], positions[rows], 0, 0.125, chunk, out)
        return out

    together = run(np.arange(n))
    for b in range(n):
        assert np.array_equal(run(np.array([b]))[0], together[b]), b
        assert np.array_equal(run(np.array([b, (b + 1) % n]))[0], together[b]), b
    assert np.array_equal(run(np.arange(n)[::-1]), together[::-1])


def test_chunk_must_be_positive():
    k_pool = np.zeros((1, N_LAYERS, 1, 4, 64), np.float32)
    q = np.zeros((1, 64), np.float32)
    out = np.zeros_like(q)
    table = np.zeros(1, np.int32)
    with pytest.raises(ValueError):
        paged_attention(q, k_pool, k_pool, 0, table, 0, 0, 1.0, 0, out)
    with pytest.raises(ValueError):
        paged_attention_decode(q, k_pool, k_pool, 0, table[None, :], np.zeros(1, np.int64), 0, 1.0, 0, out)


# ---------------------------------------------------------------------------------------------
# store_kv


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("start,n_t", [(0, 1), (13, 5), (2, 2), (8, 4)], ids=lambda v: str(v))
def test_store_kv_round_trip_touches_only_target_slots(dtype, start, n_t):
    """block_size 4: (13, 5) crosses two block boundaries (13..15 | 16..17), (2, 2) ends at one,
    (8, 4) fills exactly one block."""
    rng = np.random.default_rng(start * 10 + n_t)
    n_kv, bs, d = 3, 4, 64
    used = -(-(start + n_t) // bs)
    n_blocks = used + 3
    table = rng.permutation(n_blocks)[:used].astype(np.int32)
    # Wide dynamic range, so float16 rounding, subnormals and overflow to inf all occur.
    k = (rng.standard_normal((n_t, n_kv * d)) * 10.0 ** rng.integers(-9, 6, (n_t, n_kv * d))).astype(np.float32)
    v = rng.standard_normal((n_t, n_kv * d)).astype(np.float32)
    # Pools start with recognisable non-zero contents everywhere.
    k_pool = _encode(rng.standard_normal((n_blocks, N_LAYERS, n_kv, d, bs)).astype(np.float32), dtype)
    v_pool = _encode(rng.standard_normal((n_blocks, N_LAYERS, n_kv, bs, d)).astype(np.float32), dtype)
    k_expected, v_expected = k_pool.copy(), v_pool.copy()
    with np.errstate(over="ignore"):
        for t in range(n_t):
            p = start + t
            _key_rows(k_expected)[table[p // bs], LAYER, :, p % bs, :] = _encode(k[t].reshape(n_kv, d), dtype)
            v_expected[table[p // bs], LAYER, :, p % bs, :] = _encode(v[t].reshape(n_kv, d), dtype)

    store_kv(k_pool, v_pool, LAYER, table, start, k, v)

    np.testing.assert_array_equal(k_pool, k_expected)
    np.testing.assert_array_equal(v_pool, v_expected)
    if dtype == np.float32:  # exact round trip
        p = np.arange(start, start + n_t)
        np.testing.assert_array_equal(_key_rows(k_pool)[table[p // bs], LAYER, :, p % bs, :].reshape(n_t, -1), k)


# ---------------------------------------------------------------------------------------------
# float16 conversions and the dtype-generic accessors


@njit
def _f32_to_f16_array(x, out):
    for i in range(x.shape[0]):
        out[i] = f32_to_f16(x[i])


@njit
def _f32_to_f16_scalar(x):
    return f32_to_f16(x)


def _check_f16_bits(x: np.ndarray, got: np.ndarray):
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # NaN: any float16 NaN (exponent all ones, non-zero mantissa).
    assert np.all((got[nan] & 0x7C00) == 0x7C00) and np.all((got[nan] & 0x03FF) != 0)


SPECIAL_F32 = np.array([
    0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan,
    1.0, -1.0, 65504.0, -65504.0, 65519.0, 65520.0, -65520.0, 1e5, -1e5, 3.4e38, -3.4e38,
    1e-45, -1e-45, 1e-40, -1e-40, 1.17e-38,  # float32 subnormals / tiny normals → ±0
    6.0e-8, 5.96e-8, 2.98e-8, 2.9802322e-8, 2.99e-8, 3.0e-8, -6.0e-8,  # around the smallest f16 subnormal
    6.097e-5, 6.1035156e-5, -6.1e-5, 1e-6, -3.3e-7,  # f16 subnormal range and its top
    1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -11 + 2.0 ** -20,  # ties to even / just above
    2049.0, 2051.0, 0.1, -0.3333333, 3.14159265,
], dtype=np.float32)


def test_f32_to_f16_special_values():
    got = np.zeros(SPECIAL_F32.shape, np.uint16)
    _f32_to_f16_array(SPECIAL_F32, got)
    _check_f16_bits(SPECIAL_F32, got)
    scalar = np.array([_f32_to_f16_scalar(x) for x in SPECIAL_F32], np.uint16)
    _check_f16_bits(SPECIAL_F32, scalar)


def test_f32_to_f16_random_bit_patterns_and_values():
    rng = np.random.default_rng(5)
    # Every float32 class (normals, subnormals, inf, NaN) from uniform bits, plus values
    # concentrated in and around the float16 range. Odd length leaves a scalar remainder loop.
    bits = rng.integers(0, 2**32, 200_001, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = (rng.standard_normal(100_003) * 2.0 ** rng.integers(-26, 18, 100_003)).astype(np.float32)
    for x in (bits, near):
        got = np.zeros(x.shape, np.uint16)
        _f32_to_f16_array(x, got)
        _check_f16_bits(x, got)


def test_f16_round_trip_is_exact_for_every_half():
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    finite = ~np.isnan(halves.view(np.float16))
    as_f32 = halves.view(np.float16).astype(np.float32)
    got = np.zeros(halves.shape, np.uint16)
    _f32_to_f16_array(as_f32, got)
    np.testing.assert_array_equal(got[finite], halves[finite])


@njit
def _accessors(pool, x):
    return kv_load(kv_store_value(x, pool)), kv_store_value(x, pool[0])


def test_kv_accessors_dispatch_on_pool_dtype():
    x = np.float32(0.1)
    f16 = np.zeros(4, np.uint16)
    f32 = np.zeros(4, np.float32)
    back, raw = _accessors(f16, x)
    assert raw == np.float16(x).view(np.uint16) and back == np.float32(np.float16(x))
    back, raw = _accessors(f32, x)
    assert raw == x and back == x
    # Python fallbacks behave the same.
    assert kv_store_value(x, f16) == np.float16(x).view(np.uint16)
    assert kv_load(np.uint16(0x3C00)) == np.float32(1.0)
    assert kv_store_value(x, f32) == x and kv_load(x) == x
    # f16_to_f32 is untouched by the new intrinsic living next to it.
    assert njit(lambda b: f16_to_f32(b))(np.uint16(0xC000)) == np.float32(-2.0)


def test_balanced_item_order_covers_every_pair_once_alternating_ends():
    from worker.engine.kernels.attention import balanced_item

    for n in (1, 2, 5, 8):
        pairs = [balanced_item(item, n) for item in range(3 * n)]
        assert sorted(pairs) == [(s, i) for s in range(3) for i in range(n)]
        assert [i for s, i in pairs[:n]] == [(k >> 1) if k % 2 == 0 else n - 1 - (k >> 1) for k in range(n)]
    assert [balanced_item(item, 4)[1] for item in range(4)] == [0, 3, 1, 2]


@pytest.mark.parametrize("n_b, n_kv, group, threads, expected", [
    (1, 2, 6, 2, 6),  # Qwen2.5-1.5B, one sequence: one item per kv head, one per thread
    (1, 2, 7, 2, 7),  # Qwen2.5-0.5B
    (1, 3, 3, 2, 1),  # SmolLM2: 3 items on 2 threads is 2:1; 9 heads alone are 5:4
    (1, 1, 4, 2, 2),  # Gemma 3 270M: two halves of the group, each reading the KV once
    (8, 3, 3, 2, 3),  # a batch: whole groups
    (1, 2, 6, 1, 6),  # one thread: nothing to balance
    (1, 2, 6, 4, 3),  # four threads: halves of each group
])
def test_query_heads_stay_together_as_far_as_the_threads_allow(n_b, n_kv, group, threads, expected):
    assert heads_per_item(n_b, n_kv, group, threads) == expected


def test_a_head_has_the_same_bits_attended_alone_or_with_its_group():
    """Whatever heads_per_item chooses (it follows the batch and the thread count), each head's
    arithmetic is its own: attended alone or with the other five of its group, the same bits."""
    rng = np.random.default_rng(5)
    n_heads, n_kv, d, bs, context = 12, 2, 32, 16, 300
    pool_shape = (context // bs + 2, 1, n_kv)
    k_pool = rng.standard_normal(pool_shape + (d, bs)).astype(np.float32)
    v_pool = rng.standard_normal(pool_shape + (bs, d)).astype(np.float32)
    table = np.arange(pool_shape[0], dtype=np.int32)
    q = rng.standard_normal(n_heads * d).astype(np.float32)
    group = n_heads // n_kv
    together, alone = np.zeros_like(q), np.zeros_like(q)
    kv, params = KVLayer(k_pool, v_pool, 0), AttentionParams(0, np.float32(0.2), 64, 1)
    for kvh in range(n_kv):
        attend_group(q, HeadGroup(kvh * group, group, kvh), kv, table, 0, context, params, together)
        for h in range(kvh * group, (kvh + 1) * group):
            attend_group(q, HeadGroup(h, 1, kvh), kv, table, 0, context, params, alone)
    assert np.array_equal(together, alone)
