"""The special-token splitter: llama.cpp's longest-first partition, in time linear in the text."""
from __future__ import annotations

import random
import time

import pytest

from gateway.tokenizer.specials import SpecialSplitter


def partition_like_llama_cpp(text: str, specials: list[tuple[str, int]], plain=(), always=(), literal=()) -> list:
    """llama.cpp's tokenizer_st_partition, literally: each special longest first, split every raw
    fragment at its leftmost non-overlapping occurrences. Plain spans hide all but `always` ids,
    literal spans (Reame's, for client text) hide every id."""
    fragments: list = [(0, len(text))]
    for special, token_id in sorted(specials, key=lambda s: (-len(s[0]), s[1])):
        out = []
        for fragment in fragments:
            if isinstance(fragment, int):
                out.append(fragment)
                continue
            start, end = fragment
            pos = start
            while (found := text.find(special, pos, end)) >= 0:
                hidden = (token_id not in always and any(s < found + len(special) and found < e for s, e in plain)
                          or any(s < found + len(special) and found < e for s, e in literal))
                if hidden:
                    pos = found + 1
                    continue
                if found > start:
                    out.append((start, found))
                out.append(token_id)
                start = pos = found + len(special)
            if start < end:
                out.append((start, end))
        fragments = out
    return [text[f[0]:f[1]] if isinstance(f, tuple) else f for f in fragments]


SPECIALS = [("<|im_start|>", 1), ("<|im_end|>", 2), ("ab", 3), ("ba", 4), ("aa", 5), ("aaa", 6), ("\n", 7),
            ("\n\n", 8), ("<", 9), ("b", 10)]


def test_same_partition_as_llama_cpp_on_random_texts():
    rng = random.Random(0)
    alphabet = ["a", "b", "<|im_start|>", "<|im_end|>", "\n", "<", "x", "|>"]
    always = {7, 8, 10}
    splitter = SpecialSplitter(SPECIALS, always=always)
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
        assert splitter.split(text) == partition_like_llama_cpp(text, SPECIALS), repr(text)
        if text:
            start = rng.randrange(len(text))
            plain = [(start, rng.randrange(start, len(text)) + 1)]
            expected = partition_like_llama_cpp(text, SPECIALS, plain, always)
            assert splitter.split(text, plain) == expected, (repr(text), plain)
            expected = partition_like_llama_cpp(text, SPECIALS, literal=plain)
            assert splitter.split(text, literal=plain) == expected, (repr(text), plain)
            assert not any(isinstance(p, int) for p in splitter.split(text[start:plain[0][1]], literal=[
                (0, plain[0][1] - start)]))


def test_longer_special_wins_even_when_a_shorter_one_starts_earlier():
    assert SpecialSplitter([("ab", 1), ("bcd", 2)]).split("abcd") == ["a", 2]


@pytest.mark.parametrize("unit", ["<|im_start|><|im_end|>", "aaaaab\n\n"])
def test_time_is_linear_in_the_number_of_specials(unit):
    # The sorted-list version took 0.83 s for 20,000 pairs and 7.7 s for 80,000 (x9 for x4).
    splitter = SpecialSplitter(SPECIALS)

    def seconds(n: int) -> float:
        text = unit * n
        best = float("inf")
        for _ in range(5):  # best of 5: a noisy neighbour slows single runs by 2x here
            started = time.perf_counter()
            splitter.split(text)
            best = min(best, time.perf_counter() - started)
        return best

    small, large = seconds(10_000), seconds(40_000)
    assert large < 9 * small, (small, large)    # linear: about 4x; quadratic: 16x
