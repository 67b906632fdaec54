"""Byte-level BPE pre-tokenization: the regexes llama.cpp runs before merging (llama-vocab.cpp).

llama.cpp splits text in stages. Each regex of a pre-type runs inside every piece the previous
stage produced (a lookahead cannot see past a piece), and the text between two matches is kept
as a piece of its own. Its hand-written GPT-2 and Llama-3 splitters, and its std::regex fallback
on "collapsed" text, all agree with the patterns below once `\\s`, `\\p{L}`, `\\p{N}` and `\\p{P}`
are spelled out as the exact classes llama.cpp uses (Python's own `\\s` also matches
U+001C..U+001F, which llama.cpp's does not).
"""
from __future__ import annotations

import functools
import re
import unicodedata

from shared.errors import TokenizerError

# Unicode White_Space, the set llama.cpp's unicode tables mark as whitespace.
_WHITESPACE = r"\t-\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# Patterns use %(L)s letters, %(N)s numbers, %(P)s punctuation, %(S)s whitespace (class bodies).
_GPT2 = (r"'s|'t|'re|'ve|'m|'ll|'d| ?[%(L)s]+| ?[%(N)s]+| ?[^%(S)s%(L)s%(N)s]+"
         r"|[%(S)s]+(?![^%(S)s])|[%(S)s]+")
_LLAMA3_HEAD = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                r"|[^\r\n%(L)s%(N)s]?[%(L)s]+")
_LLAMA3_TAIL = (r"| ?[^%(S)s%(L)s%(N)s]+[\r\n]*|[%(S)s]*[\r\n]+"
                r"|[%(S)s]+(?![^%(S)s])|[%(S)s]+")
_LLAMA3 = _LLAMA3_HEAD + r"|[%(N)s]{1,3}" + _LLAMA3_TAIL
_QWEN2 = _LLAMA3_HEAD + r"|[%(N)s]" + _LLAMA3_TAIL
_ONE_NUMBER = r"[%(N)s]"

# tokenizer.ggml.pre -> the stages llama.cpp runs for it.
PRE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (r"[%(P)s\$\+<=>\^~\|]+", _GPT2, r"[%(N)s]+", r"[0-9][0-9][0-9]"),
    "gpt-2": (_GPT2,),
    "smollm": (_ONE_NUMBER, _GPT2),
    "starcoder": (_ONE_NUMBER, _GPT2),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
}


@functools.cache
def _classes() -> dict[str, str]:
    """Class bodies for \\p{L}, \\p{N}, \\p{P} built from this Python's Unicode database."""
    ranges: dict[str, list[tuple[int, int]]] = {"L": [], "N": [], "P": []}
    run_cat, run_start = "", 0
    for cp in range(0x110001):
        cat = unicodedata.category(chr(cp))[0] if cp < 0x110000 else ""
        if cat != run_cat:
            if run_cat in ranges:
                ranges[run_cat].append((run_start, cp - 1))
            run_cat, run_start = cat, cp

    def body(spans: list[tuple[int, int]]) -> str:
        return "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in spans)

    return {"L": body(ranges["L"]), "N": body(ranges["N"]), "P": body(ranges["P"]), "S": _WHITESPACE}


@functools.cache
def _compiled(pre: str) -> tuple[re.Pattern, ...]:
    classes = _classes()
    return tuple(re.compile(p % classes) for p in PRE_TYPES[pre])


class PreTokenizer:
    """Splits raw text into the words that BPE merges within."""

    def __init__(self, pre: str, *, source: str = "model"):
        if pre not in PRE_TYPES:
            raise TokenizerError(
                f"{source}: tokenizer pre-type '{pre}' is not supported "
                f"(supported: {', '.join(sorted(PRE_TYPES))})")
        self.pre = pre
        self._stages = _compiled(pre)

    def split(self, text: str) -> list[str]:
        spans = [(0, len(text))]
        for pattern in self._stages:
            spans = _split_spans(pattern, text, spans)
        return [text[a:b] for a, b in spans]


def _split_spans(pattern: re.Pattern, text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in spans:
        pos = start
        # endpos makes the piece's end the end of the string, as llama.cpp's per-piece search sees it.
        for match in pattern.finditer(text, start, end):
            a, b = match.span()
            if a > pos:
                out.append((pos, a))
            if b > a:
                out.append((a, b))
            pos = b
        if pos < end:
            out.append((pos, end))
    return out
