"""Time tokenizing ~4,000-token texts with each real model's tokenizer (a check, not a test).

    .venv/bin/python bench/tokenizer.py [path/to/model.gguf ...]

Without arguments it uses the test models in $REAME_TEST_MODELS (~/.cache/reame/models). Every
timed run gets a text it has not seen (the merge step caches words), so the numbers are cold.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.tokenizer import StreamDecoder, Tokenizer  # noqa: E402

MODELS = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()
CASES = Path(__file__).resolve().parent.parent / "tests" / "data" / "reference" / "cases.json"
TARGET_TOKENS = 4000
RUNS = 7
LETTERS = "etaoinshrdlucmfwypvbgkjqxz" * 4 + "éüßñçøåжыдλπ日本語中文한국"
OTHER = " " * 12 + "\n" + ",.;:!?'\"()-" + "0123456789"


def sample_text(seed: int, n_chars: int) -> str:
    """Golden-case snippets interleaved with pseudo-random words, different for every seed."""
    rng = random.Random(seed)
    cases = json.loads(CASES.read_text(encoding="utf-8")) if CASES.exists() else {}
    snippets = cases.get("texts", []) + cases.get("prompts", [])
    parts, size = [], 0
    while size < n_chars:
        if snippets and rng.random() < 0.1:
            part = rng.choice(snippets)
        else:
            part = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 9))) + rng.choice(OTHER)
        parts.append(part)
        size += len(part)
    return "".join(parts)


def main(paths: list[str]) -> None:
    paths = paths or [str(p) for p in sorted(MODELS.glob("*.gguf"))]
    print(f"{'model':<36} {'tokens':>7} {'encode ms':>10} {'decode ms':>10} {'stream ms':>10}")
    for path in paths:
        tok = Tokenizer.from_gguf(path)
        probe = sample_text(0, 20000)
        chars_per_token = len(probe) / len(tok.encode(probe))
        texts = [sample_text(seed, int(TARGET_TOKENS * chars_per_token)) for seed in range(1, RUNS + 1)]
        encode, ids = [], []
        for text in texts:
            start = time.perf_counter()
            ids = tok.encode(text)
            encode.append(_ms(start))
        start = time.perf_counter()
        tok.decode(ids)
        decode = _ms(start)
        start = time.perf_counter()
        decoder = StreamDecoder(tok)
        for i in ids:
            decoder.push(i)
        decoder.flush()
        print(f"{Path(path).name:<36} {len(ids):>7} {statistics.median(encode):>10.1f} "
              f"{decode:>10.1f} {_ms(start):>10.1f}")


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


if __name__ == "__main__":
    main(sys.argv[1:])
