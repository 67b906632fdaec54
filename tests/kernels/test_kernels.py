"""Every registered kernel variant against float64 math on the reference dequantization, and the
op table the fused steps dispatch through."""
from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.quant_cases import packed_table, random_tensor
from tests.kernels.yardsticks import linear as matvec
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels.matmul_batch import batch_scratch
from worker.engine.kernels.matmul_i8 import batch_scratch_i8, quantize_reference
from worker.engine.kernels.packing import FMT_F32, LAYOUT_QUADS, LAYOUT_ROWS, M_FMT, PARAM_F16, PARAM_STEP8, TILE, pack
from worker.engine.kernels.registry import (ALL_QUANT_TYPES, BUCKET_LIMITS, BUCKET_NAMES, DISPATCHED_OPS, KERNELS,
                                            MATMUL, KernelVariant, OpTable, bucket_of, layout_for, variants_of)
from worker.engine.quants import dequantize

# Rows deliberately not a multiple of TILE, so padding is exercised.
ROWS, COLS = 100, 512


# The registry's variants over packed weights and the yardstick matvec they are measured against, held
# to one reference. Its attention variants are held to float64 attention and to each other's bits in
# test_attention.py and test_prompt_attention.py (which parametrizes over them).
CHECKED = {**{key: v for key, v in KERNELS.items() if v.op != "attention"},
           ("matvec", "tiled"): KernelVariant("matvec", "tiled", matvec, "the yardstick", "float32")}


def _layout(variant) -> int:
    """The code layout a variant reads: its numerics' for matrix products; the row gather reads
    both (it is run on the int8 kernels' layout here, and compared across layouts below)."""
    return LAYOUT_QUADS if variant.op == "row" else layout_for(variant.numerics)


