"""Tokenizer and chat template against llama.cpp's golden files (tests/data/reference/*.json).

Rule 1 of the reference README: ids must be identical for every text. Each file is paired with
the real model of the same family (the .f32-exact files share their model's tokenizer).
"""
from __future__ import annotations

import pytest

from gateway.chat_template import ChatTemplate
from gateway.tokenizer import Tokenizer
from tests.conftest import REFERENCE_DIR, load_reference

FILES = sorted(p.name for p in REFERENCE_DIR.glob("*.json") if not p.name.startswith("cases"))
FIXTURE = {"smollm2": "smollm2_gguf", "gemma-3": "gemma3_gguf",
           "qwen2.5-coder-0.5b": "qwen05_gguf", "qwen2.5-coder-1.5b": "qwen15_gguf"}


def tokenizer_for(name: str, request) -> Tokenizer:
    fixture = next(f for prefix, f in FIXTURE.items() if name.startswith(prefix))
    return Tokenizer.from_gguf(request.getfixturevalue(fixture))


def test_every_reference_file_is_covered():
    assert FILES and all(any(n.startswith(p) for p in FIXTURE) for n in FILES)


@pytest.mark.parametrize("name", FILES)
def test_special_ids_and_bos_policy(name, request):
    tok, ref = tokenizer_for(name, request), load_reference(name)
    assert (tok.add_bos, tok.bos_id, tok.eos_id) == (ref["add_bos"], ref["bos_id"], ref["eos_id"])


@pytest.mark.parametrize("name", FILES)
def test_tokenize_cases(name, request):
    tok = tokenizer_for(name, request)
    for case in load_reference(name)["tokenize"]:
        assert tok.encode(case["text"]) == case["ids"], repr(case["text"])


@pytest.mark.parametrize("name", FILES)
def test_greedy_prompts_encode_to_prompt_ids(name, request):
    tok = tokenizer_for(name, request)
    template = ChatTemplate.for_tokenizer(tok)
    for case in load_reference(name)["greedy"]:
        if case["kind"] == "chat":
            rendered = template.render(case["messages"], add_generation_prompt=True)
            assert rendered == case["rendered"]
        else:
            rendered = case["prompt"]
        assert tok.encode(rendered) == case["prompt_ids"], repr(rendered)
