"""fast_exp: the vectorizable exp, sigmoid and the SwiGLU / GELU gates built on them."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
from numba import njit

from worker.engine.kernels.fast_exp import exp_neg, sigmoid
from worker.engine.kernels.ops import gelu_tanh_mul, silu_mul


@njit
def _exp_array(x, out):
    for i in range(x.shape[0]):
        out[i] = exp_neg(x[i])


@njit
def _sigmoid_array(x, out):
    for i in range(x.shape[0]):
        out[i] = sigmoid(x[i])


def test_exp_polynomial_accuracy():
    """<= 1e-6 relative on [-87, 0]."""
    x = np.concatenate([np.linspace(-87.0, 0.0, 100_001), -np.random.default_rng(2).random(10_001) * 20,
                        [0.0, -0.0, -1e-30]]).astype(np.float32)
    got = np.zeros_like(x)
    _exp_array(x, got)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 1e-6
    # Below the clamp the result stays a tiny positive number, never NaN or negative.
    tiny = np.zeros(3, np.float32)
    _exp_array(np.array([-88.0, -1e4, -3e38], np.float32), tiny)
    assert np.all((tiny > 0) & (tiny < 1e-37))


def test_sigmoid_accuracy_and_saturation():
    x = np.concatenate([np.linspace(-100.0, 100.0, 200_001), [0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38]]).astype(np.float32)
    got = np.zeros_like(x)
    _sigmoid_array(x, got)
    with np.errstate(over="ignore"):  # exp(3e38) is inf in float64 too: the sigmoid is 0 there
        want = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    assert np.all(np.isfinite(got))
    # Relative where the value is representable: both tails, not only the upper one.
    big = want > 1e-30
    assert np.max(np.abs(got[big] - want[big]) / want[big]) < 2e-6
    assert np.all(got[~big] < 1e-30) and np.all(got >= 0) and np.all(got <= 1)


def test_silu_mul_matches_float64():
    rng = np.random.default_rng(3)
    gate = (rng.standard_normal(1537) * 6).astype(np.float32)
    gate[:4] = [0.0, 90.0, -90.0, -1e-3]
    up = rng.standard_normal(1537).astype(np.float32)
    out = np.zeros_like(gate)
    silu_mul(gate, up, out)
    g = gate.astype(np.float64)
    want = g / (1.0 + np.exp(-g)) * up
    assert np.max(np.abs(out - want)) <= 2e-6 * np.max(np.abs(want))
    assert np.all(np.abs(out - want) <= 1e-6 * np.abs(want) + 1e-12)


def test_gelu_tanh_mul_matches_float64():
    rng = np.random.default_rng(4)
    gate = (rng.standard_normal(2049) * 4).astype(np.float32)
    gate[:4] = [0.0, 30.0, -30.0, 1e-4]
    up = rng.standard_normal(2049).astype(np.float32)
    out = np.zeros_like(gate)
    gelu_tanh_mul(gate, up, out)
    g = gate.astype(np.float64)
    want = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * up
    assert np.all(np.abs(out - want) <= 2e-6 * np.abs(want) + 1e-9)


@pytest.mark.parametrize("gate", [silu_mul, gelu_tanh_mul])
def test_the_gate_loops_vectorize(gate):
    """The reason this module exists: no libm call per element, vector math instead. (Checked on
    a fresh, uncached compile of the same source: numba cannot show cached code.)"""
    fresh = njit(fastmath=True)(gate.py_func)
    x = np.ones(64, np.float32)
    fresh(x, x, np.zeros_like(x))
    ir = fresh.inspect_llvm(fresh.signatures[0])
    assert not re.search(r"call [^\n]*@(expf|exp|tanhf|tanh)\b", ir)
    assert re.search(r"<(4|8|16) x float>", ir), f"{gate.__name__}: the loop did not vectorize"
