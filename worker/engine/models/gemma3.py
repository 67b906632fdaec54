"""Gemma 3: scaled embeddings, QK-norm, pre- and post-norms, GELU-gated FFN, and interleaved
local (sliding-window) and global attention layers with their own RoPE bases.

Two metadata facts are absent from the published GGUF files and are fixed by llama.cpp for
this architecture; they are used only when the file does not say otherwise:
every 6th layer is global (the others local), and local layers use RoPE base 10,000.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numba import get_num_threads, njit

from worker.engine.batch import RaggedBatch
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels.attention import AttentionParams, KVLayer
from worker.engine.kernels.ops import gelu_tanh_mul, rmsnorm
from worker.engine.kernels.packing import LAYOUT_ROWS, TableArrays
from worker.engine.layers import gelu_tanh, rms_norm
from worker.engine.models.common import (ATTN_OUT, DOWN, FFN_DOWN, GATE, GATE_UP, K, O, Q, UP, V, BatchBuffers,
                                         BlockHParams, StepRows, attend, load_packed)
from worker.engine.models.decode_parts import (add_rows, attention_rows, embed_rows, head_norm_rows, matmul,
                                               output_logits_rows, padded, qkv_rows, rmsnorm_rows, rope_rows)
from worker.engine.paged_kv import PagedKVCache
from worker.engine.rope import apply_rope_halves, rope_tables

DEFAULT_SWA_PATTERN = 6  # llama.cpp's fixed value for gemma3: layers 5, 11, 17… are global
DEFAULT_LOCAL_ROPE_BASE = 10000.0
LAYER_VECTORS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")


@dataclass(frozen=True)
class Gemma3HParams(BlockHParams):
    rope_base_global: float
    rope_base_local: float
    rope_scale_global: float  # positions are divided by this on global layers (linear scaling)
    sliding_window: int
    swa_pattern: int

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Gemma3HParams":
        a = g.arch
        g.require(f"{a}.attention.key_length")  # head_dim != d_model / n_heads in every Gemma 3
        scale = 1.0
        if g.get(f"{a}.rope.scaling.type") == "linear":
            scale = float(g.get(f"{a}.rope.scaling.factor", 1.0))
        return cls(**BlockHParams.fields_from_gguf(g),
                   rope_base_global=float(g.get(f"{a}.rope.freq_base", 1000000.0)),
                   rope_base_local=float(g.get(f"{a}.rope.freq_base_swa", DEFAULT_LOCAL_ROPE_BASE)),
                   rope_scale_global=scale,
                   sliding_window=int(g.require(f"{a}.attention.sliding_window")),
                   swa_pattern=int(g.get(f"{a}.attention.sliding_window_pattern", DEFAULT_SWA_PATTERN)))

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.swa_pattern == 0


class Gemma3Weights(NamedTuple):
    """The weights as the numba step takes them; per-layer vectors are (n_layers, n) float32."""
    tab: TableArrays  # PackedWeights.tab: the packed matrices
    mats: np.ndarray  # int64 (n_layers, 7): table index of each LAYER_MATRICES entry
    token_embd: int
    output: int
    attn_norm: np.ndarray  # (n_layers, d_model)
    q_norm: np.ndarray  # (n_layers, head_dim)
    k_norm: np.ndarray  # (n_layers, head_dim)
    post_attn_norm: np.ndarray  # (n_layers, d_model)
    ffn_norm: np.ndarray  # (n_layers, d_model)
    post_ffw_norm: np.ndarray  # (n_layers, d_model)
    output_norm: np.ndarray  # (d_model,)
    cos_local: np.ndarray  # (n_ctx, head_dim / 2) RoPE tables of the local layers
    sin_local: np.ndarray
    cos_global: np.ndarray  # the global layers' (their own base and scaling)
    sin_global: np.ndarray


class Gemma3StepConfig(NamedTuple):
    """The hyper-parameters the numba step reads."""
    eps: np.float32
    embed_scale: np.float32  # sqrt(d_model)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: np.float32  # 1 / sqrt(head_dim)
    is_global: np.ndarray  # bool (n_layers,)
    sliding_window: int  # keys a local layer's query sees


class KVPools(NamedTuple):
    """The paged KV cache's arrays, and where each layer's K/V live (paged_kv)."""
    k: np.ndarray  # the main pool
    v: np.ndarray
    k_window: np.ndarray  # the window pool of the local layers, when kv bounds them
    v_window: np.ndarray
    in_window: np.ndarray  # bool (n_layers,): the layer's K/V live in the window pool
    pool_layer: np.ndarray  # int (n_layers,): the layer's index inside its pool
    window_tables: np.ndarray  # int32 (R, blocks): each row's window slots (block_tables without a window pool)


class Gemma3:
    def __init__(self, g: GGUFFile, n_ctx: int, progress=None, layout: int = LAYOUT_ROWS):
        self.hp = hp = Gemma3HParams.from_gguf(g)
        self.w = w = load_packed(g, hp, LAYER_VECTORS, progress, layout)
        positions_global = np.arange(n_ctx) / hp.rope_scale_global
        self.rope_local = rope_tables(n_ctx, hp.head_dim, hp.rope_base_local)
        self.rope_global = rope_tables(n_ctx, hp.head_dim, hp.rope_base_global, positions=positions_global)
        self.is_global = np.array([hp.is_global(i) for i in range(hp.n_layers)])
        self.scale = 1.0 / np.sqrt(hp.head_dim)
        self.embed_scale = np.float32(np.sqrt(hp.d_model))
        self.buffers = BatchBuffers(hp.d_model, hp.q_rows, hp.kv_rows, hp.d_ff, hp.vocab_size)
        vec = w.vectors
        self.step_weights = Gemma3Weights(
            w.tab, w.mats, w.token_embd, w.output, vec["attn_norm"], vec["attn_q_norm"], vec["attn_k_norm"],
            vec["post_attention_norm"], vec["ffn_norm"], vec["post_ffw_norm"], w.output_norm,
            self.rope_local[0], self.rope_local[1], self.rope_global[0], self.rope_global[1])
        self.step_config = Gemma3StepConfig(np.float32(hp.rms_eps), self.embed_scale, hp.n_heads, hp.n_kv_heads,
                                            hp.head_dim, np.float32(self.scale), self.is_global, hp.sliding_window)

    def window(self, layer: int) -> int:
        return 0 if self.is_global[layer] else self.hp.sliding_window

    def window_layers(self) -> tuple[tuple[int, ...], int]:
        """The layers that attend only the last `tokens` keys, and that window (for the KV pools)."""
        return tuple(i for i in range(self.hp.n_layers) if not self.is_global[i]), self.hp.sliding_window

    # ---------------------------------------------------------------- ragged batch (BLAS, reference set)
    def forward(self, batch: RaggedBatch, kv: PagedKVCache, dense, logits_of_rows, attention_chunk: int) -> np.ndarray:
        hp, w, vec = self.hp, self.w, self.w.vectors
        t = batch.num_tokens
        x = w.embed(batch.tokens, dense) * self.embed_scale
        for layer in range(hp.n_layers):
            m = w.mats[layer]
            cos, sin = self.rope_global if self.is_global[layer] else self.rope_local
            cos, sin = cos[batch.positions], sin[batch.positions]
            h = rms_norm(x, vec["attn_norm"][layer], hp.rms_eps)
            q = (h @ dense(m[Q]).T).reshape(t, hp.n_heads, hp.head_dim)
            k = (h @ dense(m[K]).T).reshape(t, hp.n_kv_heads, hp.head_dim)
            v = h @ dense(m[V]).T
            q = apply_rope_halves(rms_norm(q, vec["attn_q_norm"][layer], hp.rms_eps), cos, sin)
            k = apply_rope_halves(rms_norm(k, vec["attn_k_norm"][layer], hp.rms_eps), cos, sin)
            a = attend(kv, layer, batch, q.reshape(t, -1), k.reshape(t, -1), v, self.scale, self.window(layer),
                       attention_chunk)
            x = x + rms_norm(a @ dense(m[O]).T, vec["post_attention_norm"][layer], hp.rms_eps)
            h = rms_norm(x, vec["ffn_norm"][layer], hp.rms_eps)
            f = (gelu_tanh(h @ dense(m[GATE]).T) * (h @ dense(m[UP]).T)) @ dense(m[DOWN]).T
            x = x + rms_norm(f, vec["post_ffw_norm"][layer], hp.rms_eps)
        return logits_of_rows(rms_norm(x[batch.logit_rows], w.output_norm, hp.rms_eps))

    # ---------------------------------------------------------------- fused rows (numba)
    def forward_rows(self, tokens: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
                     logit_rows: np.ndarray, kv: PagedKVCache, attention_chunk: int, ops: np.ndarray,
                     window_tables: np.ndarray | None = None) -> np.ndarray:
        """ops: the op table's codes (registry.OpTable.codes); window_tables: each row's window
        slots, when kv keeps the local layers in a window pool."""
        if window_tables is None:
            if kv.window is not None:
                raise ValueError("the local layers live in window slots: give window_tables")
            window_tables = block_tables
        buf = self.buffers.ensure(tokens.shape[0], logit_rows.shape[0])
        pools = KVPools(kv.k, kv.v, kv.k_window, kv.v_window, kv.in_window, kv.pool_layer, window_tables)
        if self.w.embedding is not None:
            self.w.embedding.fill(tokens, buf.x)
        _gemma3_rows(StepRows(tokens, positions, block_tables, logit_rows, get_num_threads()), self.step_weights, self.step_config,
                     pools, attention_chunk, ops, buf)
        return buf.logits[:logit_rows.shape[0], :self.hp.vocab_size]


@njit(cache=True, nogil=True)
def _gemma3_rows(step, w, hp, kv, chunk, ops, buf):
    """embed × sqrt(d) → per layer (norm, qkv, QK-norm, rope, attention, post-norm, residual,
    norm, GELU ffn, post-norm, residual) → norm → logits, every row."""
    rows = step.tokens.shape[0]
    d = buf.x.shape[1]
    ff = buf.act.shape[1]
    mm = (w.tab, ops, buf.scratch)
    if w.token_embd >= 0:  # else forward_rows filled buf.x from the file (FileEmbedding)
        embed_rows(mm, w.token_embd, step.tokens, buf.x)
    for b in range(rows):
        for i in range(d):
            buf.x[b, i] *= hp.embed_scale
    for layer in range(w.mats.shape[0]):
        m = w.mats[layer]
        rmsnorm_rows(buf.x, w.attn_norm[layer], hp.eps, buf.h, rows)
        qkv_rows(mm, m, buf, rows)
        head_norm_rows(buf, hp.n_heads, hp.n_kv_heads, hp.head_dim, w.q_norm[layer], w.k_norm[layer], hp.eps, rows)
        if hp.is_global[layer]:
            rope_rows(buf, step.positions, w.cos_global, w.sin_global, hp.n_heads, hp.n_kv_heads, hp.head_dim,
                      True, rows)
        else:
            rope_rows(buf, step.positions, w.cos_local, w.sin_local, hp.n_heads, hp.n_kv_heads, hp.head_dim,
                      True, rows)
        params = AttentionParams(0 if hp.is_global[layer] else hp.sliding_window, hp.scale, chunk, step.threads)
        if kv.in_window[layer]:  # a local layer whose K/V live in the window pool's slots
            attention_rows(mm, buf, KVLayer(kv.k_window, kv.v_window, kv.pool_layer[layer]), kv.window_tables,
                           step.positions, params, rows)
        else:
            attention_rows(mm, buf, KVLayer(kv.k, kv.v, kv.pool_layer[layer]), step.block_tables, step.positions,
                           params, rows)
        matmul(mm, m[ATTN_OUT], buf.att[:rows], buf.proj[:rows])
        for b in range(rows):
            rmsnorm(buf.proj[b, :d], w.post_attn_norm[layer], hp.eps, buf.proj[b, :d])
        add_rows(buf.x, buf.proj, rows)
        rmsnorm_rows(buf.x, w.ffn_norm[layer], hp.eps, buf.h, rows)
        matmul(mm, m[GATE_UP], buf.h[:rows], buf.gu[:rows])
        for b in range(rows):
            gelu_tanh_mul(buf.gu[b, :ff], buf.gu[b, padded(ff):padded(ff) + ff], buf.act[b])
        matmul(mm, m[FFN_DOWN], buf.act[:rows], buf.proj[:rows])
        for b in range(rows):
            rmsnorm(buf.proj[b, :d], w.post_ffw_norm[layer], hp.eps, buf.proj[b, :d])
        add_rows(buf.x, buf.proj, rows)
    output_logits_rows(mm, w.output, w.output_norm, hp.eps, buf, step.logit_rows)
