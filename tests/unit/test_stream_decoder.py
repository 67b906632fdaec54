"""StreamDecoder: pieces never break a character and always add up to the one-shot decode."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.tokenizer import StreamDecoder, Tokenizer
from shared.vocab import BYTE, CONTROL, NORMAL, Vocab
from tests.conftest import load_reference

SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def stream(tok: Tokenizer, ids: list[int], skip_special: bool = True) -> list[str]:
    decoder = StreamDecoder(tok, skip_special=skip_special)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def test_golden_texts_stream_to_the_one_shot_decode(tok):
    for name in ("smollm2-135m-instruct-q4_1.json", "gemma-3-270m-q4_k_m.json"):
        for case in load_reference(name)["tokenize"]:
            ids = tok.encode(case["text"])
            for skip in (True, False):
                assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip)


@SETTINGS
@given(text=st.text(max_size=80))
def test_pieces_are_whole_characters_and_add_up(tok, text):
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    # SmolLM2 cannot spell some bytes (llama.cpp drops them); any other text comes back whole,
    # so no piece carried half a character
    if "\ufffd" not in text and tok.decode(ids) == text:
        assert not any("\ufffd" in p for p in pieces)


@SETTINGS
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=40))
def test_any_id_sequence_adds_up_even_when_utf8_is_broken(smollm, ids):
    # random ids cut characters anywhere; held-back bytes and U+FFFD must match the one-shot decode
    assert "".join(stream(smollm, ids)) == smollm.decode(ids)
    assert "".join(stream(smollm, ids, False)) == smollm.decode(ids, skip_special=False)


def test_emoji_split_over_byte_level_tokens_is_held_back(smollm):
    ids = smollm.encode("🙂")
    assert len(ids) > 1                       # one emoji, several byte-level tokens
    pieces = stream(smollm, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[-2] == "🙂" and pieces[-1] == ""


def test_byte_fallback_tokens_are_held_back(gemma):
    # find a character Gemma spells with <0xXX> byte tokens
    byte_ids = {i for i in range(gemma.vocab_size) if gemma.vocab.types[i] == BYTE}
    for cp in [*range(0x1D400, 0x1D500), *range(0x10000, 0x10400), *range(0x2F800, 0x2FA1F)]:
        ids = gemma.encode(chr(cp), add_special=False)
        if ids and set(ids) <= byte_ids:
            break
    else:
        pytest.skip("no byte-fallback character found")
    assert len(ids) == len(chr(cp).encode())
    assert stream(gemma, ids) == [""] * (len(ids) - 1) + [chr(cp), ""]


def test_cut_character_at_the_end_becomes_replacement_char(smollm):
    ids = smollm.encode("日")[:-1]
    decoder = StreamDecoder(smollm)
    assert [decoder.push(i) for i in ids] == [""] * len(ids)
    assert decoder.flush() == "\ufffd" == smollm.decode(ids)


def test_control_tokens_follow_skip_special(gemma):
    ids = gemma.encode("hi<end_of_turn>")
    assert "".join(stream(gemma, ids)) == "hi"
    assert "".join(stream(gemma, ids, skip_special=False)) == "<bos>hi<end_of_turn>"


def test_sentencepiece_space_prefix_matches_decode():
    texts = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁", "▁a", "a", "b"]
    vocab = Vocab(model="llama", pre="default", tokens=texts,
                  types=[2, CONTROL, CONTROL, *[BYTE] * 256, NORMAL, NORMAL, NORMAL, NORMAL],
                  scores=[0.0] * len(texts), merges=[], bos_id=1, eos_id=2, eot_id=None,
                  add_bos=True, add_eos=False, add_space_prefix=True, ignore_merges=False,
                  chat_template=None, arch="llama", source="test")
    tok = Tokenizer(vocab)
    for text in ["a b", "ab", " a", "é a"]:
        for ids in (tok.encode(text), tok.encode(text, add_special=False)):
            assert "".join(stream(tok, ids)) == tok.decode(ids)
    assert "".join(stream(tok, tok.encode("a b", add_special=False))) == "a b"
