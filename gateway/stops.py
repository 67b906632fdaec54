"""Stop strings, matched on decoded text as it streams in.

A stop string can span several tokens, so text that might be the start of one is held back
until it either completes a match (then it and everything after are dropped) or can no longer
match (then it is released). The client therefore never sees any part of a stop string.
"""
from __future__ import annotations

from typing import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""  # text that may be the beginning of a stop string
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once one has

    def push(self, text: str) -> str:
        """Feed newly decoded text; returns the text that is now safe to show."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buffer = self.held + text
        cut = self._first_match(buffer)
        if cut is not None:
            self.stopped = True
            self.matched = next(s for s in self.stops if buffer.find(s) == cut)
            self.held = ""
            return buffer[:cut]
        keep = self._longest_partial(buffer)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """Generation ended without a match: the held text was never a stop string."""
        text, self.held = ("" if self.stopped else self.held), ""
        return text

    def _first_match(self, buffer: str) -> int | None:
        found = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _longest_partial(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:size]):
                    best = size
                    break
        return best
