"""The token ids of long text fragments seen recently, so a prompt resent with every request (an
agent's system prompt and tool list, a conversation's history) is split and merged once.

A fragment is a run of text between special tokens (specials.py); its ids depend on nothing
outside it, so they can be reused wherever it recurs. Only fragments of at least MIN_CHARS are
kept: shorter ones cost less to encode than to look up. Bounded by the characters held
(least recently used first out); thread-safe (the gateway encodes on several threads).
Measured on SmolLM2's tokenizer (2 vCPU AMD EPYC): a 2,197-token system prompt took 11-12 ms to
encode (6 ms of pre-tokenizing regex, 5 ms of merging), about a fifth of a warm request's TTFT.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

MIN_CHARS = 256
MAX_CHARS = 4_000_000  # ~1M tokens of text; the ids take about as much memory as the text


class PieceCache:
    def __init__(self, min_chars: int = MIN_CHARS, max_chars: int = MAX_CHARS):
        self.min_chars = min_chars
        self.max_chars = max_chars
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, piece: str) -> tuple[int, ...] | None:
        if len(piece) < self.min_chars:
            return None
        with self._lock:
            ids = self._ids.get(piece)
            if ids is not None:
                self._ids.move_to_end(piece)
            return ids

    def put(self, piece: str, ids: list[int]) -> None:
        if not self.min_chars <= len(piece) <= self.max_chars:
            return
        with self._lock:
            if piece in self._ids:
                return
            self._ids[piece] = tuple(ids)
            self._chars += len(piece)
            while self._chars > self.max_chars:
                old, _ = self._ids.popitem(last=False)
                self._chars -= len(old)

    def __len__(self) -> int:
        return len(self._ids)
