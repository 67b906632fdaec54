"""The tiled prompt attention (worker/engine/kernels/prompt_attention.py): every row bit-identical
to paged_attention_decode's, and the run detection that decides which rows it takes.

Pools are NaN wherever no kernel may read (other layers, spare blocks, slots past a sequence's
stored context, table padding), as in test_attention: a tile that lets one row read a neighbour's
future key, or a key outside its window, gives NaN, not a near miss.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.test_attention import LAYER, _fill, _key_rows, _nan_pool, reference
from worker.engine.kernels.attention import paged_attention_decode
from worker.engine.kernels.prompt_attention import paged_attention_runs, row_runs

DTYPES = [np.float32, np.uint16]


def _step(rng, sequences, bs, n_kv, d, dtype):
    """Pools and per-row arrays of one step: sequences = [(start, rows)], each a run of `rows`
    consecutive queries from position start (rows = 1: a decode row). K/V are stored up to each
    sequence's last position; tables are shuffled blocks, padded with NaN-only blocks."""
    used = [-(-(start + rows) // bs) for start, rows in sequences]
    width = max(used) + 2
    n_blocks = sum(used) + 3
    perm = rng.permutation(n_blocks).astype(np.int32)
    spare = perm[sum(used):]
    k_pool = _nan_pool(n_blocks, n_kv, bs, d, dtype, keys=True)
    v_pool = _nan_pool(n_blocks, n_kv, bs, d, dtype)
    tables, positions, seq_tables = [], [], []
    at = 0
    for (start, rows), u in zip(sequences, used):
        table = rng.choice(spare, width).astype(np.int32)
        table[:u] = perm[at:at + u]
        at += u
        _fill(_key_rows(k_pool), table, start + rows, rng)
        _fill(v_pool, table, start + rows, rng)
        seq_tables.append(table)
        for t in range(rows):
            tables.append(table)
            positions.append(start + t)
    return k_pool, v_pool, np.array(tables, np.int32), np.array(positions, np.int64), seq_tables


# (n_heads, n_kv_heads, head_dim): GQA groups 1, 3 and 4; head_dim 64, 256 (Gemma) and 40 (the
# plain loops of value_sums).
SHAPES = [(4, 4, 64), (9, 3, 64), (4, 1, 256), (8, 2, 40)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h%d-kv%d-d%d" % s)
@pytest.mark.parametrize("bs", [4, 16, 7], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("window", [0, 6, 40], ids=lambda w: f"window{w}")
def test_every_row_has_the_decode_kernels_bits(dtype, shape, bs, window):
    n_heads, n_kv, d = shape
    rng = np.random.default_rng([DTYPES.index(dtype), SHAPES.index(shape), bs, window])
    # A prompt chunk from 0, a decode row, a chunk in the middle of a context (crossing blocks),
    # a three-row verification run, and a long chunk over a long context.
    sequences = [(0, 21), (30, 1), (13, 19), (50, 3), (70, 37)]
    k_pool, v_pool, tables, positions, seq_tables = _step(rng, sequences, bs, n_kv, d, dtype)
    rows = positions.shape[0]
    q = (3.0 * rng.standard_normal((rows, n_heads * d))).astype(np.float32)
    runs = row_runs(tables, positions, rows, bs)
    assert runs.tolist() == [0, 21, 22, 41, 44, 81]
    scale = 1.0 / np.sqrt(d)
    for chunk in (3, 16, 1000):  # softmax chunks of a few keys, about a block, the whole context
        expected = np.full(q.shape, np.nan, np.float32)
        paged_attention_decode(q, k_pool, v_pool, LAYER, tables, positions, window, scale, chunk, expected)
        for tile in (1, 5, 16):  # tiles cross block edges, chunk edges and runs' ends
            got = np.full(q.shape, np.nan, np.float32)
            paged_attention_runs(q, k_pool, v_pool, LAYER, tables, positions, runs, window, scale, chunk, tile, got)
            differ = np.flatnonzero((got != expected).any(axis=1))
            assert differ.size == 0, f"chunk {chunk} tile {tile}: rows {differ.tolist()} differ from decode"
    # And the shared bits are right: against float64 attention, sequence by sequence.
    row = 0
    for (start, n), table in zip(sequences, seq_tables):
        want = reference(q[row:row + n], k_pool, v_pool, LAYER, table, start, window, scale)
        np.testing.assert_allclose(got[row:row + n], want, rtol=0, atol=1e-4)
        row += n


def test_a_row_has_the_same_bits_whatever_its_neighbours():
    """A verification run's last row equals the same query attended alone (a decode step) and as
    the last row of a longer run: drafted and plain decoding agree bit for bit."""
    rng = np.random.default_rng(3)
    n_heads, n_kv, d, bs = 9, 3, 64, 16
    k_pool, v_pool, tables, positions, _ = _step(rng, [(40, 24)], bs, n_kv, d, np.uint16)
    q = rng.standard_normal((24, n_heads * d)).astype(np.float32)
    full = np.zeros_like(q)
    paged_attention_runs(q, k_pool, v_pool, LAYER, tables, positions, np.array([0, 24]), 0, 0.125, 512, 16, full)
    for lo in (0, 5, 17, 23):
        part = np.zeros((24 - lo, q.shape[1]), np.float32)
        paged_attention_runs(q[lo:], k_pool, v_pool, LAYER, tables[lo:], positions[lo:], np.array([0, 24 - lo]), 0,
                             0.125, 512, 16, part)
        assert np.array_equal(part, full[lo:]), lo


def test_row_runs_follow_positions_and_the_blocks_each_row_reads():
    bs = 4
    a = np.array([5, 6, 7, 8], np.int32)
    b = np.array([5, 6, 9, 8], np.int32)  # a's first two blocks, another third
    c = np.array([5, 10, 7, 8], np.int32)  # a's first block only
    positions = np.array([4, 5, 6, 7, 8, 9, 9, 3, 3, 4], np.int64)
    tables = np.array([a, a, c, c, b, b, a, a, a, b], np.int32)
    runs = row_runs(tables, positions, positions.shape[0], bs)
    # 5 (a) -> 6 (c): row 1 reads blocks 0-1, c differs in block 1: new run. 7 (c) -> 8 (b):
    # block 1 differs again. 9 -> 9, 9 -> 3, 3 -> 3: not consecutive. 3 (a) -> 4 (b): row 8 reads
    # block 0 only, where they agree (row 9's table then serves both).
    assert runs.tolist() == [0, 2, 4, 6, 7, 8, 10]
    assert row_runs(tables, positions, 3, bs).tolist() == [0, 2, 3]
    assert row_runs(tables, positions, 1, bs).tolist() == [0, 1]


def test_chunk_and_tile_must_be_positive():
    pool = np.zeros((1, 2, 1, 4, 64), np.float32)
    q = np.zeros((1, 64), np.float32)
    args = (pool, pool, 0, np.zeros((1, 1), np.int32), np.zeros(1, np.int64), np.array([0, 1]), 0, 1.0)
    with pytest.raises(ValueError):
        paged_attention_runs(q, *args, 0, 16, np.zeros_like(q))
    with pytest.raises(ValueError):
        paged_attention_runs(q, *args, 16, 0, np.zeros_like(q))


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "q8_0"])
def test_every_attention_variant_of_the_registry_gives_the_decode_kernels_bits(kv_dtype):
    """Each registered attention variant, run through the fused steps' attention_rows by its code
    in the op table, stores the step's K/V and gives every row paged_attention_decode's bits, on a
    step of prompt runs and decode rows, over each K/V element type (one entry serves them all)."""
    from worker.engine.kernels.attention import AttentionParams, KVLayer, store_kv
    from worker.engine.kernels.registry import OpTable, variants_of
    from worker.engine.models.common import BatchBuffers
    from worker.engine.models.decode_parts import attention_rows
    from worker.engine.paged_kv import KVShape, PagedKVCache
    n_heads, n_kv, d, bs, layer = 6, 2, 64, 16, 1
    sequences = [(0, 21), (30, 1), (13, 19), (50, 3)]  # (first position of the step's rows, rows)
    rng = np.random.default_rng(11)
    rows = sum(n for _, n in sequences)
    tables, positions, earlier = [], [], []
    next_block = 0
    for start, n in sequences:
        used = -(-(start + n) // bs)
        table = np.arange(next_block, next_block + used, dtype=np.int32)[::-1].copy()  # blocks out of order
        next_block += used
        earlier.append((table, rng.standard_normal((start, n_kv * d)).astype(np.float32),
                        rng.standard_normal((start, n_kv * d)).astype(np.float32)))
        tables += [np.pad(table, (0, 8 - used))] * n
        positions += list(range(start, start + n))
    tables, positions = np.array(tables, np.int32), np.array(positions, np.int64)
    assert row_runs(tables, positions, rows, bs).shape[0] - 1 < rows  # runs as well as decode rows
    buf = BatchBuffers(64, n_heads * d, n_kv * d, 64, 64).ensure(rows, 1)
    for a in (buf.q, buf.k, buf.v):
        a[:rows] = rng.standard_normal((rows, a.shape[1]))
    params = AttentionParams(0, np.float32(1 / np.sqrt(d)), 7, 2)

    def filled_cache():
        cache = PagedKVCache(KVShape(3, n_kv, d, bs), next_block, kv_dtype)
        for table, k, v in earlier:
            store_kv(cache.k, cache.v, layer, table, 0, k, v)
        return cache

    outputs = {}
    for variant in variants_of("attention"):
        cache = filled_cache()
        buf.att[:] = np.nan
        attention_rows((np.zeros(1), OpTable.of(attention=variant).codes, ()), buf, KVLayer(cache.k, cache.v, layer),
                       tables, positions, params, rows)
        outputs[variant] = buf.att[:rows].copy()
    expected = np.full((rows, n_heads * d), np.nan, np.float32)
    paged_attention_decode(buf.q[:rows], cache.k, cache.v, layer, tables, positions, 0, params.scale, params.chunk,
                           expected)
    assert not np.isnan(expected).any()
    for variant, got in outputs.items():
        assert np.array_equal(got, expected), variant
