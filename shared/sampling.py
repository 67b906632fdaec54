"""What a request asks of the sampler, and the one table of limits every side checks it against.

The gateway validates request bodies with `LIMITS`, the OpenAPI document states them from it, and
the worker's `validate_params` re-checks a `SamplingParams` (which may come from the CLI, a test
or another gateway) against the same rows: a limit changed here changes all three.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

from shared.errors import InvalidRequestError

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 (or -1, llama.cpp's spelling) = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off (llama.cpp style: divide positive logits, multiply negative)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None  # same seed -> same tokens
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0  # how many top log-probabilities to return per token (0 = none)
    grammar: str = ""  # llguidance grammar (shared.grammar) every generated token must follow; "" = free

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class Limit:
    """The allowed range of one number. `low_open`: low itself is not allowed."""
    low: float | None
    high: float | None
    integer: bool = False
    low_open: bool = False

    def contains(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        """The range in words, for error messages: 'greater than 0 and at most 2'."""
        parts = []
        if self.low is not None:
            parts.append(f"greater than {_num(self.low)}" if self.low_open else f"at least {_num(self.low)}")
        if self.high is not None:
            parts.append(f"at most {_num(self.high)}")
        return " and ".join(parts) or "any value"

    def schema(self) -> dict:
        """The JSON Schema bounds (OpenAPI 3.1) of this range."""
        out: dict = {}
        if self.low is not None:
            out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            out["maximum"] = self.high
        return out


# Request ranges (OpenAI's where OpenAI has one; llama.cpp's for its extensions).
LIMITS: dict[str, Limit] = {
    "max_tokens": Limit(1, None, integer=True),
    "temperature": Limit(0.0, 2.0),
    "top_k": Limit(-1, None, integer=True),
    "top_p": Limit(0.0, 1.0, low_open=True),
    "min_p": Limit(0.0, 1.0),
    "repetition_penalty": Limit(0.0, 10.0, low_open=True),
    "presence_penalty": Limit(-2.0, 2.0),
    "frequency_penalty": Limit(-2.0, 2.0),
    "logit_bias": Limit(-100.0, 100.0),  # each bias value
    "seed": Limit(-(2 ** 63), 2 ** 63 - 1, integer=True),
    "logprobs": Limit(0, MAX_LOGPROBS, integer=True),
}


def validate_params(params: SamplingParams, vocab_size: int) -> None:
    """Raise InvalidRequestError naming the first field of params outside LIMITS or the vocabulary."""
    for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "logprobs"):
        check(name, getattr(params, name))
    if params.seed is not None:
        check("seed", params.seed)
    if not isinstance(params.logit_bias, dict):
        raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
    for token, bias in params.logit_bias.items():
        _token_id(token, "logit_bias", vocab_size)
        check("logit_bias", bias)
    for token in params.stop_token_ids:
        _token_id(token, "stop_token_ids", vocab_size)


def check(name: str, value: object) -> None:
    """Raise InvalidRequestError unless value has the type and range of LIMITS[name]."""
    limit = LIMITS[name]
    if limit.integer:
        if not _is_int(value):
            raise InvalidRequestError(f"'{name}' must be an integer, got {value!r}", param=name)
    elif isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise InvalidRequestError(f"'{name}' must be a finite number, got {value!r}", param=name)
    if not limit.contains(value):
        raise InvalidRequestError(f"'{name}' is {value}; it must be {limit.describe()}", param=name)


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _token_id(value: object, name: str, vocab_size: int) -> None:
    if not _is_int(value) or not 0 <= value < vocab_size:
        raise InvalidRequestError(f"'{name}': {value!r} is not a token id (vocabulary is 0..{vocab_size - 1})",
                                  param=name)


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)
