"""Quantized matrix × a few activation vectors (batched decode): each weight is read once per
call and converted once per block of up to BLOCK rows of x, then applied to all of them.

Same packed layouts (see packing.py) as `matvec`, the one-vector yardstick kernel (`linear` in
tests/kernels/yardsticks.py); outputs of the listed matrices are laid side by side in out[b].
Every out[b] depends on x[b] alone, bit for bit, whatever B and the other rows are, so a
request's output does not change when it is batched; it is the same sums in the same order as
matvec on x[b] (equal unless LLVM contracts multiply-adds differently).

How. Per tile and group of 16/32 inputs, a micro-kernel written in LLVM IR (`_group_step`, an
`@intrinsic`) keeps the group's accumulators for up to BLOCK rows × 64 outputs in vector
registers, converts each 16-wide weight vector once and feeds it to every row's FMA. Plain numba
loops could not: their 64-wide loops over several row views pay runtime alias checks and index
arithmetic on every 4-input pass (converting each group into a float buffer, then running matvec's
loop per row over it, took 5.8x one matvec call at B=1 and 12.6x at B=8). The group sums Σx that
biased formats need are computed once per call, before the tiles, into `scratch`. Each step
prefetches the codes of a group a few ahead: without it a matrix streamed from RAM ran 1.7x slower.

Arithmetic identity. Under fastmath LLVM reassociates matvec's `(a*x0 + b*x1) + (c*x2 + d*x3)`
into one FMA chain per 4-input pass onto gacc (zeroed per group): q8 rows r, r+1, r+2, r+3; q4
elements hi(j), lo(j), hi(j+1), lo(j+1), i.e. j+16, j, j+17, j+1 (`_chain_pattern`); the group
finishes with o = fma(m, Σx, fma(s, gacc, o)). The micro-kernel issues exactly that chain with
explicit `llvm.fma` calls (numba's fastmath rewrite leaves vector calls alone), so its own order
cannot drift. Σx must come from the same compiled loop as matvec's: its q4 tiles sum with a
literal group size of 32 and its q8 tiles with a runtime one, which vectorize into different
orders, hence separate sums. tests/kernels/test_matmul_batch.py asserts np.array_equal with
matvec for every quant type: if matvec's loops change, that test fails.

Speed (bench/matmul_batch.py; SmolLM2's per-layer and output matrices, Gemma 3's; 2 shared
vCPUs, 1 or 2 threads): one call costs 0.4-0.65x one matvec.linear at B=1, 1.3-1.7x at B=8 and
2.1-3.1x at B=16, i.e. 5-8x the throughput of separate calls; from B=8 up the FMAs themselves
are the bound.

Scratch: any C-contiguous float32 array of at least `scratch_size(B, K)` elements (see
`batch_scratch`); one buffer serves every call with at most that B and K.

Vectors are 16 floats (AVX-512 registers); a host that prefers 256-bit vectors splits them in two.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from worker.engine.kernels.group_step_ir import GroupAt, GroupStepEmitter
from worker.engine.kernels.group_step_ir import VEC as _VEC
from worker.engine.kernels.packing import (FMT_F32, FMT_Q4, FMT_Q8, LAYOUT_ROWS, M_BIAS, M_DATA, M_FMT, M_GROUP,
                                           M_K, M_LAYOUT, M_PARAM, M_SCALE, M_TILES, TILE, TableArrays,
                                           code_bytes_per_group, unit_offset)

_JIT = dict(fastmath=True, cache=True, nogil=True)

BLOCK = 8  # most rows of x one micro-kernel step serves
_STEP_ROWS = (1, 2, 3, 4, BLOCK)  # compiled step sizes; 5-7 rows run as 4 + the rest at the same cost per row
# Output vectors (of 16) whose accumulators a step keeps live at once: rows × vectors chains hide
# the FMA latency, and with more than ~16 accumulators the registers run out (measured).
_VECTORS_AT_ONCE = {1: 4, 2: 4, 3: 4, 4: 4, 8: 2}
_SUM_SLOTS = 3  # group sums: q4 (group 32), q8 group 16, q8 group 32


def scratch_size(batch: int, k: int) -> int:
    """float32 elements linear_batch needs for B = batch rows of K = k inputs."""
    return _SUM_SLOTS * batch * (k // 16)


def batch_scratch(max_tiles: int, max_batch: int, k_max: int | None = None) -> np.ndarray:
    """A scratch buffer for every linear_batch call with at most max_batch rows and k_max inputs.

    Without k_max, K is bounded by max_tiles * TILE (true when max_tiles counts the widest call of
    a model, e.g. the logits); linear_batch raises ValueError if a call needs more.
    """
    k = max_tiles * TILE if k_max is None else k_max
    return np.zeros(scratch_size(max_batch, k), np.float32)


def _chain_pattern(fmt: int) -> tuple[tuple[int, int, int], ...]:
    """One pass of matvec's inner loop as (row multiplier, row offset, element offset): pass p
    adds code row `mul * p + add` times x[group start + that row + element offset], in this order.
    q4 byte row j holds element j (low nibble) and element j + 16 (high nibble)."""
    if fmt == FMT_Q4:
        return (2, 0, 16), (2, 0, 0), (2, 1, 16), (2, 1, 0)
    return (4, 0, 0), (4, 1, 0), (4, 2, 0), (4, 3, 0)


@intrinsic(prefer_literal=True)
def _group_step(typingctx, tab, at, x, sums, out, b0, rows, fmt, group):
    """out[b0 + r, col0:col0 + TILE] += one group's contribution, for r < rows (runtime, one of
    _STEP_ROWS), exactly as matvec adds it.

    tab: packing.TableArrays (its codes and parameters); at: group_step_ir.GroupAt, where the
    group is (its inputs are x[b, k0 + e], its output columns col0 + t); sums[b, g]: Σ x over the
    group. fmt and group must be literals.
    """
    if not (isinstance(fmt, types.IntegerLiteral) and isinstance(group, types.IntegerLiteral)):
        return None
    sig = types.void(tab, at, x, sums, out, b0, rows, fmt, group)

    def codegen(context, builder, signature, args):
        _StepEmitter(context, builder, signature, args, fmt.literal_value, group.literal_value).emit()
        return context.get_dummy_value()

    return sig, codegen



class _StepEmitter(GroupStepEmitter):
    """The IR of one `_group_step` call: a switch on the row count, one straight FMA chain each."""

    step_rows = _STEP_ROWS
    name = "step"
    _V = ir.VectorType(ir.FloatType(), _VEC)
    _V8 = ir.VectorType(ir.IntType(8), _VEC)
    _V16 = ir.VectorType(ir.IntType(16), _VEC)
    _VH = ir.VectorType(ir.HalfType(), _VEC)

    def __init__(self, context, builder, signature, args, fmt, group):
        self.context, self.b = context, builder
        self.fmt, self.group = fmt, group
        tys = signature.args
        self.arrays = {}
        self._take_arrays(tys[0], args[0], ("data", "scales", "scales16"))
        for i, name in ((2, "x"), (3, "sums"), (4, "out")):
            self._take_arrays(tys[i], args[i], (name,))
        self._take_group(tys[1], args[1])
        self.b0, self.rows = args[5], args[6]
        self.fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(self._V, [self._V] * 3),
                                                  "llvm.fma.v16f32")

    # ---- helpers -----------------------------------------------------------------------------
    def _splat(self, value):
        b = self.b
        undef = ir.Constant(self._V, ir.Undefined)
        one = b.insert_element(undef, value, self._c(0))
        return b.shuffle_vector(one, undef, ir.Constant(ir.VectorType(ir.IntType(32), _VEC), None))

    def _weights(self, row, v, high):
        """Vector v (16 outputs) of code row `row` of the group, as float32 codes."""
        b = self.b
        at = b.add(self.d_off, b.add(b.mul(row, self._c(TILE)), b.mul(v, self._c(_VEC))))
        raw = b.load(self._vptr("data", self._V8, at), align=1)
        if self.fmt != FMT_Q4:
            return b.sitofp(raw, self._V)
        nibble = b.lshr(raw, ir.Constant(self._V8, 4)) if high else b.and_(raw, ir.Constant(self._V8, 15))
        return b.uitofp(nibble, self._V)

    def _halves_of(self, offset, v):
        at = self.b.add(offset, self.b.mul(v, self._c(_VEC)))
        return self.b.bitcast(self.b.load(self._vptr("scales16", self._V16, at), align=2), self._VH)

    def _floats_of(self, offset, v):
        at = self.b.add(offset, self.b.mul(v, self._c(_VEC)))
        return self.b.load(self._vptr("scales", self._V, at), align=4)

    def _steps_of(self, offset, v):
        at = self.b.add(offset, self.b.mul(v, self._c(_VEC)))
        return self.b.load(self._vptr("data", self._V8, at), align=1)

    # ---- the step for n rows -------------------------------------------------------------------
    def _rows(self, n):
        b, c = self.b, self._c
        at_once = _VECTORS_AT_ONCE[n]
        zero = ir.Constant(self._V, None)
        # Accumulators live in allocas that mem2reg turns into registers across the loops below.
        acc = [[cgutils.alloca_once(b, self._V) for _ in range(n)] for _ in range(at_once)]
        with cgutils.for_range(b, c(TILE // _VEC // at_once)) as chunk:
            vs = [b.add(b.mul(chunk.index, c(at_once)), c(i)) for i in range(at_once)]
            for per_v in acc:
                for slot in per_v:
                    b.store(zero, slot)  # matvec zeroes gacc too: its first FMA adds to +0.0
            with cgutils.for_range(b, c(self.group // 4)) as pass_:
                for mul, add, offset in _chain_pattern(self.fmt):
                    row = b.add(b.mul(pass_.index, c(mul)), c(add))
                    k = b.add(self.k0, b.add(row, c(offset)))
                    xk = [self._splat(b.load(self._ptr("x", b.add(self.b0, c(r)), k))) for r in range(n)]
                    for vi, v in enumerate(vs):
                        w = self._weights(row, v, offset == 16)
                        for r in range(n):
                            b.store(b.call(self.fma, [w, xk[r], b.load(acc[vi][r])]), acc[vi][r])
            for vi, v in enumerate(vs):
                self._finish(v, [b.load(slot) for slot in acc[vi]])

    def _finish(self, v, gaccs):
        """out[b0 + r, vector v] = fma(m, Σx, fma(s, gacc, out)) (the fma(m, ...) only with a bias)."""
        b, c = self.b, self._c
        s = self._times_unit(self._param(self.s_off, v), v, 0)
        col = b.add(self.col0, b.mul(v, c(_VEC)))
        partial = []
        for r, gacc in enumerate(gaccs):
            at = self._vptr("out", self._V, b.add(self.b0, c(r)), col)
            partial.append((at, b.call(self.fma, [s, gacc, b.load(at, align=4)])))
        with b.if_else(self.has_bias) as (then, otherwise):
            with then:
                m = self._times_unit(self._param(self.m_off, v), v, TILE)
                for r, (at, o) in enumerate(partial):
                    xs = self._splat(b.load(self._ptr("sums", b.add(self.b0, c(r)), self.g)))
                    b.store(b.call(self.fma, [m, xs, o]), at, align=4)
            with otherwise:
                for at, o in partial:
                    b.store(o, at, align=4)


@njit(**_JIT)
def _group_sums(x, group, sums):
    """sums[g] = Σ x over group g with the very loop of matvec._finish_group, for its q8 tiles
    (group read from the matrix's metadata at run time: the same rounding)."""
    for g in range(x.shape[0] // group):
        xs = np.float32(0.0)
        for i in range(group):
            xs += x[g * group + i]
        sums[g] = xs


@njit(**_JIT)
def _group_sums_32(x, sums):
    """The same for q4 tiles, where matvec passes a literal 32: a constant trip count vectorizes
    into a different summation order than a runtime one."""
    for g in range(x.shape[0] // 32):
        xs = np.float32(0.0)
        for i in range(32):
            xs += x[g * 32 + i]
        sums[g] = xs


@njit(**_JIT)
def zero_tile_rows(out, r0, r1, col0):
    """Clear out[r0:r1, col0:col0 + TILE], where a tile's groups add up."""
    for b in range(r0, r1):
        o = out[b, col0:col0 + TILE]
        for t in range(TILE):
            o[t] = 0.0


@njit(**_JIT)
def tile_groups(meta, tile):
    """(groups, bytes of one group's codes, where tile `tile`'s codes start) of a q4/q8 matrix
    (metadata row meta): once a tile, outside its groups' loop."""
    group = meta[M_GROUP]
    groups = meta[M_K] // group
    group_bytes = code_bytes_per_group(meta[M_FMT], group)
    return groups, group_bytes, meta[M_DATA] + tile * groups * group_bytes


@njit(**_JIT)
def group_at(meta, tile, g, groups, group_bytes, base, col0):
    """Where group g of the tile (its tile_groups: groups, group_bytes, base) keeps its codes,
    scales, biases and units, for the rows' output columns col0..col0 + TILE."""
    p = (tile * groups + g) * TILE
    m_off = meta[M_BIAS] + p if meta[M_BIAS] >= 0 else -1
    return GroupAt(base + g * group_bytes, meta[M_SCALE] + p, m_off, unit_offset(meta, tile, g), meta[M_PARAM],
                   g * meta[M_GROUP], g, col0)


@njit(**_JIT)
def _tile_quant(tab, meta, tile, x, sums, out, col0):
    """out[:, col0:col0 + TILE] = tile `tile` of a q4/q8 matrix (metadata row meta) times every row of x."""
    group = meta[M_GROUP]
    groups, group_bytes, base = tile_groups(meta, tile)
    batch = x.shape[0]
    q4 = meta[M_FMT] == FMT_Q4
    zero_tile_rows(out, 0, batch, col0)
    for g in range(groups):
        at = group_at(meta, tile, g, groups, group_bytes, base, col0)
        b0 = 0
        while b0 < batch:  # blocks of BLOCK rows; 5-7 left go as 4 + the rest
            rows = min(BLOCK, batch - b0)
            if 4 < rows < BLOCK:
                rows = 4
            if q4:
                _group_step(tab, at, x, sums, out, b0, rows, FMT_Q4, 32)
            elif group == 32:
                _group_step(tab, at, x, sums, out, b0, rows, FMT_Q8, 32)
            else:
                _group_step(tab, at, x, sums, out, b0, rows, FMT_Q8, 16)
            b0 += rows


@njit(**_JIT)
def _tile_f32(data, meta, tile, x, out, col0):
    """matvec's _tile_f32 loop for every row of x."""
    k = meta[M_K]
    start = meta[M_DATA] + tile * k * TILE * 4
    d = data[start:start + k * TILE * 4].view(np.float32).reshape(k, TILE)
    for b in range(x.shape[0]):
        o = out[b, col0:col0 + TILE]
        xb = x[b]
        for t in range(TILE):
            o[t] = 0.0
        for kk in range(k):
            row = d[kk]
            xv = xb[kk]
            for t in range(o.shape[0]):
                o[t] += row[t] * xv


@njit(**_JIT)
def _sum_slot(m):
    """Which group sums a matrix uses (-1: none needed)."""
    if m[M_FMT] == FMT_Q4:
        return 0
    if m[M_FMT] == FMT_Q8:
        return 1 if m[M_GROUP] == 16 else 2
    return -1


@njit(**_JIT)
def _prepare(meta, mats, x, out, scratch):
    """Check the shapes of a linear_batch call and compute its group sums into scratch: (tile
    offsets of the listed matrices (n_mats + 1,), sums (_SUM_SLOTS, B, K/16))."""
    n_mats = mats.shape[0]
    batch, k = x.shape
    first_tile = np.zeros(n_mats + 1, np.int64)
    need = np.zeros(_SUM_SLOTS, np.bool_)
    group_of = np.zeros(_SUM_SLOTS, np.int64)
    for i in range(n_mats):
        m = meta[mats[i]]
        if m[M_K] != k:
            raise ValueError("linear_batch: x.shape[1] differs from a listed matrix's K")
        if m[M_FMT] != FMT_F32 and m[M_GROUP] != 16 and m[M_GROUP] != 32:
            raise ValueError("linear_batch: quantized groups must have 16 or 32 inputs")
        if m[M_LAYOUT] != LAYOUT_ROWS:
            raise ValueError("linear_batch: matrices must be packed in LAYOUT_ROWS")
        first_tile[i + 1] = first_tile[i] + m[M_TILES]
        slot = _sum_slot(m)
        if slot >= 0:
            need[slot] = True
            group_of[slot] = m[M_GROUP]
    n_tiles = first_tile[n_mats]
    if out.shape[0] < batch or out.shape[1] < n_tiles * TILE or out.strides[1] != 4:
        raise ValueError("linear_batch: out must be (≥ B, ≥ Σ padded rows) with contiguous rows")
    per_slot = batch * (k // 16)
    if scratch.size < _SUM_SLOTS * per_slot:
        raise ValueError("linear_batch: scratch too small (see batch_scratch)")
    flat = scratch.reshape(scratch.size)
    sums = flat[:_SUM_SLOTS * per_slot].reshape(_SUM_SLOTS, batch, k // 16)
    for b in range(batch):
        if need[0]:
            _group_sums_32(x[b], sums[0, b])
        for slot in range(1, _SUM_SLOTS):
            if need[slot]:
                _group_sums(x[b], group_of[slot], sums[slot, b])
    return first_tile, sums


@njit(**_JIT)
def locate_tile(first_tile, tg):
    """(i, tile): tile tg counted across the listed matrices is tile `tile` of the i-th one;
    first_tile (n_mats + 1,) holds each listed matrix's first tile (as _prepare returns it)."""
    i = 0
    while tg >= first_tile[i + 1]:
        i += 1
    return i, tg - first_tile[i]


@njit(**_JIT)
def _one_tile(tab, mats, first_tile, tg, x, sums, out):
    """Tile tg of the listed matrices (counted across them) times every row of x."""
    i, tile = locate_tile(first_tile, tg)
    m = tab.meta[mats[i]]
    if m[M_FMT] == FMT_F32:
        _tile_f32(tab.data, m, tile, x, out, tg * TILE)
    else:
        _tile_quant(tab, m, tile, x, sums[_sum_slot(m)], out, tg * TILE)


@njit(parallel=True, **_JIT)
def linear_batch(data, scales, scales16, meta, mats, x, out, scratch):
    """out[b, cols of mats[i]] = W[mats[i]] @ x[b] for every listed matrix and every row b.

    x: float32 (B, K), K the input size of every listed matrix; out: float32 (≥ B, ≥ Σ padded
    rows) with contiguous rows; scratch: C-contiguous float32 of at least scratch_size(B, K)
    elements (see batch_scratch). Each out[b] is the same sums in the same order as matvec.linear
    on x[b] (bit for bit, unless LLVM contracts multiply-adds differently in the two compiles),
    and never depends on the other rows.
    """
    first_tile, sums = _prepare(meta, mats, x, out, scratch)
    tab = TableArrays(data, scales, scales16, meta)
    for tg in prange(first_tile[mats.shape[0]]):
        _one_tile(tab, mats, first_tile, tg, x, sums, out)


@njit(**_JIT)
def linear_batch_serial(data, scales, scales16, meta, mats, x, out, scratch):
    """linear_batch with every tile on the calling thread (same contract, same bits).

    Why: a parallel launch ends at a barrier that waits for the slowest thread, so when a
    neighbour holds one of the cores, or a step's matmuls are small (one decode row), one
    thread without the fork/join can beat two."""
    first_tile, sums = _prepare(meta, mats, x, out, scratch)
    tab = TableArrays(data, scales, scales16, meta)
    for tg in range(first_tile[mats.shape[0]]):
        _one_tile(tab, mats, first_tile, tg, x, sums, out)
