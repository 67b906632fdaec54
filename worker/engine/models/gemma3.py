"""Gemma 3: scaled embeddings, QK-norm, pre- and post-norms, GELU-gated FFN, and interleaved
local (sliding-window) and global attention layers with their own RoPE bases.

Two metadata facts are absent from the published GGUF files and are fixed by llama.cpp for
this architecture; they are used only when the file does not say otherwise:
every 6th layer is global (the others local), and local layers use RoPE base 10,000.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from shared.errors import ModelLoadError
from worker.engine.batch import RaggedBatch
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels.attention import paged_attention_decode
from worker.engine.kernels.ops import gelu_tanh_mul, rmsnorm, rope_halves
from worker.engine.layers import gelu_tanh, rms_norm
from worker.engine.models.common import BatchBuffers, attend, load_packed
from worker.engine.models.decode_parts import (add_rows, embed_rows, head_norm, matmul, output_logits_rows, padded,
                                               rmsnorm_rows, split_qkv_rows, store_kv_rows)
from worker.engine.paged_kv import PagedKVCache
from worker.engine.rope import apply_rope_halves, rope_tables

Q, K, V, O, GATE, UP, DOWN = range(7)
DEFAULT_SWA_PATTERN = 6  # llama.cpp's fixed value for gemma3: layers 5, 11, 17… are global
DEFAULT_LOCAL_ROPE_BASE = 10000.0
LAYER_VECTORS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")


@dataclass(frozen=True)
class Gemma3HParams:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    n_ctx_train: int
    rope_base_global: float
    rope_base_local: float
    rope_scale_global: float  # positions are divided by this on global layers (linear scaling)
    sliding_window: int
    swa_pattern: int
    rms_eps: float

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Gemma3HParams":
        a = g.arch
        n_heads = int(g.require(f"{a}.attention.head_count"))
        scale = 1.0
        if g.get(f"{a}.rope.scaling.type") == "linear":
            scale = float(g.get(f"{a}.rope.scaling.factor", 1.0))
        hp = cls(
            n_layers=int(g.require(f"{a}.block_count")),
            d_model=int(g.require(f"{a}.embedding_length")),
            n_heads=n_heads,
            n_kv_heads=int(g.get(f"{a}.attention.head_count_kv", n_heads)),
            head_dim=int(g.require(f"{a}.attention.key_length")),
            d_ff=int(g.require(f"{a}.feed_forward_length")),
            vocab_size=int(g.get(f"{a}.vocab_size") or g.tensor("token_embd.weight").shape[0]),
            n_ctx_train=int(g.require(f"{a}.context_length")),
            rope_base_global=float(g.get(f"{a}.rope.freq_base", 1000000.0)),
            rope_base_local=float(g.get(f"{a}.rope.freq_base_swa", DEFAULT_LOCAL_ROPE_BASE)),
            rope_scale_global=scale,
            sliding_window=int(g.require(f"{a}.attention.sliding_window")),
            swa_pattern=int(g.get(f"{a}.attention.sliding_window_pattern", DEFAULT_SWA_PATTERN)),
            rms_eps=float(g.require(f"{a}.attention.layer_norm_rms_epsilon")),
        )
        if hp.n_heads % hp.n_kv_heads:
            raise ModelLoadError(f"{g.path}: {hp.n_heads} heads not divisible by {hp.n_kv_heads} KV heads")
        return hp

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.swa_pattern == 0

    def layer_matrices(self) -> dict[str, tuple[int, int]]:
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {"attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
                "ffn_gate": (self.d_ff, d), "ffn_up": (self.d_ff, d), "ffn_down": (d, self.d_ff)}


class Gemma3:
    def __init__(self, g: GGUFFile, n_ctx: int, progress=None):
        self.hp = hp = Gemma3HParams.from_gguf(g)
        self.w = load_packed(g, hp.n_layers, hp.vocab_size, hp.d_model, hp.layer_matrices(), LAYER_VECTORS, progress)
        positions_global = np.arange(n_ctx) / hp.rope_scale_global
        self.rope_local = rope_tables(n_ctx, hp.head_dim, hp.rope_base_local)
        self.rope_global = rope_tables(n_ctx, hp.head_dim, hp.rope_base_global, positions=positions_global)
        self.is_global = np.array([hp.is_global(i) for i in range(hp.n_layers)])
        self.scale = 1.0 / np.sqrt(hp.head_dim)
        self.embed_scale = np.float32(np.sqrt(hp.d_model))
        self.buffers = BatchBuffers(hp.d_model, hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim,
                                    hp.d_ff, hp.vocab_size)

    def window(self, layer: int) -> int:
        return 0 if self.is_global[layer] else self.hp.sliding_window

    def window_layers(self) -> tuple[tuple[int, ...], int]:
        """The layers that attend only the last `tokens` keys, and that window (for the KV pools)."""
        return tuple(i for i in range(self.hp.n_layers) if not self.is_global[i]), self.hp.sliding_window

    # ---------------------------------------------------------------- ragged batch (BLAS, reference set)
    def forward(self, batch: RaggedBatch, kv: PagedKVCache, dense, logits_of_rows, attention_chunk: int) -> np.ndarray:
        hp, w, vec = self.hp, self.w, self.w.vectors
        t = batch.num_tokens
        x = dense(w.token_embd)[batch.tokens].astype(np.float32) * self.embed_scale
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
                     logit_rows: np.ndarray, kv: PagedKVCache, attention_chunk: int,
                     window_tables: np.ndarray | None = None) -> np.ndarray:
        """window_tables: each row's window slots, when kv keeps the local layers in a window pool."""
        hp, w, b, t, vec = self.hp, self.w, self.buffers, self.w.table, self.w.vectors
        if window_tables is None:
            if kv.window is not None:
                raise ValueError("the local layers live in window slots: give window_tables")
            window_tables = block_tables
        rows = tokens.shape[0]
        b.ensure(rows, logit_rows.shape[0])
        _gemma3_rows(tokens, positions, block_tables, logit_rows, (t.data, t.scales, t.scales16, t.meta), w.mats,
                       w.token_embd, w.output, vec["attn_norm"], vec["attn_q_norm"], vec["attn_k_norm"],
                       vec["post_attention_norm"], vec["ffn_norm"], vec["post_ffw_norm"], w.output_norm,
                       np.float32(hp.rms_eps), self.embed_scale, hp.n_heads, hp.n_kv_heads, hp.head_dim,
                       self.is_global, hp.sliding_window, self.rope_local[0], self.rope_local[1],
                       self.rope_global[0], self.rope_global[1], np.float32(self.scale), kv.k, kv.v,
                       kv.k_window, kv.v_window, kv.in_window, kv.pool_layer, window_tables, attention_chunk,
                       b.x, b.h, b.qkv, b.q, b.k, b.v, b.att, b.proj, b.gu, b.act, b.scratch, b.logits)
        return b.logits[:logit_rows.shape[0], :hp.vocab_size]


