"""Tiny random GGUF models written with gguf.GGUFWriter, and a float64 numpy forward pass
written from the architecture's description (independent of the engine's code)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT


@dataclass
class TinyLlama:
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 96
    vocab: int = 160
    n_ctx: int = 128
    rope_base: float = 10000.0
    eps: float = 1e-5
    tied: bool = True
    matrix_type: QT = QT.Q8_0
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # dequantized, float64

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _quantized(w: np.ndarray, qtype: QT) -> tuple[np.ndarray, np.ndarray]:
    """(bytes to store, the float64 weights they dequantize to)."""
    packed = gguf.quants.quantize(w.astype(np.float32), qtype)
    return packed, gguf.quants.dequantize(packed, qtype).reshape(w.shape).astype(np.float64)


def write_tiny_llama(path: Path, spec: TinyLlama, seed: int = 0) -> TinyLlama:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama-test")
    writer.add_block_count(spec.n_layers)
    writer.add_context_length(spec.n_ctx)
    writer.add_embedding_length(spec.d_model)
    writer.add_feed_forward_length(spec.d_ff)
    writer.add_head_count(spec.n_heads)
    writer.add_head_count_kv(spec.n_kv_heads)
    writer.add_layer_norm_rms_eps(spec.eps)
    writer.add_rope_freq_base(spec.rope_base)
    writer.add_vocab_size(spec.vocab)

    def matrix(name: str, rows: int, cols: int, qtype: QT = spec.matrix_type) -> None:
        w = rng.standard_normal((rows, cols)) * (1.0 / np.sqrt(cols))
        packed, deq = _quantized(w, qtype)
        writer.add_tensor(name, packed, raw_dtype=qtype)
        spec.weights[name] = deq

    def vector(name: str, n: int) -> None:
        v = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        writer.add_tensor(name, v)
        spec.weights[name] = v.astype(np.float64)

    d, hd = spec.d_model, spec.head_dim
    matrix("token_embd.weight", spec.vocab, d, QT.Q8_0)
    if not spec.tied:
        matrix("output.weight", spec.vocab, d, QT.F16)
    vector("output_norm.weight", d)
    for i in range(spec.n_layers):
        vector(f"blk.{i}.attn_norm.weight", d)
        vector(f"blk.{i}.ffn_norm.weight", d)
        matrix(f"blk.{i}.attn_q.weight", spec.n_heads * hd, d)
        matrix(f"blk.{i}.attn_k.weight", spec.n_kv_heads * hd, d)
        matrix(f"blk.{i}.attn_v.weight", spec.n_kv_heads * hd, d)
        matrix(f"blk.{i}.attn_output.weight", d, spec.n_heads * hd)
        matrix(f"blk.{i}.ffn_gate.weight", spec.d_ff, d)
        matrix(f"blk.{i}.ffn_up.weight", spec.d_ff, d)
        matrix(f"blk.{i}.ffn_down.weight", d, spec.d_ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return spec


def llama_forward_f64(spec: TinyLlama, tokens: list[int]) -> np.ndarray:
    """Logits (T, vocab) for every position, in float64, from the paper's description."""
    w = spec.weights
    hd = spec.head_dim
    t = len(tokens)

    def norm(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + spec.eps) * weight

    def rope(x):  # x: (T, heads, hd); rotate adjacent pairs (2i, 2i+1)
        pos = np.arange(t)[:, None, None]
        theta = pos * spec.rope_base ** (-np.arange(0, hd, 2) / hd)[None, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * np.cos(theta) - b * np.sin(theta)
        out[..., 1::2] = a * np.sin(theta) + b * np.cos(theta)
        return out

    x = w["token_embd.weight"][tokens]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(t, spec.n_heads, hd))
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(t, spec.n_kv_heads, hd))
        v = (h @ w[p + "attn_v.weight"].T).reshape(t, spec.n_kv_heads, hd)
        heads = []
        for head in range(spec.n_heads):
            kv = head // (spec.n_heads // spec.n_kv_heads)
            s = q[:, head] @ k[:, kv].T / np.sqrt(hd) + mask
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            heads.append(pr @ v[:, kv])
        x = x + np.concatenate(heads, axis=-1) @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    out = w["token_embd.weight"] if spec.tied else w["output.weight"]
    return norm(x, w["output_norm.weight"]) @ out.T
