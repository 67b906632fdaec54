"""Prompt-chunk matmuls on AMX tiles (Intel Sapphire Rapids and later), with the bits of the int8
kernels (matmul_i8).

Same contract and numerics as matmul_i8.linear_batch_i8: activations quantized per 32 inputs to
int8, one exact integer sum per (row of x, output, weight group), then per group
out = fma(m, Σx, fma(float(acc), s·d, out)). Only where the integer sums come from changes: AMX's
`tdpbssd` multiplies a 16-row tile of int8 activations by a tile of int8 weight codes (16 outputs,
4 consecutive inputs per dword) into a 16 × 16 tile of int32 sums — 8,192 multiply-adds per
instruction for a 32-input group, 128 times an AVX-512 `vpdpbusd`. The sums are exact, so every
output has the int8 kernels' bits (tests/kernels check it); the float finish of each group is
matmul_i8's own code generator, fed from the stored tile instead of registers.

Why groups stay separate. A K-quant's scale changes every 16 or 32 inputs, so a tile's K is one
group (32 bytes; 16 for Q6_K) and each group's sums are stored and finished before the next. The
finish (4 vector operations per row of 16 outputs, the same as matmul_i8's) is then what a prompt's
matmuls spend their time on: a group of 16 rows × 64 outputs of the 1.5B file's gate/up, one thread
on Sapphire Rapids, takes ~130 ns, 107 of them the finish alone, where its 4 tile multiplies at the
tiles' peak take 21 (bench/int8_peak.py). Summing several groups in integers first needs one
activation scale per 256 inputs (llama.cpp's Q8_K): other numerics, not these kernels' bits.

Operands. Weights are the tile's B operand: for each of a LAYOUT_QUADS tile's 4 interleaved
vectors v (16 outputs, packing.quad_lanes), rows of 64 bytes = the 16 outputs' dwords of 4 inputs.
q8 codes are stored exactly so (a quad's vector v is such a row): the tile is loaded straight from
the table with a 256-byte stride. q4 nibbles and q6's 6-bit codes are unpacked once per tile into a
panel (signed codes, the same rows) that every block of 16 prompt rows then reads from L2.
Activations are the A operand: 16 rows of x's int8 codes, a group's 32 (or 16) bytes each, read in
place from the quantized rows with a stride of K bytes.

Rows of x beyond the last whole 16 take matmul_i8's step (the same bits). The tiles' outputs are in
interleaved-vector order like matmul_i8's and are put back in natural order at the tile's end.

AMX needs the CPU's amx-tile and amx-int8, numba's target with AVX-512 VNNI (the finish is the VNNI
one), and Linux's permission for the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM), asked once
when this module loads. Where any is missing, AVAILABLE is False and linear_batch_amx runs
matmul_i8's blocked kernel (same bits), so the variant is safe to call anywhere; the kernel tuner
offers it only where it is native. AVAILABLE depends on the host alone (no switch in the
environment), so compiled code cached with it baked in stays right: numba keys its cache by CPU
and features. To run prompt chunks without tiles, [engine] matmul_tiles = off picks the VNNI
variant instead.
"""
from __future__ import annotations

import ctypes
import platform

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from worker.engine.kernels import matmul_i8
from worker.engine.kernels.matmul_batch import group_at, locate_tile, tile_groups
from worker.engine.kernels.matmul_i8 import (PARAMS_ANY, PARAMS_STEPS, PARAMS_STEPS_BIAS, QuantizedRows, _I8Emitter,
                                             _one_tile_i8, _prepare_i8, _quantize_row, _unpermute, params_kind)
from worker.engine.kernels.packing import FMT_F32, FMT_Q4, FMT_Q6, FMT_Q8, M_FMT, M_GROUP, TILE, TableArrays

ROWS = 16  # rows of x per tile multiply (an AMX tile's rows)
_SUMS_BYTES = ROWS * 16 * 4  # one 16 × 16 tile of int32 sums
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


