"""What every architecture shares: packed weights loaded by GGUF name, and decode buffers."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.errors import ModelLoadError
from worker.engine.gguf_file import GGUFFile, TensorRef
from worker.engine.kernels.matvec import linear
from worker.engine.kernels.packing import TILE, MatrixTable, pack
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


class DecodeBuffers:
    """Every activation a fused decode step touches, allocated once per model."""

    def __init__(self, d_model: int, q_rows: int, kv_rows: int, d_ff: int, n_heads: int, n_ctx: int, vocab: int):
        f32 = np.float32
        self.x = np.zeros(d_model, f32)
        self.h = np.zeros(max(d_model, q_rows), f32)
        self.qkv = np.zeros(padded(q_rows) + 2 * padded(kv_rows), f32)
        self.att = np.zeros(q_rows, f32)
        self.proj = np.zeros(padded(d_model), f32)
        self.gu = np.zeros(2 * padded(d_ff), f32)
        self.act = np.zeros(d_ff, f32)
        self.scores = np.zeros((n_heads, n_ctx), f32)
        self.logits = np.zeros(padded(vocab), f32)
        most_tiles = max(self.logits.shape[0], self.qkv.shape[0], self.gu.shape[0]) // TILE
        self.tiles = np.zeros((most_tiles, TILE), f32)  # per-tile group sums of matvec.linear


def project(w: PackedWeights, buffers: DecodeBuffers, h: np.ndarray, vocab: int) -> np.ndarray:
    """Final hidden state (d,) → logits through the packed output matrix (numba)."""
    t = w.table
    buffers.h[:h.shape[0]] = h
    linear(t.data, t.scales, t.scales16, t.meta, np.array([w.output]), buffers.h[:h.shape[0]], buffers.logits, buffers.tiles)
    return buffers.logits[:vocab]
