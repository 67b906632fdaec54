"""Tokenizer behaviour: round trips, agreement with literal ports of llama.cpp's algorithms, errors.

The ports below ("reference twins") are slow and obvious on purpose: priority merges done by
rescanning all pairs, special tokens cut out with str.find, and llama.cpp's hand-written GPT-2 and
Llama-3 splitters walked one character at a time. Hypothesis checks the fast path against them.
The golden ids from llama.cpp itself are checked in tests/model/test_tokenizer_golden.py.
"""
from __future__ import annotations

import functools
import unicodedata

import gguf
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gateway.tokenizer import Tokenizer
from gateway.tokenizer.pretokenize import PreTokenizer
from gateway.tokenizer.specials import SpecialSplitter
from shared.vocab import BYTE, CONTROL, NORMAL, USER_DEFINED, Vocab
from shared.errors import InvalidRequestError, TokenizerError
from tests.conftest import load_reference

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

# Pieces that stress the edge cases: specials of both models, whitespace runs, contractions,
# digits, letters of several scripts, marks, symbols, emoji with modifiers, Unicode spaces.
FRAGMENTS = [" ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n ", "'s", "'LL", "'re", "'", "123",
             "4567", "3.14", "-42", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>",
             "<bos>", "<eos>", "<b>", "</s>", "<", "|>", "Hello", " world", "naïve", "é", "e\u0301",
             "日本語", "Привет", "Γειά", "🙂", "👍🏽", "∑", "½", "Ⅷ", "\u00a0", "\u2028", "\u3000",
             "\x1c", "\u200d", "ǅ", "٣", "{\"k\": [1]}", "aaaa", "::", "$+<=>^~|", "...", "!?"]
TEXTS = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=10).map("".join)


# -- reference twins --------------------------------------------------------------------------

WHITESPACE = set("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {
    chr(c) for c in range(0x2000, 0x200B)}


def kind(text: str, i: int) -> str | None:
    """'S' whitespace, 'L' letter, 'N' number, 'O' anything else, None past the end."""
    if i >= len(text):
        return None
    if text[i] in WHITESPACE:
        return "S"
    cat = unicodedata.category(text[i])[0]
    return cat if cat in "LN" else "O"


def split_gpt2(text: str) -> list[str]:
    out, pos, n = [], 0, len(text)
    while pos < n:
        start, c = pos, text[pos]
        if c == "'" and pos + 1 < n and text[pos + 1] in "stmd":
            pos += 2
        elif c == "'" and text[pos + 1:pos + 3] in ("re", "ve", "ll"):
            pos += 3
        elif (k := kind(text, pos + 1) if c == " " else kind(text, pos)) in ("L", "N", "O"):
            pos += c == " "
            while kind(text, pos) == k:
                pos += 1
        else:
            run = 0
            while kind(text, pos + run) == "S":
                run += 1
            pos += run - 1 if run > 1 and pos + run < n else run
        out.append(text[start:pos])
    return out


def split_llama3(text: str, digits: int = 3) -> list[str]:
    out, pos, n = [], 0, len(text)
    while pos < n:
        start, c = pos, text[pos]
        nxt = text[pos + 1:pos + 3].lower()
        if c == "'" and nxt[:1] in ("s", "t", "m", "d") and nxt[:1]:
            pos += 2
        elif c == "'" and nxt in ("re", "ve", "ll"):
            pos += 3
        elif c not in "\r\n" and kind(text, pos) != "N" and "L" in (kind(text, pos), kind(text, pos + 1)):
            pos += 1
            while kind(text, pos) == "L":
                pos += 1
        elif kind(text, pos) == "N":
            while kind(text, pos) == "N":
                pos += 1
                if pos - start == digits:
                    out.append(text[start:pos])
                    start = pos
            if pos == start:
                continue
        elif (kind(text, pos + 1) if c == " " else kind(text, pos)) == "O":
            pos += c == " "
            while kind(text, pos) == "O":
                pos += 1
            while pos < n and text[pos] in "\r\n":
                pos += 1
        else:
            run, last_newline = 0, 0
            while kind(text, pos + run) == "S":
                if text[pos + run] in "\r\n":
                    last_newline = pos + run + 1
                run += 1
            pos = last_newline or pos + (run - 1 if run > 1 and pos + run < n else run)
        out.append(text[start:pos])
    return out


