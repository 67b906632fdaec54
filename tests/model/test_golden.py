"""The real models against llama.cpp's golden outputs, every greedy case, both kernel sets."""
from __future__ import annotations

import pytest

from tests.conftest import load_reference
from tests.model.golden import EXACT_RULE, SHIPPED_RULE, check_greedy_case
from worker.engine.engine import load_engine
from worker.engine.gguf_file import GGUFFile

MODELS = {  # name → (model fixture, reference file stem)
    "smollm2": ("smollm2_gguf", "smollm2-135m-instruct-q4_1"),
    "gemma3": ("gemma3_gguf", "gemma-3-270m-q4_k_m"),
}


def _cases(variants):
    cases = []
    for model, (_, stem) in MODELS.items():
        for variant in variants:
            ref = load_reference(f"{stem}{'.f32-exact' if variant == 'exact' else ''}.json")
            for i, case in enumerate(ref["greedy"]):
                cases.append(pytest.param(model, variant, case, ref["eos_id"], id=f"{model}-{variant}-{case['kind']}{i}"))
    return cases


@pytest.fixture(scope="module")
def engines(request):
    cache = {}

    def get(model: str, kernels: str):
        if (model, kernels) not in cache:
            path = request.getfixturevalue(MODELS[model][0])
            cache[(model, kernels)] = load_engine(path, kernels=kernels, context_length=512, progress=lambda m: None)
        return cache[(model, kernels)]
    return get


@pytest.mark.parametrize("model, variant, case, eos_id", _cases(["exact"]))
def test_reference_kernels(engines, model, variant, case, eos_id):
    # The reference set is plain float32 math: it must meet the tight rule on the exact file.
    assert check_greedy_case(engines(model, "reference"), case, eos_id, EXACT_RULE) >= 1


@pytest.mark.parametrize("model, variant, case, eos_id", _cases(["exact", "shipped"]))
def test_default_kernels(engines, model, variant, case, eos_id):
    # The fast kernels keep activations in float32 too, so they also meet the exact file's rule.
    rule = EXACT_RULE if variant == "exact" else SHIPPED_RULE
    assert check_greedy_case(engines(model, "auto"), case, eos_id, rule) >= 1


@pytest.mark.parametrize("model", list(MODELS))
def test_model_file_is_the_one_the_reference_was_made_from(request, model):
    fixture, stem = MODELS[model]
    assert GGUFFile(request.getfixturevalue(fixture)).fingerprint() == load_reference(f"{stem}.json")["model_sha256"]
