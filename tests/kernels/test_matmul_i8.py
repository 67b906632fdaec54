"""linear_batch_i8 (int8 activations, VNNI / AVX2): float64 references with the kernel's quantized
activations (tight) and with the exact ones (loose), row independence, mixed matrices."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tests.kernels.quant_cases import batch_inputs, packed_table, random_tensor
from worker.engine.kernels.matmul_i8 import (ROW_BLOCK, QuantizedRows, _quantize_rows, batch_scratch_i8,
                                             linear_batch_i8, linear_batch_i8_blocked, linear_batch_i8_serial,
                                             quantize_reference, scratch_size_i8)
from worker.engine.kernels.packing import FMT_Q6, FMT_Q8, LAYOUT_QUADS, LAYOUT_ROWS, M_FMT, M_NARROW, TILE
from worker.engine.kernels.registry import ALL_QUANT_TYPES
from worker.engine.quants import dequantize

ROWS, COLS = 100, 512  # rows not a multiple of TILE: padding is exercised
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)


def _batch(table, mats, x, kernel=linear_batch_i8):
    width = sum(table.padded_rows(int(i)) for i in mats)
    out = np.full((x.shape[0], width), np.nan, np.float32)  # every output must be written
    kernel(table.data, table.scales, table.scales16, table.meta, np.asarray(mats), x, out,
                    batch_scratch_i8(width // TILE, x.shape[0], x.shape[1]))
    return out


def _x_hat(x):
    q, d = quantize_reference(x)
    b, k = x.shape
    return (q.reshape(b, k // 32, 32) * d[:, :, None].astype(np.float64)).reshape(b, k)


def test_in_kernel_quantization_equals_the_numpy_reference():
    x = batch_inputs(5, 576, seed=4)
    x[1, 40:72] = 0.0  # an all-zero block: d = 0, codes 0
    x[2, 100] = 50.0  # an outlier
    b, k = x.shape
    xq, xs = np.zeros((b, k), np.int8), np.zeros((b, k // 32), np.float32)
    f16, f32 = np.zeros((b, k // 16), np.float32), np.zeros((b, k // 32), np.float32)
    c16, c32 = np.zeros((b, k // 16), np.int32), np.zeros((b, k // 32), np.int32)
    _quantize_rows(x, QuantizedRows(xq, xs, f16, f32, c16, c32))
    q, d = quantize_reference(x)
    assert np.array_equal(xq, q) and np.array_equal(xs, d)
    assert np.abs(q).max() == 127
    s16 = q.reshape(b, -1, 16).astype(np.int64).sum(axis=2)
    assert np.array_equal(c16, -128 * s16) and np.array_equal(c32, -128 * s16.reshape(b, -1, 2).sum(axis=2))
    np.testing.assert_allclose(f32, d * s16.reshape(b, -1, 2).sum(axis=2), rtol=1e-6)


@pytest.mark.parametrize("batch", [1, 2, 3, 8, 13])
@pytest.mark.parametrize("qtype", ALL_QUANT_TYPES, ids=lambda q: q.name)
def test_every_row_matches_the_float64_references(qtype, batch):
    raw = random_tensor(qtype, ROWS, COLS, seed=3)
    table = packed_table([(raw, qtype)], LAYOUT_QUADS)
    x = batch_inputs(batch, COLS)
    got = _batch(table, [0], x)[:, :ROWS]
    w = dequantize(raw, qtype).T.astype(np.float64)
    exact = x.astype(np.float64) @ w
    if qtype in FLOAT_TYPES:  # not quantized: matmul_batch's float path
        np.testing.assert_allclose(got, exact, rtol=0, atol=2e-5 * np.abs(exact).max())
        return
    # Tight: the product of the dequantized weights with the dequantized int8 activations; the
    # integer dot products are exact, only the float32 group sums round (as linear_batch's 2e-5).
    with_x_hat = _x_hat(x) @ w
    np.testing.assert_allclose(got, with_x_hat, rtol=0, atol=2e-5 * np.abs(with_x_hat).max())
    # Loose: vs the exact product. Each activation moves by at most d/2 = max|block|/254, a
    # uniform-like error (std d/√12) uncorrelated with the weights, so the output error is about
    # ‖w‖·‖x‖/(254·√3·√32)-ish of a typical output ~‖w‖·‖x‖/√K: ≲ 1% of max |output| here; 2% bound.
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-2 * np.abs(exact).max())


@pytest.mark.parametrize("batch", [5, 8, 13])
def test_a_row_does_not_depend_on_the_rows_batched_with_it(batch):
    # Q4_1 (q4, fp16 scale and bias), Q6_K (q8, group 16, factored scales), Q8_0 (q8, no bias), BF16 (f32)
    types = (QT.Q4_1, QT.Q6_K, QT.Q8_0, QT.BF16)
    table = packed_table([(random_tensor(q, 64 + 8 * i, 256, i), q) for i, q in enumerate(types)], LAYOUT_QUADS)
    mats = [0, 1, 2, 3]
    x = batch_inputs(batch, 256, seed=7)
    together = _batch(table, mats, x)
    for b in range(batch):
        assert np.array_equal(together[b], _batch(table, mats, x[b:b + 1])[0])
    reordered = _batch(table, mats, x[::-1].copy())
    assert np.array_equal(reordered, together[::-1])


@pytest.mark.parametrize("batch", [1, ROW_BLOCK, 2 * ROW_BLOCK + 7])
def test_the_int8_variants_give_the_same_bits(batch):
    # Row blocks that split a 4-row micro-kernel step, a last block shorter than ROW_BLOCK, every
    # format (q4 with fp16 scales, q8 with group 16 and factored scales, q8 without bias, f32).
    types = (QT.Q4_1, QT.Q6_K, QT.Q8_0, QT.BF16, QT.Q4_K, QT.Q5_0)
    table = packed_table([(random_tensor(q, 64 + 8 * i, 256, i), q) for i, q in enumerate(types)], LAYOUT_QUADS)
    mats = list(range(len(types)))
    x = batch_inputs(batch, 256, seed=9)
    plain = _batch(table, mats, x)
    assert not np.isnan(plain).any()
    for kernel in (linear_batch_i8_blocked, linear_batch_i8_serial):
        assert np.array_equal(_batch(table, mats, x, kernel), plain), kernel.__name__


def _extreme_codes(qtype, rows, cols):
    """GGUF rows whose every code is the type's most negative (all quant bits zero), scale 0.01."""
    d = np.float16(0.01).tobytes()
    if qtype == QT.Q6_K:  # 256 per block: ql[128], qh[64], scales int8[16], d: code = q - 32
        block = np.zeros(210, np.uint8)
        block[192:208] = 1
        block[208:210] = np.frombuffer(d, np.uint8)
    else:  # Q5_0, 32 per block: d, qh[4], qs[16]: code = q - 16
        block = np.zeros(22, np.uint8)
        block[0:2] = np.frombuffer(d, np.uint8)
    per_block = 256 if qtype == QT.Q6_K else 32
    return np.tile(block, (rows, cols // per_block))


def _largest_q6_k_codes(rows, cols):
    """Q6_K rows whose every code is +31 (all quant bits set), scale 0.01."""
    block = np.full(210, 0xFF, np.uint8)
    block[192:208] = 1
    block[208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return np.tile(block, (rows, cols // 256))


def test_narrow_q8_and_six_bit_group_sums_cannot_overflow_int16():
    # Q5_0 takes the narrow path (a group's pair sums add up in int16): the largest codes times
    # activations all at +127 reach 32512 per lane, just within int16. Q8_0 does not. Q6_K's
    # six-bit codes (c + 32 up to 63) sum 2 quads in int16 on AVX2: up to 32004.
    raws = [(_extreme_codes(QT.Q5_0, 64, 256), QT.Q5_0), (_extreme_codes(QT.Q6_K, 64, 256), QT.Q6_K),
            (random_tensor(QT.Q8_0, 64, 256, 1), QT.Q8_0), (_largest_q6_k_codes(64, 256), QT.Q6_K)]
    table = packed_table(raws, LAYOUT_QUADS)
    assert list(table.meta[:, M_NARROW]) == [1, 0, 0, 0]
    assert list(table.meta[:, M_FMT]) == [FMT_Q8, FMT_Q6, FMT_Q8, FMT_Q6]
    x = np.ones((3, 256), np.float32)
    x[1] = -2.0
    x[2, ::2] = -1.0  # mixed signs
    got = _batch(table, [0, 1, 2, 3], x)
    for i, (raw, qtype) in enumerate(raws):
        expected = _x_hat(x) @ dequantize(raw, qtype).T.astype(np.float64)
        np.testing.assert_allclose(got[:, 64 * i:64 * (i + 1)], expected, rtol=0,
                                   atol=2e-5 * np.abs(expected).max(), err_msg=qtype.name)


def test_six_bit_codes_give_the_bits_of_one_byte_codes(monkeypatch):
    # The same Q6_K matrix, its codes stored in 6 bits (FMT_Q6) and in a byte each (FMT_Q8): the
    # integer sums are exact either way, so every output is the same float.
    from worker.engine.kernels import packing
    raw = random_tensor(QT.Q6_K, 100, 512, 5)
    six = packed_table([(raw, QT.Q6_K)], LAYOUT_QUADS)
    monkeypatch.setattr(packing, "fits_six_bits", lambda m: False)
    eight = packed_table([(raw, QT.Q6_K)], LAYOUT_QUADS)
    assert six.meta[0, M_FMT] == FMT_Q6 and eight.meta[0, M_FMT] == FMT_Q8
    assert six.data.nbytes < 0.8 * eight.data.nbytes
    for batch in (1, 3, 6):
        x = batch_inputs(batch, 512, seed=11)
        assert np.array_equal(_batch(six, [0], x), _batch(eight, [0], x)), batch


@pytest.mark.parametrize("qtype", [QT.Q5_0, QT.Q6_K], ids=lambda q: q.name)
def test_the_narrow_path_gives_the_bits_of_the_wide_one(qtype, monkeypatch):
    from worker.engine.kernels import packing
    monkeypatch.setattr(packing, "fits_six_bits", lambda m: False)  # Q6_K as one byte a code
    table = packed_table([(random_tensor(qtype, 100, 512, 5), qtype)], LAYOUT_QUADS)
    assert table.meta[0, M_NARROW] == 1
    x = batch_inputs(6, 512, seed=11)
    narrow = _batch(table, [0], x)
    table.meta[0, M_NARROW] = 0  # every product widened to int32 at once
    assert np.array_equal(_batch(table, [0], x), narrow)


def test_several_matrices_of_different_formats_lie_side_by_side():
    raws = [(random_tensor(QT.Q4_K, 64, 256, 1), QT.Q4_K), (random_tensor(QT.Q6_K, 70, 256, 2), QT.Q6_K),
            (random_tensor(QT.F16, 64, 256, 3), QT.F16), (random_tensor(QT.Q5_1, 30, 256, 4), QT.Q5_1)]
    table = packed_table(raws, LAYOUT_QUADS)
    x = batch_inputs(3, 256)
    got = _batch(table, [0, 1, 2, 3], x)
    start = 0
    for i, (raw, qtype) in enumerate(raws):
        w = dequantize(raw, qtype).T.astype(np.float64)
        expected = (x.astype(np.float64) if qtype == QT.F16 else _x_hat(x)) @ w
        np.testing.assert_allclose(got[:, start:start + w.shape[1]], expected, rtol=0,
                                   atol=2e-5 * np.abs(expected).max(), err_msg=qtype.name)
        start += table.padded_rows(i)
    swapped = _batch(table, [2, 0], x)
    assert np.array_equal(swapped[:, :64], got[:, 64 + 128:64 + 128 + 64])
    assert np.array_equal(swapped[:, 64:128], got[:, :64])


def test_bad_shapes_raise_instead_of_writing_out_of_bounds():
    table = packed_table([(random_tensor(QT.Q4_0, 64, 256, 1), QT.Q4_0)], LAYOUT_QUADS)
    args = (table.data, table.scales, table.scales16, table.meta, np.array([0]))
    x = batch_inputs(2, 256)
    with pytest.raises(ValueError, match="scratch"):
        linear_batch_i8(*args, x, np.zeros((2, 64), np.float32), np.zeros(scratch_size_i8(2, 256) - 1, np.float32))
    with pytest.raises(ValueError, match="out"):
        linear_batch_i8(*args, x, np.zeros((2, 32), np.float32), batch_scratch_i8(1, 2, 256))
    with pytest.raises(ValueError, match="K"):
        linear_batch_i8(*args, batch_inputs(2, 512), np.zeros((2, 64), np.float32), batch_scratch_i8(1, 2, 512))
    with pytest.raises(ValueError, match="contiguous rows"):  # the quantizer loads 32 inputs at once
        linear_batch_i8(*args, batch_inputs(2, 512)[:, ::2], np.zeros((2, 64), np.float32), batch_scratch_i8(1, 2, 256))


def test_codes_in_the_float_kernels_layout_are_refused():
    """A table packed for the float32 kernels (LAYOUT_ROWS) would be read as the wrong bytes."""
    table = packed_table([(random_tensor(QT.Q4_0, 64, 256, 1), QT.Q4_0)], LAYOUT_ROWS)
    with pytest.raises(ValueError, match="LAYOUT_QUADS"):
        _batch(table, [0], batch_inputs(2, 256))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda q: q.name)
def test_factored_parameters_give_the_bits_of_float32_ones(qtype):
    # unit × step is the file's float32 scale exactly, so both paths add the same numbers.
    raws = [(random_tensor(qtype, 70, 512, 4), qtype)]
    x = batch_inputs(5, 512, seed=4)
    factored = packed_table(raws, LAYOUT_QUADS)
    whole = packed_table(raws, LAYOUT_QUADS, float32_params=True)
    assert factored.scales16.size > 1 and whole.scales.size > 1
    assert np.array_equal(_batch(factored, [0], x), _batch(whole, [0], x))
