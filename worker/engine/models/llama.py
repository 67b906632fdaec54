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
from worker.engine.gguf_file import GGUFFile, TensorRef
from worker.engine.kernels.matvec import linear
from worker.engine.kernels.ops import attention_decode, dequant_row, rmsnorm, rope_pairs, silu_mul
from worker.engine.kernels.packing import TILE, MatrixTable, pack
from worker.engine.kv_cache import KVCache
from worker.engine.layers import causal_attention, rms_norm, silu
from worker.engine.rope import apply_rope_pairs, rope_tables

# Per-layer matrices, in the column order of LlamaWeights.mats.
Q, K, V, O, GATE, UP, DOWN = range(7)
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


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
    rms_eps: float

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "LlamaHParams":
        a = g.arch
        n_heads = int(g.require(f"{a}.attention.head_count"))
        d_model = int(g.require(f"{a}.embedding_length"))
        vocab = g.get(f"{a}.vocab_size")
        if vocab is None:
            vocab = g.tensor("token_embd.weight").shape[0]
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
            rms_eps=float(g.require(f"{a}.attention.layer_norm_rms_epsilon")),
        )
        if hp.n_heads % hp.n_kv_heads:
            raise ModelLoadError(f"{g.path}: {hp.n_heads} heads not divisible by {hp.n_kv_heads} KV heads")
        return hp


@dataclass
class LlamaWeights:
    """Packed matrices live in `table`; names follow the GGUF tensors."""
    table: MatrixTable
    mats: np.ndarray  # int64 (n_layers, 7): table index of attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down
    token_embd: int  # table index, (vocab, d_model)
    output: int  # table index, (vocab, d_model); the same matrix as token_embd when tied
    attn_norm: np.ndarray  # float32 (n_layers, d_model)
    ffn_norm: np.ndarray  # float32 (n_layers, d_model)
    output_norm: np.ndarray  # float32 (d_model,)
    tensors: list[TensorRef]  # GGUF tensor of each table index (for the reference set)


def _vector(g: GGUFFile, name: str) -> np.ndarray:
    from worker.engine.quants import dequantize
    t = g.tensor(name)
    return dequantize(t.raw, t.qtype).reshape(-1)


def load_weights(g: GGUFFile, hp: LlamaHParams, progress=None) -> LlamaWeights:
    table = MatrixTable()
    tensors: list[TensorRef] = []

    def add(name: str, rows: int, cols: int) -> int:
        t = g.tensor(name)
        if t.shape != (rows, cols):
            raise ModelLoadError(f"{g.path}: tensor {name} has shape {t.shape}, expected {(rows, cols)}")
        tensors.append(t)
        return table.add(pack(t.raw, t.qtype))

    d, hd = hp.d_model, hp.head_dim
    shapes = {"attn_q": (hp.n_heads * hd, d), "attn_k": (hp.n_kv_heads * hd, d), "attn_v": (hp.n_kv_heads * hd, d),
              "attn_output": (d, hp.n_heads * hd), "ffn_gate": (hp.d_ff, d), "ffn_up": (hp.d_ff, d),
              "ffn_down": (d, hp.d_ff)}
    token_embd = add("token_embd.weight", hp.vocab_size, d)
    output = add("output.weight", hp.vocab_size, d) if "output.weight" in g.tensors else token_embd
    mats = np.zeros((hp.n_layers, len(LAYER_MATRICES)), np.int64)
    for layer in range(hp.n_layers):
        for j, name in enumerate(LAYER_MATRICES):
            mats[layer, j] = add(f"blk.{layer}.{name}.weight", *shapes[name])
        if progress:
            progress(layer + 1, hp.n_layers)
    table.finalize()
    return LlamaWeights(
        table=table, mats=mats, token_embd=token_embd, output=output,
        attn_norm=np.stack([_vector(g, f"blk.{i}.attn_norm.weight") for i in range(hp.n_layers)]),
        ffn_norm=np.stack([_vector(g, f"blk.{i}.ffn_norm.weight") for i in range(hp.n_layers)]),
        output_norm=_vector(g, "output_norm.weight"),
        tensors=tensors,
    )


