"""Every kernel variant, by (op, variant), with the quant types it serves.

The model code calls the active variant; tests parametrize over this table so a new
variant cannot land untested. Each op's reference twin is plain float32 math on weights
dequantized by `worker.engine.quants.dequantize` (bit-identical to gguf.quants).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from worker.engine.kernels import matmul_batch, matmul_i8, matvec, ops
from worker.engine.quants import SPECS


@dataclass(frozen=True)
class KernelVariant:
    op: str  # "matvec": W @ x; "matvec_batch": W @ x[b] for B vectors;
    # "matvec_batch_int8": the same with x quantized per 32 values; "row": one row
    variant: str
    fn: Callable
    description: str


ALL_QUANT_TYPES = tuple(SPECS)  # F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K

KERNELS: dict[tuple[str, str], KernelVariant] = {
    ("matvec", "tiled"): KernelVariant("matvec", "tiled", matvec.linear,
                                       "transposed 64-row tiles, parallel over tiles, several matrices per launch "
                                       "(the bit-exact yardstick of matvec_batch)"),
    ("matvec_batch", "registers"): KernelVariant("matvec_batch", "registers", matmul_batch.linear_batch,
                                                 "each weight block converted once and applied to up to 8 rows "
                                                 "held in registers (every decode step); same bits as matvec"),
    ("matvec_batch_int8", "vnni"): KernelVariant("matvec_batch_int8", "vnni", matmul_i8.linear_batch_i8,
                                                 "activations quantized per 32 to int8, dot products on "
                                                 "AVX-512 VNNI or AVX2 (portable IR elsewhere); rows independent"),
    ("row", "gather"): KernelVariant("row", "gather", ops.dequant_row,
                                     "dequantize one row (embedding lookup)"),
}