def _tile_permission() -> bool:
    """Ask Linux for this process's AMX tile data state (once; every thread may then use tiles)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):  # pragma: no cover - no libc symbol
        return False


def _amx_usable() -> bool:
    if platform.machine() != "x86_64":
        return False
    if matmul_i8.ISA != "vnni":  # the finish is the VNNI kernel's; AMX hosts all have it
        return False
    feats = llvm.get_host_cpu_features()
    if not (feats.get("amx-tile") and feats.get("amx-int8")):
        return False
    return _tile_permission()


AVAILABLE = _amx_usable()
if AVAILABLE:
    llvm.initialize_native_asmparser()  # the tile instructions are inline assembly

_JIT = dict(fastmath=True, cache=True, nogil=True)
_I8P, _I64 = ir.IntType(8).as_pointer(), ir.IntType(64)


def _asm(b, text, constraints="~{memory}", args=(), tys=()):
    """One tile instruction as inline assembly; a trap where the host has no AMX (nothing reaches
    it there, and x86 assembly would not even parse on ARM64)."""
    if not AVAILABLE:
        b.call(cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), []), "llvm.trap"), [])
        return
    fn = ir.InlineAsm(ir.FunctionType(ir.VoidType(), list(tys)), text, constraints, side_effect=True)
    b.call(fn, list(args))


def _byte_ptr(context, b, ty, value, offset):
    data = b.bitcast(context.make_array(ty)(context, b, value).data, _I8P)
    return b.gep(data, [offset])


@intrinsic
def _configure(typingctx, cfg):
    """ldtilecfg: the tile shapes of cfg (64 bytes, _tile_config)."""
    def codegen(context, b, signature, args):
        _asm(b, "ldtilecfg ($0)", "r,~{memory}", [_byte_ptr(context, b, signature.args[0], args[0], _c(0))], [_I8P])
        return context.get_dummy_value()
    return types.void(cfg), codegen


@intrinsic
def _release(typingctx):
    """tilerelease: back to the initial tile state (nothing left for the OS to save)."""
    def codegen(context, b, signature, args):
        _asm(b, "tilerelease")
        return context.get_dummy_value()
    return types.void(), codegen


def _c(n):
    return ir.Constant(_I64, n)


def _emit_vector_sums(context, b, tys, args, v, part="all"):
    """Tile multiply of the group's interleaved vector v (args: xq, a_off, k, codes, b_off,
    b_row_stride, b_vec_stride, cbuf, slot; tmm0 must hold the activations): tmm1-3 take the
    weights in turn, tmm4 + v the sums, stored to cbuf[slot, v]. part: "multiply" (load, zero,
    multiply), "store" or "all"."""
    codes_ty, cbuf_ty, slot_ty = tys[3], tys[7], tys[8]
    w = 1 + v % 3
    if part in ("all", "multiply"):
        at = _byte_ptr(context, b, codes_ty, args[3], b.add(args[4], b.mul(args[6], _c(v))))
        _asm(b, f"tileloadd ($0,$1,1), %tmm{w}", "r,r,~{memory}", [at, args[5]], [_I8P, _I64])
        _asm(b, f"tilezero %tmm{4 + v}")
        _asm(b, f"tdpbssd %tmm{w}, %tmm0, %tmm{4 + v}")  # AT&T order: B, A, destination
    if part in ("all", "store"):
        slot = context.cast(b, args[8], slot_ty, types.int64)
        out_at = _byte_ptr(context, b, cbuf_ty, args[7], b.add(b.mul(slot, _c(4 * _SUMS_BYTES)), _c(v * _SUMS_BYTES)))
        _asm(b, f"tilestored %tmm{4 + v}, ($0,$1,1)", "r,r,~{memory}", [out_at, _c(64)], [_I8P, _I64])


def _emit_activations(context, b, tys, args):
    """tmm0 = the 16 rows of xq at byte a_off (row stride k)."""
    at = _byte_ptr(context, b, tys[0], args[0], args[1])
    _asm(b, "tileloadd ($0,$1,1), %tmm0", "r,r,~{memory}", [at, args[2]], [_I8P, _I64])


@intrinsic
def _group_sums(typingctx, xq, a_off, k, codes, b_off, b_row_stride, b_vec_stride, cbuf, slot):
    """cbuf[slot, v] (16 × 16 int32, v = 0..3) = the 16 rows of xq at byte a_off (row stride k) times
    the group's B tiles of interleaved vectors v at codes[b_off + v b_vec_stride] (row stride
    b_row_stride)."""
    sig = types.void(xq, a_off, k, codes, b_off, b_row_stride, b_vec_stride, cbuf, slot)

    def codegen(context, b, signature, args):
        _emit_activations(context, b, signature.args, args)
        for v in range(4):
            _emit_vector_sums(context, b, signature.args, args, v)
        return context.get_dummy_value()

    return sig, codegen


class _TileFinish(_I8Emitter):
    """matmul_i8's group finish for 16 rows, its integer sums read from the stored tiles, with the
    next group's tile multiplies (when `more`) woven in. Tile registers are not renamed: an
    instruction that rewrites a tile still being read waits, and the core issues nothing behind
    it. So the multiplies are issued first (vector 3's after vector 0's finish, when the weight
    tile it reuses is free) and their sums stored last, when the multiplies are long done. One
    16-row × 64-output group of the 1.5B file's gate/up, one thread: tiles then finish in sequence
    175 ns, all multiplies first 150, this order 130; the finish alone 107."""

    step_rows = (ROWS,)
    name = "amx"

    def __init__(self, context, builder, signature, args, *literals):
        super().__init__(context, builder, signature, args, *literals[:4])
        self._take_arrays(signature.args[10], args[10], ("cbuf",))
        self.slot = context.cast(builder, args[11], signature.args[11], types.int64)
        self.more = context.cast(builder, args[12], signature.args[12], types.int64)
        # the next group's operands, as _group_sums takes them (its cbuf slot: the other one)
        other = builder.sub(_c(1), self.slot)
        self.sums_tys = list(signature.args[13:20]) + [signature.args[10], types.int64]
        self.sums_args = list(args[13:20]) + [args[10], other]

    def _prefetch(self):  # the codes were read by the tile multiply already
        pass

    def _ptr(self, name, *indices):
        """Addresses with the layouts _tile_amx gives, so that a group's 16 rows are one base
        pointer plus constant offsets (computed from the arrays' run-time strides, 3 of the 16
        rows' pointers were reloaded from the stack for every row's vector: ~9 loads for 4
        vector operations). xs and fsum are transposed (column, row of x), contiguous; out is the
        16 × TILE block of rows b0..; cbuf is (2, 4, 16, 16) int32."""
        b = self.b
        if name in ("xs", "fsum", "out", "cbuf"):
            ty, ary = self.arrays[name]
            if name == "out":
                rb, col = indices
                flat = b.add(b.mul(b.sub(rb, self.b0), self._c(TILE)), col)
            elif name == "cbuf":
                slot, v, r, e = indices
                flat = b.add(b.mul(b.add(b.mul(b.add(b.mul(slot, self._c(4)), v), self._c(ROWS)), r), self._c(16)), e)
            else:
                rb, col = indices
                flat = b.add(b.mul(col, cgutils.unpack_tuple(b, ary.shape)[1]), rb)
            return b.gep(ary.data, [flat])
        return super()._ptr(name, *indices)

    def _rows(self, n):
        b = self.b
        rows_b = [b.add(self.b0, self._c(r)) for r in range(n)]
        more = b.icmp_signed("!=", self.more, self._c(0))
        sums = lambda v, part: _emit_vector_sums(self.context, b, self.sums_tys, self.sums_args, v, part)  # noqa: E731
        with b.if_then(more):
            _emit_activations(self.context, b, self.sums_tys, self.sums_args)
            for v in range(3):
                sums(v, "multiply")
        # One interleaved vector at a time: its 16 rows' sums in flight at once fit the 32
        # registers (all 4 vectors' 64 spilled: ~10 cycles a row's vector instead of ~3).
        for v in range(4):
            acc = {(r, v): b.load(self._vptr("cbuf", ir.VectorType(ir.IntType(32), 16), self.slot, self._c(v),
                                             self._c(r), self._c(0)), align=4)
                   for r in range(n)}
            self._finish([v], rows_b, acc)
            if v == 0:  # vector 3 reuses vector 0's weight tile, free once its multiply has read it
                with b.if_then(more):
                    sums(3, "multiply")
        with b.if_then(more):
            for v in range(4):
                sums(v, "store")


@intrinsic(prefer_literal=True)
def _finish_group(typingctx, tab, acts, at, out, b0, rows, fmt, group, narrow, params, cbuf, slot, more,
                  xq, a_off, k, codes, b_off, b_row_stride, b_vec_stride):
    """out[b0 + r, col0:col0 + TILE] (interleaved order) += the group's part, r < 16, from
    cbuf[slot]; when `more`, interleaved with _group_sums of the next group (xq .. b_vec_stride)
    into cbuf[1 - slot]."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (fmt, group, narrow, params)):
        return None
    sig = types.void(tab, acts, at, out, b0, rows, fmt, group, narrow, params, cbuf, slot, more,
                     xq, a_off, k, codes, b_off, b_row_stride, b_vec_stride)

    def codegen(context, builder, signature, args):
        _TileFinish(context, builder, signature, args, fmt.literal_value, group.literal_value,
                    narrow.literal_value != 0, params.literal_value).emit()
        return context.get_dummy_value()

    return sig, codegen


