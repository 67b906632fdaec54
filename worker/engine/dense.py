"""Float32 (n, K) weight matrices for the BLAS paths (prefill, and every op of the reference set).

`ReferenceDense` dequantizes straight from the GGUF bytes with the numpy reference decoder —
independent of the packed layouts, which is what makes it a reference. `PackedDense` unpacks
the decode kernels' packed matrices, either once at load (`f32`: fastest prefill, 4 bytes per
weight) or into one reused scratch buffer per use (`dequantize`: no extra memory).
"""
from __future__ import annotations

import numpy as np

from worker.engine.gguf_file import TensorRef
from worker.engine.kernels.matvec import unpack_f32
from worker.engine.kernels.packing import M_K, M_N, MatrixTable
from worker.engine.quants import dequantize


class ReferenceDense:
    def __init__(self, tensors: list[TensorRef]):
        self._mats = [dequantize(t.raw, t.qtype) for t in tensors]

    def __call__(self, index: int) -> np.ndarray:
        return self._mats[index]


class PackedDense:
    def __init__(self, table: MatrixTable, cache_all: bool, skip: set[int] = frozenset()):
        self._table = table
        self._cache: dict[int, np.ndarray] = {}
        self._scratch = np.zeros(0, np.float32)
        if cache_all:
            for i in range(table.meta.shape[0]):
                if i not in skip:
                    self._cache[i] = self._unpack(i, None)

    def _unpack(self, index: int, into: np.ndarray | None) -> np.ndarray:
        n, k = int(self._table.meta[index, M_N]), int(self._table.meta[index, M_K])
        out = np.empty((n, k), np.float32) if into is None else into[:n * k].reshape(n, k)
        t = self._table
        unpack_f32(t.data, t.scales, t.scales16, t.meta, index, out)
        return out

    def __call__(self, index: int) -> np.ndarray:
        cached = self._cache.get(index)
        if cached is not None:
            return cached
        n, k = int(self._table.meta[index, M_N]), int(self._table.meta[index, M_K])
        if self._scratch.size < n * k:
            self._scratch = np.empty(n * k, np.float32)
        return self._unpack(index, self._scratch)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self._cache.values()) + self._scratch.nbytes
