"""q8_0 KV pools: int8 values with one float16 scale per 32 values of a token's head vector, as
llama.cpp's q8_0 (scale = max|x| / 127, values round(x / scale)).

Layout. A q8_0 pool is an int8 array of the float pools' shape with ceil(n_layers / 16) extra
layers at the end holding the scales: the scales of layer l, kv head h take bytes
[(l % 16)·S, (l % 16 + 1)·S) of the (h) slab of extra layer n_extra-1-l // 16, read row-major,
S = head_dim·block_size/16 (two bytes per 32 values). So every shape the kernels read (kv heads,
head_dim, block_size) stays where it was, a block (all its layers and scales) is still one
contiguous span the prefix store copies as a unit, and a pool costs 34/64 of float16's bytes
(plus rounding of the extra layers), as llama.cpp's q8_0 does.
Scale index of (group g, token t): g·block_size + t in a K slab (head_dim, block_size), t·(head_dim/32)
+ g in a V slab (block_size, head_dim).

Attention reads the pool directly: `k_slab`/`v_slab` give a float pool's slab as it is and decode
one q8_0 block slab into the caller's scratch (a few KiB, in L1) just before it is scored; the
cache is never copied to floats. numba resolves them at typing time by the pool's dtype.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from worker.engine.kernels.half import f16_to_f32, f32_to_f16
from worker.engine.kernels.kv_element import kv_store_value

GROUP = 32  # values per scale
LAYERS_PER_SCALE_LAYER = 16
_JIT = dict(fastmath=True, cache=True, nogil=True)


def scale_layers(n_layers: int) -> int:
    """Extra layers a q8_0 pool of n_layers layers holds its scales in."""
    return -(-n_layers // LAYERS_PER_SCALE_LAYER)


@njit(**_JIT)
def _scale_at(pool, blk, layer, kvh, index):
    """The float16 scale number `index` of (layer, kv head) in block blk, as float32."""
    slab = pool[blk, pool.shape[1] - 1 - layer // LAYERS_PER_SCALE_LAYER, kvh]
    cols = slab.shape[1]
    f = (layer % LAYERS_PER_SCALE_LAYER) * (slab.shape[0] * cols // 16) + 2 * index
    lo = np.uint16(np.uint8(slab[f // cols, f % cols]))
    hi = np.uint16(np.uint8(slab[(f + 1) // cols, (f + 1) % cols]))
    return f16_to_f32(np.uint16(lo | (hi << np.uint16(8))))


@njit(**_JIT)
def _set_scale(pool, blk, layer, kvh, index, value):
    slab = pool[blk, pool.shape[1] - 1 - layer // LAYERS_PER_SCALE_LAYER, kvh]
    cols = slab.shape[1]
    f = (layer % LAYERS_PER_SCALE_LAYER) * (slab.shape[0] * cols // 16) + 2 * index
    bits = f32_to_f16(np.float32(value))
    slab[f // cols, f % cols] = np.int8(np.uint8(bits & np.uint16(0xFF)))
    slab[(f + 1) // cols, (f + 1) % cols] = np.int8(np.uint8(bits >> np.uint16(8)))


@njit(**_JIT)
def quantize_group(x, base):
    """(scale, 1/scale) of x[base:base + 32], llama.cpp's q8_0: the stored scale is float16, the
    values are rounded with the float32 one."""
    amax = np.float32(0.0)
    for i in range(GROUP):
        amax = max(amax, abs(x[base + i]))
    d = amax / np.float32(127.0)
    return d, (np.float32(1.0) / d if d > 0 else np.float32(0.0))


@njit(**_JIT)
def _q(value, inv):
    return np.int8(round(value * inv))


# ---- writing one token's head vector -------------------------------------------------------------

def store_k_head(pool, blk, layer, kvh, slot, src, base, d):
    """pool's K slab column `slot` of (blk, layer, kvh) = src[base:base + d] (Python: unused)."""


def store_v_head(pool, blk, layer, kvh, slot, src, base, d):
    """pool's V slab row `slot` of (blk, layer, kvh) = src[base:base + d] (Python: unused)."""


