"""Batched float32 building blocks (numpy + BLAS) for prefill and the reference kernel set."""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: (T, d) → x / rms(x) * weight."""
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x * (1.0 / np.sqrt(ms + np.float32(eps)))).astype(np.float32) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (1.0 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


def causal_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int,
                     scale: float, window: int = 0, chunk: int = 512) -> np.ndarray:
    """Attention of T new queries over the cache, causal (and windowed when window > 0).

    q: (T, H, D) at positions start..start+T-1; keys/values: (KVH, S, D) with S = start + T
    valid positions. Query head h uses KV head h // (H // KVH). Returns (T, H*D).

    The softmax runs online over `chunk` keys at a time (running max, rescaled sum and
    accumulator), so a long context never needs a (T, S) score matrix. Keys before the
    window of the first query are skipped.
    """
    t, n_heads, d = q.shape
    n_kv, s, _ = keys.shape
    group = n_heads // n_kv
    # (KVH, group*T, D): queries sharing a KV head are stacked so one matmul serves them.
    qg = q.reshape(t, n_kv, group, d).transpose(1, 2, 0, 3).reshape(n_kv, group * t, d) * np.float32(scale)
    qpos = np.tile(start + np.arange(t), group)[:, None]  # position of each stacked query row
    best = np.full((n_kv, group * t, 1), -np.inf, np.float32)
    total = np.zeros((n_kv, group * t, 1), np.float32)
    acc = np.zeros((n_kv, group * t, d), np.float32)
    first = max(0, start - window + 1) if window > 0 else 0
    for lo in range(first, s, chunk):
        hi = min(s, lo + chunk)
        scores = np.matmul(qg, keys[:, lo:hi].transpose(0, 2, 1))  # (KVH, group*T, C)
        kpos = np.arange(lo, hi)[None, :]
        masked = kpos > qpos
        if window > 0:
            masked |= kpos <= qpos - window
        scores[:, masked] = -np.inf
        new_best = np.maximum(best, scores.max(axis=-1, keepdims=True))
        # A row with no visible key yet keeps -inf; exp(-inf - -inf) would be nan, so pin it.
        safe = np.where(np.isfinite(new_best), new_best, np.float32(0.0))
        np.exp(scores - safe, out=scores)
        rescale = np.exp(best - safe)
        total = total * rescale + scores.sum(axis=-1, keepdims=True)
        acc = acc * rescale + np.matmul(scores, values[:, lo:hi])
        best = new_best
    out = acc / total  # (KVH, group*T, D)
    return out.reshape(n_kv, group, t, d).transpose(2, 0, 1, 3).reshape(t, n_heads * d)
