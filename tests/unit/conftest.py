"""Fixtures shared by the unit tests: the real models' tokenizers."""
from __future__ import annotations

import pytest

from gateway.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm(smollm2_gguf):
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def gemma(gemma3_gguf):
    return Tokenizer.from_gguf(gemma3_gguf)


@pytest.fixture(scope="session")
def qwen05(qwen05_gguf):
    return Tokenizer.from_gguf(qwen05_gguf)


@pytest.fixture(scope="session")
def qwen15(qwen15_gguf):
    return Tokenizer.from_gguf(qwen15_gguf)


@pytest.fixture(params=["smollm", "gemma"])
def tok(request):
    return request.getfixturevalue(request.param)
