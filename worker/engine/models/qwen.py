"""Qwen 2 / 2.5 (`qwen2`: biases on Q, K, V) and Qwen 3 (`qwen3`: per-head RMSNorm on Q and K,
no biases). Otherwise the llama recipe — RMSNorm, GQA, SwiGLU — with NEOX-layout RoPE.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels.ops import attention_decode, dequant_row, rmsnorm, rope_halves
from worker.engine.kv_cache import KVCache
from worker.engine.layers import causal_attention, rms_norm, silu
from worker.engine.models.common import DecodeBuffers, load_packed, project, vector
from worker.engine.models.decode_parts import (add_into, head_norm, matvec, output_logits, split_qkv,
                                               store_kv, swiglu_ffn)
from worker.engine.models.llama import DOWN, GATE, K, O, Q, UP, V, LlamaHParams
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
        self.buffers = DecodeBuffers(hp.d_model, q_rows, kv_rows, hp.d_ff, hp.n_heads, n_ctx, hp.vocab_size)

    # ---------------------------------------------------------------- batched (BLAS)
    def forward(self, tokens: np.ndarray, start: int, kv: KVCache, dense, logits_of_last) -> np.ndarray:
        hp, w, vec, bias = self.hp, self.w, self.w.vectors, self.bias
        t = tokens.shape[0]
        x = dense(w.token_embd)[tokens].astype(np.float32)
        cos, sin = self.cos[start:start + t], self.sin[start:start + t]
        for layer in range(hp.n_layers):
            m = w.mats[layer]
            h = rms_norm(x, vec["attn_norm"][layer], hp.rms_eps)
            q = (h @ dense(m[Q]).T + bias["attn_q"][layer]).reshape(t, hp.n_heads, hp.head_dim)
            k = (h @ dense(m[K]).T + bias["attn_k"][layer]).reshape(t, hp.n_kv_heads, hp.head_dim)
            v = (h @ dense(m[V]).T + bias["attn_v"][layer]).reshape(t, hp.n_kv_heads, hp.head_dim)
            if self.qk_norm:
                q = rms_norm(q, vec["attn_q_norm"][layer], hp.rms_eps)
                k = rms_norm(k, vec["attn_k_norm"][layer], hp.rms_eps)
            q, k = apply_rope_halves(q, cos, sin), apply_rope_halves(k, cos, sin)
            kv.store(layer, start, k, v)
            a = causal_attention(q, kv.k[layer, :, :start + t], kv.v[layer, :, :start + t], start, self.scale)
            x = x + a @ dense(m[O]).T
            h = rms_norm(x, vec["ffn_norm"][layer], hp.rms_eps)
            x = x + (silu(h @ dense(m[GATE]).T) * (h @ dense(m[UP]).T)) @ dense(m[DOWN]).T
        h = rms_norm(x[-1:], w.output_norm, hp.rms_eps)[0]
        return logits_of_last(h)

    # ---------------------------------------------------------------- fused decode (numba)
    def decode_step(self, token: int, pos: int, kv: KVCache) -> np.ndarray:
        hp, w, b, t, vec = self.hp, self.w, self.buffers, self.w.table, self.w.vectors
        _qwen_decode(token, pos, (t.data, t.scales, t.scales16, t.meta), w.mats, w.token_embd, w.output,
                     vec["attn_norm"], vec["ffn_norm"], w.output_norm, self.bias["attn_q"], self.bias["attn_k"],
                     self.bias["attn_v"], self.qk_norm, vec["attn_q_norm"], vec["attn_k_norm"],
                     np.float32(hp.rms_eps), hp.n_heads, hp.n_kv_heads, hp.head_dim, self.cos[pos], self.sin[pos],
                     np.float32(self.scale), kv.k, kv.v,
                     b.x, b.h[:hp.d_model], b.qkv, b.att, b.proj, b.gu, b.act, b.scores, b.tiles, b.logits)
        return b.logits[:hp.vocab_size]

    def project(self, h: np.ndarray) -> np.ndarray:
        return project(self.w, self.buffers, h, self.hp.vocab_size)


@njit(cache=True, nogil=True)
def _qwen_decode(token, pos, tab, mats, token_embd, output, attn_norm, ffn_norm, output_norm,
                 q_bias, k_bias, v_bias, qk_norm, q_norm, k_norm, eps, n_heads, n_kv, head_dim,
                 cos, sin, scale, k_cache, v_cache, x, h, qkv, att, proj, gu, act, scores, tiles, logits):
    dequant_row(tab[0], tab[1], tab[2], tab[3][token_embd], token, x)
    for layer in range(mats.shape[0]):
        m = mats[layer]
        rmsnorm(x, attn_norm[layer], eps, h)
        matvec(tab, m[0:3], h, qkv, tiles)
        q, k, v = split_qkv(qkv, n_heads * head_dim, n_kv * head_dim)
        add_into(q, q_bias[layer])
        add_into(k, k_bias[layer])
        add_into(v, v_bias[layer])
        if qk_norm:
            head_norm(q, n_heads, head_dim, q_norm[layer], eps)
            head_norm(k, n_kv, head_dim, k_norm[layer], eps)
        rope_halves(q, n_heads, head_dim, cos, sin)
        rope_halves(k, n_kv, head_dim, cos, sin)
        store_kv(k_cache, v_cache, layer, pos, k, v, n_kv, head_dim)
        attention_decode(q, k_cache[layer], v_cache[layer], pos + 1, 0, scale, att, scores)
        matvec(tab, m[3:4], att, proj, tiles)
        add_into(x, proj)
        swiglu_ffn(tab, m, x, ffn_norm[layer], eps, h, gu, act, proj, tiles)
    output_logits(tab, output, x, output_norm, eps, h, logits, tiles)
