"""linear_batch (batched decode): float64 reference, agreement with matvec.linear per row, and
bit-exact independence of each row from the batch around it."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tests.kernels.quant_cases import batch_inputs, packed_table, random_tensor
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels.matmul_batch import batch_scratch, linear_batch, scratch_size
from tests.kernels.yardsticks import linear
from worker.engine.kernels.packing import TILE
from worker.engine.kernels.registry import ALL_QUANT_TYPES
from worker.engine.quants import dequantize

ROWS, COLS = 100, 512  # rows not a multiple of TILE: padding is exercised


def _batch(table, mats, x):
    width = sum(table.padded_rows(int(i)) for i in mats)
    out = np.full((x.shape[0], width), np.nan, np.float32)  # every output must be written
    linear_batch(table.data, table.scales, table.scales16, table.meta, np.asarray(mats), x, out,
                 batch_scratch(width // TILE, x.shape[0], x.shape[1]))
    return out


def _matvec(table, mats, x):
    width = sum(table.padded_rows(int(i)) for i in mats)
    out = np.zeros((x.shape[0], width), np.float32)
    for b in range(x.shape[0]):
        linear(table.data, table.scales, table.scales16, table.meta, np.asarray(mats),
               np.ascontiguousarray(x[b]), out[b], np.zeros((width // TILE, TILE), np.float32))
    return out


def _assert_matches_matvec(got: np.ndarray, table, mats, x) -> None:
    """linear_batch against the one-row matvec.linear: the same sums in the same order, so equal up
    to how LLVM contracts multiply-adds, which it decides per compile (on znver3 the Q5 formats
    differed in the last bit when the kernels were compiled in another order). Bit-exactness that
    serving relies on, a row independent of its batch, is tested on linear_batch alone below."""
    want = _matvec(table, mats, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * max(np.abs(want).max(), 1.0))


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
@pytest.mark.parametrize("qtype", ALL_QUANT_TYPES, ids=lambda q: q.name)
def test_every_row_matches_the_reference_and_matvec(qtype, batch):
    raw = random_tensor(qtype, ROWS, COLS, seed=3)
    table = packed_table([(raw, qtype)])
    x = batch_inputs(batch, COLS)
    got = _batch(table, [0], x)
    expected = x.astype(np.float64) @ dequantize(raw, qtype).T.astype(np.float64)
    np.testing.assert_allclose(got[:, :ROWS], expected, rtol=0, atol=2e-5 * np.abs(expected).max())
    _assert_matches_matvec(got, table, [0], x)


def test_real_tensors_of_every_type_in_gemma_equal_matvec(gemma3_gguf):
    g = GGUFFile(gemma3_gguf)
    by_type = {}
    for t in g.tensors.values():
        if len(t.shape) == 2 and t.qtype not in by_type:
            by_type[t.qtype] = t
    tensors = list(by_type.values())
    table = packed_table([(t.raw[:130], t.qtype) for t in tensors])
    for i, t in enumerate(tensors):
        x = batch_inputs(5, t.shape[1], seed=i)
        _assert_matches_matvec(_batch(table, [i], x), table, [i], x)


def test_several_matrices_of_different_formats_lie_side_by_side():
    raws = [(random_tensor(QT.Q4_K, 64, 256, 1), QT.Q4_K), (random_tensor(QT.Q6_K, 70, 256, 2), QT.Q6_K),
            (random_tensor(QT.F16, 64, 256, 3), QT.F16), (random_tensor(QT.Q5_1, 30, 256, 4), QT.Q5_1)]
    table = packed_table(raws)
    x = batch_inputs(3, 256)
    got = _batch(table, [0, 1, 2, 3], x)
    _assert_matches_matvec(got, table, [0, 1, 2, 3], x)
    start = 0
    for i, (raw, qtype) in enumerate(raws):
        w = dequantize(raw, qtype)
        expected = x.astype(np.float64) @ w.T.astype(np.float64)
        np.testing.assert_allclose(got[:, start:start + w.shape[0]], expected, rtol=0,
                                   atol=2e-5 * np.abs(expected).max(), err_msg=qtype.name)
        start += table.padded_rows(i)
    # A different order of the same matrices moves the blocks, not their values.
    swapped = _batch(table, [2, 0], x)
    assert np.array_equal(swapped[:, :64], got[:, 64 + 128:64 + 128 + 64])
    assert np.array_equal(swapped[:, 64:128], got[:, :64])


@pytest.mark.parametrize("batch", [5, 8, 13])
def test_a_row_does_not_depend_on_the_rows_batched_with_it(batch):
    # Q4_1 (q4, fp16 scale and bias), Q6_K (q8, group 16, factored scales), Q8_0 (q8, no bias), BF16 (f32)
    types = (QT.Q4_1, QT.Q6_K, QT.Q8_0, QT.BF16)
    table = packed_table([(random_tensor(q, 64 + 8 * i, 256, i), q) for i, q in enumerate(types)])
    mats = [0, 1, 2, 3]
    x = batch_inputs(batch, 256, seed=7)
    together = _batch(table, mats, x)
    for b in range(batch):
        assert np.array_equal(together[b], _batch(table, mats, x[b:b + 1])[0])
    reordered = _batch(table, mats, x[::-1].copy())
    assert np.array_equal(reordered, together[::-1])


def test_scratch_from_the_widest_call_serves_narrower_ones():
    table = packed_table([(random_tensor(QT.Q4_0, 256, 512, 1), QT.Q4_0), (random_tensor(QT.Q8_0, 64, 256, 2), QT.Q8_0)])
    scratch = batch_scratch(256 // TILE, 4, 512)
    assert scratch.size == scratch_size(4, 512)
    for index, k, batch in ((0, 512, 4), (1, 256, 2)):
        x = batch_inputs(batch, k)
        out = np.zeros((batch, table.padded_rows(index)), np.float32)
        linear_batch(table.data, table.scales, table.scales16, table.meta, np.array([index]), x, out, scratch)
        _assert_matches_matvec(out, table, [index], x)


def test_bad_shapes_raise_instead_of_writing_out_of_bounds():
    table = packed_table([(random_tensor(QT.Q4_0, 64, 256, 1), QT.Q4_0)])
    args = (table.data, table.scales, table.scales16, table.meta, np.array([0]))
    x = batch_inputs(2, 256)
    with pytest.raises(ValueError, match="scratch"):
        linear_batch(*args, x, np.zeros((2, 64), np.float32), np.zeros(scratch_size(2, 256) - 1, np.float32))
    with pytest.raises(ValueError, match="out"):
        linear_batch(*args, x, np.zeros((2, 32), np.float32), batch_scratch(1, 2, 256))
    with pytest.raises(ValueError, match="K"):
        linear_batch(*args, batch_inputs(2, 512), np.zeros((2, 64), np.float32), batch_scratch(1, 2, 512))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda q: q.name)
def test_factored_parameters_give_the_bits_of_float32_ones(qtype):
    # unit × step is the file's float32 scale exactly, so both paths add the same numbers.
    raws = [(random_tensor(qtype, 70, 512, 4), qtype)]
    x = batch_inputs(5, 512, seed=4)
    factored, whole = packed_table(raws), packed_table(raws, float32_params=True)
    assert factored.scales16.size > 1 and whole.scales.size > 1
    assert np.array_equal(_batch(factored, [0], x), _batch(whole, [0], x))
    # matvec is numba code under fastmath, free to reassociate step × unit × Σx: last bits only.
    want = _matvec(whole, [0], x)
    np.testing.assert_allclose(_matvec(factored, [0], x), want, rtol=0, atol=1e-6 * np.abs(want).max())
