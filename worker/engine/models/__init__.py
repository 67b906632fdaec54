"""One module per architecture family; `build_model` picks by `general.architecture`."""
from __future__ import annotations

from shared.errors import ModelLoadError
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels.packing import LAYOUT_ROWS

SUPPORTED = ("llama", "gemma3", "qwen2", "qwen3")


def build_model(g: GGUFFile, n_ctx: int, progress=None, layout: int = LAYOUT_ROWS):
    """The model of g's architecture; layout: the packed codes' layout (packing.LAYOUT_*), the one
    the engine's matmul kernels read."""
    if g.arch in ("llama", "qwen2", "qwen3"):  # llama.ARCHITECTURES
        from worker.engine.models.llama import Llama
        return Llama(g, n_ctx, progress, layout)
    if g.arch == "gemma3":
        from worker.engine.models.gemma3 import Gemma3
        return Gemma3(g, n_ctx, progress, layout)
    raise ModelLoadError(f"{g.path}: unsupported architecture '{g.arch}' (supported: {', '.join(SUPPORTED)})")
