"""The llama architecture (Llama 2/3, SmolLM2, TinyLlama…): RMSNorm, RoPE, GQA, SwiGLU.

Two forwards over the same weights and the same paged KV cache:
  `forward`       a ragged batch of chunks with float32 matmuls on BLAS over dequantized weights
                  (the reference kernel set);
  `forward_rows`  every token of a step (decode tokens and prompt chunks of many sequences)
                  through every layer inside a single numba call over the packed weights (the
                  fast path: per-call Python dispatch would otherwise cost more than the math);
                  all rows share each weight read, and each row's result does not depend on
                  the others, so batching never changes a sequence's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from shared.errors import ModelLoadError
from worker.engine.batch import RaggedBatch
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels.attention import paged_attention_decode
from worker.engine.kernels.ops import rope_pairs
from worker.engine.layers import rms_norm, silu
from worker.engine.models.common import BatchBuffers, attend, load_packed, vector
from worker.engine.models.decode_parts import (add_rows, embed_rows, matmul, output_logits_rows, rmsnorm_rows,
                                               split_qkv_rows, store_kv_rows, swiglu_ffn_rows)
from worker.engine.paged_kv import PagedKVCache
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
        self.buffers = BatchBuffers(hp.d_model, hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim,
                                    hp.d_ff, hp.vocab_size)

    # ---------------------------------------------------------------- ragged batch (BLAS, reference set)
    def forward(self, batch: RaggedBatch, kv: PagedKVCache, dense, logits_of_rows, attention_chunk: int) -> np.ndarray:
        """Run every chunk of the batch through the model; return logits (R, vocab) of its logit rows.

        dense(i) gives table matrix i as float32 (n, K); logits_of_rows(h) projects final normed
        hidden states (R, d) to the vocabulary.
        """
        hp, w = self.hp, self.w
        t = batch.num_tokens
        x = dense(w.token_embd)[batch.tokens].astype(np.float32)  # (T, d)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        for layer in range(hp.n_layers):
            m = w.mats[layer]
            h = rms_norm(x, w.vectors["attn_norm"][layer], hp.rms_eps)
            q = (h @ dense(m[Q]).T).reshape(t, hp.n_heads, hp.head_dim)
            k = (h @ dense(m[K]).T).reshape(t, hp.n_kv_heads, hp.head_dim)
            v = h @ dense(m[V]).T
            q, k = apply_rope_pairs(q, cos, sin), apply_rope_pairs(k, cos, sin)
            a = attend(kv, layer, batch, q.reshape(t, -1), k.reshape(t, -1), v, self.scale, 0, attention_chunk)
            x = x + a @ dense(m[O]).T
            h = rms_norm(x, w.vectors["ffn_norm"][layer], hp.rms_eps)
            x = x + (silu(h @ dense(m[GATE]).T) * (h @ dense(m[UP]).T)) @ dense(m[DOWN]).T
        return logits_of_rows(rms_norm(x[batch.logit_rows], w.output_norm, hp.rms_eps))

    # ---------------------------------------------------------------- fused rows (numba)
    def forward_rows(self, tokens: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
                     logit_rows: np.ndarray, kv: PagedKVCache, attention_chunk: int) -> np.ndarray:
        """Every row (a token at its position, with its sequence's block table) through all
        layers in one numba call; returns logits (len(logit_rows), vocab), a view of the buffers."""
        hp, w, b, t = self.hp, self.w, self.buffers, self.w.table
        rows = tokens.shape[0]
        b.ensure(rows, logit_rows.shape[0])
        _llama_rows(tokens, positions, block_tables, logit_rows, (t.data, t.scales, t.scales16, t.meta), w.mats,
                      w.token_embd, w.output, w.vectors["attn_norm"], w.vectors["ffn_norm"], w.output_norm,
                      np.float32(hp.rms_eps), hp.n_heads, hp.n_kv_heads, hp.head_dim, self.cos, self.sin,
                      np.float32(self.scale), kv.k, kv.v, attention_chunk,
                      b.x, b.h, b.qkv, b.q, b.k, b.v, b.att, b.proj, b.gu, b.act, b.scratch, b.logits)
        return b.logits[:logit_rows.shape[0], :hp.vocab_size]


@njit(cache=True, nogil=True)
def _llama_rows(tokens, positions, block_tables, logit_rows, tab, mats, token_embd, output, attn_norm, ffn_norm,
                  output_norm, eps, n_heads, n_kv, head_dim, cos, sin, scale, k_pool, v_pool, chunk,
                  x, h, qkv, q, k, v, att, proj, gu, act, scratch, logits):
    rows = tokens.shape[0]
    embed_rows(tab, token_embd, tokens, x)
    for layer in range(mats.shape[0]):
        m = mats[layer]
        rmsnorm_rows(x, attn_norm[layer], eps, h, rows)
        matmul(tab, m[0:3], h[:rows], qkv[:rows], scratch)
        split_qkv_rows(qkv, q, k, v, rows)
        for b in range(rows):
            rope_pairs(q[b], n_heads, head_dim, cos[positions[b]], sin[positions[b]])
            rope_pairs(k[b], n_kv, head_dim, cos[positions[b]], sin[positions[b]])
        store_kv_rows(k_pool, v_pool, layer, block_tables, positions, k, v, rows)
        paged_attention_decode(q[:rows], k_pool, v_pool, layer, block_tables, positions, 0, scale, chunk, att[:rows])
        matmul(tab, m[3:4], att[:rows], proj[:rows], scratch)
        add_rows(x, proj, rows)
        swiglu_ffn_rows(tab, m, x, ffn_norm[layer], eps, h, gu, act, proj, scratch, rows)
    output_logits_rows(tab, output, x, output_norm, eps, h, logits, scratch, logit_rows)
