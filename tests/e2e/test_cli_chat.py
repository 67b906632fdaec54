"""`reame tokenize` and `reame chat` as a person uses them."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import load_reference


def reame(*args: str, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reame.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def test_tokenize_json_gives_llama_cpp_ids(smollm2_gguf):
    case = load_reference("smollm2-135m-instruct-q4_1.json")["tokenize"][4]
    result = reame("tokenize", "--model", str(smollm2_gguf), "--json", case["text"])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"ids": case["ids"]}


def test_chat_streams_an_answer_and_keeps_the_conversation(smollm2_gguf):
    result = reame("chat", "--model", str(smollm2_gguf), "--temperature", "0", "--max-tokens", "24",
                   # "Answer in one word": without it the first token is a near-tie that int8
                   # activations flip (as llama.cpp's do), and the answer wanders off.
                   stdin="What is the capital of France? Answer in one word.\nAnd of Italy?\n\n")
    assert result.returncode == 0, result.stderr
    answers = [line for line in result.stdout.splitlines() if line.startswith("> ")]
    assert "Paris" in answers[0]
    assert "Rome" in result.stdout  # the second turn sees the first
    assert "<|im_end|>" not in result.stdout


def test_chat_with_a_broken_template_is_one_clear_line(smollm2_gguf, tmp_path):
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}{{ m.content }")
    conf = tmp_path / "reame.conf"
    conf.write_text(f"[model]\nchat_template = {template}\n")
    result = reame("--config", str(conf), "chat", "--model", str(smollm2_gguf), stdin="hi\n\n")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("reame: error: chat template")


def test_chat_with_a_missing_model_is_one_clear_line():
    result = reame("chat", "--model", "/nowhere/model.gguf", stdin="hi\n")
    assert result.returncode == 1
    assert result.stderr.strip() == ("reame: error: model not found: /nowhere/model.gguf (known names: smollm2-135m, "
                                     "gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b)")
