"""TEMPORARY placeholder until the model store lands (see helper task)."""
from pathlib import Path

_FILES = {"smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3-270m": "gemma-3-270m-q4_k_m.gguf"}


def ensure_model(name: str, models_dir: Path) -> Path:
    return Path(models_dir) / _FILES[name]
