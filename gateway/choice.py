"""One choice of a completion, built up from the tokens a worker streams back.

Tokens are decoded incrementally (a UTF-8 character may span tokens), passed through the stop
matcher, and released as text deltas. Log-probability entries are released together with the
text they produced, so a streamed client never sees logprobs for text that stop matching later
withholds. Offsets are in characters of the decoded text (the completions API's text_offset).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from gateway.stops import StopMatcher


class Decoder(Protocol):
    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(frozen=True)
class TokenEntry:
    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]
    offset: int  # first character of this token's text in the choice's text
    end: int


@dataclass
class Delta:
    text: str = ""
    entries: list[TokenEntry] = field(default_factory=list)
    finish_reason: str | None = None

    def __bool__(self) -> bool:
        return bool(self.text or self.entries or self.finish_reason)


class Choice:
    def __init__(self, index: int, decoder: Callable[[], Decoder], stops: Sequence[str],
                 hidden_ids: frozenset[int] = frozenset()):
        self.index = index
        self.hidden_ids = hidden_ids  # end-of-generation tokens: counted, never shown
        self.decoder = decoder()
        self.matcher = StopMatcher(stops)
        self.text = ""
        self.entries: list[TokenEntry] = []  # released, in order
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self._decoded = 0  # characters decoded so far, released or held
        self._pending: list[TokenEntry] = []  # entries whose text is still (partly) held

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, tokens: Sequence[int], logprobs: Sequence[float | None] = (),
            tops: Sequence[Sequence[Sequence[float]]] = ()) -> Delta:
        """Tokens from one chunk. A matched stop string finishes the choice (reason "stop")."""
        delta = Delta()
        for i, token in enumerate(tokens):
            if self.done:
                break
            self.num_tokens += 1
            piece = "" if token in self.hidden_ids else self.decoder.push(token)
            start = self._decoded
            self._decoded += len(piece)
            top = tuple((int(t), float(lp)) for t, lp in tops[i]) if i < len(tops) else ()
            self._pending.append(TokenEntry(token, logprobs[i] if i < len(logprobs) else None, top,
                                            start, self._decoded))
            self._release(self.matcher.push(piece), delta)
            if self.matcher.stopped:
                self._finish("stop", delta)
        return delta

    def finish(self, reason: str) -> Delta:
        """The worker ended the sequence: release everything still held."""
        delta = Delta()
        if not self.done:
            self._release(self.matcher.push(self.decoder.flush()), delta)
            self._release(self.matcher.flush(), delta)
            self._finish(reason, delta)
        return delta

    def _release(self, text: str, delta: Delta) -> None:
        self.text += text
        delta.text += text
        released = len(self.text)
        while self._pending and self._pending[0].end <= released and not self.matcher.stopped:
            self._emit(self._pending.pop(0), delta)

    def _finish(self, reason: str, delta: Delta) -> None:
        # On a stop match the tokens that began before the cut produced visible text; keep those.
        cut = len(self.text)
        for entry in self._pending:
            if entry.offset < cut or not self.matcher.stopped:
                self._emit(entry, delta)
        self._pending.clear()
        self.finish_reason = reason
        delta.finish_reason = reason

    def _emit(self, entry: TokenEntry, delta: Delta) -> None:
        self.entries.append(entry)
        delta.entries.append(entry)
