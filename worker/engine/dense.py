"""Float32 (n, K) weight matrices for the reference kernel set's BLAS forward.

`ReferenceDense` dequantizes straight from the GGUF bytes with the numpy reference decoder —
independent of the packed layouts, which is what makes it a reference.
"""
from __future__ import annotations

import numpy as np

from worker.engine.gguf_file import TensorRef
from worker.engine.quants import dequantize


class ReferenceDense:
    def __init__(self, tensors: list[TensorRef]):
        self._mats = [dequantize(t.raw, t.qtype) for t in tensors]

    def __call__(self, index: int) -> np.ndarray:
        return self._mats[index]
