"""reame perplexity: llama-perplexity's measurement (windows, second half, BOS, error estimate)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from reame.cli import main
from shared.errors import InvalidRequestError
from worker.engine.perplexity import PerplexityTally, negative_log_likelihoods, windows

TEXT = str(Path(__file__).resolve().parents[2] / "bench" / "data" / "gpl-3.0.txt")


def test_tally_is_llama_cpps_estimate():
    nlls = np.array([1.0, 2.0, 4.0])
    t = PerplexityTally()
    t.add(nlls[:1])
    t.add(nlls[1:])
    mean = nlls.mean()
    assert t.count == 3
    assert t.ppl == pytest.approx(math.exp(mean))
    # perplexity.cpp: sqrt((E[x^2] - E[x]^2) / (count - 1)) * ppl
    assert t.error == pytest.approx(math.sqrt(((nlls ** 2).mean() - mean ** 2) / 2) * math.exp(mean))


def test_windows_do_not_overlap_and_need_two():
    tokens = list(range(50))
    assert windows(tokens, 16, None) == [tokens[0:16], tokens[16:32], tokens[32:48]]
    assert windows(tokens, 16, 2) == [tokens[0:16], tokens[16:32]]
    with pytest.raises(InvalidRequestError, match="needs at least 64"):
        windows(tokens, 32, None)


def test_negative_log_likelihood_is_minus_log_softmax():
    logits = np.array([[0.0, 1.0, 2.0], [5.0, 5.0, 5.0]], np.float32)
    got = negative_log_likelihoods(logits, np.array([2, 0]))
    want = [-(2.0 - math.log(1 + math.e + math.e ** 2)), math.log(3.0)]
    assert got == pytest.approx(want)


def test_command_prints_llama_cpps_final_line(smollm2_gguf, capsys):
    assert main(["perplexity", "--model", str(smollm2_gguf), "--file", TEXT, "--ctx", "64", "--chunks", "2"]) == 0
    out, err = capsys.readouterr()
    m = re.fullmatch(r"Final estimate: PPL = (\d+\.\d{4}) \+/- (\d+\.\d{5})\n", out)
    assert m, out
    ppl, error = float(m.group(1)), float(m.group(2))
    # A licence text is plain English: a 135M model is unsure, never random (vocab 49152) nor certain.
    assert 3 < ppl < 200 and 0 < error < ppl
    assert "2/2 windows" in err


def test_command_refuses_a_short_text(smollm2_gguf, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Too short to score.")
    assert main(["perplexity", "--model", str(smollm2_gguf), "--file", str(short), "--ctx", "64"]) == 1
    assert "needs at least 128" in capsys.readouterr().err
