"""The llama forward (both kernel sets, prefill and decode) against a float64 numpy forward."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tests.model.tiny_gguf import TinyLlama, llama_forward_f64, write_tiny_llama
from worker.engine.engine import load_engine

PROMPT = [3, 17, 42, 99, 5, 8, 150, 77, 23]


@pytest.fixture(scope="module", params=[(QT.Q8_0, True), (QT.Q4_1, False), (QT.Q5_0, True)],
                ids=["q8_0-tied", "q4_1-separate-output", "q5_0-tied"])
def tiny(request, tmp_path_factory):
    qtype, tied = request.param
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    spec = write_tiny_llama(path, TinyLlama(matrix_type=qtype, tied=tied))
    return path, spec


def _logits_along(engine, tokens):
    """Prefill the first token, then decode the rest one by one; logits after each token."""
    out = [engine.prefill(np.array(tokens[:1])).copy()]
    for pos, tok in enumerate(tokens[1:], start=1):
        out.append(engine.decode(tok, pos).copy())
    return np.stack(out)


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_decode_path_matches_float64_forward(tiny, kernels):
    path, spec = tiny
    engine = load_engine(path, kernels=kernels, progress=lambda m: None)
    expected = llama_forward_f64(spec, PROMPT)
    got = _logits_along(engine, PROMPT)
    np.testing.assert_allclose(got, expected, atol=2e-3 * np.abs(expected).max())


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_prefill_in_chunks_matches_float64_forward(tiny, kernels):
    path, spec = tiny
    engine = load_engine(path, kernels=kernels, prefill_chunk=4, progress=lambda m: None)
    expected = llama_forward_f64(spec, PROMPT)[-1]
    got = engine.prefill(np.array(PROMPT))
    np.testing.assert_allclose(got, expected, atol=2e-3 * np.abs(expected).max())


def test_greedy_generation_is_the_same_for_both_kernel_sets(tiny):
    path, _ = tiny
    ref = load_engine(path, kernels="reference", progress=lambda m: None).generate_ids(PROMPT, 12)
    fast = load_engine(path, kernels="auto", progress=lambda m: None).generate_ids(PROMPT, 12)
    assert ref == fast
