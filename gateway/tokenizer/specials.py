"""Cutting special tokens out of raw text before tokenization, as llama.cpp does.

llama.cpp (`tokenizer_st_partition`) takes the special tokens longest first and, for each, splits
every remaining raw fragment at all of its non-overlapping occurrences, leftmost first. A longer
token therefore wins over a shorter one wherever they overlap, even when the shorter one starts
earlier, which a single leftmost-longest regex scan would get wrong.

Doing that literally is one `str.find` per special token (Gemma 3 has 6,414) per fragment. Here
the specials are put in passes, in llama.cpp's order: consecutive specials of one length whose
occurrences can never overlap each other share a pass (40 passes for Gemma 3, 7 for SmolLM2),
and each pass is one regex scan (a trie of its texts) over the text with the spans claimed so
far masked out, so that no match can reach into them. A scan finds leftmost non-overlapping
matches, which is what the per-token loop finds when the pass's tokens cannot overlap.

The cost is linear in the text. Inserting each claim into a sorted list was not: 40,000
`<|im_start|><|im_end|>` pairs (880 KB) took 2.6 s, and 400 KB of spaces took 29 s through
Gemma's 31 whitespace-run tokens; now 0.26 s and 0.22 s (tests/unit/test_specials.py).

`plain` spans (llama.cpp's parse_special=False) are scanned with them masked out for every pass
that is not `always` cut; `literal` spans (text a client wrote inside a chat message or around a
fill-in-the-middle cursor) for every pass, so no special token's text there, not even a
user-defined one, becomes a special token.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence


class SpecialSplitter:
    """Splits text into raw fragments (str) and special token ids (int)."""

    def __init__(self, specials: list[tuple[str, int]], always: Iterable[int] = ()):
        """`always`: ids still cut out inside plain spans (llama.cpp's user-defined tokens)."""
        always = frozenset(always)
        # llama.cpp sorts by length only (std::sort, unstable); ties are ordered by id here.
        ordered = sorted(((text, i) for text, i in specials if text), key=lambda s: (-len(s[0]), s[1]))
        groups: list[list[tuple[str, int]]] = []
        heads: set[str] = set()     # proper prefixes of the last group's texts
        tails: set[str] = set()     # and their proper suffixes
        for text, token_id in ordered:
            group = groups[-1] if groups else None
            overlaps = any(text[k:] in heads or text[:k] in tails for k in range(1, len(text)))
            if (group is None or len(group[0][0]) != len(text) or overlaps
                    or (group[0][1] in always) != (token_id in always)):
                group = []
                groups.append(group)
                heads, tails = set(), set()
            group.append((text, token_id))
            heads.update(text[:k] for k in range(1, len(text)))
            tails.update(text[k:] for k in range(1, len(text)))
        used = set("".join(text for text, _ in ordered))
        # Stands in for claimed (and plain) text while scanning: no special contains it.
        self._mask = next(chr(c) for c in range(0xE000, 0x110000) if chr(c) not in used)
        self._passes = [(re.compile(_trie_pattern([t for t, _ in group])), {t: i for t, i in group},
                         group[0][1] in always) for group in groups]

    def split(self, text: str, plain: Sequence[tuple[int, int]] = (),
              literal: Sequence[tuple[int, int]] = ()) -> list[str | int]:
        """`plain`: disjoint (start, end) spans of `text`, in order, where only `always` ids are cut;
        `literal`: such spans where none is."""
        if not self._passes or not text:
            return [text] if text else []
        claims: list[tuple[int, int, int]] = []     # (start, end, id), disjoint
        scanned = _masked(text, literal, self._mask) if literal else text   # claimed spans masked
        scanned_plain = _masked(scanned, plain, self._mask) if plain else scanned
        for finder, ids, always in self._passes:
            found = [(m.start(), m.end(), ids[m.group()])
                     for m in finder.finditer(scanned if always else scanned_plain)]
            if not found:
                continue
            claims.extend(found)
            spans = [(start, end) for start, end, _ in found]
            scanned = _masked(scanned, spans, self._mask)
            scanned_plain = _masked(scanned_plain, spans, self._mask) if plain else scanned
        if not claims:
            return [text]
        claims.sort()
        pieces: list[str | int] = []
        pos = 0
        for start, end, token_id in claims:
            if start > pos:
                pieces.append(text[pos:start])
            pieces.append(token_id)
            pos = end
        if pos < len(text):
            pieces.append(text[pos:])
        return pieces


def _masked(text: str, spans: Sequence[tuple[int, int]], mask: str) -> str:
    """`text` with each of the ordered, disjoint `spans` replaced by as many `mask` characters."""
    parts, pos = [], 0
    for start, end in spans:
        parts.append(text[pos:start])
        parts.append(mask * (end - start))
        pos = end
    parts.append(text[pos:])
    return "".join(parts)


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
