"""Shared fixtures: the real models (pulled once, cached between runs) and golden files."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import system_tools

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE_DIR = REPO_ROOT / "tests" / "data" / "reference"  # llama.cpp's outputs, kept as data
TEST_MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()


def pytest_configure(config):
    config.addinivalue_line("markers", "system_tool(*names, package): the test drives a system tool "
                            "(tests/system_tools.py: skips without it, fails in CI)")


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures start servers
def pytest_runtest_setup(item):
    system_tools.check_marked(item)


def _model(name: str) -> Path:
    from shared.model_store import ensure_model

    return ensure_model(name, TEST_MODELS_DIR)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return _model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    return _model("gemma3-270m")


@pytest.fixture(scope="session")
def qwen05_gguf() -> Path:
    return _model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen15_gguf() -> Path:
    return _model("qwen2.5-coder-1.5b")


def load_reference(name: str) -> dict:
    return json.loads((REFERENCE_DIR / name).read_text(encoding="utf-8"))
