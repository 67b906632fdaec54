"""Drive a BatchGenerator to completion: the one loop the model tests share."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from shared.sampling import SamplingParams
from worker.sched.generation import BatchGenerator, FinishEvent, TokenEvent


@dataclass
class Outcome:
    tokens: dict[str, list[int]]  # generated token ids by request id
    finished: dict[str, FinishEvent]
    widest: int  # the most sequences one engine step carried


def run_requests(generator: BatchGenerator, requests: dict[str, tuple[list[int], SamplingParams]],
                 each_step=None) -> Outcome:
    """Add every request, step until all finish; each_step(generator) runs after every step."""
    for rid, (prompt, params) in requests.items():
        generator.add(rid, prompt, params)
    tokens: dict[str, list[int]] = defaultdict(list)
    finished: dict[str, FinishEvent] = {}
    widest = 0
    while generator.has_work:
        events = generator.step()
        widest = max(widest, generator.last_step.sequences)
        if each_step is not None:
            each_step(generator)
        for event in events:
            if isinstance(event, TokenEvent):
                tokens[event.request_id].append(event.token)
            elif isinstance(event, FinishEvent):
                finished[event.request_id] = event
            else:
                raise AssertionError(f"unexpected {event}")
    return Outcome(dict(tokens), finished, widest)
