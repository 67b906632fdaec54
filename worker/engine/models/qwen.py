"""Qwen 2 / 2.5 (`qwen2`: biases on Q, K, V) and Qwen 3 (`qwen3`: per-head RMSNorm on Q and K,
no biases). Otherwise the llama recipe — RMSNorm, GQA, SwiGLU — with NEOX-layout RoPE.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from worker.engine.batch import RaggedBatch
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels.attention import paged_attention_decode
from worker.engine.kernels.ops import rope_halves
from worker.engine.layers import rms_norm, silu
from worker.engine.models.common import BatchBuffers, attend, load_packed, vector
from worker.engine.models.decode_parts import (add_into, add_rows, embed_rows, head_norm, matmul,
                                               output_logits_rows, rmsnorm_rows, split_qkv_rows, store_kv_rows,
                                               swiglu_ffn_rows)
from worker.engine.models.llama import DOWN, GATE, K, O, Q, UP, V, LlamaHParams
from worker.engine.paged_kv import PagedKVCache
from worker.engine.rope import apply_rope_halves, rope_tables


class Qwen:
    def __init__(self, g: GGUFFile, n_ctx: int, progress=None):
        self.hp = hp = LlamaHParams.from_gguf(g)
        self.qk_norm = "blk.0.attn_q_norm.weight" in g.tensors  # qwen3
        self.qkv_bias = "blk.0.attn_q.bias" in g.tensors  # qwen2
        vectors = ("attn_norm", "ffn_norm") + (("attn_q_norm", "attn_k_norm") if self.qk_norm else ())
        self.w = load_packed(g, hp.n_layers, hp.vocab_size, hp.d_model, hp.layer_matrices(), vectors, progress)
        q_rows, kv_rows = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
        if self.qkv_bias:
            self.bias = {name: np.stack([vector(g, f"blk.{i}.{name}.bias") for i in range(hp.n_layers)])
                         for name in ("attn_q", "attn_k", "attn_v")}
        else:
            self.bias = {"attn_q": np.zeros((hp.n_layers, q_rows), np.float32),
                         "attn_k": np.zeros((hp.n_layers, kv_rows), np.float32),
                         "attn_v": np.zeros((hp.n_layers, kv_rows), np.float32)}
        if not self.qk_norm:  # the decode step takes the arrays either way; ones are a no-op scale
            self.w.vectors["attn_q_norm"] = np.ones((hp.n_layers, hp.head_dim), np.float32)
            self.w.vectors["attn_k_norm"] = np.ones((hp.n_layers, hp.head_dim), np.float32)
        self.cos, self.sin = rope_tables(n_ctx, hp.head_dim, hp.rope_base)
        self.scale = 1.0 / np.sqrt(hp.head_dim)
        self.buffers = BatchBuffers(hp.d_model, q_rows, kv_rows, hp.d_ff, hp.vocab_size)

    # ---------------------------------------------------------------- ragged batch (BLAS, reference set)
    def forward(self, batch: RaggedBatch, kv: PagedKVCache, dense, logits_of_rows, attention_chunk: int) -> np.ndarray:
        hp, w, vec, bias = self.hp, self.w, self.w.vectors, self.bias
        t = batch.num_tokens
        x = dense(w.token_embd)[batch.tokens].astype(np.float32)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        for layer in range(hp.n_layers):
            m = w.mats[layer]
            h = rms_norm(x, vec["attn_norm"][layer], hp.rms_eps)
            q = (h @ dense(m[Q]).T + bias["attn_q"][layer]).reshape(t, hp.n_heads, hp.head_dim)
            k = (h @ dense(m[K]).T + bias["attn_k"][layer]).reshape(t, hp.n_kv_heads, hp.head_dim)
            v = h @ dense(m[V]).T + bias["attn_v"][layer]
            if self.qk_norm:
                q = rms_norm(q, vec["attn_q_norm"][layer], hp.rms_eps)
                k = rms_norm(k, vec["attn_k_norm"][layer], hp.rms_eps)
            q, k = apply_rope_halves(q, cos, sin), apply_rope_halves(k, cos, sin)
            a = attend(kv, layer, batch, q.reshape(t, -1), k.reshape(t, -1), v, self.scale, 0, attention_chunk)
            x = x + a @ dense(m[O]).T
            h = rms_norm(x, vec["ffn_norm"][layer], hp.rms_eps)
            x = x + (silu(h @ dense(m[GATE]).T) * (h @ dense(m[UP]).T)) @ dense(m[DOWN]).T
        return logits_of_rows(rms_norm(x[batch.logit_rows], w.output_norm, hp.rms_eps))

    # ---------------------------------------------------------------- fused rows (numba)
    def forward_rows(self, tokens: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
                     logit_rows: np.ndarray, kv: PagedKVCache, attention_chunk: int) -> np.ndarray:
        hp, w, b, t, vec = self.hp, self.w, self.buffers, self.w.table, self.w.vectors
        rows = tokens.shape[0]
        b.ensure(rows, logit_rows.shape[0])
        _qwen_rows(tokens, positions, block_tables, logit_rows, (t.data, t.scales, t.scales16, t.meta), w.mats,
                     w.token_embd, w.output, vec["attn_norm"], vec["ffn_norm"], w.output_norm, self.bias["attn_q"],
                     self.bias["attn_k"], self.bias["attn_v"], self.qk_norm, vec["attn_q_norm"], vec["attn_k_norm"],
                     np.float32(hp.rms_eps), hp.n_heads, hp.n_kv_heads, hp.head_dim, self.cos, self.sin,
                     np.float32(self.scale), kv.k, kv.v, attention_chunk,
                     b.x, b.h, b.qkv, b.q, b.k, b.v, b.att, b.proj, b.gu, b.act, b.scratch, b.logits)
        return b.logits[:logit_rows.shape[0], :hp.vocab_size]


@njit(cache=True, nogil=True)
def _qwen_rows(tokens, positions, block_tables, logit_rows, tab, mats, token_embd, output, attn_norm, ffn_norm, output_norm,
                 q_bias, k_bias, v_bias, qk_norm, q_norm, k_norm, eps, n_heads, n_kv, head_dim,
                 cos, sin, scale, k_pool, v_pool, chunk, x, h, qkv, q, k, v, att, proj, gu, act, scratch,
                 logits):
    rows = tokens.shape[0]
    embed_rows(tab, token_embd, tokens, x)
    for layer in range(mats.shape[0]):
        m = mats[layer]
        rmsnorm_rows(x, attn_norm[layer], eps, h, rows)
        matmul(tab, m[0:3], h[:rows], qkv[:rows], scratch)
        split_qkv_rows(qkv, q, k, v, rows)
        for b in range(rows):
            add_into(q[b], q_bias[layer])
            add_into(k[b], k_bias[layer])
            add_into(v[b], v_bias[layer])
            if qk_norm:
                head_norm(q[b], n_heads, head_dim, q_norm[layer], eps)
                head_norm(k[b], n_kv, head_dim, k_norm[layer], eps)
            rope_halves(q[b], n_heads, head_dim, cos[positions[b]], sin[positions[b]])
            rope_halves(k[b], n_kv, head_dim, cos[positions[b]], sin[positions[b]])
        store_kv_rows(k_pool, v_pool, layer, block_tables, positions, k, v, rows)
        paged_attention_decode(q[:rows], k_pool, v_pool, layer, block_tables, positions, 0, scale, chunk, att[:rows])
        matmul(tab, m[3:4], att[:rows], proj[:rows], scratch)
        add_rows(x, proj, rows)
        swiglu_ffn_rows(tab, m, x, ffn_norm[layer], eps, h, gu, act, proj, scratch, rows)
    output_logits_rows(tab, output, x, output_norm, eps, h, logits, scratch, logit_rows)
