"""Incremental detokenization for streamed completions.

A token may carry part of a UTF-8 character (byte-fallback `<0xF0>` tokens, byte-level BPE pieces
of an emoji), so bytes are held back until their character completes. The pieces pushed so far,
plus flush(), always equal Tokenizer.decode of the same ids.
"""
from __future__ import annotations

import codecs

from .tokenizer import Tokenizer


class StreamDecoder:
    """Turns token ids, one at a time, into text that never contains a broken character."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, token_id: int) -> str:
        """Text completed by this token ("" while a character is still incomplete)."""
        piece = self._tokenizer.token_bytes(token_id, self._skip_special)
        if self._first:
            self._first = False
            piece = self._strip_prefix_space(token_id, piece)
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)

    def _strip_prefix_space(self, token_id: int, piece: bytes) -> bytes:
        # Mirrors Tokenizer.decode: a SentencePiece text starts with the space the encoder added,
        # unless it starts with a skipped BOS (llama.cpp's detokenize rule).
        tok = self._tokenizer
        if not tok.add_space_prefix:
            return piece
        if self._skip_special and tok.add_bos and token_id == tok.bos_id:
            return piece
        return piece[1:] if piece.startswith(b" ") else piece
