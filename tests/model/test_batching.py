"""Continuous batching on real engines: batching never changes a request's tokens, and the KV
block pool never leaks (finish, abort, preemption, engine failure)."""
from __future__ import annotations

import random

import pytest

from shared.config import EngineSection
from shared.errors import ContextLengthError, InvalidRequestError
from shared.sampling import SamplingParams
from tests.conftest import load_reference
from tests.model.golden import SHIPPED_RULE
from tests.model.run_requests import run_requests
from tests.model.tiny_gguf import TinyModel, write_tiny
from worker.engine.engine import load_engine
from worker.sched.generation import BatchGenerator, ErrorEvent, FinishEvent
from worker.sched.tuning_state import SchedulerKnobs, TuningState


def _generator(engine, **knobs) -> BatchGenerator:
    knobs.setdefault("batching_window_ms", 0.0)
    return BatchGenerator(engine, TuningState(SchedulerKnobs(**knobs)))


def _run(generator: BatchGenerator, requests: dict[str, tuple[list[int], SamplingParams]]):
    """(tokens by id, finish events by id, max batch seen)."""
    out = run_requests(generator, requests)
    return out.tokens, out.finished, out.widest


def _all_blocks_free(generator: BatchGenerator) -> bool:
    return generator.blocks.num_free_blocks == generator.blocks.num_blocks


# ---- the real model, against its golden file --------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_engine(smollm2_gguf, EngineSection(context_length=512), progress=lambda m: None)


def _golden_requests(n: int):
    """n greedy golden cases of different lengths (repeating shortened ones if the file has fewer)."""
    ref = load_reference("smollm2-135m-instruct-q4_1.json")
    cases = ref["greedy"]
    requests, references = {}, {}
    for i in range(n):
        case = cases[i % len(cases)]
        prompt = case["prompt_ids"][: len(case["prompt_ids"]) - (i // len(cases)) * 3] or case["prompt_ids"]
        steps = case["steps"] if len(prompt) == len(case["prompt_ids"]) else None
        params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(ref["eos_id"],))
        requests[f"r{i}"] = (list(prompt), params)
        references[f"r{i}"] = steps
    return requests, references


def _comparable_prefix(steps, length: int) -> int:
    """How many leading tokens must agree: up to and including the first reference near-tie."""
    if steps is None:
        return length
    _, near_tie = SHIPPED_RULE
    for i, step in enumerate(steps[:length]):
        top = step["top"]
        if top[0][1] - top[1][1] < near_tie:
            return i
    return length


def test_greedy_tokens_alone_equal_tokens_batched_with_seven_others(smollm2):
    requests, references = _golden_requests(8)
    alone = {}
    for rid, request in requests.items():
        tokens, _, _ = _run(_generator(smollm2, max_batch_size=8), {rid: request})
        alone[rid] = tokens[rid]
    generator = _generator(smollm2, max_batch_size=8)
    batched, finished, widest = _run(generator, requests)
    assert widest == 8  # they really ran together
    for rid in requests:
        n = _comparable_prefix(references[rid], min(len(alone[rid]), len(batched[rid])))
        assert batched[rid][:n] == alone[rid][:n], rid
        if references[rid] is not None:  # and both follow llama.cpp up to the near-tie
            assert alone[rid][:n] == [s["token"] for s in references[rid][:n]], rid
    assert _all_blocks_free(generator)


def test_seeded_sampling_does_not_depend_on_the_batch(smollm2):
    prompt = load_reference("smollm2-135m-instruct-q4_1.json")["greedy"][0]["prompt_ids"]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone, _, _ = _run(_generator(smollm2), {"x": (prompt, params)})
    others = {f"o{i}": (prompt[i:] + [i + 5], SamplingParams(max_tokens=8 + i, temperature=1.0, seed=i))
              for i in range(5)}
    generator = _generator(smollm2)
    together, _, widest = _run(generator, {"x": (prompt, params), **others})
    assert widest == 6
    assert together["x"] == alone["x"]
    assert _all_blocks_free(generator)


# ---- a tiny random model: many requests, fast ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("batching") / "tiny.gguf"
    write_tiny(path, TinyModel())
    # 512 bytes of K/V per token: 48 KiB is 6 blocks of 16 tokens, one full 64-token context
    # and a half, so busy steps run out of blocks and preempt.
    return load_engine(path, EngineSection(kv_block_size=16, kv_cache_memory="48KiB", context_length=64),
                       progress=lambda m: None)


def test_preemption_recomputes_and_gives_the_same_tokens(tiny):
    rng = random.Random(5)
    requests = {f"r{i}": ([rng.randrange(3, 160) for _ in range(rng.randint(5, 30))],
                          SamplingParams(max_tokens=rng.randint(10, 30), temperature=0.0)) for i in range(6)}
    expected = {rid: _run(_generator(tiny), {rid: r})[0][rid] for rid, r in requests.items()}
    generator = _generator(tiny, max_batch_size=6)
    tokens, finished, _ = _run(generator, requests)
    assert generator.preemptions > 0  # the pool really ran out
    assert tokens == expected
    assert _all_blocks_free(generator)


def test_no_block_leaks_over_a_thousand_requests_with_aborts(tiny):
    rng = random.Random(7)
    generator = _generator(tiny, max_batch_size=8, token_budget=64, prefill_chunk=16)
    added = finished = aborted = 0
    live: set[str] = set()
    while added < 1000 or generator.has_work:
        while added < 1000 and len(live) < 12:
            rid = f"q{added}"
            prompt = [rng.randrange(3, 160) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.8]),
                                    seed=rng.randrange(1000), stop_token_ids=(rng.randrange(3, 160),))
            generator.add(rid, prompt, params)
            live.add(rid)
            added += 1
        if live and rng.random() < 0.15:
            rid = rng.choice(sorted(live))
            assert generator.abort(rid) is not None
            live.discard(rid)
            aborted += 1
        for event in generator.step():
            if isinstance(event, FinishEvent):
                live.discard(event.request_id)
                finished += 1
        used = generator.blocks.num_used_blocks
        held = sum(len(s.block_table) for s in generator.scheduler.running)
        assert used == held  # every used block belongs to a running sequence
        counters = generator.heartbeat_counters()  # what /metrics will show
        assert counters["kv_blocks_used"] == used
        assert counters["kv_bytes_used"] == used * counters["kv_bytes"] // generator.blocks.num_blocks
    assert finished + aborted == 1000 and not live
    assert _all_blocks_free(generator)
    counters = generator.heartbeat_counters()
    assert (counters["kv_blocks"], counters["kv_blocks_used"]) == (generator.blocks.num_blocks, 0)
    assert (counters["kv_bytes"], counters["kv_bytes_used"]) == (generator.engine.kv.nbytes, 0)


