"""Sampler: one row of logits → the next token id, for one sequence.

The chain follows llama.cpp's default order so that outputs are comparable with it:
logit_bias → repetition penalty → presence/frequency penalties → (greedy: argmax) or
top_k → top_p → min_p → temperature → softmax → draw. Note that top_p and min_p judge the
temperature-1 distribution, because temperature comes after them.

It runs once per generated token over a 49k–262k vocabulary, so it never sorts the whole
vocabulary: top_k uses a partition, and top_p sorts only a growing candidate prefix.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from shared.sampling import SamplingParams

# top_p first looks at this many best tokens; usually the nucleus is far smaller. When it is
# not (a flat distribution), the prefix grows 8x at a time, up to the whole vocabulary.
_TOP_P_FIRST = 256


class Sampler:
    """Owns one sequence's random stream and token counts. Expects params that passed `shared.sampling.validate_params`."""

    def __init__(self, params: SamplingParams, vocab_size: int):
        self.params = params
        self.vocab_size = vocab_size
        # OpenAI clients may send negative seeds; numpy wants a non-negative one.
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self._bias_ids = np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias))
        self._bias_values = np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias))
        self._output_counts: dict[int, int] = {}  # generated tokens only: presence/frequency (OpenAI)
        self._seen: set[int] = set()  # prompt and generated tokens: repetition penalty (llama.cpp)
        self._seen_ids: np.ndarray | None = None  # `_seen` as an array, rebuilt only when it grows
        self._work = np.empty(vocab_size, np.float32)  # processed logits, reused for every token
        self._weights = np.empty(vocab_size, np.float64)  # draw weights / running sum, reused

    # ---- state -------------------------------------------------------------------------------

    def observe_prompt(self, ids: Iterable[int]) -> None:
        """Prompt tokens count for the repetition penalty, not for presence/frequency."""
        before = len(self._seen)
        self._seen.update(int(i) for i in ids)
        if len(self._seen) != before:
            self._seen_ids = None

    def observe(self, token: int) -> None:
        """Record a generated token. `sample` does this itself; call it only for tokens chosen elsewhere."""
        token = int(token)
        self._output_counts[token] = self._output_counts.get(token, 0) + 1
        if token not in self._seen:
            self._seen.add(token)
            self._seen_ids = None

    # ---- sampling ----------------------------------------------------------------------------

    def sample(self, logits: np.ndarray, mask: np.ndarray | None = None) -> int:
        """logits: float32 (vocab_size,). Returns the chosen id and records it.

        mask: a grammar's allowed tokens, llguidance's bitmask (int32 words, bit i = token i);
        the others get -inf after bias and penalties, so no later step can bring them back."""
        token = self._greedy_unpenalized(logits) if mask is None else None
        if token is not None:
            self.observe(token)
            return token
        x = self._process(logits)
        if mask is not None:
            allowed = np.unpackbits(mask.view(np.uint8), count=self.vocab_size, bitorder="little")
            x[allowed == 0] = -np.inf
        token = int(np.argmax(x)) if self.params.greedy else self._draw(x)  # argmax: ties → lowest id
        self.observe(token)
        return token

    def logprobs(self, logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        """Log-probability of `token` and the k most likely (id, logprob), best first, ties by id.

        Taken from the model's distribution after logit_bias only: penalties and temperature
        shape the choice, not what the model believed.
        """
        self._check_shape(logits)
        x = logits.astype(np.float32)  # a copy: the bias must not touch the caller's logits
        if self._bias_ids.size:
            x[self._bias_ids] += self._bias_values
        log_z = _logsumexp(x)
        top: list[tuple[int, float]] = []
        k = min(int(k), x.size)
        if k > 0:
            # A partition picks arbitrary members of a tie at the boundary; take the lowest ids.
            threshold = x[np.argpartition(x, x.size - k)[x.size - k]]
            above = np.flatnonzero(x > threshold)
            best = np.concatenate((above, np.flatnonzero(x == threshold)[:k - above.size]))
            best = best[np.lexsort((best, -x[best]))]
            top = [(int(i), float(x[i]) - log_z) for i in best]
        return float(x[int(token)]) - log_z, top

    def _greedy_unpenalized(self, logits: np.ndarray) -> int | None:
        """The greedy choice without copying the vocabulary, when only logit_bias shapes it; None
        when the full chain must run (penalties, a biased or NaN argmax, non-float32 logits).

        Bit-equal to argmax over the processed copy: the bias touches only its own ids, so the
        answer is the unbiased argmax m (lowest id of the best) or the best biased id, whichever
        is larger, ties to the lower id; the biased values are the same float32 sums as in
        _process. It saves a copy of the logits per row (49k-262k floats), every decode step.
        """
        p = self.params
        if (not p.greedy or logits.dtype != np.float32 or (p.repetition_penalty != 1.0 and self._seen)
                or ((p.presence_penalty or p.frequency_penalty) and self._output_counts)):
            return None
        self._check_shape(logits)
        best = int(np.argmax(logits))
        if not self._bias_ids.size:
            return best
        best_value = logits[best]
        if np.isnan(best_value) or best in self.params.logit_bias:
            return None
        biased = logits[self._bias_ids] + self._bias_values
        top = biased.max()
        if top < best_value:
            return best
        top_id = int(self._bias_ids[biased == top].min())
        return top_id if top > best_value else min(top_id, best)

    def _check_shape(self, logits: np.ndarray) -> None:
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"logits shape {logits.shape}, expected ({self.vocab_size},)")

    def _process(self, logits: np.ndarray) -> np.ndarray:
        """Bias and penalties, written into the reused work buffer (the caller's logits stay untouched)."""
        self._check_shape(logits)
        x = self._work
        np.copyto(x, logits, casting="same_kind")
        p = self.params
        if self._bias_ids.size:
            x[self._bias_ids] += self._bias_values  # ids are unique (dict keys), so += is safe
        if p.repetition_penalty != 1.0 and self._seen:
            if self._seen_ids is None:
                self._seen_ids = np.fromiter(self._seen, np.int64, len(self._seen))
            seen = x[self._seen_ids]
            # llama.cpp: dividing a negative logit would raise it, so negatives are multiplied.
            x[self._seen_ids] = np.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self._output_counts:
            ids = np.fromiter(self._output_counts.keys(), np.int64, len(self._output_counts))
            counts = np.fromiter(self._output_counts.values(), np.float32, len(self._output_counts))
            x[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return x

    def _draw(self, x: np.ndarray) -> int:
        p = self.params
        n = x.size
        ids: np.ndarray | None = None  # None: the candidates are the whole vocabulary, in id order
        vals = x
        if 0 < p.top_k < n:
            ids = np.argpartition(x, n - p.top_k)[n - p.top_k:]
            vals = x[ids]
        top = float(vals.max())
        if not math.isfinite(top):
            return int(np.argmax(x))  # every candidate masked to -inf (or a +inf logit): nothing to draw from
        if p.top_p < 1.0:
            keep = _nucleus(vals, p.top_p)
            ids = keep if ids is None else ids[keep]
            vals = vals[keep]
        if p.min_p > 0.0:
            # p_i >= min_p * p_max  ⇔  logit_i >= logit_max + log(min_p): no softmax needed.
            keep = np.flatnonzero(vals >= top + math.log(p.min_p))
            ids = keep if ids is None else ids[keep]
            vals = vals[keep]
        # float64 so the running sum stays accurate over a 262k vocabulary.
        weights = self._weights[:vals.size]
        np.subtract(vals, top, out=weights)
        weights /= p.temperature
        np.exp(weights, out=weights)
        np.cumsum(weights, out=weights)
        # side="right" never lands on a zero-weight token; min() guards u rounding up to the total.
        i = min(int(np.searchsorted(weights, self.rng.random() * weights[-1], side="right")), vals.size - 1)
        return int(i if ids is None else ids[i])


def _nucleus(vals: np.ndarray, top_p: float) -> np.ndarray:
    """Positions in `vals` of the fewest best tokens whose probability reaches top_p (llama.cpp: inclusive).

    Grows an unsorted best-prefix until its mass reaches top_p, then sorts only that prefix.
    """
    n = vals.size
    log_z = _logsumexp(vals)
    size = min(n, _TOP_P_FIRST)
    while True:
        best = np.argpartition(vals, n - size)[n - size:] if size < n else np.arange(n)
        probs = np.exp(vals[best].astype(np.float64) - log_z)
        if probs.sum() >= top_p or size == n:
            break
        size = min(n, size * 8)
    # Introsort is deterministic for equal input, which is all a seed needs; exact ties at the
    # cut are rare enough that ordering them by id is not worth a stable sort's cost (~5x).
    order = np.argsort(-probs)
    cut = int(np.searchsorted(np.cumsum(probs[order]), top_p, side="left")) + 1
    return best[order[:min(cut, size)]]


def _logsumexp(x: np.ndarray) -> float:
    top = float(x.max())
    return top + math.log(float(np.exp(x - top).sum(dtype=np.float64)))