def split_specials(text: str, specials: list[tuple[str, int]]) -> list[str | int]:
    """llama.cpp's tokenizer_st_partition: longest special first, str.find in each raw fragment."""
    fragments: list[str | int] = [text] if text else []
    for special, token_id in specials:
        out: list[str | int] = []
        for frag in fragments:
            while isinstance(frag, str) and (at := frag.find(special)) >= 0:
                out.extend([frag[:at]] if at else [])
                out.append(token_id)
                frag = frag[at + len(special):]
            if frag != "":
                out.append(frag)
        fragments = out
    return fragments


def merge(symbols: list[str], priority) -> list[str]:
    """Repeatedly merge the adjacent pair of best priority (None = no merge), leftmost on ties."""
    while True:
        best = None
        for j in range(len(symbols) - 1):
            p = priority(symbols[j], symbols[j + 1])
            if p is not None and (best is None or p < best[0]):
                best = (p, j)
        if best is None:
            return symbols
        j = best[1]
        symbols[j:j + 2] = [symbols[j] + symbols[j + 1]]


@functools.cache
def reference_tables(tok: Tokenizer, parse_special: bool):
    v = tok.vocab
    kinds = (CONTROL, USER_DEFINED, 2) if parse_special else (USER_DEFINED,)
    specials = sorted(((t, i) for i, (t, k) in enumerate(zip(v.tokens, v.types)) if k in kinds),
                      key=lambda s: (-len(s[0]), s[1]))
    ranks = {tuple(m.split(" ", 1)): r for r, m in reversed(list(enumerate(v.merges)))}
    return specials, ranks


