"""What every architecture shares: block hyper-parameters from GGUF metadata, packed weights
loaded by GGUF name, the layer matrices' named slots, and the row step's buffers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from shared.errors import ModelLoadError
from worker.engine.batch import RaggedBatch
from worker.engine.gguf_file import GGUFFile, TensorRef
from worker.engine.kernels.attention import store_kv
from worker.engine.kernels.packing import LAYOUT_ROWS, TILE, MatrixTable, TableArrays, pack
from worker.engine.kernels.registry import scratches
from worker.engine.layers import causal_attention
from worker.engine.paged_kv import PagedKVCache
from worker.engine.quants import dequantize

# Each layer's matrices (blk.N.<name>.weight), in the column order of PackedWeights.mats.
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
Q, K, V, O, GATE, UP, DOWN = range(len(LAYER_MATRICES))
# The matrices one matmul launch computes together; their outputs lie side by side, each padded
# to a whole tile (split_qkv, and gate | up in the FFN buffer).
QKV = slice(Q, V + 1)
ATTN_OUT = slice(O, O + 1)
GATE_UP = slice(GATE, UP + 1)
FFN_DOWN = slice(DOWN, DOWN + 1)


@dataclass(frozen=True)
class BlockHParams:
    """The shape every decoder block here shares (attention with GQA, a gated FFN, RMSNorm)."""
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    n_ctx_train: int
    rms_eps: float

    @staticmethod
    def fields_from_gguf(g: GGUFFile) -> dict:
        """BlockHParams' fields from `<arch>.*` metadata; ModelLoadError when heads do not group."""
        a = g.arch
        n_heads = int(g.require(f"{a}.attention.head_count"))
        n_kv_heads = int(g.get(f"{a}.attention.head_count_kv", n_heads))
        d_model = int(g.require(f"{a}.embedding_length"))
        if n_heads % n_kv_heads:
            raise ModelLoadError(f"{g.path}: {n_heads} heads not divisible by {n_kv_heads} KV heads")
        return dict(
            n_layers=int(g.require(f"{a}.block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=int(g.get(f"{a}.attention.key_length", d_model // n_heads)),
            d_ff=int(g.require(f"{a}.feed_forward_length")),
            vocab_size=int(g.get(f"{a}.vocab_size") or g.tensor("token_embd.weight").shape[0]),
            n_ctx_train=int(g.require(f"{a}.context_length")),
            rms_eps=float(g.require(f"{a}.attention.layer_norm_rms_epsilon")),
        )

    @property
    def q_rows(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_matrices(self) -> dict[str, tuple[int, int]]:
        """Shape (rows, inputs) of each LAYER_MATRICES entry."""
        d, q, kv, ff = self.d_model, self.q_rows, self.kv_rows, self.d_ff
        shapes = ((q, d), (kv, d), (kv, d), (d, q), (ff, d), (ff, d), (d, ff))
        return dict(zip(LAYER_MATRICES, shapes))


@dataclass(frozen=True)
class FileEmbedding:
    """A token embedding that is not also the output projection, read from the file's mapped bytes
    a step's rows at a time instead of packed: only the rows of tokens seen become resident.
    Packed, Qwen2.5-Coder-1.5B's 151,936 × 1,536 Q4_K embedding held 146 MB of a serving
    worker's memory for one row a token (RSS 2841 -> 2683 MB). Dequantizing a step's rows here
    costs 0.16 ms for a decode row and 19 ms for a 512-token prompt chunk (numpy, AMD Zen 3),
    against ~72 ms and 10-15 s for those steps."""
    tensor: TensorRef  # (vocab, row_bytes), memory-mapped

    def rows(self, tokens: np.ndarray) -> np.ndarray:
        """float32 (len(tokens), d_model), bit-identical to gguf.quants' dequantization."""
        return dequantize(self.tensor.raw[np.asarray(tokens, np.int64)], self.tensor.qtype)

    def fill(self, tokens: np.ndarray, x: np.ndarray) -> None:
        """x[b] = the embedding of tokens[b], for every row of tokens."""
        x[:len(tokens)] = self.rows(tokens)


@dataclass
class PackedWeights:
    """Matrices packed for the kernels plus float32 vectors; names follow the GGUF tensors."""
    table: MatrixTable
    mats: np.ndarray  # int64 (n_layers, len(LAYER_MATRICES)): table index of each layer matrix
    token_embd: int  # table index, (vocab, d_model); -1 when `embedding` reads it from the file
    output: int  # table index, (vocab, d_model); the same matrix as token_embd when tied
    vectors: dict[str, np.ndarray]  # per-layer vectors by GGUF suffix ("attn_norm"): float32 (n_layers, n)
    output_norm: np.ndarray  # float32 (d_model,)
    tensors: list[TensorRef]  # the GGUF tensor behind each table index (for the reference set)
    embedding: FileEmbedding | None = None  # an untied embedding, not in the table

    @property
    def tab(self) -> TableArrays:
        """The table's arrays as the kernels take them."""
        return self.table.arrays

    def embed(self, tokens: np.ndarray, matrix) -> np.ndarray:
        """The embedding rows of tokens, float32 (len(tokens), d_model); matrix(i) gives table
        matrix i dense (the reference set's dequantization), used when the embedding is packed."""
        if self.embedding is not None:
            return self.embedding.rows(tokens)
        return np.asarray(matrix(self.token_embd)[tokens], np.float32)


def vector(g: GGUFFile, name: str) -> np.ndarray:
    t = g.tensor(name)
    return dequantize(t.raw, t.qtype).reshape(-1)


def layer_vectors(g: GGUFFile, n_layers: int, name: str, kind: str = "weight") -> np.ndarray:
    """blk.N.<name>.<kind> of every layer: float32 (n_layers, n)."""
    return np.stack([vector(g, f"blk.{i}.{name}.{kind}") for i in range(n_layers)])


def load_packed(g: GGUFFile, hp: BlockHParams, vector_names: tuple[str, ...], progress=None,
                layout: int = LAYOUT_ROWS) -> PackedWeights:
    """Pack output (token_embd when tied; an untied one stays in the file, FileEmbedding) and every
    layer's LAYER_MATRICES, codes in `layout`; read the named per-layer vectors
    (blk.N.<name>.weight) and output_norm."""
    table = MatrixTable()
    tensors: list[TensorRef] = []

    def add(name: str, shape: tuple[int, int]) -> int:
        t = g.tensor(name)
        if t.shape != shape:
            raise ModelLoadError(f"{g.path}: tensor {name} has shape {t.shape}, expected {shape}")
        tensors.append(t)
        return table.add(pack(t.raw, t.qtype))

    if "output.weight" in g.tensors:  # untied: the embedding is only ever read a row per token
        embedding = FileEmbedding(g.tensor("token_embd.weight"))
        if embedding.tensor.shape != (hp.vocab_size, hp.d_model):
            raise ModelLoadError(f"{g.path}: tensor token_embd.weight has shape {embedding.tensor.shape}, "
                                 f"expected {(hp.vocab_size, hp.d_model)}")
        token_embd, output = -1, add("output.weight", (hp.vocab_size, hp.d_model))
    else:
        embedding = None
        token_embd = output = add("token_embd.weight", (hp.vocab_size, hp.d_model))
    shapes = hp.layer_matrices()
    mats = np.zeros((hp.n_layers, len(LAYER_MATRICES)), np.int64)
    for layer in range(hp.n_layers):
        for j, name in enumerate(LAYER_MATRICES):
            mats[layer, j] = add(f"blk.{layer}.{name}.weight", shapes[name])
        if progress:
            progress(layer + 1, hp.n_layers)
    table.finalize(layout)
    vectors = {name: layer_vectors(g, hp.n_layers, name) for name in vector_names}
    return PackedWeights(table, mats, token_embd, output, vectors, vector(g, "output_norm.weight"), tensors,
                         embedding)


def padded(n: int) -> int:
    return -(-n // TILE) * TILE


class StepRows(NamedTuple):
    """What one fused step computes: row b is tokens[b] at positions[b] of the sequence whose
    K/V blocks are block_tables[b] (prompt chunks and decode tokens alike)."""
    tokens: np.ndarray  # int64 (R,)
    positions: np.ndarray  # int64 (R,)
    block_tables: np.ndarray  # int32 (R, most blocks); padded with 0, never read
    logit_rows: np.ndarray  # int64 (L,): the rows whose logits the step returns, in order
    threads: int  # threads the step runs on (numba's setting of the calling thread): attention splits by it


class RowBuffers(NamedTuple):
    """BatchBuffers' arrays as one numba argument (llama2.c's RunState). Row b is the b-th token."""
    x: np.ndarray  # (rows, d_model) the residual stream
    h: np.ndarray  # (rows, d_model) normed hidden state: the matmuls' input
    qkv: np.ndarray  # (rows, padded(q_rows) + 2 * padded(kv_rows)): one QKV launch's output
    q: np.ndarray  # (rows, q_rows) roped queries, contiguous for attention
    k: np.ndarray  # (rows, kv_rows)
    v: np.ndarray  # (rows, kv_rows)
    att: np.ndarray  # (rows, q_rows) attention output
    proj: np.ndarray  # (rows, padded(d_model)) output of attn_output and ffn_down
    gu: np.ndarray  # (rows, 2 * padded(d_ff)) gate | up
    act: np.ndarray  # (rows, d_ff) gated activation
    logits: np.ndarray  # (logit_rows, padded(vocab))
    scratch: tuple  # registry.scratches: one per numerics (the matmul kernels' per-row sums)


class BatchBuffers:
    """Every activation the fused row step touches, for up to `rows` tokens.

    The arrays grow when a bigger step arrives (rarely: the scheduler's token budget caps it).
    Logits are kept for at most `logit_rows` rows (the vocabulary makes them the biggest buffer).
    """

    def __init__(self, d_model: int, q_rows: int, kv_rows: int, d_ff: int, vocab: int, rows: int = 1):
        self.dims = (d_model, q_rows, kv_rows, d_ff, vocab)
        self.rows = 0
        self.logit_rows = 0
        self.ensure(rows, rows)

    def ensure(self, rows: int, logit_rows: int) -> RowBuffers:
        """Buffers for a step of `rows` tokens returning `logit_rows` logits."""
        d_model, q_rows, kv_rows, d_ff, vocab = self.dims
        more_logits = logit_rows > self.logit_rows
        if more_logits:
            self.logit_rows = logit_rows
            self._logits = np.zeros((logit_rows, padded(vocab)), np.float32)
        if rows <= self.rows:
            if more_logits:
                self.arrays = self.arrays._replace(logits=self._logits)
            return self.arrays
        f32 = np.float32
        self.rows = rows
        qkv = np.zeros((rows, padded(q_rows) + 2 * padded(kv_rows)), f32)
        gu = np.zeros((rows, 2 * padded(d_ff)), f32)
        most_tiles = max(padded(vocab), qkv.shape[1], gu.shape[1]) // TILE
        # The matmul kernels' per-row sums; K is at most the widest matrix input.
        k_max = max(d_model, q_rows, d_ff)
        self.arrays = RowBuffers(
            x=np.zeros((rows, d_model), f32), h=np.zeros((rows, d_model), f32), qkv=qkv,
            q=np.zeros((rows, q_rows), f32), k=np.zeros((rows, kv_rows), f32), v=np.zeros((rows, kv_rows), f32),
            att=np.zeros((rows, q_rows), f32), proj=np.zeros((rows, padded(d_model)), f32), gu=gu,
            act=np.zeros((rows, d_ff), f32), logits=self._logits,
            scratch=scratches(most_tiles, rows, k_max))
        return self.arrays


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