@overload(store_k_head)
def _store_k_head_impl(pool, blk, layer, kvh, slot, src, base, d):
    if pool.dtype == types.int8:
        def q8(pool, blk, layer, kvh, slot, src, base, d):
            kd = pool[blk, layer, kvh]
            bs = kd.shape[1]
            for g in range(d // GROUP):
                s, inv = quantize_group(src, base + g * GROUP)
                _set_scale(pool, blk, layer, kvh, g * bs + slot, s)
                for i in range(GROUP):
                    kd[g * GROUP + i, slot] = _q(src[base + g * GROUP + i], inv)
        return q8

    def plain(pool, blk, layer, kvh, slot, src, base, d):
        kd = pool[blk, layer, kvh]
        for i in range(d):
            kd[i, slot] = kv_store_value(src[base + i], pool)
    return plain


@overload(store_v_head)
def _store_v_head_impl(pool, blk, layer, kvh, slot, src, base, d):
    if pool.dtype == types.int8:
        def q8(pool, blk, layer, kvh, slot, src, base, d):
            vd = pool[blk, layer, kvh, slot]
            groups = d // GROUP
            for g in range(groups):
                s, inv = quantize_group(src, base + g * GROUP)
                _set_scale(pool, blk, layer, kvh, slot * groups + g, s)
                for i in range(GROUP):
                    vd[g * GROUP + i] = _q(src[base + g * GROUP + i], inv)
        return q8

    def plain(pool, blk, layer, kvh, slot, src, base, d):
        vd = pool[blk, layer, kvh, slot]
        for i in range(d):
            vd[i] = kv_store_value(src[base + i], pool)
    return plain


# ---- reading one block's slab ----------------------------------------------------------------------

def slab_scratch(pool):
    """Scratch k_slab/v_slab decode into: (slab, scales) float32 for a q8_0 pool, tiny otherwise."""


def k_slab(pool, blk, layer, kvh, scratch):
    """The K slab (head_dim, block_size) of (blk, layer, kvh): the pool's own for float pools,
    decoded into scratch for q8_0."""


def v_slab(pool, blk, layer, kvh, scratch):
    """The V slab (block_size, head_dim), as k_slab."""


@overload(slab_scratch)
def _slab_scratch_impl(pool):
    if pool.dtype == types.int8:
        def q8(pool):
            a, b = pool.shape[3], pool.shape[4]
            return np.empty((a, b), np.float32), np.empty((max(a, b) // GROUP, min(a, b)), np.float32)
        return q8
    return lambda pool: (np.empty((1, 1), np.float32), np.empty((1, 1), np.float32))


@overload(k_slab)
def _k_slab_impl(pool, blk, layer, kvh, scratch):
    if pool.dtype == types.int8:
        def q8(pool, blk, layer, kvh, scratch):
            out, sc = scratch
            kd = pool[blk, layer, kvh]
            d, bs = kd.shape
            for g in range(d // GROUP):
                for t in range(bs):
                    sc[g, t] = _scale_at(pool, blk, layer, kvh, g * bs + t)
            for r in range(d):
                g = r // GROUP
                for t in range(bs):
                    out[r, t] = np.float32(kd[r, t]) * sc[g, t]
            return out
        return q8
    return lambda pool, blk, layer, kvh, scratch: pool[blk, layer, kvh]


@overload(v_slab)
def _v_slab_impl(pool, blk, layer, kvh, scratch):
    if pool.dtype == types.int8:
        def q8(pool, blk, layer, kvh, scratch):
            out, _ = scratch
            vd = pool[blk, layer, kvh]
            bs, d = vd.shape
            groups = d // GROUP
            for t in range(bs):
                for g in range(groups):
                    s = _scale_at(pool, blk, layer, kvh, t * groups + g)
                    for i in range(g * GROUP, (g + 1) * GROUP):
                        out[t, i] = np.float32(vd[t, i]) * s
            return out
        return q8
    return lambda pool, blk, layer, kvh, scratch: pool[blk, layer, kvh]