def byte_alphabet() -> dict[int, str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def reference_encode(tok: Tokenizer, text: str, parse_special: bool = True) -> list[int]:
    v, table = tok.vocab, tok_ids(tok)
    specials, ranks = reference_tables(tok, parse_special)
    out = [v.bos_id] if v.add_bos else []
    prev_special = True
    for frag in split_specials(text, specials):
        if isinstance(frag, int):
            out.append(frag)
            prev_special = True
            continue
        if v.model == "llama":
            word = ((" " if v.add_space_prefix and prev_special else "") + frag).replace(" ", "▁")
            score = lambda a, b: -v.scores[table[a + b]] if a + b in table else None  # noqa: E731
            for sym in merge(list(word), score):
                out.extend([table[sym]] if sym in table else
                           [table[f"<0x{b:02X}>"] for b in sym.encode()])
        else:
            words = _isolate_numbers(frag) if v.pre == "smollm" else [frag]
            alphabet = byte_alphabet()
            for word in (w for piece in words for w in split_gpt2(piece)):
                symbols = list("".join(alphabet[b] for b in word.encode()))
                # a symbol outside the vocabulary is dropped (its bytes are not tokens either)
                out.extend(table[s] for s in merge(symbols, lambda a, b: ranks.get((a, b)))
                           if s in table)
        prev_special = False
    return out


def _isolate_numbers(text: str) -> list[str]:
    pieces, start = [], 0
    for i in range(len(text)):
        if kind(text, i) == "N":
            pieces.extend([text[start:i], text[i]] if i > start else [text[i]])
            start = i + 1
    return pieces + ([text[start:]] if start < len(text) else [])


@functools.cache
def tok_ids(tok: Tokenizer) -> dict[str, int]:
    return {t: i for i, t in enumerate(tok.vocab.tokens)}


# -- agreement with the twins --------------------------------------------------------------------

@SETTINGS
@given(text=TEXTS)
def test_encode_matches_llama_cpp_algorithm(tok, text):
    assert tok.encode(text) == reference_encode(tok, text)


@SETTINGS
@given(text=TEXTS)
def test_encode_without_special_parsing_matches_llama_cpp_algorithm(tok, text):
    assert tok.encode(text, parse_special=False) == reference_encode(tok, text, parse_special=False)


@settings(max_examples=300, deadline=None)
@given(text=TEXTS)
def test_pretokenizers_match_llama_cpp_splitters(text):
    assert PreTokenizer("gpt-2").split(text) == split_gpt2(text)
    assert PreTokenizer("llama-bpe").split(text) == split_llama3(text)
    assert PreTokenizer("qwen2").split(text) == split_llama3(text, digits=1)
    assert PreTokenizer("smollm").split(text) == [w for p in _isolate_numbers(text) for w in split_gpt2(p)]


def test_default_pretokenizer_runs_its_four_stages_in_turn():
    # punctuation runs, then GPT-2 words, then number runs, then groups of three digits
    assert PreTokenizer("default").split("a, 12345 b!!") == ["a", ",", " ", "123", "45", " b", "!!"]


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abcx<>", max_size=16))
def test_special_splitter_matches_llama_cpp_partition(text):
    specials = [("abc", 10), ("xa", 11), ("<a>", 12), ("b", 13), ("bc", 14), ("<", 15)]
    ordered = sorted(specials, key=lambda s: (-len(s[0]), s[1]))
    assert SpecialSplitter(specials).split(text) == split_specials(text, ordered)


def test_longer_special_wins_even_when_it_starts_later():
    assert SpecialSplitter([("abc", 1), ("xa", 2)]).split("xabc") == ["x", 1]


# -- round trips and facts of the real models ----------------------------------------------------

@pytest.mark.parametrize("name", ["smollm2-135m-instruct-q4_1.json", "gemma-3-270m-q4_k_m.json"])
def test_round_trip_on_golden_texts(name, request):
    tok = request.getfixturevalue("smollm" if name.startswith("smollm") else "gemma")
    for case in load_reference(name)["tokenize"]:
        text = case["text"]
        assert tok.decode(tok.encode(text, add_special=False), skip_special=False) == text
        assert tok.decode(tok.encode(text, parse_special=False)) == text


def spellable(tok: Tokenizer, text: str) -> bool:
    """False where no round trip is possible: SmolLM2 lacks some bytes (0x04, 0xF1, ...), which
    llama.cpp drops; SentencePiece reads a literal "▁" as a space."""
    if tok.model != "gpt2":
        return "\u2581" not in text
    alphabet, table = byte_alphabet(), tok_ids(tok)
    return all(alphabet[b] in table for b in text.encode())


@SETTINGS
@given(text=st.text(max_size=60) | TEXTS)
def test_round_trip_on_random_unicode(tok, text):
    assume(spellable(tok, text))
    assert tok.decode(tok.encode(text, parse_special=False)) == text
    assert tok.decode(tok.encode(text, add_special=False), skip_special=False) == text


def test_model_facts(smollm, gemma):
    assert (smollm.arch, smollm.model, smollm.add_bos) == ("llama", "gpt2", False)
    assert (smollm.bos_id, smollm.eos_id, smollm.vocab_size) == (1, 2, 49152)
    assert smollm.eot_ids == {smollm.token_id("<|im_end|>"), smollm.token_id("<|endoftext|>")}
    assert "<|im_start|>" in smollm.chat_template
    assert (gemma.arch, gemma.model, gemma.add_bos, gemma.chat_template) == ("gemma3", "llama", True, None)
    assert (gemma.bos_id, gemma.eos_id, gemma.vocab_size) == (2, 1, 262144)
    assert gemma.eot_ids == {1, gemma.token_id("<end_of_turn>")}


def test_special_parsing_switch(smollm, gemma):
    assert smollm.encode("<|im_start|>")[0] == 1
    assert 1 not in smollm.encode("<|im_start|>", parse_special=False)
    assert gemma.encode("<start_of_turn>", add_special=False) == [105]
    assert 105 not in gemma.encode("<start_of_turn>", parse_special=False)
    # user-defined tokens (Gemma's "\n", "<b>") are cut out even without special parsing
    assert gemma.encode("a\nb", parse_special=False, add_special=False)[1] == gemma.token_id("\n")


def test_decode_hides_control_tokens_only_when_asked(gemma):
    ids = gemma.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert gemma.decode(ids) == "user\nhi"
    assert gemma.decode(ids, skip_special=False) == "<bos><start_of_turn>user\nhi<end_of_turn>"
    assert gemma.token_bytes(105) == b"<start_of_turn>"
    assert gemma.token_bytes(105, skip_special=True) == b""


def test_bytes_the_vocabulary_cannot_spell_are_dropped_like_llama_cpp(smollm):
    # SmolLM2 has no token for byte 0x04: llama.cpp drops it, and it still separates its neighbours
    assert smollm.encode("(\x04)") == smollm.encode("(") + smollm.encode(")")


def test_bad_token_id_is_a_client_error(smollm):
    with pytest.raises(InvalidRequestError, match="out of range"):
        smollm.decode([smollm.vocab_size])


# -- SentencePiece rules on a small in-memory vocabulary -----------------------------------------

def spm_vocab(**overrides) -> Vocab:
    texts = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)],
             "▁", "H", "e", "l", "o", "He", "ll", "llo", "Hello", "▁Hello", "<t>"]
    types = [2, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * 10, USER_DEFINED]
    fields = dict(model="llama", pre="default", tokens=texts, types=types,
                  scores=[-float(i) for i in range(len(texts))], merges=[], bos_id=1, eos_id=2,
                  eot_id=None, add_bos=True, add_eos=False, add_space_prefix=True,
                  ignore_merges=False, chat_template=None, arch="llama", source="test")
    return Vocab(**{**fields, **overrides})