def _run(variant, table, index, w, x):
    fn = variant.fn
    t = table
    if variant.op == "matvec":
        out = np.zeros(t.padded_rows(index), np.float32)
        scratch = np.zeros((t.padded_rows(index) // TILE, TILE), np.float32)
        fn(t.data, t.scales, t.scales16, t.meta, np.array([index]), x, out, scratch)
        return out[:w.shape[0]], w.astype(np.float64) @ x.astype(np.float64)
    if variant.op == "matmul" and variant.numerics == "float32":
        xs = np.stack([x, -0.5 * x, np.roll(x, 7)])
        out = np.zeros((3, t.padded_rows(index)), np.float32)
        scratch = batch_scratch(t.padded_rows(index) // TILE, 3, x.shape[0])
        fn(t.data, t.scales, t.scales16, t.meta, np.array([index]), xs, out, scratch)
        return out[:, :w.shape[0]], xs.astype(np.float64) @ w.T.astype(np.float64)
    if variant.op == "matmul" and variant.numerics == "int8":
        # The reference multiplies by the activations the kernel sees: quantized per 32 values
        # (F32 matrices are multiplied in float32, unquantized).
        xs = np.stack([x, -0.5 * x, np.roll(x, 7)])
        out = np.zeros((3, t.padded_rows(index)), np.float32)
        scratch = batch_scratch_i8(t.padded_rows(index) // TILE, 3, x.shape[0])
        fn(t.data, t.scales, t.scales16, t.meta, np.array([index]), xs, out, scratch)
        codes, d = quantize_reference(xs)
        seen = codes.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
        if t.meta[index, M_FMT] == FMT_F32:
            seen = xs.astype(np.float64)
        return out[:, :w.shape[0]], seen @ w.T.astype(np.float64)
    if variant.op == "row":
        out = np.zeros(w.shape[1], np.float32)
        fn(t.data, t.scales, t.scales16, t.meta[index], 37, out)
        return out, w[37]
    raise AssertionError(f"no test for {variant.op}/{variant.variant}")


@pytest.mark.parametrize("key", list(CHECKED), ids=lambda k: "-".join(k))
@pytest.mark.parametrize("qtype", ALL_QUANT_TYPES, ids=lambda q: q.name)
def test_kernel_matches_reference_on_random_tensors(key, qtype):
    raw = random_tensor(qtype, ROWS, COLS, seed=3)
    w = dequantize(raw, qtype)
    x = np.random.default_rng(1).standard_normal(COLS).astype(np.float32)
    got, expected = _run(CHECKED[key], packed_table([(raw, qtype)], _layout(CHECKED[key])), 0, w, x)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("key", list(CHECKED), ids=lambda k: "-".join(k))
def test_kernels_on_real_tensors_of_every_type_in_gemma(key, gemma3_gguf):
    g = GGUFFile(gemma3_gguf)
    by_type = {}
    for t in g.tensors.values():
        if len(t.shape) == 2 and t.qtype not in by_type:
            by_type[t.qtype] = t
    raws = [(t.raw[:130], t.qtype) for t in by_type.values()]
    table = packed_table(raws, _layout(CHECKED[key]))
    for i, (raw, qtype) in enumerate(raws):
        w = dequantize(raw, qtype)
        x = np.random.default_rng(i).standard_normal(w.shape[1]).astype(np.float32)
        got, expected = _run(CHECKED[key], table, i, w, x)
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * np.abs(expected).max(), err_msg=qtype.name)


def test_one_launch_computes_several_matrices_of_different_formats():
    from gguf import GGMLQuantizationType as QT
    raws = [(random_tensor(QT.Q4_K, 64, 256, 1), QT.Q4_K), (random_tensor(QT.Q8_0, 70, 256, 2), QT.Q8_0),
            (random_tensor(QT.F16, 64, 256, 3), QT.F16)]
    table = packed_table(raws)
    x = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    widths = [table.padded_rows(i) for i in range(3)]
    out = np.zeros(sum(widths), np.float32)
    matvec(table.data, table.scales, table.scales16, table.meta, np.arange(3), x, out,
           np.zeros((sum(widths) // TILE, TILE), np.float32))
    start = 0
    for i, (raw, qtype) in enumerate(raws):
        w = dequantize(raw, qtype)
        expected = w.astype(np.float64) @ x
        np.testing.assert_allclose(out[start:start + w.shape[0]], expected, atol=2e-5 * np.abs(expected).max())
        start += widths[i]


def test_scales_are_stored_as_float16_only_when_exact():
    from gguf import GGMLQuantizationType as QT
    fp16_scaled = pack(random_tensor(QT.Q4_1, 64, 256, 1), QT.Q4_1)
    assert fp16_scaled.param == PARAM_F16 and fp16_scaled.bias.dtype == np.float16 and fp16_scaled.units is None


@pytest.mark.parametrize("qtype_name, per", [("Q4_K", 8), ("Q5_K", 8), ("Q6_K", 16)])
def test_k_quant_scales_are_stored_factored_and_exact(qtype_name, per):
    # A K-quant's scale is float16 d × a 6/8-bit step: not a float16 in general, so it is kept
    # as the file's two factors, the step as int8 and d as float16, whose float32 product is the
    # file's scale to the bit.
    from gguf import GGMLQuantizationType as QT
    from worker.engine.quants import decode_rows
    qtype = QT[qtype_name]
    raw = random_tensor(qtype, 64, 512, 2)
    packed = pack(raw, qtype)
    assert packed.param == PARAM_STEP8 and packed.units is not None and packed.per == per
    dec = decode_rows(raw, qtype)
    assert dec.scale.astype(np.float16).astype(np.float32).tolist() != dec.scale.tolist()  # not whole float16s
    width = 1 if dec.bias is None else 2
    units = packed.units.reshape(1, 512 // (dec.group * per), width, TILE).astype(np.float32)
    steps = packed.scale.reshape(1, 512 // dec.group, TILE).astype(np.float32)
    scale = steps * np.repeat(units[:, :, 0, :], per, axis=1)
    np.testing.assert_array_equal(scale[0].T, dec.scale)
    if dec.bias is not None:
        bias_steps = packed.bias.reshape(1, 512 // dec.group, TILE).astype(np.float32)
        bias = bias_steps * np.repeat(units[:, :, 1, :], per, axis=1)
        np.testing.assert_array_equal(bias[0].T, dec.bias)


def test_each_dispatched_op_has_variants_with_distinct_codes():
    for op in DISPATCHED_OPS:
        codes = [v.code for v in variants_of(op).values()]
        assert codes and sorted(codes) == list(range(len(codes))), op


def test_matmul_has_at_least_three_variants_and_two_of_each_numerics():
    assert len(variants_of("matmul")) >= 3
    for numerics in ("float32", "int8"):
        assert len(variants_of("matmul", numerics)) >= 2, numerics


def test_buckets_cover_every_row_count_and_agree_with_the_step():
    from worker.engine.models.decode_parts import bucket_of as step_bucket_of
    assert [bucket_of(r) for r in (1, 2, 8, 9, 32, 33, 512)] == [0, 1, 1, 2, 2, 3, 3]
    assert len(BUCKET_NAMES) == len(BUCKET_LIMITS) + 1
    for rows in range(1, 70):
        assert step_bucket_of(rows) == bucket_of(rows), rows


def test_op_table_names_its_variants_and_rejects_unknown_ones():
    table = OpTable.of(matmul="int8")
    assert table["matmul"] == "int8" and table["row"] == "gather"
    assert table.codes.shape == (len(DISPATCHED_OPS), len(BUCKET_NAMES))
    assert table.codes[MATMUL].tolist() == [KERNELS[("matmul", "int8")].code] * len(BUCKET_NAMES)
    assert OpTable.of()["matmul"] == "float32"
    with pytest.raises(ValueError, match="no variant"):
        OpTable.of(matmul="fp8")
    with pytest.raises(ValueError, match="no dispatched op"):
        OpTable.of(softmax="fast")
    with pytest.raises(ValueError, match="buckets"):
        OpTable.of(matmul=("int8", "int8"))


def test_op_table_per_bucket_choice_and_numerics():
    table = OpTable.of(matmul="int8").with_variant("matmul", 0, "int8_serial")
    assert table.names("matmul") == ("int8_serial", "int8", "int8", "int8")
    assert table["matmul"] == "int8_serial/int8/int8/int8"
    assert table.codes[MATMUL, 0] == KERNELS[("matmul", "int8_serial")].code
    assert table.numerics("matmul") == "int8"
    mixed = table.with_variant("matmul", 3, "float32")
    with pytest.raises(ValueError, match="mixes numerics"):
        mixed.numerics("matmul")


@pytest.mark.parametrize("rows", [1, 3, 12, 40])
@pytest.mark.parametrize("variant", list(variants_of("matmul")))
def test_the_step_matmul_runs_the_function_its_table_entry_names(variant, rows):
    """decode_parts.matmul with a table's codes gives the bits of that entry's own function, in
    the bucket of the call's row count (the other buckets name another variant)."""
    from gguf import GGMLQuantizationType as QT
    from worker.engine.models.decode_parts import matmul
    entry = KERNELS[("matmul", variant)]
    table = packed_table([(random_tensor(QT.Q4_K, ROWS, COLS, 4), QT.Q4_K)], layout_for(entry.numerics))
    width = table.padded_rows(0)
    xs = np.random.default_rng(5).standard_normal((rows, COLS)).astype(np.float32)
    scratch = (batch_scratch(width // TILE, rows, COLS), batch_scratch_i8(width // TILE, rows, COLS))
    mats = np.array([0])
    got = np.zeros((rows, width), np.float32)
    tab = table.arrays
    other = "float32" if KERNELS[("matmul", variant)].numerics == "int8" else "int8"
    ops = OpTable.of(matmul=other).with_variant("matmul", bucket_of(rows), variant)
    matmul((tab, ops.codes, scratch), mats, xs, got)
    expected = np.zeros_like(got)
    entry.fn(*tab, mats, xs, expected, scratch[1] if entry.numerics == "int8" else scratch[0])
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("numerics", ["float32", "int8"])
@pytest.mark.parametrize("qtype", ALL_QUANT_TYPES, ids=lambda q: q.name)
def test_variants_of_one_numerics_give_the_same_bits(numerics, qtype):
    """What lets a tuner swap them under live requests: no output changes."""
    raw = random_tensor(qtype, ROWS, COLS, seed=6)
    table = packed_table([(raw, qtype)], layout_for(numerics))
    width = table.padded_rows(0)
    xs = np.random.default_rng(2).standard_normal((5, COLS)).astype(np.float32)
    outs = []
    for variant in variants_of("matmul", numerics).values():
        out = np.zeros((5, width), np.float32)
        scratch = batch_scratch(width // TILE, 5, COLS) if numerics == "float32" else \
            batch_scratch_i8(width // TILE, 5, COLS)
        variant.fn(table.data, table.scales, table.scales16, table.meta, np.array([0]), xs, out, scratch)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


@pytest.mark.parametrize("qtype", ALL_QUANT_TYPES, ids=lambda q: q.name)
def test_the_row_gather_reads_both_code_layouts_alike(qtype):
    """Embedding lookups read the table whatever kernels it was packed for: every row, every
    output position within a tile (the quads layout permutes them), the same floats."""
    from worker.engine.kernels.ops import dequant_row
    raw = random_tensor(qtype, ROWS, COLS, seed=8)
    tables = [packed_table([(raw, qtype)], layout) for layout in (LAYOUT_ROWS, LAYOUT_QUADS)]
    w = dequantize(raw, qtype)
    for token in range(ROWS):
        rows = []
        for t in tables:
            out = np.zeros(COLS, np.float32)
            dequant_row(t.data, t.scales, t.scales16, t.meta[0], token, out)
            rows.append(out)
        np.testing.assert_array_equal(rows[0], rows[1])
        np.testing.assert_allclose(rows[0], w[token], rtol=0, atol=1e-6 * np.abs(w).max())


def test_the_float_kernels_refuse_the_int8_layout():
    from gguf import GGMLQuantizationType as QT
    from worker.engine.kernels.matmul_batch import linear_batch
    table = packed_table([(random_tensor(QT.Q4_K, 64, 256, 1), QT.Q4_K)], LAYOUT_QUADS)
    args = (table.data, table.scales, table.scales16, table.meta, np.array([0]))
    x = np.ones((2, 256), np.float32)
    with pytest.raises(ValueError, match="LAYOUT_ROWS"):
        linear_batch(*args, x, np.zeros((2, 64), np.float32), batch_scratch(1, 2, 256))
    with pytest.raises(ValueError, match="LAYOUT_ROWS"):
        matvec(*args, x[0], np.zeros(64, np.float32), np.zeros((1, TILE), np.float32))


def test_every_registry_entry_is_reached_by_the_steps_dispatch():
    """Adding a variant is one registry entry: the fused steps' dispatch (decode_parts.dispatch,
    which builds the matmul and row calls) has a branch for every entry, reached by its code and
    running that entry's own function (here a marker standing in for it: variants of one numerics
    give the same bits, so outputs cannot tell them apart)."""
    from numba import njit
    from worker.engine.models.decode_parts import dispatch
    assert {v.op for v in KERNELS.values()} <= set(DISPATCHED_OPS)

    def marker(entry):
        mark = list(KERNELS.values()).index(entry)

        @njit
        def run(out):
            out[0] = mark
        return run

    for op in DISPATCHED_OPS:
        call = dispatch(op, marker)
        entries = variants_of(op).values()
        assert sorted(e.code for e in entries) == list(range(len(entries))), op
        for entry in entries:
            out = np.full(1, -1)
            call(entry.code, out)
            assert out[0] == list(KERNELS.values()).index(entry), f"{op}/{entry.variant}"


@pytest.mark.parametrize("layout", [LAYOUT_ROWS, LAYOUT_QUADS])
def test_the_step_embedding_runs_the_row_variant_of_its_table(layout):
    from gguf import GGMLQuantizationType as QT
    from worker.engine.models.decode_parts import embed_rows
    table = packed_table([(random_tensor(QT.Q6_K, ROWS, COLS, 9), QT.Q6_K)], layout)
    tab = table.arrays
    tokens = np.array([3, 0, 99, 3])
    for variant in variants_of("row").values():
        ops = OpTable.of(row=variant.variant)
        got = np.zeros((4, COLS), np.float32)
        embed_rows((tab, ops.codes, ()), 0, tokens, got)
        for b, token in enumerate(tokens):
            want = np.zeros(COLS, np.float32)
            variant.fn(table.data, table.scales, table.scales16, table.meta[0], token, want)
            np.testing.assert_array_equal(got[b], want)
