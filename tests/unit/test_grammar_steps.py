"""Constrained rows in BatchGenerator steps (issue 41, item 3): a late grammar mask never holds the
other rows of a step (the late row is deferred and samples later, from the same logits), and a
request whose masks take more than the budget is stopped with a clear error while the others go on.

A fake engine (logits that prefer 'a', then '7') and the real llguidance matchers over a byte
vocabulary; a mask is made late by a gate its computation waits on, and mask time is a fake clock.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from shared.grammar import regex_grammar, token_table
from shared.sampling import SamplingParams
from shared.vocab import BYTE, CONTROL, Vocab
from worker.sched.constraint import Constraints
from worker.sched.generation import BatchGenerator, ErrorEvent, FinishEvent, TokenEvent
from worker.sched.tuning_state import SchedulerKnobs, TuningState

EOS = 256
VOCAB = 257


def vocab() -> Vocab:
    tokens = [f"<0x{b:02X}>" for b in range(256)] + ["</s>"]
    return Vocab(model="llama", pre="default", tokens=tokens, types=[BYTE] * 256 + [CONTROL],
                 scores=[0.0] * VOCAB, merges=[], bos_id=None, eos_id=EOS, eot_id=None, add_bos=False,
                 add_eos=False, add_space_prefix=False, ignore_merges=False, chat_template=None, arch="llama",
                 source="test")


class FakeEngine:
    """Every sampling row's logits prefer 'a', then '7': free rows write 'a', digit grammars '7'."""
    vocab_size = VOCAB
    kv = SimpleNamespace(num_blocks=64, block_size=16, window=None)

    def __init__(self):
        self.rows = 0  # sampling rows computed

    def validate(self, prompt_ids, max_tokens) -> None:
        pass

    def execute(self, chunks, attention_chunk=None):
        out = []
        for chunk in chunks:
            if not chunk.wants_logits:
                out.append(None)
                continue
            self.rows += 1
            logits = np.zeros(VOCAB, np.float32)
            logits[ord("a")], logits[ord("7")] = 10.0, 5.0
            out.append(logits)
        return out


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup():
    clock = Clock()
    constraints = Constraints(lambda: token_table(vocab(), [EOS]), VOCAB, capacity=4, budget=5.0, clock=clock,
                              limit=3.0)
    engine = FakeEngine()
    # No batching window: every step() runs a step (a window would make the first ones empty).
    generator = BatchGenerator(engine, TuningState(SchedulerKnobs(batching_window_ms=0.0)), constraints=constraints)
    yield generator, constraints, clock
    constraints.close()


def params(grammar: str = "", max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, grammar=grammar, stop_token_ids=(EOS,))


def step(generator: BatchGenerator) -> list:
    """One step, or a failure if it does not return (before the fix it waited for every mask)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(generator.step()), daemon=True)
    thread.start()
    thread.join(30)
    assert result, "the step waited for a grammar mask that was not ready"
    return result[0]


def tokens_of(events, request_id: str) -> list[int]:
    return [e.token for e in events if isinstance(e, TokenEvent) and e.request_id == request_id]


def gate_masks(generator: BatchGenerator, request_id: str) -> threading.Event:
    """From now on the request's masks wait for the returned gate to open."""
    row = generator._grammars[request_id]
    gate, fill = threading.Event(), row.fill
    row.fill = lambda: (gate.wait(), fill())
    return gate


def test_a_late_mask_is_deferred_and_the_other_rows_go_on(setup):
    generator, constraints, _ = setup
    generator.add("free", [1, 2, 3], params())
    generator.add("json", [1, 2, 3], params(regex_grammar("[0-9]+")))
    gate = gate_masks(generator, "json")
    for _ in range(3):
        events = step(generator)
        assert tokens_of(events, "free") == [ord("a")]  # not held by the grammar's late mask
        assert tokens_of(events, "json") == []
        assert not any(isinstance(e, ErrorEvent) for e in events)
    gate.set()
    constraints.wait([generator._grammars["json"]])
    events = step(generator)
    assert tokens_of(events, "free") == [ord("a")]
    assert tokens_of(events, "json") == [ord("7")]  # the grammar's, sampled from the row fed again
    json_seq = next(s for s in generator.scheduler.running if s.seq_id == "json")
    assert json_seq.output_token_ids == [ord("7")] and json_seq.num_computed_tokens == 3


