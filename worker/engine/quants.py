"""GGUF tensor encodings: decode packed blocks into integer codes with per-group scales.

Every quantized GGUF type dequantizes as `scale * code + bias` over groups of 16 or 32
elements. `decode_blocks` returns those three parts (bias is None where the type has none);
the kernels repack them into their own layouts, and `dequantize` multiplies them back in the
exact operation order of `gguf.quants` so the result is bit-identical to the reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT

from shared.errors import ModelLoadError

QK_K = 256


@dataclass(frozen=True)
class Factors:
    """A K-quant's group parameters as the file stores them: scale = scale_unit × scale_steps and
    bias = bias_unit × bias_steps, exactly (the units are the super-block's float16 d and -dmin,
    the steps its 6- or 8-bit integers). Kept apart they fit float16 without rounding, where the
    products need float32."""
    scale_steps: np.ndarray  # float32 (n_blocks, block_size // group), small integers
    scale_unit: np.ndarray  # float32 (n_blocks,)
    bias_steps: np.ndarray | None
    bias_unit: np.ndarray | None


@dataclass(frozen=True)
class Decoded:
    codes: np.ndarray  # int8 (n_blocks, block_size): integer levels, already centred
    scale: np.ndarray  # float32 (n_blocks, block_size // group)
    bias: np.ndarray | None  # float32 like scale, or None
    group: int  # elements sharing one scale
    factors: Factors | None = None  # the K-quants' scale and bias as unit × step


@dataclass(frozen=True)
class QuantSpec:
    qtype: QT
    block_size: int  # elements per block
    type_size: int  # bytes per block
    group: int
    decode: Callable[[np.ndarray], Decoded] | None  # None for float types


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles_split_halves(qs: np.ndarray) -> np.ndarray:
    """Bytes (n, 16) → 32 codes: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes (n, 4) little-endian → the 32 high bits, element i from bit i."""
    bits = qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _q4_0(b: np.ndarray) -> Decoded:
    codes = _nibbles_split_halves(b[:, 2:]).astype(np.int8) - 8
    return Decoded(codes, _f16(b[:, :2]), None, 32)


def _q4_1(b: np.ndarray) -> Decoded:
    codes = _nibbles_split_halves(b[:, 4:]).astype(np.int8)
    return Decoded(codes, _f16(b[:, :2]), _f16(b[:, 2:4]), 32)


def _q5_0(b: np.ndarray) -> Decoded:
    low = _nibbles_split_halves(b[:, 6:])
    codes = (low | (_fifth_bits(b[:, 2:6]) << 4)).astype(np.int8) - 16
    return Decoded(codes, _f16(b[:, :2]), None, 32)


def _q5_1(b: np.ndarray) -> Decoded:
    low = _nibbles_split_halves(b[:, 8:])
    codes = (low | (_fifth_bits(b[:, 4:8]) << 4)).astype(np.int8)
    return Decoded(codes, _f16(b[:, :2]), _f16(b[:, 2:4]), 32)


def _q8_0(b: np.ndarray) -> Decoded:
    return Decoded(b[:, 2:].copy().view(np.int8), _f16(b[:, :2]), None, 32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K/Q5_K → 8 six-bit scales and 8 six-bit mins."""
    d, m, mh = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (mh & 0x0F) | ((d >> 6) << 4)], axis=1)
    mn = np.concatenate([m & 0x3F, (mh >> 4) | ((m >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b: np.ndarray) -> Decoded:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 32 bytes: low nibbles → sub-block 2c, high → 2c+1
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, QK_K).astype(np.int8)
    return Decoded(codes, d * sc, -(dmin * mn), 32, Factors(sc, d, mn, -dmin))


def _q5_k(b: np.ndarray) -> Decoded:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48]  # bit s of byte i is the 5th bit of element i of sub-block s
    qs = b[:, 48:].reshape(-1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    codes = (low | (high << 4)).reshape(-1, QK_K).astype(np.int8)
    return Decoded(codes, d * sc, -(dmin * mn), 32, Factors(sc, d, mn, -dmin))


def _q6_k(b: np.ndarray) -> Decoded:
    ql = b[:, 0:128].reshape(-1, 2, 1, 64)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    scales = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = ((ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 2, 4, 32)
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03).reshape(-1, 2, 4, 32)
    codes = (low | (high << 4)).reshape(-1, QK_K).astype(np.int8) - 32
    return Decoded(codes, d * scales, None, 16, Factors(scales, d, None, None))


SPECS: dict[QT, QuantSpec] = {
    QT.F32: QuantSpec(QT.F32, 1, 4, 1, None),
    QT.F16: QuantSpec(QT.F16, 1, 2, 1, None),
    QT.BF16: QuantSpec(QT.BF16, 1, 2, 1, None),
    QT.Q4_0: QuantSpec(QT.Q4_0, 32, 18, 32, _q4_0),
    QT.Q4_1: QuantSpec(QT.Q4_1, 32, 20, 32, _q4_1),
    QT.Q5_0: QuantSpec(QT.Q5_0, 32, 22, 32, _q5_0),
    QT.Q5_1: QuantSpec(QT.Q5_1, 32, 24, 32, _q5_1),
    QT.Q8_0: QuantSpec(QT.Q8_0, 32, 34, 32, _q8_0),
    QT.Q4_K: QuantSpec(QT.Q4_K, QK_K, 144, 32, _q4_k),
    QT.Q5_K: QuantSpec(QT.Q5_K, QK_K, 176, 32, _q5_k),
    QT.Q6_K: QuantSpec(QT.Q6_K, QK_K, 210, 16, _q6_k),
}


def spec_for(qtype: QT | int, tensor_name: str = "") -> QuantSpec:
    try:
        return SPECS[QT(qtype)]
    except (KeyError, ValueError):
        name = QT(qtype).name if qtype in QT._value2member_map_ else str(qtype)
        where = f" (tensor {tensor_name})" if tensor_name else ""
        supported = ", ".join(s.qtype.name for s in SPECS.values())
        raise ModelLoadError(f"unsupported tensor type {name}{where}; supported: {supported}") from None


def decode_rows(raw: np.ndarray, qtype: QT) -> Decoded:
    """Packed rows (rows, row_bytes) → codes (rows, K), scale/bias (rows, K // group)."""
    spec = spec_for(qtype)
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, spec.type_size)
    dec = spec.decode(blocks)
    f = dec.factors
    if f is not None:
        f = Factors(f.scale_steps.reshape(rows, -1), f.scale_unit.reshape(rows, -1),
                    None if f.bias_steps is None else f.bias_steps.reshape(rows, -1),
                    None if f.bias_unit is None else f.bias_unit.reshape(rows, -1))
    return Decoded(dec.codes.reshape(rows, -1), dec.scale.reshape(rows, -1),
                   None if dec.bias is None else dec.bias.reshape(rows, -1), dec.group, f)


def dequantize(raw: np.ndarray, qtype: QT) -> np.ndarray:
    """Packed rows (rows, row_bytes) → float32 (rows, K), bit-identical to gguf.quants."""
    qtype = QT(qtype)
    raw = np.ascontiguousarray(raw)
    if qtype == QT.F32:
        return raw.view(np.float32).reshape(raw.shape[0], -1).copy()
    if qtype == QT.F16:
        return raw.view(np.float16).reshape(raw.shape[0], -1).astype(np.float32)
    if qtype == QT.BF16:
        return (raw.view(np.int16).astype(np.int32) << 16).view(np.float32).reshape(raw.shape[0], -1)
    dec = decode_rows(raw, qtype)
    rows, k = dec.codes.shape
    codes = dec.codes.reshape(rows, -1, dec.group).astype(np.float32)
    out = dec.scale[:, :, None] * codes
    if dec.bias is not None:
        out = out + dec.bias[:, :, None]
    return out.reshape(rows, k)
