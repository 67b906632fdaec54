"""Every architecture (both kernel sets, prefill and decode) against a float64 numpy forward."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tests.model.tiny_gguf import TinyModel, forward_f64, write_tiny
from worker.engine.engine import load_engine

PROMPT = [3, 17, 42, 99, 5, 8, 150, 77, 23, 61, 4]

SPECS = {
    "llama-q8_0-tied": TinyModel(),
    "llama-q4_1-separate-output": TinyModel(matrix_type=QT.Q4_1, tied=False),
    "llama-q5_0": TinyModel(matrix_type=QT.Q5_0),
    "llama3-freq-factors": TinyModel(freq_factors=True, rope_base=500000.0),
    "llama-linear-rope": TinyModel(linear_rope_factor=4.0),
    "qwen2": TinyModel(arch="qwen2", matrix_type=QT.Q5_1),
    "qwen3": TinyModel(arch="qwen3", head_dim=32, matrix_type=QT.Q4_0),
    "gemma3": TinyModel(arch="gemma3", n_layers=6, n_kv_heads=1, head_dim=32, rope_base=1e6, matrix_type=QT.Q8_0),
}


@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf"
    spec = write_tiny(path, SPECS[request.param])
    return path, spec


def _decode_along(engine, tokens):
    """Prefill the first token, then decode the rest one by one; logits after each token."""
    out = [engine.prefill(np.array(tokens[:1])).copy()]
    for pos, tok in enumerate(tokens[1:], start=1):
        out.append(engine.decode(tok, pos).copy())
    return np.stack(out)


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_decode_matches_float64_forward(tiny, kernels):
    path, spec = tiny
    engine = load_engine(path, kernels=kernels, progress=lambda m: None)
    expected = forward_f64(spec, PROMPT)
    np.testing.assert_allclose(_decode_along(engine, PROMPT), expected, atol=2e-3 * np.abs(expected).max())


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_chunked_prefill_matches_float64_forward(tiny, kernels):
    path, spec = tiny
    engine = load_engine(path, kernels=kernels, prefill_chunk=4, progress=lambda m: None)
    expected = forward_f64(spec, PROMPT)[-1]
    np.testing.assert_allclose(engine.prefill(np.array(PROMPT)), expected, atol=2e-3 * np.abs(expected).max())


def test_both_kernel_sets_generate_the_same_greedy_tokens(tiny):
    path, _ = tiny
    ref = load_engine(path, kernels="reference", progress=lambda m: None).generate_ids(PROMPT, 12)
    fast = load_engine(path, kernels="auto", progress=lambda m: None).generate_ids(PROMPT, 12)
    assert ref == fast
