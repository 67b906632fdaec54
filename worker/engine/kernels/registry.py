"""Every kernel variant, by (op, variant), with the quant types it serves.

The model code calls the active variant; tests parametrize over this table so a new
variant cannot land untested. Each op's reference twin is plain float32 math on weights
dequantized by `worker.engine.quants.dequantize` (bit-identical to gguf.quants).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from worker.engine.kernels import matmul_batch, matvec, ops
from worker.engine.quants import SPECS


@dataclass(frozen=True)
class KernelVariant:
    op: str  # "matvec": W @ x; "matvec_batch": W @ x[b] for B vectors; "unpack": W → float32; "row": one row
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
    ("unpack", "rows"): KernelVariant("unpack", "rows", matvec.unpack_f32,
                                      "dequantize a packed matrix to float32, parallel over rows"),
    ("row", "gather"): KernelVariant("row", "gather", ops.dequant_row,
                                     "dequantize one row (embedding lookup)"),
}
