"""One element of a KV pool: float32 as it is, or float16 bits in a uint16 (numba has no float16).

Kernel sources read through ``kv_load`` and write through ``kv_store_value``; numba resolves them
at typing time (identity for float32, a float16 conversion for uint16), so one source serves both
pool dtypes. The plain Python versions do the same outside numba.
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from worker.engine.kernels.half import f16_to_f32, f32_to_f16


def kv_load(x):
    """Pool element → float32 (Python fallback; inside numba the overload below is used)."""
    if isinstance(x, np.uint16):
        return np.float32(np.uint16(x).view(np.float16))
    return np.float32(x)


def kv_store_value(x, marker):
    """float value → pool element of marker's dtype (marker: the pool array or one of its elements)."""
    dtype = marker.dtype
    if dtype == np.uint16:
        return np.float32(x).astype(np.float16).view(np.uint16)
    return np.float32(x)


@overload(kv_load)
def _kv_load_impl(x):
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:
        return lambda x: f16_to_f32(x)
    return None


@overload(kv_store_value)
def _kv_store_value_impl(x, marker):
    dtype = marker.dtype if isinstance(marker, types.Array) else marker
    if dtype == types.float32:
        return lambda x, marker: np.float32(x)
    if dtype == types.uint16:
        return lambda x, marker: f32_to_f16(np.float32(x))
    return None
