"""Packed test tensors for every GGUF type: random data and slices of the real Gemma 3 file."""
from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from worker.engine.kernels.packing import LAYOUT_ROWS, MatrixTable, pack
from worker.engine.quants import SPECS

QUANTIZABLE = (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0)
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)


def random_k_quant(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes with sane fp16 super-block scales (gguf.quants cannot quantize K types)."""
    spec = SPECS[qtype]
    blocks = rng.integers(0, 256, (rows * cols // spec.block_size, spec.type_size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, (blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == QT.Q6_K:
        blocks[:, 208:210] = scales[:, 0:2]
    else:
        blocks[:, 0:4] = scales
    return blocks.reshape(rows, -1)


def random_tensor(qtype: QT, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Packed rows (rows, row_bytes) of a random matrix in `qtype`."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        return random_k_quant(qtype, rows, cols, rng)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    return gguf.quants.quantize(w, qtype).view(np.uint8).reshape(rows, -1)


def packed_table(raws, layout: int = LAYOUT_ROWS) -> MatrixTable:
    """A finalized MatrixTable of (packed rows, qtype) pairs, in order, codes in `layout`."""
    table = MatrixTable()
    for raw, qtype in raws:
        table.add(pack(raw, qtype))
    table.finalize(layout)
    return table


def batch_inputs(batch: int, k: int, seed: int = 1) -> np.ndarray:
    """float32 (batch, k) activations, each row at its own scale (as hidden states differ)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, k)) * rng.uniform(0.1, 3.0, (batch, 1))).astype(np.float32)