def test_a_request_over_its_mask_budget_stops_with_an_error(setup):
    generator, constraints, clock = setup
    generator.add("free", [1, 2, 3], params())
    generator.add("slow", [1, 2, 3], params(regex_grammar("[0-9]+")))
    row = generator._grammars["slow"]
    fill = row.fill

    def slow_fill():  # each mask takes 2 s of the fake clock: the third passes the 5 s budget
        clock.now += 2.0
        fill()
    row.fill = slow_fill
    seen: list = []
    for _ in range(10):
        seen += step(generator)
        if any(isinstance(e, ErrorEvent) for e in seen):
            break
        constraints.wait([row])  # each mask is done before the next step
    assert tokens_of(seen, "slow") == [ord("7")] * 2
    errors = [e for e in seen if isinstance(e, ErrorEvent)]
    assert [e.request_id for e in errors] == ["slow"]
    assert errors[0].error.code == "grammar_too_complex" and errors[0].error.status == 400
    assert "5 s" in errors[0].error.message
    free = tokens_of(seen, "free")
    assert free == [ord("a")] * len(free) and len(free) >= 3  # the others go on, a token every step
    assert "slow" not in generator._grammars and generator.load() == (1, 0)


def test_a_mask_still_computing_past_the_budget_stops_its_request(setup):
    generator, constraints, clock = setup
    generator.add("free", [1, 2, 3], params())
    generator.add("stuck", [1, 2, 3], params(regex_grammar("[0-9]+")))
    gate = gate_masks(generator, "stuck")
    assert tokens_of(step(generator), "stuck") == []
    row = generator._grammars["stuck"]
    for _ in range(1000):  # until the helper thread has begun the mask (it waits at the gate)
        if row.computing_since is not None:
            break
        threading.Event().wait(0.01)
    clock.now += 6.0  # the helper has been on this mask for 6 s
    events = step(generator)
    assert [e.request_id for e in events if isinstance(e, ErrorEvent)] == ["stuck"]
    assert tokens_of(events, "free") == [ord("a")]
    gate.set()
    events = []
    while generator.has_work:
        events += step(generator)
    assert [e.reason for e in events if isinstance(e, FinishEvent)] == ["length"]


def test_a_grammar_is_built_off_the_step_loop(setup):
    """A 10,000-property schema's matcher takes ~1.6 s to build; add() and the steps must not wait
    for it (the first mask builds it, on the mask thread)."""
    generator, constraints, _ = setup
    built = threading.Event()
    real = constraints._vocab_source

    def slow_table():  # the token table (and so the first matcher) is not ready until the gate opens
        built.wait()
        return real()
    constraints._vocab_source = slow_table
    generator.add("free", [1, 2, 3], params())
    generator.add("json", [1, 2, 3], params(regex_grammar("[0-9]+")))  # returns at once
    for _ in range(2):
        events = step(generator)
        assert tokens_of(events, "free") == [ord("a")] and tokens_of(events, "json") == []
    built.set()
    constraints.wait([generator._grammars["json"]])
    assert tokens_of(step(generator), "json") == [ord("7")]


def test_a_grammar_the_worker_cannot_build_ends_its_request_with_an_error(setup):
    generator, constraints, _ = setup
    generator.add("free", [1, 2, 3], params())
    generator.add("bad", [1, 2, 3], params("not a grammar"))
    events = []
    for _ in range(3):
        events += step(generator)
        if any(isinstance(e, ErrorEvent) for e in events):
            break
        constraints.wait([generator._grammars["bad"]])
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    assert [e.request_id for e in errors] == ["bad"] and errors[0].error.status == 400
    assert tokens_of(events, "free")


def test_one_mask_over_the_limit_stops_its_request(setup):
    generator, constraints, clock = setup
    generator.add("slow", [1, 2, 3], params(regex_grammar("[0-9]+")))
    row = generator._grammars["slow"]
    fill = row.fill

    def slow_fill():  # 4 s of the fake clock: over the 3 s limit for one mask, under the 5 s budget
        clock.now += 4.0
        fill()
    row.fill = slow_fill
    events: list = []
    for _ in range(5):
        events += step(generator)
        if events:
            break
        constraints.wait([row])
    assert [type(e) for e in events] == [ErrorEvent] and "3000 ms" in events[0].error.message
