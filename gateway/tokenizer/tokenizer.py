"""Text <-> token ids for a GGUF model, giving the same ids as llama.cpp.

encode = cut special tokens out (specials.py) -> split each raw fragment into words
(pretokenize.py for byte-level BPE; the whole fragment, spaces as "▁", for SentencePiece)
-> merge every word in one call into the Rust `tokenizers` model (merging.py) -> put the
special ids back between the fragments' tokens. Long fragments' ids are kept (piece_cache.py).
"""
from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from shared.errors import InvalidRequestError, TokenizerError
from shared.vocab import (CONTROL, SPACE_MARK, UNKNOWN, USER_DEFINED, Vocab, end_of_generation_ids, piece_table,
                          read_vocab)

from .merging import build_merger
from .piece_cache import PieceCache
from .pretokenize import PreTokenizer
from .specials import SpecialSplitter

_MARKER = re.compile(r"<\|[^|<>]+\|>")     # <|fim_prefix|>, <|endoftext|>: never a piece of prose
MERGE_BATCH = 2048      # words per call into the Rust merger (see Tokenizer._merge)


class Tokenizer:
    """Immutable and thread-safe once built; share one per model."""

    def __init__(self, vocab: Vocab):
        self._vocab = vocab
        self._spm = vocab.model == "llama"
        self._pre = None if self._spm else PreTokenizer(vocab.pre, source=vocab.source)
        self._merger = build_merger(vocab)
        self._ids = {text: i for i, text in enumerate(vocab.tokens)}
        self._pieces = piece_table(vocab)
        # Control and unknown tokens render as nothing when special tokens are skipped.
        self._hidden = frozenset(i for i, t in enumerate(vocab.types) if t in (CONTROL, UNKNOWN))
        specials = [(text, i) for i, (text, t) in enumerate(zip(vocab.tokens, vocab.types))
                    if t in (CONTROL, USER_DEFINED, UNKNOWN)]
        # Without special parsing llama.cpp still cuts out user-defined tokens.
        user_defined = [i for _, i in specials if vocab.types[i] == USER_DEFINED]
        self._splitter = SpecialSplitter(specials, always=user_defined)
        self._control_texts = frozenset(text for text, i in specials if vocab.types[i] != USER_DEFINED)
        self._user_defined_texts = frozenset(vocab.tokens[i] for i in user_defined if vocab.tokens[i])
        self._max_token_bytes = max((len(p) for p in self._pieces), default=1)
        self._eot_ids = end_of_generation_ids(vocab)
        self._piece_ids = PieceCache()

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build from the file's `tokenizer.ggml.*` keys; one build per file version per process."""
        path = Path(path).resolve()
        try:
            stat = os.stat(path)
        except OSError as exc:
            raise TokenizerError(f"cannot read tokenizer from {path}: {exc.strerror}") from exc
        # Building the Rust tokenizer from a 262k-entry vocabulary takes seconds, so repeated
        # requests for the same unchanged file share one Tokenizer.
        return _cached(str(path), stat.st_mtime_ns, stat.st_size)

    # -- encoding --------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True,
               literal: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of `text`, as llama.cpp's llama_tokenize(add_special, parse_special).

        `literal`: ordered, disjoint (start, end) spans of `text` (what a client wrote, inside a
        rendered template or a fill-in-the-middle prompt) where no special token is cut out, not
        even the user-defined ones (Qwen's <tool_call>) that parse_special=False still cuts."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to tokenize must be a string, not {type(text).__name__}")
        vocab = self._vocab
        pieces = self._splitter.split(text, () if parse_special else [(0, len(text))], literal)
        # Each fragment's ids: a special id, ids from the piece cache, or None (merged below).
        parts: list[int | tuple[int, ...] | None] = []
        words: list[str] = []
        misses: list[tuple[str, int]] = []     # (fragment, number of its words) to merge
        prev_special = True
        for piece in pieces:
            if isinstance(piece, int):
                parts.append(piece)
                prev_special = True
                continue
            if self._spm and vocab.add_space_prefix and prev_special:
                piece = " " + piece
            prev_special = False
            cached = self._piece_ids.get(piece)
            if cached is not None:
                parts.append(cached)
                continue
            split = [piece.replace(" ", SPACE_MARK)] if self._spm else self._pre.split(piece)
            words.extend(split)
            misses.append((piece, len(split)))
            parts.append(None)

        ids: list[int] = [vocab.bos_id] if add_special and vocab.add_bos else []
        merged_pieces = iter(self._merge_pieces(words, misses)) if words else iter(())
        for part in parts:
            if part is None:
                ids.extend(next(merged_pieces, ()))
            elif isinstance(part, int):
                ids.append(part)
            else:
                ids.extend(part)
        dropped = len(vocab.tokens)     # merging.DROPPED_BYTE
        if dropped in ids:
            ids = [i for i in ids if i != dropped]
        if add_special and vocab.add_eos:
            ids.append(vocab.eos_id)
        return ids

    def _merge_pieces(self, words: list[str], misses: list[tuple[str, int]]) -> list[list[int]]:
        """The ids of each missed fragment (its words merged in one call with all the others),
        kept in the piece cache."""
        merged, word_ids = self._merge(words)
        out: list[list[int]] = []
        j, first_word = 0, 0
        for piece, n_words in misses:
            first_word += n_words
            start = j
            while j < len(merged) and word_ids[j] < first_word:
                j += 1
            out.append(merged[start:j])
            self._piece_ids.put(piece, out[-1])
        return out

    def _merge(self, words: list[str]) -> tuple[list[int], list[int]]:
        """Token ids of pre-split words, and the index of the word each came from.

        Words are merged independently, so merging them in batches gives the same ids; the Rust
        call holds the GIL, and one call for 240,000 words held it (and stalled the gateway's
        event loop) for 1.3 s, so batches of MERGE_BATCH words (about 10 ms each) let it run."""
        if len(words) <= MERGE_BATCH:
            encoding = self._merger.encode(words, is_pretokenized=True, add_special_tokens=False)
            return encoding.ids, encoding.word_ids
        ids: list[int] = []
        word_ids: list[int] = []
        for first in range(0, len(words), MERGE_BATCH):
            encoding = self._merger.encode(words[first:first + MERGE_BATCH], is_pretokenized=True,
                                           add_special_tokens=False)
            ids.extend(encoding.ids)
            word_ids.extend(w + first for w in encoding.word_ids)
        return ids, word_ids

    # -- decoding --------------------------------------------------------------------------

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes one token stands for (llama.cpp's token_to_piece); may be part of a character."""
        if not 0 <= token_id < len(self._pieces):
            raise InvalidRequestError(
                f"token id {token_id} is out of range for a vocabulary of {len(self._pieces)}")
        if skip_special and token_id in self._hidden:
            return b""
        return self._pieces[token_id]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`, as llama.cpp's llama_detokenize(remove_special=unparse_special=skip_special).

        Invalid UTF-8 (a cut multi-byte character) becomes U+FFFD. llama.cpp's `clean_spaces`
        post-pass (some BPE pre-types) is not applied: the server streams pieces as they come.
        """
        ids = list(ids)
        strip_space = self._vocab.add_space_prefix
        if ids and skip_special and self._vocab.add_bos and ids[0] == self._vocab.bos_id:
            strip_space = False     # as llama.cpp: a leading BOS keeps the next token's space
        parts = [self.token_bytes(i, skip_special) for i in ids]
        if parts and strip_space and parts[0].startswith(b" "):
            parts[0] = parts[0][1:]
        return b"".join(parts).decode("utf-8", errors="replace")

    # -- facts -------------------------------------------------------------------------------

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is exactly `text`, if any."""
        return self._ids.get(text)

    @property
    def control_texts(self) -> frozenset[str]:
        """Texts of the special tokens that only parse_special=True cuts out (e.g. <|im_start|>)."""
        return self._control_texts

    def marker_texts(self, *sources: str) -> frozenset[str]:
        """Texts of the special tokens that mark structure, which a client's text must not produce:
        the control and unknown ones, and the user-defined ones written as `<|...|>`, named by the
        GGUF's FIM keys, or found in the GGUF's chat template or in `sources` (Qwen's <tool_call>).
        The other user-defined tokens are pieces of ordinary text (Gemma's "\\n", runs of spaces,
        "<b>"), cut out of any text as llama.cpp does."""
        where = (self._vocab.chat_template or "", *sources)
        fim = {self._vocab.tokens[i] for i in self._vocab.fim_ids.values() if 0 <= i < len(self._vocab.tokens)}
        return self._control_texts | {
            text for text in self._user_defined_texts
            if len(text.strip()) > 1 and (_MARKER.fullmatch(text) or text in fim or any(text in w for w in where))}

    @property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token: a text of more than n × this has more than n tokens."""
        return self._max_token_bytes

    def token_text(self, token_id: int) -> str:
        return self._vocab.tokens[token_id]

    @property
    def vocab(self) -> Vocab:
        """The GGUF tokenizer metadata this was built from."""
        return self._vocab

    @property
    def bos_id(self) -> int | None:
        return self._vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self._vocab.eos_id

    @property
    def eot_ids(self) -> frozenset[int]:
        """Ids that end a turn: EOS, the chat end-of-turn tokens present, and eot_token_id."""
        return self._eot_ids

    @property
    def vocab_size(self) -> int:
        return len(self._vocab.tokens)

    @property
    def add_bos(self) -> bool:
        return self._vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self._vocab.add_eos

    @property
    def add_space_prefix(self) -> bool:
        return self._vocab.add_space_prefix

    @property
    def chat_template(self) -> str | None:
        return self._vocab.chat_template

    @property
    def arch(self) -> str:
        return self._vocab.arch

    @property
    def model(self) -> str:
        """tokenizer.ggml.model: "gpt2" or "llama"."""
        return self._vocab.model

    def __repr__(self) -> str:
        return (f"Tokenizer({self._vocab.source}: {self._vocab.model}/{self._vocab.pre}, "
                f"{self.vocab_size} tokens)")


@functools.lru_cache(maxsize=4)
def _cached(path: str, mtime_ns: int, size: int) -> Tokenizer:
    return Tokenizer(read_vocab(path))
