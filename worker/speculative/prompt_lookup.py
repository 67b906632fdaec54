"""Prompt lookup: the longest recent n-gram ending the sequence, found earlier in it, proposes
the tokens that followed it there.

Answers that quote their prompt (extractive QA, code edits) repeat long runs of it; the last
few generated tokens then also occur in the prompt, and what followed them there is a good draft.

An index per n-gram size maps each n-gram to the position right after its latest occurrence
that has a follower, so a lookup is one dict probe per size; the index grows with the sequence
(each new token adds one entry per size), never rescans it.

A copy in progress is followed: once a draft came from some place, the next draft continues from
that same place while the sequence still agrees with it, rather than from the latest occurrence of
its last n-gram. Quoted text repeats its short n-grams across the source ("the council installed",
"[customer] = "), and the latest occurrence is then often another section or line, whose draft
fails at the first detail that differs.
"""
from __future__ import annotations

MIN_NGRAM = 2  # one-token matches propose mostly noise
MAX_NGRAM = 4
MATCH_CAP = 32  # agreement counted back at most this far


class PromptLookup:
    """follow_copy: False drafts from the latest occurrence every time (no copy in progress)."""

    def __init__(self, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM, follow_copy: bool = True):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.sizes = tuple(range(max_ngram, min_ngram - 1, -1))  # longest first
        self.follow_copy = follow_copy
        self._follower: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # followers of positions [0, _indexed) are in the index
        self._copy: tuple[int, int] | None = None  # (source of the last draft, sequence length then)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """k tokens that followed the longest n-gram ending `tokens` where it last occurred before
        (continuing the same copy into the draft itself); [] when no n-gram of MIN..MAX tokens
        recurs. `tokens` only ever grows (or is the same list again) between calls."""
        if k <= 0:
            return []
        found = self.find(tokens)
        return self.read(tokens, found[0], k) if found else []

    def find(self, tokens: list[int]) -> tuple[int, int] | None:
        """Where a draft for `tokens` would be copied from, and on how many tokens before it the
        source agrees with the end of the sequence (up to MATCH_CAP): the longer the agreement,
        the likelier the copy goes on (what the speculator learns per agreement length)."""
        self._extend(tokens)
        length = len(tokens)
        at, matched = self._continued(tokens)
        for n in self.sizes:
            if n <= matched:
                break  # the copy in progress agrees on at least as many tokens
            if length <= n:
                continue
            found = self._follower[n].get(tuple(tokens[length - n:]))
            if found is not None:
                at = found
                break
        if at is None:
            self._copy = None
            return None
        agree = 0
        while agree < MATCH_CAP and agree < at and tokens[at - 1 - agree] == tokens[length - 1 - agree]:
            agree += 1
        return at, agree

    def read(self, tokens: list[int], at: int, k: int) -> list[int]:
        """The k-token draft copied from `at` (find's source); the copy continues from there."""
        length = len(tokens)
        self._copy = (at, length)
        # Past the end the copy reads its own draft: a match close to the end is a period, and
        # the draft repeats it.
        out = tokens[at:at + k]
        while len(out) < k:
            out.append(out[len(out) - (length - at)])
        return out

    def _continued(self, tokens: list[int]) -> tuple[int | None, int]:
        """Where the last draft's copy continues now, and on how many of the last tokens (up to
        the longest n-gram size) it agrees with the sequence; (None, 0) below the shortest."""
        if not self.follow_copy or self._copy is None:
            return None, 0
        source, then = self._copy
        length = len(tokens)
        at = source + (length - then)  # the copy moved on with the sequence
        if at >= length:
            return None, 0
        matched = 0
        while matched < self.sizes[0] and matched < at and tokens[at - 1 - matched] == tokens[length - 1 - matched]:
            matched += 1
        return (at, matched) if matched >= self.sizes[-1] else (None, 0)

    def _extend(self, tokens: list[int]) -> None:
        """Index every position j < len(tokens) as the follower of the n-grams ending before it."""
        if len(tokens) < self._indexed:
            raise ValueError("the sequence shrank: a PromptLookup follows one growing sequence")
        for j in range(max(self._indexed, 1), len(tokens)):
            for n in self.sizes:
                if j >= n:
                    self._follower[n][tuple(tokens[j - n:j])] = j
        self._indexed = len(tokens)
