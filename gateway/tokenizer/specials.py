"""Cutting special tokens out of raw text before tokenization, as llama.cpp does.

llama.cpp (`tokenizer_st_partition`) takes the special tokens longest first and, for each, splits
every remaining raw fragment at all of its non-overlapping occurrences, leftmost first. A longer
token therefore wins over a shorter one wherever they overlap, even when the shorter one starts
earlier, which a single leftmost-longest regex scan would get wrong.

Doing that literally is one `str.find` per special token (Gemma 3 has 6,414) per fragment. Instead
one regex over a trie of all texts finds, at each position, the longest special starting there;
every special starting there is a prefix of it, so the occurrences of all of them are known, and
the longest-first claiming is replayed on that short list.
"""
from __future__ import annotations

import bisect
import re


class SpecialSplitter:
    """Splits text into raw fragments (str) and special token ids (int)."""

    def __init__(self, specials: list[tuple[str, int]]):
        # llama.cpp sorts by length only (std::sort, unstable); ties are ordered by id here.
        ordered = sorted(specials, key=lambda s: (-len(s[0]), s[1]))
        self._texts = [text for text, _ in ordered]
        self._ids = [token_id for _, token_id in ordered]
        rank = {text: r for r, text in enumerate(self._texts)}
        # For each special text, the ranks of the specials that are prefixes of it (itself included).
        self._prefixes = {
            text: [rank[text[:k]] for k in range(1, len(text) + 1) if text[:k] in rank]
            for text in self._texts
        }
        self._finder = re.compile("(?=(" + _trie_pattern(self._texts) + "))") if ordered else None

    def split(self, text: str) -> list[str | int]:
        if self._finder is None or not text:
            return [text] if text else []
        occurrences = [(r, m.start()) for m in self._finder.finditer(text)
                       for r in self._prefixes[m.group(1)]]
        if not occurrences:
            return [text]
        occurrences.sort()

        starts: list[int] = []      # claimed spans, disjoint, sorted by start
        ends: list[int] = []
        owners: list[int] = []
        last_rank, last_end = -1, 0
        for r, start in occurrences:
            end = start + len(self._texts[r])
            if r == last_rank and start < last_end:
                continue            # overlaps this token's previous match in the same scan
            i = bisect.bisect_right(starts, start)
            if (i > 0 and ends[i - 1] > start) or (i < len(starts) and starts[i] < end):
                continue            # overlaps a longer (or earlier-ranked) special already cut out
            starts.insert(i, start)
            ends.insert(i, end)
            owners.insert(i, self._ids[r])
            last_rank, last_end = r, end

        pieces: list[str | int] = []
        pos = 0
        for start, end, token_id in zip(starts, ends, owners):
            if start > pos:
                pieces.append(text[pos:start])
            pieces.append(token_id)
            pos = end
        if pos < len(text):
            pieces.append(text[pos:])
        return pieces


def _trie_pattern(texts: list[str]) -> str:
    """A regex matching the longest of `texts` at a position (alternatives differ in first char)."""
    root: dict = {}
    for text in texts:
        node = root
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = True

    def pattern(node: dict) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        # Greedy optional: a longer special is tried before settling on the one ending here.
        return "(?:" + body + ")?" if "" in node else body

    return pattern(root)
