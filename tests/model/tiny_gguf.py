"""Tiny random GGUF models written with gguf.GGUFWriter, and a float64 numpy forward pass
written from each architecture's description (independent of the engine's code).

Architectures: llama (optionally Llama-3 frequency factors or linear rope scaling), qwen2
(QKV biases), qwen3 (QK-norm), gemma3 (scaled embeddings, QK-norm, post-norms, GELU, local
sliding-window layers and global layers with their own RoPE base).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

GEMMA_SWA_PATTERN, GEMMA_LOCAL_BASE = 6, 10000.0


@dataclass
class TinyModel:
    arch: str = "llama"
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 96
    vocab: int = 160
    n_ctx: int = 128
    rope_base: float = 10000.0
    eps: float = 1e-5
    tied: bool = True
    matrix_type: QT = QT.Q8_0
    freq_factors: bool = False  # llama: a rope_freqs.weight tensor (Llama 3.1 scaling)
    linear_rope_factor: float = 1.0  # llama: rope.scaling.type = linear
    sliding_window: int = 4  # gemma3 local layers
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # dequantized, float64


TinyLlama = TinyModel  # the llama defaults


def _quantized(w: np.ndarray, qtype: QT) -> tuple[np.ndarray, np.ndarray]:
    """(bytes to store, the float64 weights they dequantize to)."""
    packed = gguf.quants.quantize(w.astype(np.float32), qtype)
    return packed, gguf.quants.dequantize(packed, qtype).reshape(w.shape).astype(np.float64)


def write_tiny(path: Path, spec: TinyModel, seed: int = 0) -> TinyModel:
    rng = np.random.default_rng(seed)
    a = spec.arch
    writer = gguf.GGUFWriter(str(path), a)
    writer.add_name(f"tiny-{a}-test")
    writer.add_block_count(spec.n_layers)
    writer.add_context_length(spec.n_ctx)
    writer.add_embedding_length(spec.d_model)
    writer.add_feed_forward_length(spec.d_ff)
    writer.add_head_count(spec.n_heads)
    writer.add_head_count_kv(spec.n_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_layer_norm_rms_eps(spec.eps)
    writer.add_rope_freq_base(spec.rope_base)
    writer.add_vocab_size(spec.vocab)
    if a == "gemma3":
        writer.add_sliding_window(spec.sliding_window)
    if spec.linear_rope_factor != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.linear_rope_factor)

    def matrix(name: str, rows: int, cols: int, qtype: QT = spec.matrix_type) -> None:
        packed, deq = _quantized(rng.standard_normal((rows, cols)) / np.sqrt(cols), qtype)
        writer.add_tensor(name, packed, raw_dtype=qtype)
        spec.weights[name] = deq

    def vector(name: str, n: int, centre: float = 1.0, spread: float = 0.1) -> None:
        v = (centre + spread * rng.standard_normal(n)).astype(np.float32)
        writer.add_tensor(name, v)
        spec.weights[name] = v.astype(np.float64)

    d, q_rows, kv_rows = spec.d_model, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    matrix("token_embd.weight", spec.vocab, d, QT.Q8_0)
    if not spec.tied:
        matrix("output.weight", spec.vocab, d, QT.F16)
    vector("output_norm.weight", d)
    if spec.freq_factors:
        vector("rope_freqs.weight", spec.head_dim // 2, centre=2.0, spread=0.5)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        for name in ("attn_norm", "ffn_norm"):
            vector(p + name + ".weight", d)
        matrix(p + "attn_q.weight", q_rows, d)
        matrix(p + "attn_k.weight", kv_rows, d)
        matrix(p + "attn_v.weight", kv_rows, d)
        matrix(p + "attn_output.weight", d, q_rows)
        matrix(p + "ffn_gate.weight", spec.d_ff, d)
        matrix(p + "ffn_up.weight", spec.d_ff, d)
        matrix(p + "ffn_down.weight", d, spec.d_ff)
        if a == "qwen2":
            vector(p + "attn_q.bias", q_rows, 0.0, 0.5)
            vector(p + "attn_k.bias", kv_rows, 0.0, 0.5)
            vector(p + "attn_v.bias", kv_rows, 0.0, 0.5)
        if a in ("qwen3", "gemma3"):
            vector(p + "attn_q_norm.weight", spec.head_dim)
            vector(p + "attn_k_norm.weight", spec.head_dim)
        if a == "gemma3":
            vector(p + "post_attention_norm.weight", d)
            vector(p + "post_ffw_norm.weight", d)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return spec


write_tiny_llama = write_tiny


def forward_f64(spec: TinyModel, tokens: list[int]) -> np.ndarray:
    """Logits (T, vocab) for every position, in float64, from the architectures' descriptions."""
    w, a, hd, t = spec.weights, spec.arch, spec.head_dim, len(tokens)

    def norm(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + spec.eps) * weight

    def rope(x, base):  # x: (T, heads, hd)
        inv = base ** (-np.arange(0, hd, 2) / hd)
        if spec.freq_factors:
            inv = inv / w["rope_freqs.weight"]
        theta = (np.arange(t) / spec.linear_rope_factor)[:, None, None] * inv[None, None, :]
        c, s = np.cos(theta), np.sin(theta)
        if a == "llama":  # adjacent pairs (2i, 2i+1)
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = x1 * c - x2 * s, x1 * s + x2 * c
            return out
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]  # NEOX: the two halves
        return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)

    x = w["token_embd.weight"][tokens] * (np.sqrt(spec.d_model) if a == "gemma3" else 1.0)
    qpos, kpos = np.arange(t)[:, None], np.arange(t)[None, :]
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        is_local = a == "gemma3" and (i + 1) % GEMMA_SWA_PATTERN != 0
        base = GEMMA_LOCAL_BASE if is_local else spec.rope_base
        hidden = kpos > qpos
        if is_local:
            hidden = hidden | (kpos <= qpos - spec.sliding_window)
        mask = np.where(hidden, -np.inf, 0.0)
        h = norm(x, w[p + "attn_norm.weight"])
        q = h @ w[p + "attn_q.weight"].T + w.get(p + "attn_q.bias", 0.0)
        k = h @ w[p + "attn_k.weight"].T + w.get(p + "attn_k.bias", 0.0)
        v = h @ w[p + "attn_v.weight"].T + w.get(p + "attn_v.bias", 0.0)
        q, k, v = q.reshape(t, spec.n_heads, hd), k.reshape(t, spec.n_kv_heads, hd), v.reshape(t, spec.n_kv_heads, hd)
        if a in ("qwen3", "gemma3"):
            q, k = norm(q, w[p + "attn_q_norm.weight"]), norm(k, w[p + "attn_k_norm.weight"])
        q, k = rope(q, base), rope(k, base)
        heads = []
        for head in range(spec.n_heads):
            kv = head // (spec.n_heads // spec.n_kv_heads)
            s = q[:, head] @ k[:, kv].T / np.sqrt(hd) + mask
            pr = np.exp(s - s.max(-1, keepdims=True))
            heads.append((pr / pr.sum(-1, keepdims=True)) @ v[:, kv])
        attn = np.concatenate(heads, axis=-1) @ w[p + "attn_output.weight"].T
        x = x + (norm(attn, w[p + "post_attention_norm.weight"]) if a == "gemma3" else attn)
        h = norm(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        if a == "gemma3":
            act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
        else:
            act = gate / (1 + np.exp(-gate))
        ffn = (act * up) @ w[p + "ffn_down.weight"].T
        x = x + (norm(ffn, w[p + "post_ffw_norm.weight"]) if a == "gemma3" else ffn)
    out = w["token_embd.weight"] if spec.tied else w["output.weight"]
    return norm(x, w["output_norm.weight"]) @ out.T


llama_forward_f64 = forward_f64
