"""Repack GGUF tensors into the layouts the decode kernels stream fastest.

A matrix W (n outputs × k inputs) is cut into tiles of TILE output rows. Inside a tile the
weights are stored transposed — for each input index, TILE consecutive bytes, one per output —
so the inner kernel loop runs over outputs with `x[k]` broadcast and LLVM vectorizes it.
Scales (and biases) are split out per group of 16/32 inputs, also TILE-wide, as float16 when
that is exact (the scales of Q4_0/Q4_1/Q5_x/Q8_0 are float16 in the file; decode streams the weights,
so the 2 bytes saved per group are ~15% of a Q4 matrix). A K-quant's scale is a product, the
super-block's float16 d times a 6- or 8-bit step, which float16 cannot hold but float32 can: it is
stored *factored* — the steps as the file's small integers, one int8 per group (in the `data`
arena, after the codes), the units (d, and -dmin for the bias) as float16 per 256-input
super-block — and the kernels multiply the two back, exactly, when they read a group. On
Qwen2.5-Coder-1.5B (Q4_K/Q6_K) that is ~117 MB of parameters (96 MB of steps, 21 MB of units)
instead of 214 MB with float16 steps or 444 MB of float32 ones. Anything else keeps float32 scales.

Three formats cover every GGUF type (see `quants.py`, which decodes them all to
`scale * code + bias`):
  FMT_Q4  two 4-bit codes per byte (codes 0..15): Q4_0, Q4_1, Q4_K
  FMT_Q8  one int8 code per byte: Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
  FMT_F32 float32 weights: F32, F16, BF16
and a fourth for the int8 kernels' table (LAYOUT_QUADS):
  FMT_Q6  6-bit codes c + 32 (0..63) of groups of 16 whose codes lie in -32..31 (Q6_K): per
          group, 8 code rows of nibbles (row r: input r low, r + 8 high) and 4 rows of the top 2
          bits (row i: inputs i, i + 4, i + 8, i + 12 at bits 0, 2, 4, 6), 12 rows in all instead
          of 16. Q6_K is ~40% of the weights a Qwen2.5-Coder decode step reads (the output
          projection and half the ffn_down), so 6 bits instead of 8 save ~10% of its bytes; the
          int8 kernels rebuild a code in 3-4 vector operations, shared by the rows of a step.
(A packed 5-bit format — nibbles plus a bit plane — read 40% fewer bytes for Q5 types but its
bit extraction made the kernel 1.4x slower at 1 thread and no faster at 2: decode here is not
purely bandwidth-bound, so Q5 types stay one byte per weight.)

All matrices of a model live in one `MatrixTable` (three flat arenas — codes, float32 and
float16 scales — plus a metadata row per matrix) so a single compiled decode step can address any
mix of formats.

Two code layouts, one per kind of matmul (a table has one, chosen by the engine's numerics):
  LAYOUT_ROWS   the transposed tile above: code row r of a tile is input r's TILE bytes (Q4: inputs
                r and r + 16 of its group). The float32 kernels broadcast x[k] over a row.
  LAYOUT_QUADS  each block of 4 code rows (a "quad": 4 consecutive inputs) stored as the int8
                kernels consume it — 4 vectors of 16 dwords, dword j of vector v holding the quad's
                4 bytes of output 16 (j // 4) + 4 v + j % 4 (the order x86 byte/word unpacks
                within 128-bit lanes produce). The int8 kernels then load their dot-product
                operands directly instead of interleaving 4 rows with 8 shuffles per 64 outputs in
                every call (AVX2, one core, SmolLM2's gate/up at 8 rows: 47-50 → 53-68 GMAC/s;
                matmul_i8). Same bytes, permuted within each 256-byte quad: offsets and sizes are
                those of LAYOUT_ROWS. The TILE parameters of a group (scales, biases, units) are
                permuted the same way (`param_position`), so a vector's 16 are one load: gathering
                them 4 by 4 cost one-row K-quant calls 16-20% of their time (8960 × 1536, one Zen
                4 core, bench/matmul_one_row.py: Q4_K 315-336 µs gathered, 258-275 in order).
F32 matrices are stored as LAYOUT_ROWS in either table (the int8 kernels run them in float32).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as QT
from numba import njit

from worker.engine.quants import decode_rows, dequantize

TILE = 64
FMT_F32, FMT_Q4, FMT_Q8, FMT_Q6 = 0, 1, 2, 3
FORMAT_NAMES = {FMT_F32: "f32", FMT_Q4: "q4", FMT_Q8: "q8", FMT_Q6: "q6"}

_Q4_TYPES = {QT.Q4_0, QT.Q4_1, QT.Q4_K}
_Q8_TYPES = {QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K, QT.Q8_0}

# Columns of MatrixTable.meta. M_PARAM is where the group parameters are and in which type
# (PARAM_*): M_SCALE and M_BIAS index `scales` (float32), `scales16` (float16) or `data` (int8
# steps of a factored matrix); M_BIAS is -1 for types without a per-group minimum; M_NARROW is 1 for a q8 matrix
# whose codes are small enough (see narrow_codes) that int16 sums of a whole group cannot overflow.
# M_LAYOUT is the matrix's code layout (LAYOUT_ROWS or LAYOUT_QUADS). M_UNIT is the offset in
# `scales16` of a factored matrix's units (-1 when its parameters are whole), M_PER its groups per
# super-block; see unit_offset for where a group's units are.
M_FMT, M_N, M_K, M_GROUP, M_DATA, M_SCALE, M_BIAS, M_TILES, M_PARAM, M_NARROW, M_LAYOUT, M_UNIT, M_PER = range(13)
META_COLS = 13
PARAM_F32, PARAM_F16, PARAM_STEP8 = 0, 1, 2

LAYOUT_ROWS, LAYOUT_QUADS = 0, 1
LAYOUT_NAMES = {LAYOUT_ROWS: "rows", LAYOUT_QUADS: "quads"}
QUAD = 4  # code rows per quad (vpdpbusd sums 4 adjacent bytes)


def quad_lanes() -> np.ndarray:
    """(4, 16): the output (within the tile) of dword j of vector v in a LAYOUT_QUADS quad."""
    v, j = np.meshgrid(np.arange(4), np.arange(16), indexing="ij")
    return 16 * (j // 4) + 4 * v + j % 4


@njit(cache=True, nogil=True)
def param_position(t: int) -> int:
    """Where output t's parameter sits among its group's TILE in a LAYOUT_QUADS table: vector
    v = (t % 16) // 4, lane j = 4 (t // 16) + t % 4 (quad_lanes inverted), position 16 v + j."""
    return 16 * ((t % 16) // 4) + 4 * (t // 16) + t % 4


def interleave_quads(tiles: np.ndarray) -> np.ndarray:
    """LAYOUT_ROWS codes (tiles, rows, TILE) → LAYOUT_QUADS bytes, same shape (rows % 4 == 0)."""
    n_tiles, rows, width = tiles.shape
    quads = tiles.reshape(n_tiles, rows // QUAD, QUAD, width)[..., quad_lanes()]  # (t, p, i, v, j)
    return np.ascontiguousarray(quads.transpose(0, 1, 3, 4, 2)).reshape(n_tiles, rows, width)

# Largest |int8 activation code| (matmul_i8 quantizes to ±127) and int16's largest value.
_ACT_MAX, _INT16_MAX = 127, 32767


def narrow_codes(code_max: int, group: int) -> bool:
    """True when a group's products with int8 activations, summed 2 at a time (vpmaddubsw) and
    then across the group's group/4 quads in int16, stay within int16: Q5_0 (|code| ≤ 16, groups
    of 32) and Q6_K (≤ 32, groups of 16) are; Q8_0 (≤ 128) is not. (The int8 table stores Q6_K as
    FMT_Q6, which sums its own way; narrow only matters for it where it stays one byte a code.)"""
    return (group // 4) * 2 * code_max * _ACT_MAX <= _INT16_MAX


SIX_BIT_GROUP, SIX_BIT_OFFSET = 16, 32  # FMT_Q6: groups of 16 codes stored as c + 32 in 0..63
SIX_BIT_ROWS = 12  # code rows of one FMT_Q6 group: 8 of nibbles, 4 of the top bits


@njit(cache=True, nogil=True)
def code_bytes_per_group(fmt: int, group: int) -> int:
    """Bytes of one group of one tile's codes in format fmt (quantized formats only)."""
    if fmt == FMT_Q4:
        return group // 2 * TILE
    if fmt == FMT_Q6:
        return SIX_BIT_ROWS * TILE
    return group * TILE


def fits_six_bits(m: "PackedMatrix") -> bool:
    """True for a q8 matrix of groups of 16 whose codes all lie in -32..31 (Q6_K's)."""
    if m.fmt != FMT_Q8 or m.group != SIX_BIT_GROUP:
        return False
    codes = m.data.view(np.int8)
    return codes.size > 0 and int(codes.min()) >= -SIX_BIT_OFFSET and int(codes.max()) < SIX_BIT_OFFSET


def six_bit(m: "PackedMatrix") -> "PackedMatrix":
    """The FMT_Q6 form (code rows as the module docstring says, LAYOUT_ROWS order) of a matrix
    fits_six_bits accepts; its parameters are shared, not copied."""
    tiles, groups = _tiles(m.n), m.k // SIX_BIT_GROUP
    codes = m.data.view(np.int8).reshape(tiles, groups, SIX_BIT_GROUP, TILE)
    rows = np.empty((tiles, groups, SIX_BIT_ROWS, TILE), np.uint8)
    step = 256  # tiles at a time: a 151,936-row output projection's temporaries stay ~100 MB, not ~1 GB
    for t0 in range(0, tiles, step):
        u = (codes[t0:t0 + step].astype(np.int16) + SIX_BIT_OFFSET).astype(np.uint8)
        rows[t0:t0 + step, :, :8] = (u[:, :, :8] & 15) | ((u[:, :, 8:] & 15) << 4)
        top = u >> 4
        rows[t0:t0 + step, :, 8:] = (top[:, :, 0:4] | (top[:, :, 4:8] << 2)
                                     | (top[:, :, 8:12] << 4) | (top[:, :, 12:16] << 6))
    return replace(m, fmt=FMT_Q6, data=rows.ravel(), narrow=False)


def format_for(qtype: QT) -> int:
    qtype = QT(qtype)
    if qtype in _Q4_TYPES:
        return FMT_Q4
    if qtype in _Q8_TYPES:
        return FMT_Q8
    return FMT_F32


def _tiles(n: int) -> int:
    return -(-n // TILE)


def _tile_transpose(a: np.ndarray) -> np.ndarray:
    """(n, cols) → (tiles, cols, TILE), zero-padding n up to a whole tile."""
    n, cols = a.shape
    padded = np.zeros((_tiles(n) * TILE, cols), dtype=a.dtype)
    padded[:n] = a
    return np.ascontiguousarray(padded.reshape(-1, TILE, cols).transpose(0, 2, 1))


@dataclass
class PackedMatrix:
    fmt: int
    n: int
    k: int
    group: int
    data: np.ndarray  # uint8, flattened (tiles, rows, TILE) in the format's element type
    scale: np.ndarray  # float32, float16 or int8 steps, flattened (tiles, k // group, TILE); empty for f32
    bias: np.ndarray | None  # like scale, or None
    narrow: bool = False  # q8 codes within narrow_codes' bound
    # Factored parameters: scale and bias hold int8 steps, these their float16 units, flattened
    # (tiles, k // (group * per), 1 or 2 (scale, bias), TILE); per = groups per super-block.
    units: np.ndarray | None = None
    per: int = 0

    @property
    def param(self) -> int:
        """PARAM_F32, PARAM_F16 or PARAM_STEP8: the type of scale and bias."""
        return {np.dtype(np.float16): PARAM_F16, np.dtype(np.int8): PARAM_STEP8}.get(self.scale.dtype, PARAM_F32)


def pack(raw: np.ndarray, qtype: QT) -> PackedMatrix:
    """GGUF rows (n, row_bytes) of one matrix → its kernel layout."""
    qtype = QT(qtype)
    fmt = format_for(qtype)
    n = raw.shape[0]
    if fmt == FMT_F32:
        w = dequantize(raw, qtype)
        return PackedMatrix(fmt, n, w.shape[1], 1, _tile_transpose(w).view(np.uint8).ravel(),
                            np.zeros(0, np.float32), None)
    dec = decode_rows(raw, qtype)
    codes, scale, bias = dec.codes, dec.scale, dec.bias
    k = codes.shape[1]
    if fmt == FMT_Q4:
        # Unsigned codes 0..15: a signed type's centre moves into the bias.
        low = codes.min() if codes.size else 0
        if low < 0:
            shift = np.float32(-low)
            bias = (np.zeros_like(scale) if bias is None else bias) - scale * shift
            codes = codes + np.int8(-low)
        u = codes.astype(np.uint8).reshape(n, k // 32, 2, 16)
        # Byte j of a group: element j in the low nibble, element j + 16 in the high one.
        packed = (u[:, :, 0, :] | (u[:, :, 1, :] << 4)).reshape(n, k // 2)
        data = _tile_transpose(packed).ravel()
        narrow = False
    else:
        data = _tile_transpose(codes).view(np.uint8).ravel()
        narrow = narrow_codes(int(np.abs(codes.astype(np.int16)).max()) if codes.size else 0, dec.group)
    halves = _as_half_if_exact(scale, bias)
    units, per = None, 0
    if halves is not None:
        scale, bias = halves
    elif dec.factors is not None and bias is dec.bias:  # not when a Q4 shift moved the bias
        f = dec.factors
        factored = _as_int8_if_exact(f.scale_steps, f.bias_steps)
        unit_parts = [f.scale_unit] if f.bias_unit is None else [f.scale_unit, f.bias_unit]
        halves_of_units = [u.astype(np.float16) for u in unit_parts]
        if factored is not None and all(np.array_equal(h.astype(np.float32), u)
                                        for h, u in zip(halves_of_units, unit_parts)):
            scale, bias = factored
            per = f.scale_steps.shape[1] // f.scale_unit.shape[1]
            # (n, supers, 1 or 2) → (tiles, supers, 1 or 2, TILE)
            stacked = np.stack(halves_of_units, axis=2)
            supers, width = stacked.shape[1], stacked.shape[2]
            padded = np.zeros((_tiles(n) * TILE, supers, width), np.float16)
            padded[:n] = stacked
            units = np.ascontiguousarray(padded.reshape(-1, TILE, supers, width).transpose(0, 2, 3, 1)).ravel()
    return PackedMatrix(fmt, n, k, dec.group, data,
                        _tile_transpose(scale).ravel(),
                        None if bias is None else _tile_transpose(bias).ravel(), narrow, units, per)


def _as_int8_if_exact(scale: np.ndarray, bias: np.ndarray | None):
    """int8 copies (scale, bias) of a K-quant's steps when they are integers of int8's range
    (always: 4- to 8-bit steps), else None."""
    parts = [scale] if bias is None else [scale, bias]
    if not all(np.array_equal(p, np.rint(p)) and (p.size == 0 or (p.min() >= -128 and p.max() <= 127))
               for p in parts):
        return None
    steps = [p.astype(np.int8) for p in parts]
    return steps[0], (steps[1] if bias is not None else None)


def _as_half_if_exact(scale: np.ndarray, bias: np.ndarray | None):
    """float16 copies (scale, bias) when they round-trip exactly (always for the types with fp16
    scales), else None."""
    parts = [scale] if bias is None else [scale, bias]
    halves = [p.astype(np.float16) for p in parts]
    if all(np.array_equal(h.astype(np.float32), p) for h, p in zip(halves, parts)):
        return halves[0], (halves[1] if bias is not None else None)
    return None


class TableArrays(NamedTuple):
    """A MatrixTable's arrays as the kernels take them (one argument instead of four)."""
    data: np.ndarray  # uint8: every matrix's codes, then the factored matrices' int8 steps
    scales: np.ndarray  # float32 group scales and biases (PARAM_F32)
    scales16: np.ndarray  # uint16 (float16 bits): float16 group parameters and factored matrices' units
    meta: np.ndarray  # int64 (n_matrices, META_COLS): each matrix's row of M_* columns


class MatrixTable:
    """All packed matrices of a model in three arenas; matrices are addressed by index."""

    def __init__(self) -> None:
        self._parts: list[PackedMatrix] = []
        self.data = np.zeros(0, np.uint8)
        self.scales = np.zeros(1, np.float32)  # float32 scales and biases
        self.scales16 = np.zeros(1, np.uint16)  # float16 scales and biases (as bits)
        self.meta = np.zeros((0, META_COLS), np.int64)

    def add(self, matrix: PackedMatrix) -> int:
        self._parts.append(matrix)
        return len(self._parts) - 1

    def finalize(self, layout: int = LAYOUT_ROWS) -> None:
        """Concatenate every added matrix into the arenas (call once, after the last add), the
        quantized ones' codes in `layout` (LAYOUT_QUADS for the int8 kernels)."""
        if layout not in LAYOUT_NAMES:
            raise ValueError(f"unknown code layout {layout!r}")
        if layout == LAYOUT_QUADS:  # only the int8 kernels read FMT_Q6
            self._parts = [six_bit(m) if fits_six_bits(m) else m for m in self._parts]
        meta = np.zeros((len(self._parts), META_COLS), np.int64)
        codes_end = sum(m.data.size for m in self._parts)
        # Next free element of each parameter arena; int8 steps go into data after every code.
        used = {PARAM_F32: 0, PARAM_F16: 0, PARAM_STEP8: codes_end}
        d_off = 0
        for i, m in enumerate(self._parts):
            s_off = used[m.param]
            b_off = -1 if m.bias is None else s_off + m.scale.size
            used[m.param] += m.scale.size + (0 if m.bias is None else m.bias.size)
            u_off = -1 if m.units is None else used[PARAM_F16]
            used[PARAM_F16] += 0 if m.units is None else m.units.size
            own = layout if m.fmt != FMT_F32 else LAYOUT_ROWS
            meta[i] = (m.fmt, m.n, m.k, m.group, d_off, s_off, b_off, _tiles(m.n), m.param, int(m.narrow), own,
                       u_off, m.per)
            d_off += m.data.size
        self.data = np.empty(used[PARAM_STEP8], np.uint8)
        self.scales = np.empty(max(used[PARAM_F32], 1), np.float32)
        halves = np.empty(max(used[PARAM_F16], 1), np.float16)
        arenas = {PARAM_F32: self.scales, PARAM_F16: halves, PARAM_STEP8: self.data.view(np.int8)}
        lanes = quad_lanes().ravel()
        for i, m in enumerate(self._parts):
            arena = arenas[m.param]
            codes, scale, bias, units = m.data, m.scale, m.bias, m.units
            if meta[i, M_LAYOUT] == LAYOUT_QUADS:  # codes and parameters in the kernels' lane order
                codes = interleave_quads(codes.reshape(_tiles(m.n), -1, TILE)).ravel()
                scale, bias, units = (None if p is None else p.reshape(-1, TILE)[:, lanes].ravel()
                                      for p in (scale, bias, units))
            self.data[meta[i, M_DATA]:meta[i, M_DATA] + m.data.size] = codes
            arena[meta[i, M_SCALE]:meta[i, M_SCALE] + m.scale.size] = scale
            if bias is not None:
                arena[meta[i, M_BIAS]:meta[i, M_BIAS] + m.bias.size] = bias
            if units is not None:
                halves[meta[i, M_UNIT]:meta[i, M_UNIT] + m.units.size] = units
        self.scales16 = halves.view(np.uint16)
        self.meta = meta
        self._parts = []

    @property
    def arrays(self) -> TableArrays:
        return TableArrays(self.data, self.scales, self.scales16, self.meta)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes + self.scales16.nbytes

    def padded_rows(self, index: int) -> int:
        return int(self.meta[index, M_TILES]) * TILE


@njit(cache=True, nogil=True)
def unit_offset(meta: np.ndarray, tile: int, g: int) -> int:
    """Offset in scales16 of the units of group g of tile `tile` of a factored matrix (the bias's
    unit is TILE further on), or -1 when the matrix's parameters are whole. meta: its metadata row."""
    if meta[M_UNIT] < 0:
        return -1
    per = meta[M_PER]
    width = 2 if meta[M_BIAS] >= 0 else 1
    return meta[M_UNIT] + (tile * (meta[M_K] // (meta[M_GROUP] * per)) + g // per) * width * TILE
