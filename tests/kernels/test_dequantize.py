"""Every GGUF type's decoder is bit-identical to gguf.quants.dequantize."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tests.kernels.quant_cases import random_tensor
from worker.engine.gguf_file import GGUFFile
from worker.engine.quants import SPECS, dequantize


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", list(SPECS), ids=lambda q: q.name)
def test_dequantize_is_bit_exact_on_random_tensors(qtype):
    raw = random_tensor(qtype, 8, 512, seed=int(qtype))
    expected = gguf.quants.dequantize(raw, qtype).reshape(8, 512)
    np.testing.assert_array_equal(_bits(dequantize(raw, qtype)), _bits(expected))


def test_all_eleven_types_are_supported():
    names = {q.name for q in SPECS}
    assert names == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}


def test_dequantize_is_bit_exact_on_real_gemma_tensors(gemma3_gguf):
    g = GGUFFile(gemma3_gguf)
    seen = set()
    for t in g.tensors.values():
        if t.qtype in seen or t.qtype not in SPECS:
            continue
        seen.add(t.qtype)
        raw = t.raw[:32]
        expected = gguf.quants.dequantize(raw, t.qtype)
        np.testing.assert_array_equal(_bits(dequantize(raw, t.qtype)), _bits(expected.reshape(raw.shape[0], -1)))
    assert {QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.F32} <= seen


def test_unsupported_type_is_a_clear_error():
    from shared.errors import ModelLoadError
    from worker.engine.quants import spec_for
    with pytest.raises(ModelLoadError, match="unsupported tensor type IQ2_XXS"):
        spec_for(QT.IQ2_XXS, "blk.0.attn_q.weight")
