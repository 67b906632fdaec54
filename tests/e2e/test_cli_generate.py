"""`reame generate` as a user runs it: JSON output, and one clear line for every bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.model.tiny_gguf import TinyLlama, write_tiny_llama


def reame(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("REAME_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "reame.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    write_tiny_llama(path, TinyLlama(n_ctx=64))
    return str(path)


def _one_clear_line(result: subprocess.CompletedProcess, needle: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("reame: error:")]
    assert len(errors) == 1 and needle in errors[0], result.stderr


def test_json_output_with_top_logits(smollm2_gguf):
    result = reame("generate", "--model", str(smollm2_gguf), "--prompt-ids", "504,3575,282,4649,314",
                   "--max-tokens", "3", "--top-logits", "4", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["tokens"][:2] == [7042, 30]  # " Paris", "." — llama.cpp's greedy choice
    assert len(out["top"]) == 3 and all(len(step) == 4 for step in out["top"])
    assert out["top"][0][0][0] == 7042
    assert out["prefill_tok_s"] > 0 and out["decode_tok_s"] > 0


@pytest.mark.parametrize("args, needle", [
    (["--model", "/nonexistent/model.gguf", "--prompt-ids", "1,2"], "model not found"),
    (["--model", "no-such-model", "--prompt-ids", "1,2"], "model not found: no-such-model"),
    (["--prompt-ids", "1,two,3"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", "1,2", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--prompt-ids", "1,-2", "--max-tokens", "-5"], "--max-tokens must be at least 1"),
])
def test_bad_input_before_loading(args, needle):
    _one_clear_line(reame("generate", *args), needle)


@pytest.mark.parametrize("args, needle", [
    (["--prompt-ids", "1,100000"], "token id 100000 is outside the vocabulary"),
    (["--prompt-ids", ""], "the prompt is empty"),  # the engine's check, the one every request meets
    (["--prompt-ids", ",".join(["1"] * 60), "--max-tokens", "10"], "context is 64 tokens"),
])
def test_bad_input_for_the_model(tiny_model, args, needle):
    _one_clear_line(reame("generate", "--model", tiny_model, *args), needle)


def test_not_a_model_file(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"\x00" * 100)
    _one_clear_line(reame("generate", "--model", str(bogus), "--prompt-ids", "1"), "not a GGUF file")
