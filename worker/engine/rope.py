"""Rotary position embedding tables (cos, sin) per position and frequency."""
from __future__ import annotations

import numpy as np


def rope_tables(n_ctx: int, rope_dim: int, base: float, freq_factors: np.ndarray | None = None,
                positions: np.ndarray | None = None):
    """(n_ctx, rope_dim/2) float32 cos and sin for theta_i = pos * base^(-2i/rope_dim) / factor_i.

    positions: the (possibly scaled) position of each cache slot; default 0..n_ctx-1.
    """
    inv_freq = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    pos = np.arange(n_ctx, dtype=np.float64) if positions is None else positions.astype(np.float64)
    angles = pos[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope_pairs(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: (T, heads, D) rotated in adjacent pairs; cos/sin: (T, D/2)."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def apply_rope_halves(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: (T, heads, D) rotated between the two halves of each head (NEOX)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
