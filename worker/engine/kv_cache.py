"""Preallocated key/value cache for one sequence slot: (layers, kv heads, context, head dim)."""
from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, n_ctx: int, head_dim: int, dtype=np.float32):
        shape = (n_layers, n_kv_heads, n_ctx, head_dim)
        self.k = np.zeros(shape, dtype)  # k[l, h, t] = key of token t, KV head h, layer l
        self.v = np.zeros(shape, dtype)
        self.n_ctx = n_ctx
        self.length = 0  # tokens whose K/V are valid

    def store(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v: (T, n_kv_heads, head_dim) for positions start .. start+T-1."""
        t = k.shape[0]
        self.k[layer, :, start:start + t] = k.transpose(1, 0, 2)
        self.v[layer, :, start:start + t] = v.transpose(1, 0, 2)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
