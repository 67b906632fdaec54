"""SmolLM2-135M-Instruct against llama.cpp's golden outputs, every greedy case."""
from __future__ import annotations

import pytest

from tests.conftest import load_reference
from tests.model.golden import EXACT_RULE, SHIPPED_RULE, check_greedy_case
from worker.engine.engine import load_engine

EXACT = load_reference("smollm2-135m-instruct-q4_1.f32-exact.json")
SHIPPED = load_reference("smollm2-135m-instruct-q4_1.json")


@pytest.fixture(scope="module")
def engines(smollm2_gguf):
    return {k: load_engine(smollm2_gguf, kernels=k, context_length=512, progress=lambda m: None)
            for k in ("reference", "auto")}


def _ids(ref):
    return [f"{c['kind']}-{i}" for i, c in enumerate(ref["greedy"])]


@pytest.mark.parametrize("case", EXACT["greedy"], ids=_ids(EXACT))
def test_reference_kernels_match_the_exact_file(engines, case):
    assert check_greedy_case(engines["reference"], case, EXACT["eos_id"], EXACT_RULE) >= 1


@pytest.mark.parametrize("case", SHIPPED["greedy"], ids=_ids(SHIPPED))
def test_default_kernels_match_the_shipped_file(engines, case):
    assert check_greedy_case(engines["auto"], case, SHIPPED["eos_id"], SHIPPED_RULE) >= 1


@pytest.mark.parametrize("case", EXACT["greedy"], ids=_ids(EXACT))
def test_default_kernels_are_exact_float_math(engines, case):
    # Our fast kernels keep activations in float32, so they meet the exact file's tight rule too.
    assert check_greedy_case(engines["auto"], case, EXACT["eos_id"], EXACT_RULE) >= 1


def test_model_file_is_the_one_the_reference_was_made_from(smollm2_gguf):
    from worker.engine.gguf_file import GGUFFile
    assert GGUFFile(smollm2_gguf).fingerprint() == SHIPPED["model_sha256"]