class _FailingEngine:
    """Delegates to the engine but raises on the n-th call of execute()."""

    def __init__(self, engine, fail_on: int):
        self._engine, self._fail_on, self.calls = engine, fail_on, 0
        self.vocab_size, self.kv = engine.vocab_size, engine.kv

    def validate(self, prompt_ids, max_tokens):
        self._engine.validate(prompt_ids, max_tokens)

    def execute(self, chunks, attention_chunk=None):
        self.calls += 1
        if self.calls == self._fail_on:
            raise FloatingPointError("injected")
        return self._engine.execute(chunks, attention_chunk)


def test_an_engine_failure_fails_that_steps_requests_and_the_generator_goes_on(tiny):
    generator = _generator(_FailingEngine(tiny, fail_on=3))
    for rid in ("a", "b"):
        generator.add(rid, [5, 6, 7], SamplingParams(max_tokens=10, temperature=0.0))
    errors = []
    for _ in range(5):
        errors += [e for e in generator.step() if isinstance(e, ErrorEvent)]
    assert sorted(e.request_id for e in errors) == ["a", "b"]
    assert "FloatingPointError: injected" in errors[0].error.message
    assert not generator.has_work and _all_blocks_free(generator)
    tokens, finished, _ = _run(generator, {"c": ([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))})
    assert len(tokens["c"]) == 4 and finished["c"].reason == "length"


def test_bad_requests_are_refused_before_they_queue(tiny):
    generator = _generator(tiny)
    with pytest.raises(ContextLengthError, match="context"):
        generator.add("long", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        generator.add("bad", [10**6], SamplingParams(max_tokens=1))
    generator.add("ok", [5], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        generator.add("ok", [5], SamplingParams(max_tokens=1))
    assert generator.load() == (0, 1)
    generator.abort_all()
    assert not generator.has_work and _all_blocks_free(generator)
