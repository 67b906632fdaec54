"""q8_0 KV pools (worker/engine/kernels/kv_q8.py): what store_kv writes is llama.cpp's q8_0 of each
32 values of a token's head vector, and attention reads exactly those values.

Tolerance: storing is checked bit-exact against a numpy q8_0 (float16 scale max|x|/127, values
rounded with the float32 scale). Attention over a q8_0 pool is checked against float64 attention
over the dequantized K/V it holds, with test_attention's 2e-5 * max|V|: the kernels decode a block
exactly (one int8 times one float16 scale is exact in float32), so only the float32 sums differ.
"""
from __future__ import annotations

import numpy as np
import pytest

from worker.engine.kernels.attention import paged_attention_decode, store_kv
from worker.engine.kernels.prompt_attention import paged_attention_runs, row_runs
from worker.engine.paged_kv import KVShape, PagedKVCache

N_LAYERS = 18  # two scale layers: layers 0-15 and 16-17 keep their scales in different ones
N_KV, D, BS = 2, 64, 16


def q8_0_reference(x: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q8_0 then dequantize, over the last axis in groups of 32."""
    g = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d = np.abs(g).max(axis=-1, keepdims=True) / np.float32(127.0)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.round(g * inv)  # half to even, as numba's round and llama.cpp's AVX q8_0 (_MM_ROUND_NEAREST)
    return (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape)


def _cache(n_blocks=6):
    return PagedKVCache(KVShape(N_LAYERS, N_KV, D, BS), n_blocks, "q8_0")


def _store(kv, layer, table, k, v):
    store_kv(kv.k, kv.v, layer, table, 0, k.reshape(len(k), -1), v.reshape(len(v), -1))


def test_pool_is_int8_with_scale_layers_and_53_percent_of_float16():
    kv = _cache()
    assert kv.k.dtype == np.int8 and kv.k.shape == (6, N_LAYERS + 2, N_KV, D, BS)
    f16 = PagedKVCache(KVShape(N_LAYERS, N_KV, D, BS), 6, "float16")
    assert kv.nbytes / f16.nbytes == pytest.approx((N_LAYERS + 2) / (2 * N_LAYERS))
    assert KVShape(N_LAYERS, N_KV, D, BS).block_bytes("q8_0") == kv.block_payload_bytes


@pytest.mark.parametrize("layer", [0, 15, 17])
def test_stored_values_are_llama_cpp_q8_0(layer):
    rng = np.random.default_rng(layer)
    kv = _cache()
    table = np.array([4, 1, 3], np.int32)
    n = 40
    k = rng.standard_normal((n, N_KV, D)).astype(np.float32) * 3
    v = rng.standard_normal((n, N_KV, D)).astype(np.float32)
    v[5, 0, :32] = 0.0  # an all-zero group: scale 0, values 0
    other = 1 if layer != 1 else 2
    _store(kv, other, table, -k, -v)  # another layer's scales must not land on this one's
    _store(kv, layer, table, k, v)
    keys, values = kv.gather(layer, table, n)  # (KVH, n, D)
    np.testing.assert_array_equal(keys, q8_0_reference(k).transpose(1, 0, 2))
    np.testing.assert_array_equal(values, q8_0_reference(v).transpose(1, 0, 2))
    keys2, _ = kv.gather(other, table, n)
    np.testing.assert_array_equal(keys2, q8_0_reference(-k).transpose(1, 0, 2))


def _reference_attention(q, keys, values, positions, scale):
    """float64 causal attention of each row b at positions[b] over keys[:, :p+1] (GQA)."""
    n_heads = q.shape[1] // D
    group = n_heads // N_KV
    out = np.zeros(q.shape)
    for b, p in enumerate(positions):
        for h in range(n_heads):
            kk = keys[h // group, :p + 1].astype(np.float64)
            s = kk @ q[b, h * D:(h + 1) * D].astype(np.float64) * scale
            w = np.exp(s - s.max())
            out[b, h * D:(h + 1) * D] = (w / w.sum()) @ values[h // group, :p + 1]
    return out


@pytest.mark.parametrize("kernel", ["decode", "runs"])
def test_attention_reads_the_q8_0_pool(kernel):
    rng = np.random.default_rng(7)
    kv = _cache()
    layer, n, n_heads = 16, 45, 4
    table = np.array([2, 5, 0], np.int32)
    k = rng.standard_normal((n, N_KV, D)).astype(np.float32)
    v = rng.standard_normal((n, N_KV, D)).astype(np.float32)
    _store(kv, layer, table, k, v)
    keys, values = kv.gather(layer, table, n)
    positions = np.arange(n - 20, n, dtype=np.int64)
    rows = positions.shape[0]
    q = rng.standard_normal((rows, n_heads * D)).astype(np.float32)
    tables = np.tile(table, (rows, 1))
    out = np.zeros_like(q)
    scale = 1 / np.sqrt(D)
    if kernel == "decode":
        paged_attention_decode(q, kv.k, kv.v, layer, tables, positions, 0, scale, 7, out)
    else:
        runs = row_runs(tables, positions, rows, BS)
        assert runs.shape[0] == 2  # one run: the tiled prompt kernel
        paged_attention_runs(q, kv.k, kv.v, layer, tables, positions, runs, 0, scale, 7, 16, out)
    want = _reference_attention(q, keys, values, positions, scale)
    np.testing.assert_allclose(out, want, atol=2e-5 * np.abs(values).max(), rtol=0)


def test_block_bytes_round_trip_through_the_prefix_stores_unit():
    rng = np.random.default_rng(3)
    kv, other = _cache(), _cache()
    table = np.array([1, 2], np.int32)
    k = rng.standard_normal((32, N_KV, D)).astype(np.float32)
    _store(kv, 17, table, k, k)
    for blk in table:
        other.write_block(int(blk), kv.read_block(int(blk)))
    np.testing.assert_array_equal(other.gather(17, table, 32)[0], kv.gather(17, table, 32)[0])