def tile_config(group: int) -> np.ndarray:
    """The 64-byte ldtilecfg operand for groups of `group` inputs: tmm0 16 rows × group bytes
    (activations), tmm1-3 group/4 rows × 64 bytes (weights), tmm4-7 16 rows × 64 bytes (sums)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1  # palette 1
    colsb, rows = cfg[16:32].view(np.uint16), cfg[48:56]
    colsb[0], rows[0] = group, ROWS
    colsb[1:4], rows[1:4] = 64, group // 4
    colsb[4:8], rows[4:8] = 64, ROWS
    return cfg


_CONFIG_32, _CONFIG_16 = tile_config(32), tile_config(16)


# ---- panels: a tile's codes unpacked to signed bytes, B-tile rows ---------------------------------

_V64 = ir.VectorType(ir.IntType(8), 64)


@intrinsic
def _unpack_nibbles(typingctx, data, src, panel, dst):
    """panel[dst:dst + 64] = the low nibbles of data[src:src + 64], panel[dst + 256:dst + 320] the
    high ones (one vector each way: a numba byte loop took ~2 cycles a byte, 41 µs for a 1.5B
    gate/up tile's 48 groups, a fifth of the tile's multiply time)."""
    def codegen(context, b, signature, args):
        tys = signature.args
        v = b.load(b.bitcast(_byte_ptr(context, b, tys[0], args[0], args[1]), _V64.as_pointer()), align=1)
        low = ir.Constant(_V64, 15)
        at = _byte_ptr(context, b, tys[2], args[2], args[3])
        b.store(b.and_(v, low), b.bitcast(at, _V64.as_pointer()), align=1)
        b.store(b.lshr(v, ir.Constant(_V64, 4)), b.bitcast(b.gep(at, [_c(256)]), _V64.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.void(data, src, panel, dst), codegen


@intrinsic
def _unpack_six_bits(typingctx, data, nib, top, shift, top_shift, panel, dst):
    """panel[dst:dst + 64] = ((data[nib + e] >> shift) & 15 | ((data[top + e] >> top_shift) & 3) << 4)
    - 32, e < 64: signed 6-bit codes (see _panel_q6)."""
    def codegen(context, b, signature, args):
        tys = signature.args

        def load(i):
            at = _byte_ptr(context, b, tys[0], args[0], args[i])
            return b.load(b.bitcast(at, _V64.as_pointer()), align=1)

        def splat(i):
            n = b.trunc(context.cast(b, args[i], tys[i], types.int64), ir.IntType(8))
            one = b.insert_element(ir.Constant(_V64, ir.Undefined), n, _c(0))
            return b.shuffle_vector(one, ir.Constant(_V64, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 64), None))

        low = b.and_(b.lshr(load(1), splat(3)), ir.Constant(_V64, 15))
        high = b.shl(b.and_(b.lshr(load(2), splat(4)), ir.Constant(_V64, 3)), ir.Constant(_V64, 4))
        code = b.sub(b.or_(low, high), ir.Constant(_V64, 32))
        b.store(code, b.bitcast(_byte_ptr(context, b, tys[5], args[5], args[6]), _V64.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.void(data, nib, top, shift, top_shift, panel, dst), codegen


@njit(**_JIT)
def _panel_q4(data, base, groups, group_bytes, panel):
    """panel[g, v, r] (64 bytes) for r < 4: low nibbles of quad r's vector v (inputs 4r..4r + 3 of
    the group), r ≥ 4: high nibbles of quad r - 4 (inputs 16 + 4(r - 4)..)."""
    for g in range(groups):
        src = base + g * group_bytes
        dst = g * 2048
        for p in range(4):
            for v in range(4):
                _unpack_nibbles(data, src + p * 256 + v * 64, panel, dst + v * 512 + p * 64)


@njit(**_JIT)
def _panel_q6(data, base, groups, group_bytes, panel):
    """panel[g, v, p] (64 bytes) = the signed codes c of input quad p of a 16-input FMT_Q6 group:
    (nibble of code-row quad p % 2, low for p < 2) | (bits 2p..2p + 1 of the top-bits quad) << 4,
    minus 32 (packing.six_bit)."""
    for g in range(groups):
        src = base + g * group_bytes
        dst = g * 1024
        for p in range(4):
            for v in range(4):
                _unpack_six_bits(data, src + (p % 2) * 256 + v * 64, src + 512 + v * 64, 4 * (p // 2), 2 * p,
                                 panel, dst + v * 256 + p * 64)


@njit(**_JIT)
def _tile_amx(tab, meta, tile, acts, acts_t, out, col0, rows):
    """out[0:rows, col0:col0 + TILE] = tile `tile` of a quantized matrix times rows 0..rows of x
    (rows a multiple of 16), in natural output order; acts_t: acts with xs, fsum16 and fsum32
    transposed (column, row), contiguous."""
    fmt, group = meta[M_FMT], meta[M_GROUP]
    groups, group_bytes, base = tile_groups(meta, tile)
    params = params_kind(meta)
    k = acts.xq.shape[1]
    if fmt == FMT_Q4:
        codes = np.empty(groups * 2048, np.uint8)
        _panel_q4(tab.data, base, groups, group_bytes, codes)
        vec_stride, row_stride, group_stride, first = 512, 64, 2048, 0
    elif fmt == FMT_Q6:
        codes = np.empty(groups * 1024, np.uint8)
        _panel_q6(tab.data, base, groups, group_bytes, codes)
        vec_stride, row_stride, group_stride, first = 256, 64, 1024, 0
    else:  # q8: a quad's vector v is a B row as stored
        codes = tab.data
        vec_stride, row_stride, group_stride, first = 64, 256, group_bytes, base
    cbuf = np.empty((2, 4, ROWS, 16), np.int32)  # two groups' sums: one finishing, one multiplying
    # The 16 rows' outputs add up in a contiguous block of their own, so that a row's address is the
    # block's plus a constant (_TileFinish._ptr); copied to out once the tile's groups are done.
    block = np.empty((ROWS, TILE), np.float32)
    _configure(_CONFIG_32 if group == 32 else _CONFIG_16)
    for b0 in range(0, rows, ROWS):
        block[:] = 0.0
        a_row = b0 * k
        _group_sums(acts.xq, a_row, k, codes, first, row_stride, vec_stride, cbuf, 0)
        for g in range(groups):
            # group g's finish, with group g + 1's tile multiplies interleaved
            at, slot, more = group_at(meta, tile, g, groups, group_bytes, base, 0), g % 2, g + 1 < groups
            a_next, b_next = a_row + (g + 1) * group, first + (g + 1) * group_stride
            # The finishes matmul_i8._tile_i8 compiles, inline (a call per group passing the
            # arrays cost more than the finish).
            if fmt == FMT_Q4 and params == PARAMS_STEPS_BIAS:
                _finish_group(tab, acts_t, at, block, b0, ROWS, FMT_Q4, 32, 0, PARAMS_STEPS_BIAS, cbuf, slot, more,
                              acts.xq, a_next, k, codes, b_next, row_stride, vec_stride)
            elif fmt == FMT_Q4:
                _finish_group(tab, acts_t, at, block, b0, ROWS, FMT_Q4, 32, 0, PARAMS_ANY, cbuf, slot, more,
                              acts.xq, a_next, k, codes, b_next, row_stride, vec_stride)
            elif fmt == FMT_Q6 and params == PARAMS_STEPS:
                _finish_group(tab, acts_t, at, block, b0, ROWS, FMT_Q6, 16, 0, PARAMS_STEPS, cbuf, slot, more,
                              acts.xq, a_next, k, codes, b_next, row_stride, vec_stride)
            elif fmt == FMT_Q6:
                _finish_group(tab, acts_t, at, block, b0, ROWS, FMT_Q6, 16, 0, PARAMS_ANY, cbuf, slot, more,
                              acts.xq, a_next, k, codes, b_next, row_stride, vec_stride)
            elif group == 32:
                _finish_group(tab, acts_t, at, block, b0, ROWS, FMT_Q8, 32, 0, PARAMS_ANY, cbuf, slot, more,
                              acts.xq, a_next, k, codes, b_next, row_stride, vec_stride)
            else:
                _finish_group(tab, acts_t, at, block, b0, ROWS, FMT_Q8, 16, 0, PARAMS_ANY, cbuf, slot, more,
                              acts.xq, a_next, k, codes, b_next, row_stride, vec_stride)
        for r in range(ROWS):
            out[b0 + r, col0:col0 + TILE] = block[r]
            _unpermute(out, b0 + r, col0)
    _release()


@njit(**_JIT)
def _one_tile_amx(tab, mats, first_tile, tg, x, acts, acts_t, out, whole):
    """Tile tg of the listed matrices times every row of x: the first `whole` rows (a multiple of
    16) on AMX tiles, the rest (and f32 matrices) with matmul_i8's step."""
    i, tile = locate_tile(first_tile, tg)
    m = tab.meta[mats[i]]
    if m[M_FMT] == FMT_F32 or whole == 0:
        _one_tile_i8(tab, mats, first_tile, tg, x, acts, out, 0, x.shape[0])
        return
    _tile_amx(tab, m, tile, acts, acts_t, out, tg * TILE, whole)
    if whole < x.shape[0]:
        _one_tile_i8(tab, mats, first_tile, tg, x, acts, out, whole, x.shape[0])


