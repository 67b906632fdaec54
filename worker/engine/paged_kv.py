"""The paged KV cache's memory: one pool of fixed-size blocks shared by every sequence.

Layout (n_blocks, n_layers, n_kv_heads, block_size, head_dim) for K and for V:
- attention reads, for one layer and KV head, a block's (block_size, head_dim) slab contiguously;
- everything one block holds (all layers) is one contiguous span of each array, so a block is
  copied, hashed or stored as a unit (the prefix store needs that).
float16 pools hold IEEE half bits as uint16 (numba has no float16 scalar); the kernels convert.

Which block belongs to whom is worker.block_manager's job; this class only owns the arrays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.errors import ConfigError

KV_DTYPES = {"float32": np.float32, "float16": np.uint16}


@dataclass(frozen=True)
class KVShape:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int

    def block_bytes(self, dtype: str) -> int:
        """K and V of one block, all layers."""
        item = np.dtype(KV_DTYPES[dtype]).itemsize
        return 2 * self.n_layers * self.n_kv_heads * self.block_size * self.head_dim * item


class PagedKVCache:
    def __init__(self, shape: KVShape, num_blocks: int, dtype: str = "float32"):
        if dtype not in KV_DTYPES:
            raise ConfigError(f"KV dtype {dtype!r} is not supported (choose float32 or float16)")
        self.shape = shape
        self.dtype = dtype
        self.num_blocks = num_blocks
        dims = (num_blocks, shape.n_layers, shape.n_kv_heads, shape.block_size, shape.head_dim)
        # np.zeros maps pages lazily: memory is committed only as blocks are first written.
        self.k = np.zeros(dims, KV_DTYPES[dtype])
        self.v = np.zeros(dims, KV_DTYPES[dtype])

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reserve(self) -> None:
        """Commit the pool's memory now (a server's choice): RSS is then flat while serving, and
        a host without the memory fails at start-up, not under load."""
        self.k.fill(0)
        self.v.fill(0)

    def gather(self, layer: int, block_table: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's first `length` keys and values of a layer, contiguous float32 (KVH, length, D)."""
        blocks = block_table[:-(-length // self.block_size)]
        out = []
        for pool in (self.k, self.v):
            part = pool[blocks, layer]  # (blocks, KVH, block_size, D), a copy
            if self.dtype == "float16":
                part = part.view(np.float16).astype(np.float32)
            heads = part.shape[1]
            out.append(part.transpose(1, 0, 2, 3).reshape(heads, -1, self.shape.head_dim)[:, :length])
        return out[0], out[1]


def pool_blocks(shape: KVShape, dtype: str, budget_bytes: int, n_ctx: int) -> int:
    """Blocks that fit in budget_bytes; ConfigError when that cannot hold one full context."""
    per_block = shape.block_bytes(dtype)
    blocks = budget_bytes // per_block
    needed = -(-n_ctx // shape.block_size)
    if blocks < needed:
        raise ConfigError(
            f"[engine] kv_cache_memory gives {budget_bytes / 2**20:.0f} MiB, which holds "
            f"{blocks * shape.block_size} tokens of KV cache ({per_block / 2**10:.0f} KiB per "
            f"{shape.block_size}-token block); one full context of {n_ctx} tokens needs "
            f"{needed * per_block / 2**20:.0f} MiB: raise kv_cache_memory or lower context_length")
    return int(blocks)