def test_space_prefix_and_byte_fallback():
    tok = Tokenizer(spm_vocab())
    hello, space = tok.token_id("▁Hello"), tok.token_id("▁")
    assert tok.encode("Hello") == [1, hello]
    assert tok.encode("Hello", add_special=False) == [hello]
    # after a special token the space prefix comes back (llama.cpp's is_prev_special rule)
    assert tok.encode("<t>Hello", add_special=False) == [tok.token_id("<t>"), hello]
    assert tok.encode("é", add_special=False) == [space, 3 + 0xC3, 3 + 0xA9]
    assert tok.decode([hello]) == "Hello"          # the added space is taken off again...
    assert tok.decode([1, hello]) == " Hello"      # ...but not after a BOS, as in llama.cpp


def test_add_eos_is_honoured():
    tok = Tokenizer(spm_vocab(add_eos=True, add_space_prefix=False))
    assert tok.encode("Hello") == [1, tok.token_id("Hello"), 2]
    assert tok.encode("Hello", add_special=False) == [tok.token_id("Hello")]


# -- errors from the file ----------------------------------------------------------------------

def write_gguf(path, model: str | None, pre: str | None = None) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    if model is not None:
        writer.add_tokenizer_model(model)
        writer.add_token_list(["a", "b", "ab"])
        writer.add_token_merges(["a b"])
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("model, pre, message", [
    ("gpt2", "made-up", "pre-type 'made-up' is not supported"),
    ("bert", None, "tokenizer model 'bert' is not supported"),
    (None, None, "has no tokenizer"),
])
def test_unsupported_files_fail_with_one_clear_line(tmp_path, model, pre, message):
    path = write_gguf(tmp_path / f"{model}-{pre}.gguf", model, pre)
    with pytest.raises(TokenizerError, match=message) as info:
        Tokenizer.from_gguf(path)
    assert "\n" not in info.value.message


def test_missing_file_is_a_tokenizer_error(tmp_path):
    with pytest.raises(TokenizerError, match="cannot read tokenizer"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")


def test_small_gpt2_file_tokenizes(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "small.gguf", "gpt2", "smollm"))
    assert tok.encode("ab") == [2]
    assert tok.encode("ba") == [1, 0]


@pytest.mark.parametrize("name", ["smollm", "gemma"])
def test_a_long_fragment_seen_before_gets_the_ids_a_fresh_tokenizer_gives(name, request):
    from gateway.tokenizer.piece_cache import PieceCache

    tok = request.getfixturevalue(name)
    uncached = Tokenizer(tok._vocab)
    uncached._piece_ids = PieceCache(min_chars=10**9)  # keeps nothing
    system = " ".join(f"tool_{i}(path: str) reads {i} files;" for i in range(40))  # one long fragment
    first = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nhi<|im_end|>"
    tok.encode(first)
    again = f"<start_of_turn>user\n{system}<end_of_turn>\n<|im_start|>user\nanother question<|im_end|>"
    assert len(tok._piece_ids) >= 1
    for text in (first, again, system, " " + system):
        assert tok.encode(text) == uncached.encode(text)
        assert tok.encode(text, parse_special=False) == uncached.encode(text, parse_special=False)
