"""Softmax-weighted sums of one block's values, for a few query heads at once.

acc[h] += Σ_r w[h, r] · v_r over a run of a block's value rows (block_size, head_dim): each row is
loaded and converted from float16 once and multiplied into the accumulators of every head of the
GQA group. The loop is built in LLVM IR (`_v_sums`) so that the accumulators of a slice of the
dimensions of up to 6 heads stay in registers for the whole run (numba code would keep them in
memory and convert every row once per head): 64-dimension slices where the registers hold them
(AVX-512: 6 heads × 4 zmm), 16-dimension ones elsewhere (AVX2: 4 heads × 64 dims would be 32 ymm
accumulators in 16 registers; spilled, the value sums of 4 heads over a 16-row block took 1.5-2x
as long as in 16-dimension slices, measured on AVX2). head_dim a multiple of 16 takes it; others
take a plain numba loop. Each head's sum is the same sequence of multiply-adds (key by key, in order) whichever
heads share the call, so a row's attention never depends on how the kernel grouped the heads.
"""
from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import config, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from worker.engine.kernels.ir_vectors import I64, counted_loop, float_vector, fma_function, load_row, splat
from worker.engine.kernels.key_scores import NARROW_HEADS_AT_ONCE
from worker.engine.kernels.kv_element import kv_load

_JIT = dict(fastmath=True, cache=True, nogil=True)


def _has_512_bit_registers() -> bool:
    """Whether numba's code here may use AVX-512 (the host's features, less any the numba
    configuration turns off). Only the slice width depends on it: each accumulator lane is the
    same chain of multiply-adds in either width, so the bits do not."""
    if config.CPU_NAME and config.CPU_NAME != "host":
        return False
    try:
        feats = llvm.get_host_cpu_features()
    except Exception:  # pragma: no cover - no host information: the width that fits everywhere
        return False
    return bool(feats.get("avx512f")) and "-avx512f" not in (config.CPU_FEATURES or "")


WIDE_SLICES = _has_512_bit_registers()


@intrinsic(prefer_literal=True)
def _v_sums(typingctx, slab, ks, run, weights, w0, acc, col, heads, dims):
    """acc[h, col:col + dims] += Σ_{r < run} weights[h, w0 + r] · slab[ks + r, col:col + dims], h < heads.

    slab: C-contiguous (block_size, d) float32 or uint16 (float16 bits) value rows, run ≥ 1;
    weights, acc: 2-D float32. heads and dims are literals."""
    if not (isinstance(heads, types.IntegerLiteral) and isinstance(dims, types.IntegerLiteral)):
        return None
    n_heads, width = heads.literal_value, dims.literal_value
    half = slab.dtype == types.uint16
    sig = types.void(slab, ks, run, weights, w0, acc, col, heads, dims)

    def codegen(context, builder, signature, args):
        slab_t, _, _, w_t, _, acc_t = signature.args[:6]
        slab_a = context.make_array(slab_t)(context, builder, args[0])
        w_a = context.make_array(w_t)(context, builder, args[3])
        acc_a = context.make_array(acc_t)(context, builder, args[5])
        ks, run, w0, col = args[1], args[2], args[4], args[6]
        vec = float_vector(width)
        fma = fma_function(builder, vec)

        def acc_ptr(h):
            at = cgutils.get_item_pointer(context, builder, acc_t, acc_a, [ir.Constant(I64, h), col])
            return builder.bitcast(at, vec.as_pointer())

        start = [builder.load(acc_ptr(h), align=4) for h in range(n_heads)]
        r, sums, close = counted_loop(builder, run, start, "vs")
        row_at = cgutils.get_item_pointer(context, builder, slab_t, slab_a, [builder.add(ks, r), col])
        row = load_row(builder, row_at, vec, half)
        updated = []
        for h in range(n_heads):
            w_at = cgutils.get_item_pointer(context, builder, w_t, w_a, [ir.Constant(I64, h), builder.add(w0, r)])
            updated.append(builder.call(fma, [splat(builder, builder.load(w_at), vec), row, sums[h]]))
        close(updated)
        for h in range(n_heads):
            builder.store(updated[h], acc_ptr(h), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(**_JIT)
def _heads(slab, ks, run, weights, w0, acc, col, heads, dims):
    """_v_sums for 1..NARROW_HEADS_AT_ONCE heads (a literal per case), `dims` a literal slice width."""
    if heads == 1:
        _v_sums(slab, ks, run, weights, w0, acc, col, 1, dims)
    elif heads == 2:
        _v_sums(slab, ks, run, weights, w0, acc, col, 2, dims)
    elif heads == 3:
        _v_sums(slab, ks, run, weights, w0, acc, col, 3, dims)
    elif heads == 4:
        _v_sums(slab, ks, run, weights, w0, acc, col, 4, dims)
    elif heads == 5:
        _v_sums(slab, ks, run, weights, w0, acc, col, 5, dims)
    else:
        _v_sums(slab, ks, run, weights, w0, acc, col, 6, dims)


@njit(**_JIT)
def _plain(slab, ks, run, weights, w0, acc, heads):
    """The same sums for any head_dim, as a numba loop."""
    d = slab.shape[1]
    for h in range(heads):
        a = acc[h]
        w = weights[h]
        for r in range(run):
            row = slab[ks + r]
            e = w[w0 + r]
            for i in range(d):
                a[i] += e * kv_load(row[i])


@njit(**_JIT)
def value_sums(slab, ks, run, weights, w0, acc, heads):
    """acc[h] += Σ_{r < run} weights[h, w0 + r] · slab[ks + r] for h < heads (run ≥ 1).

    slab: one (block_size, head_dim) block of value rows (float32 or uint16); weights: float32
    (≥ heads, ≥ w0 + run); acc: float32 (≥ heads, head_dim)."""
    d = slab.shape[1]
    # 6 heads a call, as key_scores' narrow blocks: 16-dimension slices carry 12 ymm chains of one
    # FMA per key (4 heads' 8 waited on the FMA latency), 64-dimension ones 24 of 32 zmm.
    h = 0
    while h < heads:
        n = min(NARROW_HEADS_AT_ONCE, heads - h)
        w = weights[h:h + n]
        a = acc[h:h + n]
        if WIDE_SLICES and d % 64 == 0:
            for col in range(0, d, 64):
                _heads(slab, ks, run, w, w0, a, col, n, 64)
        elif d % 16 == 0:
            for col in range(0, d, 16):
                _heads(slab, ks, run, w, w0, a, col, n, 16)
        else:
            _plain(slab, ks, run, w, w0, a, n)
        h += n
