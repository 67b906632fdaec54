"""Quantized matrix × a few activation vectors with int8 activations and integer dot products
(AVX-512 VNNI, or AVX2).

Same calling contract as matmul_batch.linear_batch (packed layouts of packing.py, outputs of the
listed matrices side by side in out[b], prange over tiles), but the activations are quantized
once per call, llama.cpp style: each row of x per 32-input block to int8 codes q = rint(x / d),
d = max|x| / 127. A weight group then contributes, for output t of row b,

    out[b, t] += s[g, t] * d[b, block] * Σ code[g, t, k] q[b, k]  +  m[g, t] * Σx_b(g)

where the integer sum runs in `vpdpbusd` (64 u8 × s8 products summed 4 at a time into 16 int32
lanes per instruction, 4× the MACs of an f32 FMA) and is exact, so the result for a row does not
depend on B, on the other rows, or on the blocking of the rows.

Σx_b(g) is the sum of the *quantized* activations, d · Σ q (llama.cpp's Q8_1 does the same): the
result is then exactly Σ_k w_k · x̂_k with x̂ = d·q the dequantized activations, so the kernel
computes the product of the dequantized weights with x̂ (to float32 rounding) — which the tests
check tightly. Using the float Σx instead would leave an error Σ (w_k - m)(x_k - x̂_k), which for
Q4_1/Q4_K (m ≈ -8 s, codes 0..15) has ~1.9x the standard deviation of Σ w_k (x_k - x̂_k).

Operands. vpdpbusd multiplies unsigned bytes of one operand by signed bytes of the other.
  FMT_Q4: codes 0..15 are the unsigned operand as they are (low / high nibble masked out).
  FMT_Q8: signed codes flipped to unsigned, c + 128 (one vpxor per weight vector, shared by the
          rows); the extra 128 Σ q of a row is removed by starting its accumulator at -128 Σ q
          (precomputed per group with the quantization), which costs nothing per weight.
  FMT_Q6: the stored codes are already c + 32 (0..63), rebuilt from a nibble and 2 top bits
          (packing) in 3-4 operations per weight vector, shared by the rows; the accumulator
          starts at -32 Σ q (the -128 Σ q above, divided by 4).
The activation is always the signed operand, a dword of 4 consecutive codes broadcast to every
lane (folded into vpdpbusd as a {1to16} memory operand).

Layout. vpdpbusd sums 4 adjacent bytes, so a lane needs one output's weights of 4 consecutive
inputs: the table stores quantized codes in packing.LAYOUT_QUADS, where each quad of 4 inputs × 64
outputs is 4 vectors whose lane j holds output t = 16 (j // 4) + 4 v + j % 4 of vector v (the order
x86 byte/word unpacks produce). The kernel loads them as they are — interleaving them in registers
instead took 8 shuffles per 4 rows × 64 outputs in every call and every block of rows (a C model
of the AVX2 loop, 8 rows of a 576 × 576 Q4 matrix in L2, one core: 63 → 106 GMAC/s). The group
scales and biases are loaded in that order (4 × 4 contiguous values per vector), the tile
accumulates in `out` in that order, and each tile ends with one in-register permutation per row
back to natural order.

Micro-kernel (`_i8_step`, LLVM IR through an @intrinsic like matmul_batch._group_step): one group
of one tile for up to 8 rows, int32 accumulators for rows × (vectors at a time) in registers; at the
group's end each is converted and added into out: out = fma(m, Σx, fma(float(acc), s·d, out)).

Portability. The native paths need the instructions on the host *and* in numba's target (not
when NUMBA_CPU_NAME / NUMBA_CPU_FEATURES select a CPU without them): AVX512-VNNI (and BW) for
vpdpbusd; else AVX2, where `_rows_avx2` builds the same 4-input dword sums from vpmaddubsw and
vpmaddwd on ymm halves (exact too, so both paths give the same bits). Otherwise the kernel is
compiled with a generic-IR emulation of vpdpbusd (widen, multiply, add lanes 4 by 4): correct
everywhere, slow. `available()` says whether a fast path is in use; a caller choosing between
linear_batch and linear_batch_i8 should check it. Set REAME_I8_GENERIC=1 to force the generic path
(it is then compiled without the on-disk cache, so cached native code is never mixed in).

Scratch: a C-contiguous float32 array of at least scratch_size_i8(B, K) elements (see
batch_scratch_i8); it receives the quantized activations, block scales and group sums.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from worker.engine.kernels.group_step_ir import VEC as _VEC
from worker.engine.kernels.group_step_ir import GroupStepEmitter
from worker.engine.kernels.matmul_batch import _tile_f32, group_at, locate_tile, tile_groups, zero_tile_rows
from worker.engine.kernels.packing import (FMT_F32, FMT_Q4, FMT_Q6, FMT_Q8, LAYOUT_QUADS, M_BIAS, M_FMT, M_GROUP, M_K,
                                           M_LAYOUT, M_NARROW, M_PARAM, M_TILES, M_UNIT, PARAM_STEP8, TILE, TableArrays,
                                           quad_lanes)


def _instruction_set() -> str:
    """Which dot-product instructions numba's code for this process may use: "vnni" (vpdpbusd on
    512-bit vectors), "avx2" (vpmaddubsw + vpmaddwd on 256-bit vectors) or "generic" (plain IR)."""
    if os.environ.get("REAME_I8_GENERIC", "") not in ("", "0"):
        return "generic"
    try:
        import llvmlite.binding as llvm
        feats = llvm.get_host_cpu_features()
    except Exception:  # pragma: no cover - no host information: be safe
        return "generic"
    name = config.CPU_NAME
    if name and name != "host":  # an explicit target CPU (portable caches): trust only host
        return "generic"
    extra = config.CPU_FEATURES or ""
    if (feats.get("avx512vnni") and feats.get("avx512bw") and feats.get("avx512f")
            and "-avx512vnni" not in extra and "-avx512bw" not in extra):
        return "vnni"
    if feats.get("avx2") and "-avx2" not in extra:
        return "avx2"
    return "generic"


ISA = _instruction_set()
NATIVE_VNNI = ISA == "vnni"


def available() -> bool:
    """True when linear_batch_i8 runs on native integer dot products (AVX-512 VNNI or AVX2);
    False: it still works, slowly (generic IR)."""
    return ISA != "generic"


_JIT = dict(fastmath=True, cache=ISA != "generic", nogil=True)

# Most rows of x one micro-kernel step serves, and how many of the tile's 4 interleaved vectors
# (16 outputs each) it accumulates at once. A step keeps rows × vectors accumulators in registers.
# VNNI (32 zmm): measured at B=8 (1 thread, a 3072×576 Q4_1 call): 4-row steps 0.45x linear_batch,
# 5 or 6 rows × 4 vectors 0.5x (spills), 8 rows × 2 vectors 0.64-0.84x, 8 rows × 1 vector 1.1x.
# AVX2 (16 ymm, a vector is two): rows × vectors × 2 int16 accumulators must leave room for the
# weights and the broadcast activation, so 3-4 rows take 1 vector at a time (with 2, the Q4 step
# spilled 97 of its 472 instructions; the 3072×576 Q4_1 call at 8 rows, 1 thread: 31 → 62 GMAC/s),
# 2 rows 2 and 1 row all 4 (fewer activation broadcasts per product).
BLOCK = 4
_STEP_ROWS = (1, 2, 3, 4)


def _vectors_at_once(rows: int) -> int:
    """Interleaved vectors a step of `rows` rows accumulates at once (see above)."""
    if ISA != "avx2":
        return 4
    return 4 if rows == 1 else 2 if rows == 2 else 1



# Rows of x one work item of linear_batch_i8_blocked computes for one tile: their outputs (32 rows ×
# 64 floats = 8 KB) stay in L1 across the tile's groups, where linear_batch_i8 re-reads and writes
# back a whole 512-row chunk's outputs (128 KB, from L2) once per group. AVX2, 1 thread, 512 rows,
# CPU time vs linear_batch_i8 (bench/matmul_profile.py --clock cpu, loaded host): 32 rows 0.85-1.03
# per matrix of SmolLM2 and Gemma 3 (7 of 8 faster); 64 rows 0.74-0.91 on SmolLM2 but 0.92-1.10 on
# Gemma 3, whose q8 tiles (640 inputs: 40 KB) then no longer share L1 with the outputs.
ROW_BLOCK = 32


def scratch_size_i8(batch: int, k: int) -> int:
    """float32 elements linear_batch_i8 needs for B = batch rows of K = k inputs: int8 codes (K/4
    floats), and per row d (K/32), Σx per 16 and 32 inputs, -128 Σq per 16 and 32 inputs."""
    return batch * 15 * (k // 32)


def batch_scratch_i8(max_tiles: int, max_batch: int, k_max: int | None = None) -> np.ndarray:
    """A scratch buffer for every linear_batch_i8 call with at most max_batch rows and k_max inputs
    (k_max defaults to max_tiles * TILE, as matmul_batch.batch_scratch)."""
    k = max_tiles * TILE if k_max is None else k_max
    return np.zeros(scratch_size_i8(max_batch, k), np.float32)


def quantize_reference(x: np.ndarray):
    """numpy version of the in-kernel activation quantization: (codes int8 (B, K), d float32 (B, K/32))."""
    x = np.asarray(x, np.float32)
    b, k = x.shape
    blocks = x.reshape(b, k // 32, 32)
    amax = np.abs(blocks).max(axis=2)
    a64 = amax.astype(np.float64)
    d = (a64 / 127.0).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, 127.0 / a64, 0.0).astype(np.float32)
    q = np.rint(blocks * inv[:, :, None]).astype(np.int8)
    return q.reshape(b, k), d


class QuantizedRows(NamedTuple):
    """A call's activations as the int8 steps read them (views of its scratch, one row per row of x)."""
    xq: np.ndarray  # int8 (B, K): codes, rint(x / d)
    xs: np.ndarray  # float32 (B, K / 32): d = max|x| / 127 of each 32-input block
    fsum16: np.ndarray  # float32 (B, K / 16): d · Σ q over each 16-input group
    fsum32: np.ndarray  # float32 (B, K / 32): the same over each 32-input group
    corr16: np.ndarray  # int32 (B, K / 16): -128 Σ q over each 16-input group (q8 codes are read as c + 128)
    corr32: np.ndarray  # int32 (B, K / 32): the same over each 32-input group


