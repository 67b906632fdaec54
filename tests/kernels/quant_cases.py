"""Packed test tensors for every GGUF type: random data and slices of the real Gemma 3 file."""
from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from worker.engine.kernels.packing import LAYOUT_ROWS, TILE, MatrixTable, PackedMatrix, pack
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


def packed_table(raws, layout: int = LAYOUT_ROWS, float32_params: bool = False) -> MatrixTable:
    """A finalized MatrixTable of (packed rows, qtype) pairs, in order, codes in `layout`; with
    float32_params, factored parameters are multiplied out into float32 ones (the kernels' other
    path, which the real types no longer take)."""
    table = MatrixTable()
    for raw, qtype in raws:
        packed = pack(raw, qtype)
        table.add(multiplied_out(packed) if float32_params else packed)
    table.finalize(layout)
    return table


def multiplied_out(m: PackedMatrix) -> PackedMatrix:
    """The same matrix with float32 scale = step × unit (and bias likewise) instead of factors."""
    if m.units is None:
        return m
    width = 1 if m.bias is None else 2
    units = m.units.astype(np.float32).reshape(-1, m.k // (m.group * m.per), width, TILE)
    per_group = np.repeat(units, m.per, axis=1)  # (tiles, groups, width, TILE)
    scale = (m.scale.astype(np.float32).reshape(per_group[:, :, 0].shape) * per_group[:, :, 0]).ravel()
    bias = None if m.bias is None else (
        m.bias.astype(np.float32).reshape(per_group[:, :, 1].shape) * per_group[:, :, 1]).ravel()
    return replace(m, scale=scale, bias=bias, units=None, per=0)


def batch_inputs(batch: int, k: int, seed: int = 1) -> np.ndarray:
    """float32 (batch, k) activations, each row at its own scale (as hidden states differ)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, k)) * rng.uniform(0.1, 3.0, (batch, 1))).astype(np.float32)
