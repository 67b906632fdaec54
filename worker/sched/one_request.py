"""One request through the serving loop, for the CLI, warm-up, benchmarks and the golden tests.

There is no second generation loop: `generate_one` adds the request to a `BatchGenerator` and
steps it until the request finishes, so what these callers measure and check is exactly what
the server runs (scheduler, chunked prefill, the batched engine step, the sampler).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Iterator

from shared.sampling import SamplingParams
from worker.sched.generation import BatchEngine, BatchGenerator, ErrorEvent, FinishEvent, TokenEvent
from worker.sched.tuning_state import SchedulerKnobs, TuningState
from worker.speculative.speculator import Speculator

_request_ids = itertools.count()


@dataclass
class TokenOutput:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    top_logits: list[tuple[int, float]] = field(default_factory=list)  # raw model logits, best first
    finish_reason: str | None = None  # None while generating, then "stop" or "length"


@dataclass
class Timing:
    """Wall time of one request's phases: prefill ends when its first token is sampled."""
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0  # tokens after the first
    decode_s: float = 0.0


def solo_generator(engine: BatchEngine, knobs: SchedulerKnobs | None = None,
                   speculator: Speculator | None = None) -> BatchGenerator:
    """A generator for one caller's requests: no batching window (a lone request never waits
    for company that will not come); the other knobs as given, or reame.conf's defaults."""
    knobs = knobs if knobs is not None else SchedulerKnobs()
    return BatchGenerator(engine, TuningState(replace(knobs, batching_window_ms=0.0)), speculator=speculator)


def generate_one(generator: BatchGenerator, prompt_ids, params: SamplingParams, top_logits: int = 0,
                 timing: Timing | None = None) -> Iterator[TokenOutput]:
    """Yield one TokenOutput per generated token; the last carries finish_reason.

    The generator must have no other work (steps would then include other requests' rows: still
    correct, but `timing` would not be this request's own). Bad params or a prompt that cannot
    fit raise ReameError before anything runs; a failed step raises its error. Closing the
    iterator early aborts the request and frees its blocks.
    """
    request_id = f"one-{next(_request_ids)}"
    generator.add(request_id, list(prompt_ids), params, top_logits=top_logits)
    timing = timing if timing is not None else Timing()
    timing.prefill_tokens = len(prompt_ids)
    started = time.perf_counter()
    first_token_at = None
    pending: TokenOutput | None = None  # held back until we know whether it is the last
    try:
        while generator.has_work:
            for event in generator.step():
                if event.request_id != request_id:
                    continue
                if isinstance(event, ErrorEvent):
                    raise event.error
                if isinstance(event, TokenEvent):
                    now = time.perf_counter()
                    if first_token_at is None:
                        first_token_at = now
                        timing.prefill_s = now - started
                    else:
                        timing.decode_tokens += 1
                        timing.decode_s = now - first_token_at
                    if pending is not None:
                        yield pending
                    pending = TokenOutput(event.token, event.logprob, event.top_logprobs, event.top_logits)
                elif isinstance(event, FinishEvent):
                    if pending is not None:
                        pending.finish_reason = event.reason
                        yield pending
                    return
    finally:
        generator.abort(request_id)  # a no-op once finished; frees the blocks of a closed iterator


def generate_ids(generator: BatchGenerator, prompt_ids, max_tokens: int) -> list[int]:
    """Greedy token ids of one request."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [out.token for out in generate_one(generator, prompt_ids, params)]