@njit(parallel=True, **_JIT)
def _linear_batch_amx(data, scales, scales16, meta, mats, x, out, scratch):
    """matmul_i8.linear_batch_i8 (same contract, same bits) with the integer sums of every whole
    block of 16 rows on AMX tiles; one work item per tile."""
    to_quantize, first_tile, xq, xs, fsum16, fsum32, corr16, corr32 = _prepare_i8(meta, mats, x, out, scratch)
    acts = QuantizedRows(xq, xs, fsum16, fsum32, corr16, corr32)
    for row in prange(to_quantize):
        _quantize_row(x, acts, row)
    tab = TableArrays(data, scales, scales16, meta)
    whole = x.shape[0] // ROWS * ROWS if to_quantize else 0
    acts_t = QuantizedRows(xq, np.ascontiguousarray(xs.T), np.ascontiguousarray(fsum16.T),
                           np.ascontiguousarray(fsum32.T), corr16, corr32)
    for tg in prange(first_tile[mats.shape[0]]):
        _one_tile_amx(tab, mats, first_tile, tg, x, acts, acts_t, out, whole)


# Without AMX the variant is matmul_i8's blocked kernel itself (same bits), so nothing with tile
# instructions is ever compiled there.
linear_batch_amx = _linear_batch_amx if AVAILABLE else matmul_i8.linear_batch_i8_blocked