def _padded(n: int) -> int:
    return -(-n // TILE) * TILE


class Llama:
    def __init__(self, hp: LlamaHParams, w: LlamaWeights, n_ctx: int):
        self.hp, self.w = hp, w
        self.cos, self.sin = rope_tables(n_ctx, hp.head_dim, hp.rope_base)
        self.scale = 1.0 / np.sqrt(hp.head_dim)
        self._decode = _DecodeBuffers(hp, w, n_ctx)

    # ---------------------------------------------------------------- batched (BLAS)
    def forward(self, tokens: np.ndarray, start: int, kv: KVCache, dense, logits_of_last) -> np.ndarray:
        """Run T tokens at positions start.. through the model; return logits of the last one.

        dense(i) gives table matrix i as float32 (n, K); logits_of_last(h) projects the final
        normed hidden state (d,) to the vocabulary.
        """
        hp, w = self.hp, self.w
        t = tokens.shape[0]
        embd = dense(w.token_embd)
        x = embd[tokens].astype(np.float32)  # (T, d)
        cos, sin = self.cos[start:start + t], self.sin[start:start + t]
        for layer in range(hp.n_layers):
            m = w.mats[layer]
            h = rms_norm(x, w.attn_norm[layer], hp.rms_eps)
            q = (h @ dense(m[Q]).T).reshape(t, hp.n_heads, hp.head_dim)
            k = (h @ dense(m[K]).T).reshape(t, hp.n_kv_heads, hp.head_dim)
            v = (h @ dense(m[V]).T).reshape(t, hp.n_kv_heads, hp.head_dim)
            q, k = apply_rope_pairs(q, cos, sin), apply_rope_pairs(k, cos, sin)
            kv.store(layer, start, k, v)
            a = causal_attention(q, kv.k[layer, :, :start + t], kv.v[layer, :, :start + t], start, self.scale)
            x = x + a @ dense(m[O]).T
            h = rms_norm(x, w.ffn_norm[layer], hp.rms_eps)
            gate = h @ dense(m[GATE]).T
            up = h @ dense(m[UP]).T
            x = x + (silu(gate) * up) @ dense(m[DOWN]).T
        h = rms_norm(x[-1:], w.output_norm, hp.rms_eps)[0]
        return logits_of_last(h)

    # ---------------------------------------------------------------- fused decode (numba)
    def decode_step(self, token: int, pos: int, kv: KVCache) -> np.ndarray:
        hp, w, b = self.hp, self.w, self._decode
        t = w.table
        _llama_decode(token, pos, t.data, t.scales, t.biases, t.meta, w.mats, w.token_embd, w.output,
                      w.attn_norm, w.ffn_norm, w.output_norm, np.float32(hp.rms_eps),
                      hp.n_heads, hp.n_kv_heads, hp.head_dim, self.cos[pos], self.sin[pos],
                      np.float32(self.scale), kv.k, kv.v,
                      b.x, b.h, b.qkv, b.att, b.proj, b.gu, b.act, b.scores, b.tiles, b.logits)
        return b.logits[:hp.vocab_size]

    def project(self, h: np.ndarray) -> np.ndarray:
        """Final hidden state (d,) → logits with the packed output matrix (numba)."""
        b, t = self._decode, self.w.table
        b.h[:] = h
        linear(t.data, t.scales, t.biases, t.meta, np.array([self.w.output]), b.h, b.logits, b.tiles)
        return b.logits[:self.hp.vocab_size]


class _DecodeBuffers:
    """Every activation the fused decode step touches, allocated once."""

    def __init__(self, hp: LlamaHParams, w: LlamaWeights, n_ctx: int):
        d, hd = hp.d_model, hp.head_dim
        f32 = np.float32
        self.x = np.zeros(d, f32)
        self.h = np.zeros(d, f32)
        self.qkv = np.zeros(_padded(hp.n_heads * hd) + 2 * _padded(hp.n_kv_heads * hd), f32)
        self.att = np.zeros(hp.n_heads * hd, f32)
        self.proj = np.zeros(_padded(d), f32)
        self.gu = np.zeros(2 * _padded(hp.d_ff), f32)
        self.act = np.zeros(hp.d_ff, f32)
        self.scores = np.zeros((hp.n_heads, n_ctx), f32)
        self.logits = np.zeros(_padded(hp.vocab_size), f32)
        most_tiles = max(self.logits.shape[0], self.qkv.shape[0], self.gu.shape[0]) // TILE
        self.tiles = np.zeros((most_tiles, TILE), f32)


@njit(cache=True, nogil=True)
def _llama_decode(token, pos, data, scales, biases, meta, mats, token_embd, output,
                  attn_norm, ffn_norm, output_norm, eps, n_heads, n_kv, head_dim, cos, sin, scale,
                  k_cache, v_cache, x, h, qkv, att, proj, gu, act, scores, tiles, logits):
    d = x.shape[0]
    q_rows, kv_rows = n_heads * head_dim, n_kv * head_dim
    k_off = -(-q_rows // TILE) * TILE
    v_off = k_off + -(-kv_rows // TILE) * TILE
    ff = act.shape[0]
    up_off = -(-ff // TILE) * TILE
    dequant_row(data, scales, biases, meta[token_embd], token, x)
    for layer in range(mats.shape[0]):
        m = mats[layer]
        rmsnorm(x, attn_norm[layer], eps, h)
        linear(data, scales, biases, meta, m[0:3], h, qkv, tiles)
        q = qkv[:q_rows]
        k = qkv[k_off:k_off + kv_rows]
        v = qkv[v_off:v_off + kv_rows]
        rope_pairs(q, n_heads, head_dim, cos, sin)
        rope_pairs(k, n_kv, head_dim, cos, sin)
        for hh in range(n_kv):
            k_cache[layer, hh, pos] = k[hh * head_dim:(hh + 1) * head_dim]
            v_cache[layer, hh, pos] = v[hh * head_dim:(hh + 1) * head_dim]
        attention_decode(q, k_cache[layer], v_cache[layer], pos + 1, 0, scale, att, scores)
        linear(data, scales, biases, meta, m[3:4], att, proj, tiles)
        for i in range(d):
            x[i] += proj[i]
        rmsnorm(x, ffn_norm[layer], eps, h)
        linear(data, scales, biases, meta, m[4:6], h, gu, tiles)
        silu_mul(gu[:ff], gu[up_off:up_off + ff], act)
        linear(data, scales, biases, meta, m[6:7], act, proj, tiles)
        for i in range(d):
            x[i] += proj[i]
    rmsnorm(x, output_norm, eps, h)
    out_mat = np.empty(1, np.int64)
    out_mat[0] = output
    linear(data, scales, biases, meta, out_mat, h, logits, tiles)
