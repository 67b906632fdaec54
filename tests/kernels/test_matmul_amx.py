"""linear_batch_amx (AMX tile sums, matmul_i8's finish): the bits of the int8 kernels for every
quant type, row count (whole blocks of 16 and a tail) and real file; on AMX where the CPU has it."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tests.kernels.quant_cases import batch_inputs, packed_table, random_tensor
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels import matmul_amx, matmul_i8
from worker.engine.kernels.matmul_amx import linear_batch_amx
from worker.engine.kernels.matmul_i8 import batch_scratch_i8, linear_batch_i8, linear_batch_i8_blocked
from worker.engine.kernels.packing import FMT_Q4, FMT_Q6, FMT_Q8, LAYOUT_QUADS, M_FMT, M_K, TILE
from worker.engine.kernels.registry import ALL_QUANT_TYPES, KERNELS, OpTable, serves_bucket


def _batch(table, mats, x, kernel):
    width = sum(table.padded_rows(int(i)) for i in mats)
    out = np.full((x.shape[0], width), np.nan, np.float32)  # every output must be written
    kernel(table.data, table.scales, table.scales16, table.meta, np.asarray(mats), x, out,
           batch_scratch_i8(width // TILE, x.shape[0], x.shape[1]))
    return out


def _host_has_amx() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return platform.machine() == "x86_64" and {"amx_tile", "amx_int8"} <= set(flags)


def test_amx_is_used_exactly_where_the_cpu_and_numba_have_it():
    expected = (_host_has_amx() and matmul_i8.ISA == "vnni" and matmul_amx._tile_permission())
    assert matmul_amx.AVAILABLE == expected
    variant = KERNELS[("matmul", "int8_amx")]
    # the tuner times it only where it runs its own code, and only on prompt chunks
    assert [serves_bucket(variant, b) for b in range(4)] == [False, False, False, expected]


def test_without_amx_the_variant_is_the_blocked_kernel_and_holds_no_tile_code():
    # numba's target without AVX-512 VNNI (as on an AVX2 host): no tiles, and the registry's entry
    # is matmul_i8's blocked kernel itself, so no tile instruction is compiled.
    code = ("from worker.engine.kernels import matmul_amx, matmul_i8; "
            "print(matmul_amx.AVAILABLE, matmul_amx.linear_batch_amx is matmul_i8.linear_batch_i8_blocked)")
    env = {**os.environ, "NUMBA_CPU_FEATURES": "-avx512vnni"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert done.stdout.split() == ["False", "True"], done.stderr


@pytest.mark.parametrize("batch", [1, 16, 33, 64, 71])
def test_every_quant_type_gives_the_bits_of_the_int8_kernels(batch):
    # Whole blocks of 16 rows go to the tiles, the rest (1, 1, 7 rows) to matmul_i8's step; all
    # eleven types side by side in one launch: q4 (Q4_0/Q4_1/Q4_K), q6 (Q6_K), q8 with groups of
    # 32 and 16 (Q5_x, Q8_0), float32 (F32/F16/BF16, not quantized).
    table = packed_table([(random_tensor(q, 64 + 8 * i, 512, i), q) for i, q in enumerate(ALL_QUANT_TYPES)],
                         LAYOUT_QUADS)
    assert {FMT_Q4, FMT_Q6, FMT_Q8} <= set(table.meta[:, M_FMT].tolist())
    mats = list(range(len(ALL_QUANT_TYPES)))
    x = batch_inputs(batch, 512, seed=batch)
    plain = _batch(table, mats, x, linear_batch_i8)
    assert not np.isnan(plain).any()
    assert np.array_equal(_batch(table, mats, x, linear_batch_amx), plain)


def test_extreme_activations_and_codes_stay_exact():
    # int32 tile sums of the largest codes times ±127 activations over 8960 inputs (the 1.5B's
    # ffn_down width) cannot overflow: 8960 · 128 · 127 < 2³¹.
    raws = [(random_tensor(QT.Q8_0, 64, 8960, 5), QT.Q8_0), (random_tensor(QT.Q6_K, 64, 8960, 6), QT.Q6_K)]
    table = packed_table(raws, LAYOUT_QUADS)
    x = np.where(np.random.default_rng(0).random((32, 8960)) < 0.5, -1.0, 1.0).astype(np.float32)
    x[3] = 0.0  # an all-zero row: d = 0
    plain = _batch(table, [0, 1], x, linear_batch_i8_blocked)
    assert np.array_equal(_batch(table, [0, 1], x, linear_batch_amx), plain)


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf", "qwen05_gguf", "qwen15_gguf"])
def test_real_files_give_the_bits_of_the_int8_kernels(fixture, request):
    # One tensor of each quantized type in each real file (its first 130 rows, all its inputs), a
    # prompt chunk of 48 rows and one of 37: with the int8 kernels' bits, AMX passes the golden
    # rule wherever they do (tests/model/test_golden.py runs them on these files).
    g = GGUFFile(request.getfixturevalue(fixture))
    by_type = {}
    for t in g.tensors.values():
        if len(t.shape) == 2 and t.qtype not in by_type and t.qtype not in (QT.F32, QT.F16, QT.BF16):
            by_type[t.qtype] = t
    raws = [(t.raw[:130], t.qtype) for t in by_type.values()]
    table = packed_table(raws, LAYOUT_QUADS)
    for i, (raw, qtype) in enumerate(raws):
        k = table.meta[i, M_K]
        for rows in (48, 37):
            x = batch_inputs(rows, int(k), seed=rows + i)
            assert np.array_equal(_batch(table, [i], x, linear_batch_amx),
                                  _batch(table, [i], x, linear_batch_i8_blocked)), qtype.name


def test_the_shipped_table_takes_amx_for_prompt_chunks_only_where_available_and_allowed():
    from shared.errors import ConfigError
    from worker.engine.engine import _int8_matmuls
    names = _int8_matmuls("auto")
    assert names[-1] == ("int8_amx" if matmul_amx.AVAILABLE else "int8_blocked")
    assert OpTable.of(matmul=names).numerics("matmul") == "int8"
    assert _int8_matmuls("off") == ("int8", "int8", "int8", "int8_blocked")  # [engine] matmul_tiles = off
    with pytest.raises(ConfigError, match="matmul_tiles"):
        _int8_matmuls("on")
