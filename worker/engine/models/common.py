"""What every architecture shares: packed weights loaded by GGUF name, and decode buffers."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.errors import ModelLoadError
from worker.engine.batch import RaggedBatch
from worker.engine.gguf_file import GGUFFile, TensorRef
from worker.engine.kernels.attention import store_kv
from worker.engine.kernels.matmul_batch import batch_scratch
from worker.engine.kernels.matmul_i8 import batch_scratch_i8
from worker.engine.kernels.packing import TILE, MatrixTable, pack
from worker.engine.layers import causal_attention
from worker.engine.paged_kv import PagedKVCache
from worker.engine.quants import dequantize


@dataclass
class PackedWeights:
    """Matrices packed for the kernels plus float32 vectors; names follow the GGUF tensors."""
    table: MatrixTable
    mats: np.ndarray  # int64 (n_layers, len(layer matrices)): table index of each layer matrix
    token_embd: int  # table index, (vocab, d_model)
    output: int  # table index, (vocab, d_model); the same matrix as token_embd when tied
    vectors: dict[str, np.ndarray]  # per-layer vectors by GGUF suffix ("attn_norm"): float32 (n_layers, n)
    output_norm: np.ndarray  # float32 (d_model,)
    tensors: list[TensorRef]  # the GGUF tensor behind each table index (for the reference set)


def vector(g: GGUFFile, name: str) -> np.ndarray:
    t = g.tensor(name)
    return dequantize(t.raw, t.qtype).reshape(-1)


def load_packed(g: GGUFFile, n_layers: int, vocab: int, d_model: int,
                layer_matrices: dict[str, tuple[int, int]], layer_vectors: tuple[str, ...],
                progress=None) -> PackedWeights:
    """Pack token_embd, output (or tie it) and blk.N.<name>.weight for every listed name."""
    table = MatrixTable()
    tensors: list[TensorRef] = []

    def add(name: str, shape: tuple[int, int]) -> int:
        t = g.tensor(name)
        if t.shape != shape:
            raise ModelLoadError(f"{g.path}: tensor {name} has shape {t.shape}, expected {shape}")
        tensors.append(t)
        return table.add(pack(t.raw, t.qtype))

    token_embd = add("token_embd.weight", (vocab, d_model))
    output = add("output.weight", (vocab, d_model)) if "output.weight" in g.tensors else token_embd
    mats = np.zeros((n_layers, len(layer_matrices)), np.int64)
    for layer in range(n_layers):
        for j, (name, shape) in enumerate(layer_matrices.items()):
            mats[layer, j] = add(f"blk.{layer}.{name}.weight", shape)
        if progress:
            progress(layer + 1, n_layers)
    table.finalize()
    vectors = {name: np.stack([vector(g, f"blk.{i}.{name}.weight") for i in range(n_layers)])
               for name in layer_vectors}
    return PackedWeights(table, mats, token_embd, output, vectors, vector(g, "output_norm.weight"), tensors)


def padded(n: int) -> int:
    return -(-n // TILE) * TILE


class BatchBuffers:
    """Every activation the fused row step touches, for up to `rows` tokens.

    Row b of each array belongs to the step's b-th token; the arrays grow when a bigger step
    arrives (rarely: the scheduler's token budget caps it). Logits are kept for at most
    `logit_rows` rows (the vocabulary makes them the biggest buffer).
    """

    def __init__(self, d_model: int, q_rows: int, kv_rows: int, d_ff: int, vocab: int, rows: int = 1):
        self.dims = (d_model, q_rows, kv_rows, d_ff, vocab)
        self.int8 = False  # decode matmuls with int8 activations (linear_batch_i8); set by the engine
        self.rows = 0
        self.logit_rows = 0
        self.ensure(rows, rows)

    def ensure(self, rows: int, logit_rows: int) -> None:
        d_model, q_rows, kv_rows, d_ff, vocab = self.dims
        if logit_rows > self.logit_rows:
            self.logit_rows = logit_rows
            self.logits = np.zeros((logit_rows, padded(vocab)), np.float32)
        if rows <= self.rows:
            return
        f32 = np.float32
        self.rows = rows
        self.x = np.zeros((rows, d_model), f32)
        self.h = np.zeros((rows, d_model), f32)  # normed hidden state: the matmuls' input
        self.qkv = np.zeros((rows, padded(q_rows) + 2 * padded(kv_rows)), f32)
        self.q = np.zeros((rows, q_rows), f32)  # roped queries, contiguous for attention
        self.k = np.zeros((rows, kv_rows), f32)
        self.v = np.zeros((rows, kv_rows), f32)
        self.att = np.zeros((rows, q_rows), f32)
        self.proj = np.zeros((rows, padded(d_model)), f32)
        self.gu = np.zeros((rows, 2 * padded(d_ff)), f32)
        self.act = np.zeros((rows, d_ff), f32)
        most_tiles = max(padded(vocab), self.qkv.shape[1], self.gu.shape[1]) // TILE
        # The matmul kernels' per-row sums; K is at most the widest matrix input.
        k_max = max(d_model, q_rows, d_ff)
        self._f32_scratch = batch_scratch(most_tiles, rows, k_max=k_max)
        self._i8_scratch = batch_scratch_i8(most_tiles, rows, k_max=k_max)

    @property
    def scratch(self) -> tuple:
        """What decode_parts.matmul takes: (int8?, linear_batch's scratch, linear_batch_i8's)."""
        return (self.int8, self._f32_scratch, self._i8_scratch)


def attend(kv: PagedKVCache, layer: int, batch: RaggedBatch, q: np.ndarray, k: np.ndarray, v: np.ndarray,
           scale: float, window: int, chunk: int) -> np.ndarray:
    """Store each segment's K/V in its blocks, then attend over them: (T, H*D) → (T, H*D).

    Prompt chunks attend with numpy/BLAS on keys gathered from the blocks: a numba parallel
    kernel between the BLAS matmuls would make the two thread pools fight over the cores
    (measured: 70-token prefill 2× slower).
    """
    out = np.empty_like(q)
    for seg in batch.segments:
        k_pool, v_pool, index, table = kv.pool_of(layer, seg.block_table, seg.window_table)
        store_kv(k_pool, v_pool, index, table, seg.start, k[seg.lo:seg.hi], v[seg.lo:seg.hi])
        keys, values = kv.gather(layer, seg.block_table, seg.start + seg.hi - seg.lo, seg.window_table)
        queries = q[seg.lo:seg.hi].reshape(seg.hi - seg.lo, -1, kv.shape.head_dim)
        out[seg.lo:seg.hi] = causal_attention(queries, keys, values, seg.start, scale, window, chunk)
    return out
