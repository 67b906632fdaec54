"""The llama family: Llama 2/3, SmolLM2, TinyLlama…, Qwen 2/2.5 and Qwen 3. RMSNorm, RoPE, GQA,
SwiGLU; three flags, read from the file, cover the differences:
  qkv_bias    biases on Q, K and V (qwen2: the file has blk.N.attn_q.bias);
  qk_norm     per-head RMSNorm of Q and K before RoPE (qwen3: blk.N.attn_q_norm.weight);
  rope_neox   RoPE rotates element i with i + head_dim/2 (NEOX layout) instead of adjacent pairs;
              GGUF has no key for it: llama.cpp fixes it per `general.architecture` (ROPE_NEOX).

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
from typing import NamedTuple

import numpy as np
from numba import get_num_threads, njit

from shared.errors import ModelLoadError
from worker.engine.batch import RaggedBatch
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels.attention import AttentionParams, KVLayer
from worker.engine.kernels.packing import LAYOUT_ROWS, TableArrays
from worker.engine.layers import rms_norm, silu
from worker.engine.models.common import (ATTN_OUT, DOWN, GATE, K, O, Q, UP, V, BatchBuffers, BlockHParams, StepRows,
                                         attend, layer_vectors, load_packed, vector)
from worker.engine.models.decode_parts import (add_into, add_rows, attention_rows, embed_rows, head_norm_rows,
                                               matmul, output_logits_rows, qkv_rows, rmsnorm_rows, rope_rows,
                                               swiglu_ffn_rows)
from worker.engine.paged_kv import PagedKVCache
from worker.engine.rope import apply_rope_halves, apply_rope_pairs, rope_tables

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_NEOX = ("qwen2", "qwen3")  # llama.cpp's LLAMA_ROPE_TYPE_NEOX for these architectures


@dataclass(frozen=True)
class LlamaHParams(BlockHParams):
    rope_base: float
    rope_linear_factor: float  # positions are divided by this ("linear" rope scaling); 1 = none
    qkv_bias: bool
    qk_norm: bool
    rope_neox: bool

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "LlamaHParams":
        a = g.arch
        hp = cls(**BlockHParams.fields_from_gguf(g),
                 rope_base=float(g.get(f"{a}.rope.freq_base", 10000.0)),
                 rope_linear_factor=_linear_rope_factor(g),
                 qkv_bias="blk.0.attn_q.bias" in g.tensors,
                 qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
                 rope_neox=a in ROPE_NEOX)
        rope_dim = g.get(f"{a}.rope.dimension_count")
        if rope_dim is not None and int(rope_dim) != hp.head_dim:
            raise ModelLoadError(f"{g.path}: partial rotary embeddings (rope.dimension_count {rope_dim} < "
                                 f"head dim {hp.head_dim}) are not supported")
        return hp


def _linear_rope_factor(g: GGUFFile) -> float:
    kind = g.get(f"{g.arch}.rope.scaling.type")
    if kind in (None, "none"):
        return 1.0
    if kind == "linear":
        return float(g.get(f"{g.arch}.rope.scaling.factor", 1.0))
    raise ModelLoadError(f"{g.path}: rope scaling type '{kind}' is not supported (supported: linear, "
                         f"and Llama 3 frequency factors in rope_freqs.weight)")


class LlamaWeights(NamedTuple):
    """The weights as the numba step takes them; per-layer vectors are (n_layers, n) float32."""
    tab: TableArrays  # PackedWeights.tab: the packed matrices
    mats: np.ndarray  # int64 (n_layers, 7): table index of each LAYER_MATRICES entry
    token_embd: int
    output: int
    attn_norm: np.ndarray  # (n_layers, d_model)
    ffn_norm: np.ndarray  # (n_layers, d_model)
    output_norm: np.ndarray  # (d_model,)
    q_bias: np.ndarray  # (n_layers, q_rows); (n_layers, 0) without qkv_bias
    k_bias: np.ndarray  # (n_layers, kv_rows); idem
    v_bias: np.ndarray  # (n_layers, kv_rows); idem
    q_norm: np.ndarray  # (n_layers, head_dim); (n_layers, 0) without qk_norm
    k_norm: np.ndarray  # (n_layers, head_dim); idem
    cos: np.ndarray  # (n_ctx, head_dim / 2) RoPE table by position
    sin: np.ndarray


class LlamaStepConfig(NamedTuple):
    """The hyper-parameters and flags the numba step reads."""
    eps: np.float32
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: np.float32  # 1 / sqrt(head_dim)
    qkv_bias: bool
    qk_norm: bool
    rope_neox: bool


class Llama:
    def __init__(self, g: GGUFFile, n_ctx: int, progress=None, layout: int = LAYOUT_ROWS):
        self.hp = hp = LlamaHParams.from_gguf(g)
        qk_norms = ("attn_q_norm", "attn_k_norm") if hp.qk_norm else ()
        self.w = w = load_packed(g, hp, ("attn_norm", "ffn_norm") + qk_norms, progress, layout)
        empty = np.zeros((hp.n_layers, 0), np.float32)  # stands in for what the flags leave out
        self.bias = {name: layer_vectors(g, hp.n_layers, name, "bias") if hp.qkv_bias else empty
                     for name in ("attn_q", "attn_k", "attn_v")}
        # Llama 3.1+ files carry per-frequency divisors (the "llama3" rope scaling) as a tensor.
        freq_factors = vector(g, "rope_freqs.weight") if "rope_freqs.weight" in g.tensors else None
        self.cos, self.sin = rope_tables(n_ctx, hp.head_dim, hp.rope_base, freq_factors,
                                         positions=np.arange(n_ctx) / hp.rope_linear_factor)
        self.scale = 1.0 / np.sqrt(hp.head_dim)
        self.buffers = BatchBuffers(hp.d_model, hp.q_rows, hp.kv_rows, hp.d_ff, hp.vocab_size)
        vec = w.vectors
        self.step_weights = LlamaWeights(
            w.tab, w.mats, w.token_embd, w.output, vec["attn_norm"], vec["ffn_norm"], w.output_norm,
            self.bias["attn_q"], self.bias["attn_k"], self.bias["attn_v"],
            vec.get("attn_q_norm", empty), vec.get("attn_k_norm", empty), self.cos, self.sin)
        self.step_config = LlamaStepConfig(np.float32(hp.rms_eps), hp.n_heads, hp.n_kv_heads, hp.head_dim,
                                           np.float32(self.scale), hp.qkv_bias, hp.qk_norm, hp.rope_neox)

    # ---------------------------------------------------------------- ragged batch (BLAS, reference set)
    def forward(self, batch: RaggedBatch, kv: PagedKVCache, dense, logits_of_rows, attention_chunk: int) -> np.ndarray:
        """Run every chunk of the batch through the model; return logits (R, vocab) of its logit rows.

        dense(i) gives table matrix i as float32 (n, K); logits_of_rows(h) projects final normed
        hidden states (R, d) to the vocabulary.
        """
        hp, w, vec, bias = self.hp, self.w, self.w.vectors, self.bias
        t = batch.num_tokens
        rope = apply_rope_halves if hp.rope_neox else apply_rope_pairs
        x = w.embed(batch.tokens, dense)  # (T, d)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        for layer in range(hp.n_layers):
            m = w.mats[layer]
            h = rms_norm(x, vec["attn_norm"][layer], hp.rms_eps)
            q, k, v = h @ dense(m[Q]).T, h @ dense(m[K]).T, h @ dense(m[V]).T
            if hp.qkv_bias:
                q, k, v = q + bias["attn_q"][layer], k + bias["attn_k"][layer], v + bias["attn_v"][layer]
            q, k = q.reshape(t, hp.n_heads, hp.head_dim), k.reshape(t, hp.n_kv_heads, hp.head_dim)
            if hp.qk_norm:
                q = rms_norm(q, vec["attn_q_norm"][layer], hp.rms_eps)
                k = rms_norm(k, vec["attn_k_norm"][layer], hp.rms_eps)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            a = attend(kv, layer, batch, q.reshape(t, -1), k.reshape(t, -1), v, self.scale, 0, attention_chunk)
            x = x + a @ dense(m[O]).T
            h = rms_norm(x, vec["ffn_norm"][layer], hp.rms_eps)
            x = x + (silu(h @ dense(m[GATE]).T) * (h @ dense(m[UP]).T)) @ dense(m[DOWN]).T
        return logits_of_rows(rms_norm(x[batch.logit_rows], w.output_norm, hp.rms_eps))

    # ---------------------------------------------------------------- fused rows (numba)
    def forward_rows(self, tokens: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
                     logit_rows: np.ndarray, kv: PagedKVCache, attention_chunk: int, ops: np.ndarray) -> np.ndarray:
        """Every row (a token at its position, with its sequence's block table) through all
        layers in one numba call; returns logits (len(logit_rows), vocab), a view of the buffers.
        ops: the op table's codes (registry.OpTable.codes), which kernel variants to run."""
        buf = self.buffers.ensure(tokens.shape[0], logit_rows.shape[0])
        if self.w.embedding is not None:
            self.w.embedding.fill(tokens, buf.x)
        _llama_rows(StepRows(tokens, positions, block_tables, logit_rows, get_num_threads()), self.step_weights, self.step_config,
                    (kv.k, kv.v), attention_chunk, ops, buf)
        return buf.logits[:logit_rows.shape[0], :self.hp.vocab_size]


@njit(cache=True, nogil=True)
def _llama_rows(step, w, hp, kv_pools, chunk, ops, buf):
    """embed (unless filled) → per layer (norm, qkv, rope, attention, residual, ffn) → norm → logits, every row."""
    rows = step.tokens.shape[0]
    k_pool, v_pool = kv_pools
    mm = (w.tab, ops, buf.scratch)
    if w.token_embd >= 0:  # else forward_rows filled buf.x from the file (FileEmbedding)
        embed_rows(mm, w.token_embd, step.tokens, buf.x)
    for layer in range(w.mats.shape[0]):
        m = w.mats[layer]
        rmsnorm_rows(buf.x, w.attn_norm[layer], hp.eps, buf.h, rows)
        qkv_rows(mm, m, buf, rows)
        if hp.qkv_bias:
            for b in range(rows):
                add_into(buf.q[b], w.q_bias[layer])
                add_into(buf.k[b], w.k_bias[layer])
                add_into(buf.v[b], w.v_bias[layer])
        if hp.qk_norm:
            head_norm_rows(buf, hp.n_heads, hp.n_kv_heads, hp.head_dim, w.q_norm[layer], w.k_norm[layer], hp.eps,
                           rows)
        rope_rows(buf, step.positions, w.cos, w.sin, hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.rope_neox, rows)
        attention_rows(mm, buf, KVLayer(k_pool, v_pool, layer), step.block_tables, step.positions,
                       AttentionParams(0, hp.scale, chunk, step.threads), rows)
        matmul(mm, m[ATTN_OUT], buf.att[:rows], buf.proj[:rows])
        add_rows(buf.x, buf.proj, rows)
        swiglu_ffn_rows(mm, m, w.ffn_norm[layer], hp.eps, buf, rows)
    output_logits_rows(mm, w.output, w.output_norm, hp.eps, buf, step.logit_rows)
