"""Every kernel variant, by (op, variant), with the quant types it serves; and the op table the
fused model steps dispatch through.

Tests parametrize over KERNELS so a new variant cannot land untested. Each op's reference twin is
plain float32 math on weights dequantized by `worker.engine.quants.dequantize` (bit-identical to
gguf.quants).

The fused steps never pick a variant themselves: the engine resolves an OpTable (one variant per
dispatched op) and passes its codes to every step, where `decode_parts` branches on them and
calls the function the chosen entry names. Codes are an argument, not a compile-time constant,
so the table can be swapped between two steps without recompiling anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from worker.engine.kernels import matmul_batch, matmul_i8, matvec, ops
from worker.engine.quants import SPECS


@dataclass(frozen=True)
class KernelVariant:
    op: str  # "matvec": W @ x (the yardstick, never dispatched); "matmul": W @ x[b] for B rows;
    # "row": one dequantized row (embedding lookup)
    variant: str
    fn: Callable
    code: int  # the value of the op's slot in OpTable.codes that selects this variant
    description: str


ALL_QUANT_TYPES = tuple(SPECS)  # F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K

KERNELS: dict[tuple[str, str], KernelVariant] = {
    ("matvec", "tiled"): KernelVariant("matvec", "tiled", matvec.linear, 0,
                                       "transposed 64-row tiles, parallel over tiles, several matrices per launch "
                                       "(the bit-exact yardstick of matmul/float32)"),
    ("matmul", "float32"): KernelVariant("matmul", "float32", matmul_batch.linear_batch, 0,
                                         "each weight block converted once and applied to up to 8 rows held in "
                                         "registers; float32 activations, the same bits as matvec"),
    ("matmul", "int8"): KernelVariant("matmul", "int8", matmul_i8.linear_batch_i8, 1,
                                      "activations quantized per 32 to int8, dot products on AVX-512 VNNI or "
                                      "AVX2 (portable IR elsewhere); rows independent"),
    ("row", "gather"): KernelVariant("row", "gather", ops.dequant_row, 0,
                                     "dequantize one row (embedding lookup)"),
}

# The ops a fused step dispatches on, in the order of their slots in OpTable.codes.
DISPATCHED_OPS = ("matmul", "row")
MATMUL, ROW = range(len(DISPATCHED_OPS))  # slots, read inside the numba steps


def variants_of(op: str) -> dict[str, KernelVariant]:
    return {v.variant: v for (o, _), v in KERNELS.items() if o == op}


@dataclass(frozen=True)
class OpTable:
    """The variant each dispatched op uses. `codes` is what a step reads: codes[MATMUL] is the
    code of the matmul variant; int64 (len(DISPATCHED_OPS),)."""
    variants: tuple[KernelVariant, ...]  # one per DISPATCHED_OPS entry, in slot order
    codes: np.ndarray

    @classmethod
    def of(cls, **chosen: str) -> "OpTable":
        """OpTable.of(matmul="int8"): the named variants, the first registered one for other ops."""
        unknown = set(chosen) - set(DISPATCHED_OPS)
        if unknown:
            raise ValueError(f"no dispatched op {sorted(unknown)[0]!r} (ops: {', '.join(DISPATCHED_OPS)})")
        picked = []
        for op in DISPATCHED_OPS:
            options = variants_of(op)
            name = chosen.get(op, next(iter(options)))
            if name not in options:
                raise ValueError(f"op {op!r} has no variant {name!r} (variants: {', '.join(options)})")
            picked.append(options[name])
        return cls(tuple(picked), np.array([v.code for v in picked], np.int64))

    def __getitem__(self, op: str) -> str:
        """The variant name op runs with: table["matmul"] == "int8"."""
        return self.variants[DISPATCHED_OPS.index(op)].variant
