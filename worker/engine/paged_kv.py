"""The paged KV cache's memory: one pool of fixed-size blocks shared by every sequence, plus, for
models with sliding-window layers, a smaller window pool that holds those layers' K/V only for
the blocks some sequence can still attend to.

Layout (n_blocks, n_layers, n_kv_heads, head_dim, block_size) for K (each block's keys transposed:
kernels.key_scores scores a whole block with one vector multiply-add per dimension) and
(n_blocks, n_layers, n_kv_heads, block_size, head_dim) for V:
- attention reads, for one layer and KV head, a block's K slab and V slab contiguously;
- everything one block holds (all layers) is one contiguous span of each array, so a block is
  copied, hashed or stored as a unit (the prefix store needs that).
float16 pools hold IEEE half bits as uint16 (numba has no float16 scalar); the kernels convert.
q8_0 pools are int8 with their float16 scales in extra layers at the end (kernels.kv_q8); K and V
may differ in dtype (k_dtype, v_dtype).

Window layers (Gemma 3's local layers: a query sees only the last `window` keys). In "bounded"
mode their K/V leave the main pool for the window pool (n_slots, n_window_layers, ...), indexed
by slot, not block: worker.kv.block_manager gives a block a slot while it is inside some sequence's
window and takes it back after, so a long context costs the main pool only its global layers
(for Gemma 3 270M: 3 of 18 layers) and the window pool a fixed amount per running sequence.
"full" mode keeps every layer in the main pool (llama.cpp's --swa-full), as for every other model.

Which block (or slot) belongs to whom is worker.kv.block_manager's job; this class only owns the arrays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.errors import ConfigError

KV_DTYPES = {"float32": np.float32, "float16": np.uint16, "q8_0": np.int8}
WINDOW_KV_MODES = ("bounded", "full")


@dataclass(frozen=True)
class KVShape:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int

    def block_bytes(self, dtype: str, layers: int | None = None, v_dtype: str | None = None) -> int:
        """K and V of one block, all layers (or `layers` of them); V in v_dtype when it differs."""
        n = self.n_layers if layers is None else layers
        slab = self.n_kv_heads * self.block_size * self.head_dim
        return sum(pool_layers(dt, n) * slab * np.dtype(KV_DTYPES[dt]).itemsize
                   for dt in (dtype, v_dtype or dtype))


def pool_layers(dtype: str, layers: int) -> int:
    """Layers a pool of `layers` model layers has: q8_0 adds the layers holding its scales."""
    if dtype == "q8_0":
        from worker.engine.kernels.kv_q8 import scale_layers
        return layers + scale_layers(layers)
    return layers


def kv_dtype_name(k_dtype: str, v_dtype: str) -> str:
    """One name for the pair (the prefix store's fingerprint): "q8_0", or "k=q8_0,v=float16"."""
    return k_dtype if k_dtype == v_dtype else f"k={k_dtype},v={v_dtype}"


@dataclass(frozen=True)
class WindowLayout:
    """Which layers attend only the last `tokens` keys, and how many window slots hold them."""
    layers: tuple[int, ...]
    tokens: int
    slots: int


class PagedKVCache:
    def __init__(self, shape: KVShape, num_blocks: int, dtype: str = "float32", window: WindowLayout | None = None,
                 v_dtype: str | None = None):
        v_dtype = v_dtype or dtype
        for dt in (dtype, v_dtype):
            if dt not in KV_DTYPES:
                raise ConfigError(f"KV dtype {dt!r} is not supported (choose float32, float16 or q8_0)")
            if dt == "q8_0" and shape.head_dim % 32:
                raise ConfigError(f"q8_0 KV needs a head size that is a multiple of 32, this model's is "
                                  f"{shape.head_dim}")
        self.shape = shape
        self.k_dtype, self.v_dtype = dtype, v_dtype
        self.dtype = kv_dtype_name(dtype, v_dtype)
        self.num_blocks = num_blocks
        self.window = window
        windowed = set(window.layers) if window else set()
        # Per model layer: does it live in the window pool, and its index inside its pool.
        self.in_window = np.array([i in windowed for i in range(shape.n_layers)], np.bool_)
        self.pool_layer = np.zeros(shape.n_layers, np.int64)
        counts = [0, 0]
        for i, w in enumerate(self.in_window.tolist()):
            self.pool_layer[i] = counts[w]
            counts[w] += 1
        n_kv, bs, d = shape.n_kv_heads, shape.block_size, shape.head_dim
        main = (num_blocks, counts[0])
        # A 1-slot placeholder when there is no window pool: the kernels take both pools always.
        windowed = (window.slots if window else 1, max(counts[1], 1))
        # np.zeros maps pages lazily: memory is committed only as blocks are first written.
        def pool(dt, size, layers, slab):
            return np.zeros((size, pool_layers(dt, layers)) + slab, KV_DTYPES[dt])
        self.k = pool(dtype, *main, (n_kv, d, bs))
        self.v = pool(v_dtype, *main, (n_kv, bs, d))
        self.k_window = pool(dtype, *windowed, (n_kv, d, bs))
        self.v_window = pool(v_dtype, *windowed, (n_kv, bs, d))

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (self.k_window.nbytes + self.v_window.nbytes if self.window else 0)

    def held_bytes(self, blocks: int, slots: int = 0) -> int:
        """Bytes of `blocks` main-pool blocks and `slots` window slots (what requests hold: /metrics)."""
        held = blocks * (self.k[0].nbytes + self.v[0].nbytes)
        return held + (slots * (self.k_window[0].nbytes + self.v_window[0].nbytes) if self.window else 0)

    @property
    def layout(self) -> str:
        """Names the byte layout of a stored block (part of the prefix store's fingerprint)."""
        base = "v2:blocks,layers,kv_heads,(K: head_dim,block_size | V: block_size,head_dim)"
        if self.window is None:
            return base
        return f"{base};window_layers={','.join(map(str, self.window.layers))}"

    def reserve(self) -> None:
        """Commit the pool's memory now (a server's choice): RSS is then flat while serving, and
        a host without the memory fails at start-up, not under load."""
        for pool in (self.k, self.v, self.k_window, self.v_window):
            pool.fill(0)

    # ---- where a layer lives ---------------------------------------------------------------------

    def pool_of(self, layer: int, block_table: np.ndarray, window_table: np.ndarray | None):
        """(K pool, V pool, index of the layer in them, the table that maps positions' blocks there)."""
        index = int(self.pool_layer[layer])
        if not self.in_window[layer]:
            return self.k, self.v, index, block_table
        if window_table is None:
            raise ValueError(f"layer {layer} keeps its K/V in window slots: the chunk needs a window_table")
        return self.k_window, self.v_window, index, window_table

    def gather(self, layer: int, block_table: np.ndarray, length: int,
               window_table: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's first `length` keys and values of a layer, contiguous float32 (KVH, length, D).

        Blocks without a window slot (negative entries: outside every query's window) read as zeros."""
        k_pool, v_pool, index, table = self.pool_of(layer, block_table, window_table)
        ids = np.asarray(table[:-(-length // self.block_size)])
        missing = ids < 0
        out = []
        for pool, keys in ((k_pool, True), (v_pool, False)):
            part = pool[np.where(missing, 0, ids), index]  # a copy: (blocks, KVH, block_size, D), K transposed
            dtype = self.k_dtype if keys else self.v_dtype
            if dtype == "float16":
                part = part.view(np.float16).astype(np.float32)
            elif dtype == "q8_0":
                part = _q8_0_values(pool, np.where(missing, 0, ids), index, keys)
            part[missing] = 0.0
            heads = part.shape[1]
            rows = part.transpose(1, 0, 3, 2) if keys else part.transpose(1, 0, 2, 3)
            out.append(rows.reshape(heads, -1, self.shape.head_dim)[:, :length])
        return out[0], out[1]

    # ---- one block as bytes (the prefix store's unit) ----------------------------------------------

    @property
    def block_payload_bytes(self) -> int:
        """K then V of a main-pool block, then K then V of its window slot (window models)."""
        window = self.k_window[0].nbytes + self.v_window[0].nbytes if self.window else 0
        return self.k[0].nbytes + self.v[0].nbytes + window

    def read_block(self, block_id: int, slot: int = -1) -> bytes:
        parts = [self.k[block_id].tobytes(), self.v[block_id].tobytes()]
        if self.window is not None:
            if slot < 0:
                raise ValueError(f"block {block_id} has no window slot: its window layers are gone")
            parts += [self.k_window[slot].tobytes(), self.v_window[slot].tobytes()]
        return b"".join(parts)

    def write_block(self, block_id: int, payload: bytes, slot: int = -1) -> None:
        """The inverse of read_block. A window model's block without a slot (outside the window of
        the sequence it is restored for) keeps only its main-pool part."""
        raw = np.frombuffer(payload, np.uint8)
        targets = [self.k[block_id], self.v[block_id]]
        if self.window is not None and slot >= 0:
            targets += [self.k_window[slot], self.v_window[slot]]
        at = 0
        for t in targets:
            t.reshape(-1).view(np.uint8)[:] = raw[at:at + t.nbytes]
            at += t.nbytes


def _q8_0_values(pool: np.ndarray, blocks: np.ndarray, layer: int, keys: bool) -> np.ndarray:
    """float32 values of a q8_0 pool's blocks for one layer (the reference set's gather; the fused
    kernels decode a block at a time instead): (blocks, KVH, D, block_size) for K, (blocks, KVH,
    block_size, D) for V."""
    from worker.engine.kernels.kv_q8 import GROUP, LAYERS_PER_SCALE_LAYER
    values = pool[blocks, layer].astype(np.float32)
    n_blk, n_kv, a, b = values.shape
    per = a * b // 16  # scale bytes of one layer and kv head
    region = pool[blocks, pool.shape[1] - 1 - layer // LAYERS_PER_SCALE_LAYER].reshape(n_blk, n_kv, -1)
    start = (layer % LAYERS_PER_SCALE_LAYER) * per
    scales = region[:, :, start:start + per].copy().view(np.float16).astype(np.float32)
    if keys:  # (D, block_size): scale g*block_size + t covers rows g*32.. of column t
        scales = scales.reshape(n_blk, n_kv, a // GROUP, 1, b)
        return (values.reshape(n_blk, n_kv, a // GROUP, GROUP, b) * scales).reshape(values.shape)
    scales = scales.reshape(n_blk, n_kv, a, b // GROUP, 1)
    return (values.reshape(n_blk, n_kv, a, b // GROUP, GROUP) * scales).reshape(values.shape)


def window_blocks_per_sequence(window_tokens: int, prefill_chunk: int, block_size: int) -> int:
    """Most blocks one sequence can hold inside its window at once: the window before its next
    query plus one prefill chunk, each possibly straddling a block boundary."""
    return -(-(window_tokens - 1 + prefill_chunk) // block_size) + 2


def pool_tokens(shape: KVShape, dtype: str, budget_bytes: int, layers: int | None = None,
                v_dtype: str | None = None) -> int:
    """Tokens of K/V (whole blocks of `layers` layers) that fit in budget_bytes."""
    return max(0, budget_bytes) // shape.block_bytes(dtype, layers, v_dtype) * shape.block_size


def pool_blocks(shape: KVShape, dtype: str, budget_bytes: int, n_ctx: int, layers: int | None = None,
                v_dtype: str | None = None) -> int:
    """Main-pool blocks (of `layers` layers) that fit in budget_bytes; ConfigError when that cannot
    hold one full context."""
    per_block = shape.block_bytes(dtype, layers, v_dtype)
    blocks = budget_bytes // per_block
    needed = -(-n_ctx // shape.block_size)
    if blocks < needed:
        raise ConfigError(
            f"[engine] kv_cache_memory gives {budget_bytes / 2**20:.0f} MiB, which holds "
            f"{blocks * shape.block_size} tokens of KV cache ({per_block / 2**10:.0f} KiB per "
            f"{shape.block_size}-token block); one full context of {n_ctx} tokens needs "
            f"{needed * per_block / 2**20:.0f} MiB: raise kv_cache_memory or lower context_length")
    return int(blocks)


def memory_plan(weights_bytes: int, pool_bytes: int, available_bytes: int, dtype: str) -> str:
    """The start-up line naming weights, KV pool and the memory left spare; ConfigError naming the
    numbers and the keys to change when the pool (not yet committed: reserve() commits it) does
    not fit the memory the host has available once the weights are loaded."""
    mib = 2 ** 20
    if pool_bytes > available_bytes:
        raise ConfigError(
            f"the KV pool needs {pool_bytes / mib:.0f} MiB ({dtype}) but this host has {available_bytes / mib:.0f} "
            f"MiB available after loading the weights ({weights_bytes / mib:.0f} MiB): lower [engine] "
            f"kv_cache_memory (or context_length, which sets the least it may be), or set [engine] kv_dtype = "
            f"q8_0 (0.54x float16's bytes per token)")
    return (f"memory: weights {weights_bytes / mib:.0f} MiB, KV pool {pool_bytes / mib:.0f} MiB ({dtype}), "
            f"{(available_bytes - pool_bytes) / mib:.0f} MiB spare of {available_bytes / mib:.0f} MiB available")
