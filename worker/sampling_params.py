"""What a request asks of the sampler. Plain data, shared by the engine, the worker and the protocol."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off (llama.cpp style: divide positive logits, multiply negative)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None  # same seed -> same tokens
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0  # how many top log-probabilities to return per token (0 = none)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0