_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_VB = ir.VectorType(_I8, 64)
_VW = ir.VectorType(_I16, 32)
_VD = ir.VectorType(_I32, _VEC)
_VF = ir.VectorType(ir.FloatType(), _VEC)
_YB, _YW, _YD = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)  # one ymm
_V32F, _V32D = ir.VectorType(ir.FloatType(), 32), ir.VectorType(_I32, 32)  # a 32-input block


@intrinsic
def _quantize_block(typingctx, x, acts, row, blk):
    """Quantize x[row, 32 blk : 32 blk + 32] (contiguous) into acts: codes, d and the block's
    sums, equal to quantize_reference's, in one pass with the block in registers.

    A scalar numba loop took 0.87 ns an input (512 × 8960, Zen 4): a pass for the maxima over the
    whole of x, then one for the codes that read x again from L3. The vector block takes ~0.25."""
    sig = types.void(x, acts, row, blk)

    def codegen(context, builder, signature, args):
        b = builder
        x_ty, acts_ty, row_ty, blk_ty = signature.args
        i64, f32, f64 = ir.IntType(64), ir.FloatType(), ir.DoubleType()
        fields = dict(zip(acts_ty.fields, zip(acts_ty.types, cgutils.unpack_tuple(b, args[1]))))
        at_row = context.cast(b, args[2], row_ty, types.int64)
        at_blk = context.cast(b, args[3], blk_ty, types.int64)

        def ptr(ty, value, *index):
            return cgutils.get_item_pointer(context, b, ty, context.make_array(ty)(context, b, value), list(index))

        def acts_ptr(name, column):
            return ptr(*fields[name], at_row, column)

        def intrinsic_fn(name, ret, *arg_types):
            return cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, list(arg_types)), name)

        k0 = b.mul(at_blk, ir.Constant(i64, 32))
        v = b.load(b.bitcast(ptr(x_ty, args[0], at_row, k0), _V32F.as_pointer()), align=4)
        magnitudes = b.call(intrinsic_fn("llvm.fabs.v32f32", _V32F, _V32F), [v])
        amax = b.fpext(b.call(intrinsic_fn("llvm.vector.reduce.fmax.v32f32", f32, _V32F), [magnitudes]), f64)
        # Divisions in float64, rounded once to float32: the result (equal to quantize_reference's)
        # survives fast-math's x / c → x * (1 / c) (off by < 1e-16 relative before rounding).
        d = b.fptrunc(b.fdiv(amax, ir.Constant(f64, 127.0)), f32)
        positive = b.fcmp_ordered(">", amax, ir.Constant(f64, 0.0))
        inv = b.select(positive, b.fptrunc(b.fdiv(ir.Constant(f64, 127.0), amax), f32), ir.Constant(f32, 0.0))
        scaled = b.fmul(v, b.shuffle_vector(b.insert_element(ir.Constant(_V32F, ir.Undefined), inv, ir.Constant(i64, 0)),
                                            ir.Constant(_V32F, ir.Undefined), ir.Constant(_V32D, None)))
        codes = b.fptosi(b.call(intrinsic_fn("llvm.rint.v32f32", _V32F, _V32F), [scaled]), _V32D)
        b.store(b.trunc(codes, ir.VectorType(_I8, 32)),
                b.bitcast(acts_ptr("xq", k0), ir.VectorType(_I8, 32).as_pointer()), align=1)
        b.store(d, acts_ptr("xs", at_blk))
        add = intrinsic_fn("llvm.vector.reduce.add.v16i32", _I32, _VD)
        halves = [b.call(add, [b.shuffle_vector(codes, ir.Constant(_V32D, ir.Undefined),
                                                ir.Constant(_VD, list(range(16 * h, 16 * h + 16))))]) for h in (0, 1)]
        total = b.add(halves[0], halves[1])
        minus128 = ir.Constant(_I32, -128)
        for h, acc in enumerate(halves):
            column = b.add(b.mul(at_blk, ir.Constant(i64, 2)), ir.Constant(i64, h))
            b.store(b.fmul(d, b.sitofp(acc, f32)), acts_ptr("fsum16", column))
            b.store(b.mul(acc, minus128), acts_ptr("corr16", column))
        b.store(b.fmul(d, b.sitofp(total, f32)), acts_ptr("fsum32", at_blk))
        b.store(b.mul(total, minus128), acts_ptr("corr32", at_blk))
        return context.get_dummy_value()

    return sig, codegen


