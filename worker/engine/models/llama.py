"""The llama architecture (Llama 2/3, SmolLM2, TinyLlama…): RMSNorm, RoPE, GQA, SwiGLU.

Two forwards over the same weights:
  `forward`      T tokens at once with float32 matmuls on BLAS (prefill, and the reference set);
  `decode_step`  one token through every layer inside a single numba call (the fast decode path:
                 per-call Python dispatch would otherwise cost more than the math).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from shared.errors import ModelLoadError
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels.ops import attention_decode, dequant_row, rmsnorm, rope_pairs
from worker.engine.kv_cache import KVCache
from worker.engine.layers import causal_attention, rms_norm, silu
from worker.engine.models.common import DecodeBuffers, load_packed, project, vector
from worker.engine.models.decode_parts import add_into, matvec, output_logits, split_qkv, store_kv, swiglu_ffn
from worker.engine.rope import apply_rope_pairs, rope_tables

# Per-layer matrices, in the column order of PackedWeights.mats.
Q, K, V, O, GATE, UP, DOWN = range(7)


@dataclass(frozen=True)
class LlamaHParams:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    n_ctx_train: int
    rope_base: float
    rope_linear_factor: float  # positions are divided by this ("linear" rope scaling); 1 = none
    rms_eps: float

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "LlamaHParams":
        a = g.arch
        n_heads = int(g.require(f"{a}.attention.head_count"))
        d_model = int(g.require(f"{a}.embedding_length"))
        vocab = g.get(f"{a}.vocab_size") or g.tensor("token_embd.weight").shape[0]
        hp = cls(
            n_layers=int(g.require(f"{a}.block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(g.get(f"{a}.attention.head_count_kv", n_heads)),
            head_dim=int(g.get(f"{a}.attention.key_length", d_model // n_heads)),
            d_ff=int(g.require(f"{a}.feed_forward_length")),
            vocab_size=int(vocab),
            n_ctx_train=int(g.require(f"{a}.context_length")),
            rope_base=float(g.get(f"{a}.rope.freq_base", 10000.0)),
            rope_linear_factor=_linear_rope_factor(g),
            rms_eps=float(g.require(f"{a}.attention.layer_norm_rms_epsilon")),
        )
        rope_dim = g.get(f"{a}.rope.dimension_count")
        if rope_dim is not None and int(rope_dim) != hp.head_dim:
            raise ModelLoadError(f"{g.path}: partial rotary embeddings (rope.dimension_count {rope_dim} < "
                                 f"head dim {hp.head_dim}) are not supported")
        if hp.n_heads % hp.n_kv_heads:
            raise ModelLoadError(f"{g.path}: {hp.n_heads} heads not divisible by {hp.n_kv_heads} KV heads")
        return hp

    def layer_matrices(self) -> dict[str, tuple[int, int]]:
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {"attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
                "ffn_gate": (self.d_ff, d), "ffn_up": (self.d_ff, d), "ffn_down": (d, self.d_ff)}


def _linear_rope_factor(g: GGUFFile) -> float:
    kind = g.get(f"{g.arch}.rope.scaling.type")
    if kind in (None, "none"):
        return 1.0
    if kind == "linear":
        return float(g.get(f"{g.arch}.rope.scaling.factor", 1.0))
    raise ModelLoadError(f"{g.path}: rope scaling type '{kind}' is not supported (supported: linear, "
                         f"and Llama 3 frequency factors in rope_freqs.weight)")


class Llama:
    def __init__(self, g: GGUFFile, n_ctx: int, progress=None):
        self.hp = hp = LlamaHParams.from_gguf(g)
        self.w = load_packed(g, hp.n_layers, hp.vocab_size, hp.d_model, hp.layer_matrices(),
                             ("attn_norm", "ffn_norm"), progress)
        # Llama 3.1+ files carry per-frequency divisors (the "llama3" rope scaling) as a tensor.
        freq_factors = vector(g, "rope_freqs.weight") if "rope_freqs.weight" in g.tensors else None
        self.cos, self.sin = rope_tables(n_ctx, hp.head_dim, hp.rope_base, freq_factors,
                                         positions=np.arange(n_ctx) / hp.rope_linear_factor)
        self.scale = 1.0 / np.sqrt(hp.head_dim)
        self.buffers = DecodeBuffers(hp.d_model, hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim,
                                     hp.d_ff, hp.n_heads, n_ctx, hp.vocab_size)

    # ---------------------------------------------------------------- batched (BLAS)
    def forward(self, tokens: np.ndarray, start: int, kv: KVCache, dense, logits_of_last) -> np.ndarray:
        """Run T tokens at positions start.. through the model; return logits of the last one.

        dense(i) gives table matrix i as float32 (n, K); logits_of_last(h) projects the final
        normed hidden state (d,) to the vocabulary.
        """
        hp, w = self.hp, self.w
        t = tokens.shape[0]
        x = dense(w.token_embd)[tokens].astype(np.float32)  # (T, d)
        cos, sin = self.cos[start:start + t], self.sin[start:start + t]
        for layer in range(hp.n_layers):
            m = w.mats[layer]
            h = rms_norm(x, w.vectors["attn_norm"][layer], hp.rms_eps)
            q = (h @ dense(m[Q]).T).reshape(t, hp.n_heads, hp.head_dim)
            k = (h @ dense(m[K]).T).reshape(t, hp.n_kv_heads, hp.head_dim)
            v = (h @ dense(m[V]).T).reshape(t, hp.n_kv_heads, hp.head_dim)
            q, k = apply_rope_pairs(q, cos, sin), apply_rope_pairs(k, cos, sin)
            kv.store(layer, start, k, v)
            a = causal_attention(q, kv.k[layer, :, :start + t], kv.v[layer, :, :start + t], start, self.scale)
            x = x + a @ dense(m[O]).T
            h = rms_norm(x, w.vectors["ffn_norm"][layer], hp.rms_eps)
            x = x + (silu(h @ dense(m[GATE]).T) * (h @ dense(m[UP]).T)) @ dense(m[DOWN]).T
        h = rms_norm(x[-1:], w.output_norm, hp.rms_eps)[0]
        return logits_of_last(h)

    # ---------------------------------------------------------------- fused decode (numba)
    def decode_step(self, token: int, pos: int, kv: KVCache) -> np.ndarray:
        hp, w, b, t = self.hp, self.w, self.buffers, self.w.table
        _llama_decode(token, pos, (t.data, t.scales, t.scales16, t.meta), w.mats, w.token_embd, w.output,
                      w.vectors["attn_norm"], w.vectors["ffn_norm"], w.output_norm, np.float32(hp.rms_eps),
                      hp.n_heads, hp.n_kv_heads, hp.head_dim, self.cos[pos], self.sin[pos],
                      np.float32(self.scale), kv.k, kv.v,
                      b.x, b.h[:hp.d_model], b.qkv, b.att, b.proj, b.gu, b.act, b.scores, b.tiles, b.logits)
        return b.logits[:hp.vocab_size]

    def project(self, h: np.ndarray) -> np.ndarray:
        return project(self.w, self.buffers, h, self.hp.vocab_size)


@njit(cache=True, nogil=True)
def _llama_decode(token, pos, tab, mats, token_embd, output, attn_norm, ffn_norm, output_norm, eps,
                  n_heads, n_kv, head_dim, cos, sin, scale, k_cache, v_cache,
                  x, h, qkv, att, proj, gu, act, scores, tiles, logits):
    dequant_row(tab[0], tab[1], tab[2], tab[3][token_embd], token, x)
    for layer in range(mats.shape[0]):
        m = mats[layer]
        rmsnorm(x, attn_norm[layer], eps, h)
        matvec(tab, m[0:3], h, qkv, tiles)
        q, k, v = split_qkv(qkv, n_heads * head_dim, n_kv * head_dim)
        rope_pairs(q, n_heads, head_dim, cos, sin)
        rope_pairs(k, n_kv, head_dim, cos, sin)
        store_kv(k_cache, v_cache, layer, pos, k, v, n_kv, head_dim)
        attention_decode(q, k_cache[layer], v_cache[layer], pos + 1, 0, scale, att, scores)
        matvec(tab, m[3:4], att, proj, tiles)
        add_into(x, proj)
        swiglu_ffn(tab, m, x, ffn_norm[layer], eps, h, gu, act, proj, tiles)
    output_logits(tab, output, x, output_norm, eps, h, logits, tiles)
