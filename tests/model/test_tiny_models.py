"""Every architecture (both kernel sets, prefill and decode) against a float64 numpy forward."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tests.model.tiny_gguf import TinyModel, forward_f64, write_tiny
from worker.engine.batch import StepChunk
from shared.config import EngineSection
from worker.engine.engine import load_engine
from worker.sched.one_request import generate_ids, solo_generator

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


# Kernel sets under test → load_engine settings, and the tolerance (× max |logit|) against the
# float64 forward. int8 quantizes each decode matmul's activations per 32 values (|error| ≤ half
# a step of max|x|/127, ~1% of an output after the sums), compounding over the layers; its
# kernels are held to a tight bound against quantized activations in tests/kernels.
KERNEL_SETS = {
    "reference": (dict(kernels="reference"), 2e-3),
    "float32": (dict(kernels="auto", matmul_activations="float32"), 2e-3),
    "int8": (dict(kernels="auto", matmul_activations="int8"), 4e-2),
}


def _load(path, kernels, **kw):
    # Small blocks so that every sequence spans several, in a shuffled order.
    settings, _ = KERNEL_SETS[kernels]
    kw.setdefault("kv_dtype", "float32")  # the float16 cache has its own test
    return load_engine(path, EngineSection(kv_block_size=4, kv_cache_memory="64MiB", **settings, **kw),
                       progress=lambda m: None)


def _close(got, expected, kernels, factor=1.0):
    np.testing.assert_allclose(got, expected, atol=factor * KERNEL_SETS[kernels][1] * np.abs(expected).max())


def _table(engine, blocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.permutation(engine.kv.num_blocks)[:blocks].astype(np.int32)


def _decode_along(engine, tokens, table):
    """Feed the first token, then the rest one by one; logits after each token."""
    out = [engine.execute([StepChunk.of(tokens[:1], 0, table, True)])[0]]
    for pos, tok in enumerate(tokens[1:], start=1):
        out.append(engine.execute([StepChunk.of([tok], pos, table, True)])[0])
    return np.stack(out)


@pytest.mark.parametrize("kernels", list(KERNEL_SETS))
def test_decode_matches_float64_forward(tiny, kernels):
    path, spec = tiny
    engine = _load(path, kernels)
    expected = forward_f64(spec, PROMPT)
    _close(_decode_along(engine, PROMPT, _table(engine, 3, seed=1)), expected, kernels)


@pytest.mark.parametrize("kernels", list(KERNEL_SETS))
def test_chunked_prefill_matches_float64_forward(tiny, kernels):
    path, spec = tiny
    engine = _load(path, kernels)
    table = _table(engine, 3, seed=2)
    expected = forward_f64(spec, PROMPT)[-1]
    chunks = [PROMPT[0:4], PROMPT[4:8], PROMPT[8:]]
    for i, part in enumerate(chunks):
        logits = engine.execute([StepChunk.of(part, 4 * i, table, i == len(chunks) - 1)])[0]
    _close(logits, expected, kernels)


@pytest.mark.parametrize("kernels", list(KERNEL_SETS))
def test_ragged_batch_matches_float64_forward_of_each_sequence(tiny, kernels):
    """Three sequences in each step: prompt chunks of different lengths, then decode tokens,
    in mixed steps, each in its own shuffled blocks; every logit row matches its sequence alone."""
    path, spec = tiny
    engine = _load(path, kernels)
    order = np.random.default_rng(3).permutation(engine.kv.num_blocks).astype(np.int32)
    prompts = [PROMPT, PROMPT[3:9], [7, 7, 7]]
    tables = [order[0:3], order[3:6], order[6:9]]
    step1 = [StepChunk.of(prompts[0][:5], 0, tables[0], False), StepChunk.of(prompts[1], 0, tables[1], True),
             StepChunk.of(prompts[2][:1], 0, tables[2], True)]
    out1 = engine.execute(step1)
    step2 = [StepChunk.of(prompts[0][5:], 5, tables[0], True), StepChunk.of([11], len(prompts[1]), tables[1], True),
             StepChunk.of(prompts[2][1:], 1, tables[2], True)]
    out2 = engine.execute(step2)
    step3 = [StepChunk.of([12], len(prompts[0]), tables[0], True), StepChunk.of([13], len(prompts[1]) + 1, tables[1], True),
             StepChunk.of([14], len(prompts[2]), tables[2], True)]
    out3 = engine.execute(step3)
    assert out1[0] is None
    cases = [(out1[1], prompts[1]), (out1[2], prompts[2][:1]),
             (out2[0], prompts[0]), (out2[1], prompts[1] + [11]), (out2[2], prompts[2]),
             (out3[0], prompts[0] + [12]), (out3[1], prompts[1] + [11, 13]), (out3[2], prompts[2] + [14])]
    for got, tokens in cases:
        _close(got, forward_f64(spec, tokens)[-1], kernels)


def test_float16_kv_cache_stays_close_to_float64_forward(tiny):
    path, spec = tiny
    engine = _load(path, "float32", kv_dtype="float16")
    got = _decode_along(engine, PROMPT, _table(engine, 3, seed=4))
    _close(got, forward_f64(spec, PROMPT), "float32", factor=2.5)  # K/V rounded to 11 bits


def test_both_kernel_sets_generate_the_same_greedy_tokens(tiny):
    path, _ = tiny
    ref = generate_ids(solo_generator(_load(path, "reference")), PROMPT, 12)
    generator = solo_generator(_load(path, "float32"))
    assert generate_ids(generator, PROMPT, 12) == ref
    assert generator.blocks.num_free_blocks == generator.blocks.num_blocks  # the request gave its blocks back


@pytest.mark.parametrize("name, flags", [("llama-q8_0-tied", (False, False, False)), ("qwen2", (True, False, True)),
                                         ("qwen3", (False, True, True))])
def test_llama_family_flags_come_from_the_file_not_its_name(tmp_path, name, flags):
    """(qkv_bias, qk_norm, rope_neox): tensors and general.architecture decide, whatever the file is called."""
    from dataclasses import replace

    from worker.engine.gguf_file import GGUFFile
    from worker.engine.models.llama import LlamaHParams
    path = tmp_path / "gemma3-llama-qwen3.gguf"
    write_tiny(path, replace(SPECS[name], weights={}))
    hp = LlamaHParams.from_gguf(GGUFFile(path))
    assert (hp.qkv_bias, hp.qk_norm, hp.rope_neox) == flags