@njit(**_JIT)
def _quantize_row(x, acts, row):
    for blk in range(x.shape[1] // 32):
        _quantize_block(x, acts, row, blk)


@njit(**_JIT)
def _quantize_rows(x, acts):
    for row in range(x.shape[0]):
        _quantize_row(x, acts, row)


# ---- the micro-kernel -------------------------------------------------------------------------

# What a step knows of its group's parameters when it is compiled (the `params` literal). PARAMS_ANY
# reads packing's parameter kind, factoring and bias at run time, with a branch around every load;
# the K-quant cases (int8 steps × float16 units, packing's factored tables) are compiled without
# them. 512 rows of the 1.5B file's layer, 1 thread, Zen 4 VNNI, A/B of the same kernel: Q/K/V
# 16.4-18.0 → 13.8-16.6 ms, gate/up 127-144 → 118-120, down 73-85 → 65-74.
PARAMS_ANY, PARAMS_STEPS, PARAMS_STEPS_BIAS = 0, 1, 2


@njit(**_JIT)
def params_kind(meta) -> int:
    """The `params` literal for a matrix (its metadata row): PARAMS_STEPS(_BIAS) for a factored
    table of int8 steps (with biases), else PARAMS_ANY."""
    if meta[M_PARAM] != PARAM_STEP8 or meta[M_UNIT] < 0:
        return PARAMS_ANY
    return PARAMS_STEPS_BIAS if meta[M_BIAS] >= 0 else PARAMS_STEPS


@intrinsic(prefer_literal=True)
def _i8_step(typingctx, tab, acts, at, out, b0, rows, fmt, group, narrow, params):
    """out[b0 + r, col0:col0 + TILE] (permuted order) += one group's contribution, r < rows.

    tab: packing.TableArrays (the group's codes and parameters); acts: QuantizedRows, of which the
    step reads xq[b, k0 + e], the group's int8 activations, xs[b, k0 // 32] their scale, and of
    the sums for its group size (fsum16/corr16 or fsum32/corr32) fsum[b, g] = Σ of the dequantized
    activations over the group and corr[b, g] = -128 Σ q (used by q8); at: group_step_ir.GroupAt,
    where the group is. fmt, group and narrow (1: a q8 matrix whose group sums fit int16,
    packing.narrow_codes) and params (PARAMS_*, params_kind) must be literals.
    """
    if not all(isinstance(a, types.IntegerLiteral) for a in (fmt, group, narrow, params)):
        return None
    sig = types.void(tab, acts, at, out, b0, rows, fmt, group, narrow, params)

    def codegen(context, builder, signature, args):
        _I8Emitter(context, builder, signature, args, fmt.literal_value, group.literal_value,
                   narrow.literal_value != 0, params.literal_value).emit()
        return context.get_dummy_value()

    return sig, codegen



class _I8Emitter(GroupStepEmitter):
    """IR of one `_i8_step` call: a switch on the row count, straight-line code per case."""

    step_rows = _STEP_ROWS
    name = "i8"

    def __init__(self, context, builder, signature, args, fmt, group, narrow, params):
        self.context, self.b = context, builder
        self.fmt, self.group, self.narrow, self.params = fmt, group, narrow, params
        tys = signature.args
        self.arrays = {}
        self._take_arrays(tys[0], args[0], ("data", "scales", "scales16"))
        self._take_arrays(tys[1], args[1], ("xq", "xs", f"fsum{group}", f"corr{group}"))
        self.arrays["fsum"], self.arrays["corr"] = self.arrays[f"fsum{group}"], self.arrays[f"corr{group}"]
        self._take_arrays(tys[3], args[3], ("out",))
        self._take_group(tys[2], args[2])
        self.blk = builder.lshr(self.k0, self._c(5))  # the activations' 32-input block
        self.b0, self.rows = args[4], args[5]
        self.fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3),
                                                  "llvm.fma.v16f32")
        if NATIVE_VNNI:
            self.vnni = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VD, [_VD] * 3),
                                                       "llvm.x86.avx512.vpdpbusd.512")
        if ISA == "avx2":
            module = builder.module
            self.maddubs = cgutils.get_or_insert_function(module, ir.FunctionType(_YW, [_YB, _YB]),
                                                          "llvm.x86.avx2.pmadd.ub.sw")
            self.maddwd = cgutils.get_or_insert_function(module, ir.FunctionType(_YD, [_YW, _YW]),
                                                         "llvm.x86.avx2.pmadd.wd")
            self.psign = cgutils.get_or_insert_function(module, ir.FunctionType(_YB, [_YB, _YB]),
                                                        "llvm.x86.avx2.psign.b")

    # ---- helpers ---------------------------------------------------------------------------
    def _splat(self, value, vtype):
        b = self.b
        undef = ir.Constant(vtype, ir.Undefined)
        one = b.insert_element(undef, value, self._c(0))
        return b.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, vtype.count), None))

    def _dot(self, acc, w, a):
        """acc + Σ of 4 adjacent u8(w) × s8(a) products per int32 lane (vpdpbusd)."""
        b = self.b
        if NATIVE_VNNI:
            return b.call(self.vnni, [acc, w, a])
        wide = ir.VectorType(_I32, 64)
        p = b.mul(b.zext(b.bitcast(w, _VB), wide), b.sext(b.bitcast(a, _VB), wide))
        for j in range(4):
            part = b.shuffle_vector(p, ir.Constant(wide, ir.Undefined),
                                    ir.Constant(ir.VectorType(_I32, _VEC), [4 * i + j for i in range(_VEC)]))
            acc = b.add(acc, part)
        return acc

    def _quad_vectors(self, p, vs):
        """Vectors v in vs (as <64 x i8>) of quad p of the group: LAYOUT_QUADS stores them ready,
        lane j = the quad's 4 bytes of output quad_lanes()[v, j] (packing.quad_lanes)."""
        b = self.b
        return {v: b.load(self._vptr("data", _VB, b.add(self.d_off, self._c((4 * p + v) * TILE))), align=1)
                for v in vs}

    def _six_bit_vectors(self, p, vs, loaded):
        """Vectors v in vs (as <64 x i8>) of input quad p (inputs 4p..4p + 3) of an FMT_Q6 group
        as unsigned codes c + 32: the nibbles of code-row quad p % 2 (low for p < 2, high for
        p ≥ 2) or'ed with bits 2p..2p + 1 of the top-bits quad (code rows 8-11) moved to bits 4-5.
        x86 shifts 16-bit lanes, not bytes: the masks drop what crosses from the neighbouring byte.
        loaded: the chunk's code-row quads already loaded (each is loaded once a chunk)."""
        b = self.b
        for quad in (p % 2, 2):
            if quad not in loaded:
                loaded[quad] = self._quad_vectors(quad, vs)
        low, top_bits = ir.Constant(_VB, 0x0F), ir.Constant(_VB, 0x30)
        out = {}
        for v in vs:
            nibbles = loaded[p % 2][v]
            if p >= 2:
                nibbles = b.bitcast(b.lshr(b.bitcast(nibbles, _VW), ir.Constant(_VW, 4)), _VB)
            top = b.bitcast(loaded[2][v], _VW)
            shift = 4 - 2 * p  # bits 2p..2p + 1 to bits 4..5
            if shift > 0:
                top = b.shl(top, ir.Constant(_VW, shift))
            elif shift < 0:
                top = b.lshr(top, ir.Constant(_VW, -shift))
            out[v] = b.or_(b.and_(nibbles, low), b.and_(b.bitcast(top, _VB), top_bits))
        return out

    def _group_param(self, offset, v, shift):
        """Vector v of the group's scales (shift 0) or biases (shift TILE) at offset, as float32:
        with PARAMS_STEPS(_BIAS) int8 steps × float16 units, without a branch."""
        if self.params == PARAMS_ANY:
            return self._times_unit(self._param(offset, v), v, shift)
        b = self.b
        units = self._halves_of(b.add(self.u_off, self._c(shift)), v)
        product = b.fmul(b.sitofp(self._steps_of(offset, v), _VF), b.fpext(units, _VF))
        # Fast-math may reassociate straight-line products, (step·unit)·d → step·(unit·d), and did
        # so differently at different row counts: a row's bits then depended on its neighbours.
        # The fence keeps the exact step·unit one value, as the branches of PARAMS_ANY do.
        fence = cgutils.get_or_insert_function(b.module, ir.FunctionType(_VF, [_VF]), "llvm.arithmetic.fence.v16f32")
        return b.call(fence, [product])

    def _six_bit_start(self, rb):
        """An FMT_Q6 accumulator's start for row rb: -32 Σ q over the group, splat."""
        b = self.b
        return self._splat(b.ashr(b.load(self._ptr("corr", rb, self.g)), ir.Constant(_I32, 2)), _VD)

    def _act(self, r, k):
        """Dword of xq[b0 + r, k:k + 4] broadcast to 16 lanes."""
        b = self.b
        word = b.load(self._vptr("xq", _I32, b.add(self.b0, self._c(r)), k), align=1)
        return self._splat(word, _VD)

    # A LAYOUT_QUADS table keeps a group's parameters in lane order (packing.param_position):
    # those of interleaved vector v are the 16 at offset + 16 v.
    def _halves_of(self, offset, v):
        at = self._vptr("scales16", ir.VectorType(_I16, _VEC), self.b.add(offset, self._c(_VEC * v)))
        return self.b.bitcast(self.b.load(at, align=2), ir.VectorType(ir.HalfType(), _VEC))

    def _floats_of(self, offset, v):
        return self.b.load(self._vptr("scales", _VF, self.b.add(offset, self._c(_VEC * v))), align=4)

    def _steps_of(self, offset, v):
        return self.b.load(self._vptr("data", ir.VectorType(_I8, _VEC), self.b.add(offset, self._c(_VEC * v))),
                           align=1)

    # ---- AVX2: 512-bit values as two ymm halves ---------------------------------------------
    def _halves(self, v, count):
        """The two 256-bit halves of a 512-bit vector of `count` elements."""
        b = self.b
        undef = ir.Constant(v.type, ir.Undefined)
        h = count // 2
        return [b.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, h), list(range(i * h, i * h + h))))
                for i in (0, 1)]

    def _join(self, lo, hi, count):
        return self.b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, count), list(range(count))))

    def _maddubs(self, u, s):
        """Σ of 2 adjacent u8(u) × s8(s) products per int16 lane (vpmaddubsw; saturating, so the
        callers keep |pair sums| ≤ 32767)."""
        lo = [self.b.call(self.maddubs, [x, y]) for x, y in zip(self._halves(u, 64), self._halves(s, 64))]
        return self._join(lo[0], lo[1], 32)

    def _widen_pairs(self, w16):
        """Σ of 2 adjacent int16 lanes per int32 lane (vpmaddwd by ones)."""
        ones = ir.Constant(_YW, 1)
        parts = [self.b.call(self.maddwd, [h, ones]) for h in self._halves(w16, 32)]
        return self._join(parts[0], parts[1], 16)

    def _sign(self, a, w):
        """a negated where w < 0, zeroed where w == 0 (vpsignb)."""
        parts = [self.b.call(self.psign, [x, y]) for x, y in zip(self._halves(a, 64), self._halves(w, 64))]
        return self._join(parts[0], parts[1], 64)

    def _rows_avx2(self, n):
        """AVX2 has no vpdpbusd: vpmaddubsw multiplies u8 × s8 and sums pairs into int16 (saturating),
        vpmaddwd by ones sums int16 pairs into int32 — the same 4-input dword sums.

        q4: codes 0..15 are the unsigned operand; a pair sum is at most 2·15·127 = 3810, so all 8
        products of a 32-input group add up in int16 (≤ 30480) and widen once per group.
        q8: signed codes cannot be flipped to c + 128 here (pairs would saturate), so the unsigned
        operand is |c| and the activation takes c's sign (vpsignb): |c|·sign(c)·a = c·a, pair sums
        ≤ 2·128·127 = 32512; each product is widened at once, unless the matrix is narrow (Q5_0:
        |c| ≤ 16 in groups of 32, Q6_K: ≤ 32 in groups of 16), where a whole group's pair sums
        add up in int16 (≤ 32512) and widen once per group, as q4's: a vpmaddwd and a vpaddd less
        per 32 products. The accumulators start at 0.
        q6: the codes c + 32 (0..63) are the unsigned operand as they are, no vpsignb; pair sums
        ≤ 2·63·127 = 16002, so 2 quads add up in int16 (≤ 32004) and widen, twice a group; the
        accumulators start at -32 Σ q."""
        b, c = self.b, self._c
        rows_b = [b.add(self.b0, c(r)) for r in range(n)]
        low = ir.Constant(_VB, 0x0F)
        four = ir.Constant(_VW, 4)
        quads = 4 if self.fmt == FMT_Q4 else self.group // 4
        at_once = _vectors_at_once(n)
        for chunk in range(4 // at_once):
            vs = list(range(chunk * at_once, (chunk + 1) * at_once))
            if self.fmt == FMT_Q6:
                starts = [self._six_bit_start(rb) for rb in rows_b]
                acc = {(r, v): starts[r] for r in range(n) for v in vs}
            else:
                acc = {(r, v): ir.Constant(_VD, None) for r in range(n) for v in vs}
            acc16 = {(r, v): ir.Constant(_VW, None) for r in range(n) for v in vs}
            loaded = {}
            for p in range(quads):
                if self.fmt == FMT_Q6:
                    ws = self._six_bit_vectors(p, vs, loaded)
                    k = b.add(self.k0, c(4 * p))
                    acts = [b.bitcast(self._act(r, k), _VB) for r in range(n)]
                    for v in vs:
                        for r in range(n):
                            acc16[r, v] = b.add(acc16[r, v], self._maddubs(ws[v], acts[r]))
                    if p % 2 == 1:
                        for key in acc16:
                            acc[key] = b.add(acc[key], self._widen_pairs(acc16[key]))
                            acc16[key] = ir.Constant(_VW, None)
                    continue
                wv = self._quad_vectors(p, vs)
                if self.fmt == FMT_Q4:
                    lo_w = {v: b.and_(w, low) for v, w in wv.items()}
                    hi_w = {v: b.and_(b.bitcast(b.lshr(b.bitcast(w, _VW), four), _VB), low) for v, w in wv.items()}
                    for ws, e in ((lo_w, 4 * p), (hi_w, 16 + 4 * p)):
                        k = b.add(self.k0, c(e))
                        acts = [b.bitcast(self._act(r, k), _VB) for r in range(n)]
                        for v in vs:
                            for r in range(n):
                                acc16[r, v] = b.add(acc16[r, v], self._maddubs(ws[v], acts[r]))
                else:
                    k = b.add(self.k0, c(4 * p))
                    acts = [b.bitcast(self._act(r, k), _VB) for r in range(n)]
                    for v in vs:
                        w = wv[v]
                        neg = b.icmp_signed("<", w, ir.Constant(_VB, 0))
                        mag = b.select(neg, b.sub(ir.Constant(_VB, 0), w), w)
                        for r in range(n):
                            pairs = self._maddubs(mag, self._sign(acts[r], w))
                            if self.narrow:
                                acc16[r, v] = b.add(acc16[r, v], pairs)
                            else:
                                acc[r, v] = b.add(acc[r, v], self._widen_pairs(pairs))
            if self.fmt == FMT_Q4 or self.narrow:
                acc = {key: self._widen_pairs(a16) for key, a16 in acc16.items()}
            self._finish(vs, rows_b, acc)

    # ---- the step for n rows ---------------------------------------------------------------
    def _rows(self, n):
        if ISA == "avx2":
            return self._rows_avx2(n)
        b, c = self.b, self._c
        at_once = _vectors_at_once(n)
        rows_b = [b.add(self.b0, c(r)) for r in range(n)]
        if self.fmt == FMT_Q8:
            init = [self._splat(b.load(self._ptr("corr", rb, self.g)), _VD) for rb in rows_b]
        elif self.fmt == FMT_Q6:
            init = [self._six_bit_start(rb) for rb in rows_b]
        else:
            init = [ir.Constant(_VD, None)] * n
        flip = ir.Constant(_VB, 0x80)
        low = ir.Constant(_VB, 0x0F)
        four = ir.Constant(_VW, 4)
        quads = 4 if self.fmt == FMT_Q4 else self.group // 4
        for chunk in range(4 // at_once):
            vs = list(range(chunk * at_once, (chunk + 1) * at_once))
            acc = {(r, v): init[r] for r in range(n) for v in vs}
            loaded = {}
            for p in range(quads):
                if self.fmt == FMT_Q6:
                    halves = [(self._six_bit_vectors(p, vs, loaded), 4 * p)]
                elif self.fmt == FMT_Q4:
                    wv = self._quad_vectors(p, vs)
                    lo_w = {v: b.and_(w, low) for v, w in wv.items()}
                    hi_w = {v: b.and_(b.bitcast(b.lshr(b.bitcast(w, _VW), four), _VB), low) for v, w in wv.items()}
                    halves = [(lo_w, 4 * p), (hi_w, 16 + 4 * p)]
                else:
                    wv = self._quad_vectors(p, vs)
                    halves = [({v: b.xor(w, flip) for v, w in wv.items()}, 4 * p)]
                for ws, e in halves:
                    k = b.add(self.k0, c(e))
                    acts = [self._act(r, k) for r in range(n)]
                    for v in vs:
                        wd = b.bitcast(ws[v], _VD)
                        for r in range(n):
                            acc[r, v] = self._dot(acc[r, v], wd, acts[r])
            self._finish(vs, rows_b, acc)

    def _finish(self, vs, rows_b, acc):
        """out[b, slot v] = fma(m, Σx, fma(float(acc), s·d_b, out)) (the fma(m, ...) only with a bias)."""
        b, c = self.b, self._c
        d = [self._splat(b.load(self._ptr("xs", rb, self.blk)), _VF) for rb in rows_b]
        partial = []
        for v in vs:
            s = self._group_param(self.s_off, v, 0)
            col = b.add(self.col0, c(_VEC * v))
            for r, rb in enumerate(rows_b):
                at = self._vptr("out", _VF, rb, col)
                f = b.sitofp(acc[r, v], _VF)
                partial.append((at, r, v, b.call(self.fma, [f, b.fmul(s, d[r]), b.load(at, align=4)])))
        if self.params == PARAMS_STEPS_BIAS:
            self._store_biased(vs, rows_b, partial)
        elif self.params == PARAMS_STEPS:
            for at, r, v, o in partial:
                b.store(o, at, align=4)
        else:
            with b.if_else(self.has_bias) as (then, otherwise):
                with then:
                    self._store_biased(vs, rows_b, partial)
                with otherwise:
                    for at, r, v, o in partial:
                        b.store(o, at, align=4)

    def _store_biased(self, vs, rows_b, partial):
        b = self.b
        ms = {v: self._group_param(self.m_off, v, TILE) for v in vs}
        sums = [self._splat(b.load(self._ptr("fsum", rb, self.g)), _VF) for rb in rows_b]
        for at, r, v, o in partial:
            b.store(b.call(self.fma, [ms[v], sums[r], o]), at, align=4)


@intrinsic
def _unpermute(typingctx, out, row, col0):
    """out[row, col0:col0 + TILE] from interleaved-vector order back to natural output order."""
    sig = types.void(out, row, col0)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0], ary, [args[1], args[2]])
        v64 = ir.VectorType(ir.FloatType(), TILE)
        at = builder.bitcast(ptr, v64.as_pointer())
        perm = builder.load(at, align=4)
        natural = [0] * TILE
        for v in range(4):
            for j, t in enumerate(quad_lanes()[v]):
                natural[t] = _VEC * v + j
        builder.store(builder.shuffle_vector(perm, ir.Constant(v64, ir.Undefined),
                                             ir.Constant(ir.VectorType(_I32, TILE), natural)), at, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(**_JIT)
def _tile_i8(tab, meta, tile, acts, out, col0, r0, r1):
    """out[r0:r1, col0:col0 + TILE] = tile `tile` of a q4/q8 matrix (metadata row meta) times rows r0..r1 of
    x, quantized in acts."""
    group = meta[M_GROUP]
    groups, group_bytes, base = tile_groups(meta, tile)
    q4 = meta[M_FMT] == FMT_Q4
    six = meta[M_FMT] == FMT_Q6
    narrow = meta[M_NARROW] != 0
    params = params_kind(meta)
    zero_tile_rows(out, r0, r1, col0)
    for g in range(groups):
        at = group_at(meta, tile, g, groups, group_bytes, base, col0)
        b0 = r0
        while b0 < r1:  # blocks of BLOCK rows
            rows = min(BLOCK, r1 - b0)
            # Q4_K and Q6_K (the Qwen files' weights) get steps compiled for their parameters.
            if q4 and params == PARAMS_STEPS_BIAS:
                _i8_step(tab, acts, at, out, b0, rows, FMT_Q4, 32, 0, PARAMS_STEPS_BIAS)
            elif q4:
                _i8_step(tab, acts, at, out, b0, rows, FMT_Q4, 32, 0, PARAMS_ANY)
            elif six and params == PARAMS_STEPS:
                _i8_step(tab, acts, at, out, b0, rows, FMT_Q6, 16, 0, PARAMS_STEPS)
            elif six:
                _i8_step(tab, acts, at, out, b0, rows, FMT_Q6, 16, 0, PARAMS_ANY)
            elif group == 32 and narrow:
                _i8_step(tab, acts, at, out, b0, rows, FMT_Q8, 32, 1, PARAMS_ANY)
            elif group == 32:
                _i8_step(tab, acts, at, out, b0, rows, FMT_Q8, 32, 0, PARAMS_ANY)
            elif narrow:
                _i8_step(tab, acts, at, out, b0, rows, FMT_Q8, 16, 1, PARAMS_ANY)
            else:
                _i8_step(tab, acts, at, out, b0, rows, FMT_Q8, 16, 0, PARAMS_ANY)
            b0 += rows
    for b in range(r0, r1):
        _unpermute(out, b, col0)


@njit(**_JIT)
def _prepare_i8(meta, mats, x, out, scratch):
    """Check the shapes of a linear_batch_i8 call and lay out its quantized activations in scratch:
    (rows of x to quantize: B, or 0 when every listed matrix is f32; tile offsets of the listed
    matrices (n_mats + 1,); then QuantizedRows' arrays, in its order). Not the named tuple itself: a
    parallel loop can take one only from a call of its class in the same function."""
    n_mats = mats.shape[0]
    batch, k = x.shape
    first_tile = np.zeros(n_mats + 1, np.int64)
    quantized = False
    for i in range(n_mats):
        m = meta[mats[i]]
        if m[M_K] != k:
            raise ValueError("linear_batch_i8: x.shape[1] differs from a listed matrix's K")
        if m[M_FMT] != FMT_F32:
            quantized = True
            if m[M_GROUP] != 16 and m[M_GROUP] != 32:
                raise ValueError("linear_batch_i8: quantized groups must have 16 or 32 inputs")
            if m[M_LAYOUT] != LAYOUT_QUADS:
                raise ValueError("linear_batch_i8: quantized matrices must be packed in LAYOUT_QUADS")
        first_tile[i + 1] = first_tile[i] + m[M_TILES]
    if quantized and k % 32 != 0:
        raise ValueError("linear_batch_i8: K must be a multiple of 32")
    if quantized and x.strides[1] != 4:
        raise ValueError("linear_batch_i8: x must have contiguous rows")
    n_tiles = first_tile[n_mats]
    if out.shape[0] < batch or out.shape[1] < n_tiles * TILE or out.strides[1] != 4:
        raise ValueError("linear_batch_i8: out must be (≥ B, ≥ Σ padded rows) with contiguous rows")
    blocks = k // 32 if quantized else 0
    if scratch.size < batch * 15 * blocks:
        raise ValueError("linear_batch_i8: scratch too small (see batch_scratch_i8)")
    flat = scratch.reshape(scratch.size)
    at = batch * blocks * 8
    nb = batch * blocks
    xq = flat[:at].view(np.int8).reshape(batch, blocks * 32)
    xs = flat[at:at + nb].reshape(batch, blocks)
    fsum32 = flat[at + nb:at + 2 * nb].reshape(batch, blocks)
    fsum16 = flat[at + 2 * nb:at + 4 * nb].reshape(batch, 2 * blocks)
    corr32 = flat[at + 4 * nb:at + 5 * nb].view(np.int32).reshape(batch, blocks)
    corr16 = flat[at + 5 * nb:at + 7 * nb].view(np.int32).reshape(batch, 2 * blocks)
    return batch if quantized else 0, first_tile, xq, xs, fsum16, fsum32, corr16, corr32


@njit(**_JIT)
def _one_tile_i8(tab, mats, first_tile, tg, x, acts, out, r0, r1):
    """Tile tg of the listed matrices (counted across them) times rows r0..r1 of x."""
    i, tile = locate_tile(first_tile, tg)
    m = tab.meta[mats[i]]
    if m[M_FMT] == FMT_F32:
        _tile_f32(tab.data, m, tile, x[r0:r1], out[r0:r1], tg * TILE)
    else:
        _tile_i8(tab, m, tile, acts, out, tg * TILE, r0, r1)


@njit(parallel=True, **_JIT)
def linear_batch_i8(data, scales, scales16, meta, mats, x, out, scratch):
    """out[b, cols of mats[i]] ≈ W[mats[i]] @ x[b] with x[b] quantized to int8 per 32 inputs.

    x: float32 (B, K), K the input size of every listed matrix (a multiple of 32 when any is
    quantized); out: float32 (≥ B, ≥ Σ padded rows) with contiguous rows; scratch: C-contiguous
    float32 of at least scratch_size_i8(B, K) elements (see batch_scratch_i8). f32 matrices take
    matmul_batch's float path (x not quantized). out[b] depends on x[b] only.
    """
    to_quantize, first_tile, xq, xs, fsum16, fsum32, corr16, corr32 = _prepare_i8(meta, mats, x, out, scratch)
    acts = QuantizedRows(xq, xs, fsum16, fsum32, corr16, corr32)
    _quantize_rows(x[:to_quantize], acts)
    tab = TableArrays(data, scales, scales16, meta)
    for tg in prange(first_tile[mats.shape[0]]):
        _one_tile_i8(tab, mats, first_tile, tg, x, acts, out, 0, x.shape[0])


@njit(parallel=True, **_JIT)
def linear_batch_i8_blocked(data, scales, scales16, meta, mats, x, out, scratch):
    """linear_batch_i8 (same contract, same bits: each row's sums run in the same order) with one
    work item per (tile, block of ROW_BLOCK rows) instead of per tile.

    For prompt chunks: a block's outputs stay in L1 while the tile's groups stream past them, and
    the items split evenly over the threads even when a matrix has few tiles (576 outputs are 9
    tiles: one of 2 threads gets 5; 9 × 16 blocks of a 512-row chunk split 72/72). Items run tile
    by tile, so a thread's consecutive blocks reuse the tile's weights from L2."""
    to_quantize, first_tile, xq, xs, fsum16, fsum32, corr16, corr32 = _prepare_i8(meta, mats, x, out, scratch)
    acts = QuantizedRows(xq, xs, fsum16, fsum32, corr16, corr32)
    # A prompt chunk's quantization is worth its own fork/join: 512 × 8960 inputs take ~1.1 ms on
    # one core.
    for row in prange(to_quantize):
        _quantize_row(x, acts, row)
    tab = TableArrays(data, scales, scales16, meta)
    batch = x.shape[0]
    blocks = (batch + ROW_BLOCK - 1) // ROW_BLOCK
    for item in prange(first_tile[mats.shape[0]] * blocks):
        tg = item // blocks
        r0 = (item % blocks) * ROW_BLOCK
        _one_tile_i8(tab, mats, first_tile, tg, x, acts, out, r0, min(r0 + ROW_BLOCK, batch))


@njit(**_JIT)
def linear_batch_i8_serial(data, scales, scales16, meta, mats, x, out, scratch):
    """linear_batch_i8 with every tile on the calling thread (same contract, same bits): no
    fork/join barrier, which pays for one-row calls and when a neighbour holds a core."""
    to_quantize, first_tile, xq, xs, fsum16, fsum32, corr16, corr32 = _prepare_i8(meta, mats, x, out, scratch)
    acts = QuantizedRows(xq, xs, fsum16, fsum32, corr16, corr32)
    _quantize_rows(x[:to_quantize], acts)
    tab = TableArrays(data, scales, scales16, meta)
    for tg in range(first_tile[mats.shape[0]]):
        _one_tile_i8(tab, mats, first_tile, tg, x, acts, out, 0, x.shape[0])
