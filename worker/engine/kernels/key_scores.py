"""q·k scores of one block of transposed keys, for a few query heads at once.

The K pool stores each block transposed, (head_dim, block_size): row i holds dimension i of the
block's keys. A query head's scores for the whole block are then Σ_i q[i] · row_i, one vector
multiply-add per dimension with a lane per key and no horizontal sum at the end, and the query
heads of a GQA group share each row's load and float16 conversion. (Keys stored as rows, the
earlier layout, cost a horizontal sum per key and head; this layout made the decode attention of 8
sequences at 140–400 tokens of context 15% faster, measured.)

The loop is built in LLVM IR (`_kt_scores`) so that the heads' accumulators stay in registers,
which numba code would keep in memory. Block sizes of 4 to 64 tokens take it; others take a
plain numba loop. A head's scores are the same operations in the same order whichever heads it
is computed with, so a row's attention never depends on how the kernel grouped the heads.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from worker.engine.kernels.ir_vectors import I64, counted_loop, float_vector, fma_function, load_row, splat
from worker.engine.kernels.kv_element import kv_load

_JIT = dict(fastmath=True, cache=True, nogil=True)

HEADS_AT_ONCE = 4  # accumulators per call: 4 heads × 4 vectors of a 64-key block fit the registers
# Blocks of at most 16 keys take up to 6 heads per call: each head's accumulator is a chain of one
# FMA per dimension, so 4 heads × 2 ymm (8 chains) waited on the FMA latency (~5.4 cycles per
# dimension for 1-4 heads alike, AVX2 znver3); 6 × 2 = 12 chains, with the row and a broadcast,
# fill 15 of the 16 ymm registers.
NARROW_HEADS_AT_ONCE = 6


@intrinsic(prefer_literal=True)
def _kt_scores(typingctx, slab, q, qoff, scale, out, j, heads, lanes):
    """out[h, j:j + lanes] = scale · Σ_i q[qoff + h·d + i] · slab[i, :] for h < heads.

    slab: C-contiguous (d, lanes) float32 or uint16 (float16 bits) block of transposed keys, d ≥ 1;
    q: float32 query heads one after another; out: 2-D float32. heads and lanes are literals."""
    if not (isinstance(heads, types.IntegerLiteral) and isinstance(lanes, types.IntegerLiteral)):
        return None
    n_heads, width = heads.literal_value, lanes.literal_value
    half = slab.dtype == types.uint16
    sig = types.void(slab, q, qoff, scale, out, j, heads, lanes)

    def codegen(context, builder, signature, args):
        slab_t, q_t, _, _, out_t = signature.args[:5]
        slab_a = context.make_array(slab_t)(context, builder, args[0])
        q_a = context.make_array(q_t)(context, builder, args[1])
        out_a = context.make_array(out_t)(context, builder, args[4])
        qoff, scale, col = args[2], args[3], args[5]
        d = cgutils.unpack_tuple(builder, slab_a.shape)[0]
        vec = float_vector(width)
        fma = fma_function(builder, vec)
        i, accs, close = counted_loop(builder, d, [ir.Constant(vec, None)] * n_heads, "kt")
        row_at = cgutils.get_item_pointer(context, builder, slab_t, slab_a, [i, ir.Constant(I64, 0)])
        row = load_row(builder, row_at, vec, half)
        updated = []
        for h in range(n_heads):
            at = builder.add(builder.add(qoff, builder.mul(d, ir.Constant(I64, h))), i)
            qi = builder.load(cgutils.get_item_pointer(context, builder, q_t, q_a, [at]))
            updated.append(builder.call(fma, [splat(builder, qi, vec), row, accs[h]]))
        close(updated)
        factor = splat(builder, scale, vec)
        for h in range(n_heads):
            at = cgutils.get_item_pointer(context, builder, out_t, out_a, [ir.Constant(I64, h), col])
            builder.store(builder.fmul(updated[h], factor), builder.bitcast(at, vec.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(**_JIT)
def _heads(slab, q, qoff, scale, out, j, heads, lanes):
    """_kt_scores for 1..NARROW_HEADS_AT_ONCE heads (a literal per case), `lanes` a literal block size."""
    if heads == 1:
        _kt_scores(slab, q, qoff, scale, out, j, 1, lanes)
    elif heads == 2:
        _kt_scores(slab, q, qoff, scale, out, j, 2, lanes)
    elif heads == 3:
        _kt_scores(slab, q, qoff, scale, out, j, 3, lanes)
    elif heads == 4:
        _kt_scores(slab, q, qoff, scale, out, j, 4, lanes)
    elif heads == 5:
        _kt_scores(slab, q, qoff, scale, out, j, 5, lanes)
    else:
        _kt_scores(slab, q, qoff, scale, out, j, 6, lanes)


@njit(**_JIT)
def _plain(slab, q, qoff, scale, out, j, heads):
    """The same scores for any block size, as a numba loop (accumulating in `out`)."""
    d, bs = slab.shape
    for h in range(heads):
        o = out[h, j:j + bs]
        base = qoff + h * d
        for t in range(bs):
            o[t] = 0.0
        for i in range(d):
            qi = q[base + i]
            row = slab[i]
            for t in range(bs):
                o[t] += qi * kv_load(row[t])
        for t in range(bs):
            o[t] *= scale


@njit(**_JIT)
def block_scores(slab, q, qoff, scale, out, j, heads):
    """out[h, j:j + block_size] = scale · q_h · k for every key of the block, h < heads.

    slab: one (head_dim, block_size) block of transposed keys (float32 or uint16); q: float32, head
    h of the group at q[qoff + h·head_dim:]; out: float32 (≥ heads, ≥ j + block_size); scale float32.
    Every key of the block is scored, also those past the caller's range."""
    bs = slab.shape[1]
    d = slab.shape[0]
    at_once = NARROW_HEADS_AT_ONCE if bs <= 16 else HEADS_AT_ONCE
    h = 0
    while h < heads:
        n = min(at_once, heads - h)
        at = qoff + h * d
        rows = out[h:h + n]
        if bs == 16:
            _heads(slab, q, at, scale, rows, j, n, 16)
        elif bs == 32:
            _heads(slab, q, at, scale, rows, j, n, 32)
        elif bs == 8:
            _heads(slab, q, at, scale, rows, j, n, 8)
        elif bs == 64:
            _heads(slab, q, at, scale, rows, j, n, 64)
        elif bs == 4:
            _heads(slab, q, at, scale, rows, j, n, 4)
        else:
            _plain(slab, q, at, scale, rows, j, n)
        h += n