@njit(cache=True, nogil=True)
def _gemma3_rows(tokens, positions, block_tables, logit_rows, tab, mats, token_embd, output,
                   attn_norm, q_norm, k_norm, post_attn_norm, ffn_norm, post_ffw_norm, output_norm, eps,
                   embed_scale, n_heads, n_kv, head_dim, is_global, window, cos_local, sin_local,
                   cos_global, sin_global, scale, k_pool, v_pool, k_window, v_window, in_window, pool_layer,
                   window_tables, chunk,
                   x, h, qkv, q, k, v, att, proj, gu, act, scratch, logits):
    rows = tokens.shape[0]
    d = x.shape[1]
    ff = act.shape[1]
    embed_rows(tab, token_embd, tokens, x)
    for b in range(rows):
        for i in range(d):
            x[b, i] *= embed_scale
    for layer in range(mats.shape[0]):
        m = mats[layer]
        rmsnorm_rows(x, attn_norm[layer], eps, h, rows)
        matmul(tab, m[0:3], h[:rows], qkv[:rows], scratch)
        split_qkv_rows(qkv, q, k, v, rows)
        for b in range(rows):
            head_norm(q[b], n_heads, head_dim, q_norm[layer], eps)
            head_norm(k[b], n_kv, head_dim, k_norm[layer], eps)
            pos = positions[b]
            if is_global[layer]:
                cos, sin = cos_global[pos], sin_global[pos]
            else:
                cos, sin = cos_local[pos], sin_local[pos]
            rope_halves(q[b], n_heads, head_dim, cos, sin)
            rope_halves(k[b], n_kv, head_dim, cos, sin)
        layer_window = 0 if is_global[layer] else window
        if in_window[layer]:  # a local layer whose K/V live in the window pool's slots
            kp, vp, tables = k_window, v_window, window_tables
        else:
            kp, vp, tables = k_pool, v_pool, block_tables
        store_kv_rows(kp, vp, pool_layer[layer], tables, positions, k, v, rows)
        paged_attention_decode(q[:rows], kp, vp, pool_layer[layer], tables, positions, layer_window, scale, chunk,
                               att[:rows])
        matmul(tab, m[3:4], att[:rows], proj[:rows], scratch)
        for b in range(rows):
            rmsnorm(proj[b, :d], post_attn_norm[layer], eps, proj[b, :d])
        add_rows(x, proj, rows)
        rmsnorm_rows(x, ffn_norm[layer], eps, h, rows)
        matmul(tab, m[4:6], h[:rows], gu[:rows], scratch)
        for b in range(rows):
            gelu_tanh_mul(gu[b, :ff], gu[b, padded(ff):padded(ff) + ff], act[b])
        matmul(tab, m[6:7], act[:rows], proj[:rows], scratch)
        for b in range(rows):
            rmsnorm(proj[b, :d], post_ffw_norm[layer], eps, proj[b, :d])
        add_rows(x, proj, rows)
    output_logits_rows(tab, output, x, output_norm, eps, h, logits, scratch, logit_rows)
