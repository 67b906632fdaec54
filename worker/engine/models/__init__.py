"""One module per architecture; `build_model` picks by `general.architecture`."""
from __future__ import annotations

from shared.errors import ModelLoadError
from worker.engine.gguf_file import GGUFFile


def build_model(g: GGUFFile, n_ctx: int, progress=None):
    if g.arch == "llama":
        from worker.engine.models.llama import Llama, LlamaHParams, load_weights
        hp = LlamaHParams.from_gguf(g)
        return Llama(hp, load_weights(g, hp, progress), n_ctx)
    raise ModelLoadError(f"{g.path}: unsupported architecture '{g.arch}' (supported: llama)")
