"""Speculative decoding on real engines: lossless, whatever is drafted.

Greedy: every golden case gives the same tokens and the same logits with drafts as without,
alone and batched, on both models. Sampling: seeded requests give the same tokens, and the
distribution of what is emitted at an accepted draft position is the target's (chi-square on a
tiny model). max_tokens and stop tokens cut a draft where they would cut plain decoding, and
rollbacks leave the block pool whole.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from shared.config import EngineSection
from shared.sampling import SamplingParams
from tests.conftest import load_reference
from tests.model.golden import SHIPPED_RULE, check_greedy_case
from tests.model.run_requests import run_requests
from tests.model.tiny_gguf import TinyModel, write_tiny
from worker.engine.engine import load_engine
from worker.sched.generation import BatchGenerator, TokenEvent
from worker.sched.tuning_state import SchedulerKnobs, TuningState
from worker.speculative.speculator import Speculator

MODELS = {"smollm2": ("smollm2_gguf", "smollm2-135m-instruct-q4_1"), "gemma3": ("gemma3_gguf", "gemma-3-270m-q4_k_m")}


class OracleDrafts(Speculator):
    """Drafts the tokens a plain run produced, each draft with one wrong token half of the
    time: verification then accepts runs of every length and rejects at every position."""

    def __init__(self, expected: dict[str, list[int]], vocab: int, seed: int = 0, wrong: float = 0.5):
        super().__init__(max_draft=6, adaptive=False)
        self.expected, self.vocab, self.rng, self.wrong = expected, vocab, random.Random(seed), wrong
        self.prompt_len: dict[str, int] = {}

    def begin(self, seq_id, prompt_ids, namespace=b""):
        super().begin(seq_id, prompt_ids, namespace)
        self.prompt_len[seq_id] = len(prompt_ids)

    def propose(self, seq_id, tokens, limit):
        if seq_id not in self.prompt_len:
            return []  # never begun (opted out, or constrained): as Speculator.propose
        done = len(tokens) - self.prompt_len[seq_id]
        draft = list(self.expected[seq_id][done:done + self.rng.randint(1, min(limit, self.max_draft))])
        if draft and self.rng.random() < self.wrong:
            i = self.rng.randrange(len(draft))
            draft[i] = (draft[i] + 1) % self.vocab
        return draft


class FixedDrafts(Speculator):
    def __init__(self, draft: list[int]):
        super().__init__(max_draft=len(draft), adaptive=False)
        self.draft = draft

    def propose(self, seq_id, tokens, limit):
        return self.draft[:limit]


def _generator(engine, speculator=None, **knobs) -> BatchGenerator:
    knobs.setdefault("batching_window_ms", 0.0)
    return BatchGenerator(engine, TuningState(SchedulerKnobs(**knobs)), speculator=speculator)


def _logits_run(generator, requests):
    """Tokens and raw top-8 logits of every token, by request."""
    for rid, (prompt, params) in requests.items():
        generator.add(rid, prompt, params, top_logits=8)
    out: dict[str, list] = {rid: [] for rid in requests}
    while generator.has_work:
        for event in generator.step():
            if isinstance(event, TokenEvent):
                out[event.request_id].append((event.token, event.top_logits))
    return out


@pytest.fixture(scope="module")
def engines(request):
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = load_engine(request.getfixturevalue(MODELS[model][0]), EngineSection(context_length=512),
                                       progress=lambda m: None)
        return cache[model]
    return get


@pytest.mark.parametrize("model", list(MODELS))
def test_every_golden_case_decodes_the_same_with_drafts_alone_and_batched(engines, model):
    engine = engines(model)
    ref = load_reference(f"{MODELS[model][1]}.json")
    params = SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=(ref["eos_id"],))
    requests = {f"c{i}": (case["prompt_ids"], params) for i, case in enumerate(ref["greedy"])}
    plain = {rid: _logits_run(_generator(engine), {rid: r})[rid] for rid, r in requests.items()}
    expected = {rid: [token for token, _ in out] for rid, out in plain.items()}
    for rid, request in requests.items():
        spec = OracleDrafts(expected, engine.vocab_size, seed=len(rid))
        assert _logits_run(_generator(engine, spec), {rid: request})[rid] == plain[rid], rid
        assert spec.counters.spec_accepted_tokens > 0
    spec = OracleDrafts(expected, engine.vocab_size, seed=99)
    generator = _generator(engine, spec, max_batch_size=len(requests))
    assert _logits_run(generator, requests) == plain
    assert 0 < spec.counters.spec_accepted_tokens < spec.counters.spec_drafted_tokens  # both paths ran
    assert generator.blocks.num_free_blocks == generator.blocks.num_blocks


@pytest.mark.parametrize("model", list(MODELS))
def test_golden_cases_still_follow_llama_cpp_with_the_real_draft_sources(engines, model):
    ref = load_reference(f"{MODELS[model][1]}.json")
    for case in ref["greedy"]:
        assert check_greedy_case(engines(model), case, ref["eos_id"], SHIPPED_RULE, speculator=Speculator()) >= 1


def test_seeded_sampling_gives_the_same_tokens_with_drafts(engines):
    engine = engines("smollm2")
    prompt = load_reference("smollm2-135m-instruct-q4_1.json")["greedy"][0]["prompt_ids"]
    requests = {f"s{seed}": (prompt * 2, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=seed,
                                                        repetition_penalty=1.1, logprobs=2))
                for seed in range(4)}
    plain = run_requests(_generator(engine), requests).tokens
    spec = OracleDrafts(plain, engine.vocab_size, seed=3)
    assert run_requests(_generator(engine, spec), requests).tokens == plain
    assert spec.counters.spec_accepted_tokens > 0


# ---- a tiny model: many requests, fast ----------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "tiny.gguf"
    write_tiny(path, TinyModel(vocab=16))
    # 16-token blocks, 6 of them: busy steps run out and preempt.
    return load_engine(path, EngineSection(kv_block_size=16, kv_cache_memory="48KiB", context_length=64),
                       progress=lambda m: None)


def test_max_tokens_and_stop_tokens_cut_a_draft_where_plain_decoding_stops(tiny):
    prompt = [3, 4, 5, 6]
    plain = run_requests(_generator(tiny), {"x": (prompt, SamplingParams(max_tokens=12, temperature=0.0))}).tokens["x"]
    long_draft = {"x": plain}
    out = run_requests(_generator(tiny, OracleDrafts(long_draft, 16, wrong=0.0)),
                       {"x": (prompt, SamplingParams(max_tokens=3, temperature=0.0))})
    assert out.tokens["x"] == plain[:3] and out.finished["x"].reason == "length"
    stop = plain[4]
    cut = plain.index(stop) + 1
    out = run_requests(_generator(tiny, OracleDrafts(long_draft, 16, wrong=0.0)),
                       {"x": (prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,)))})
    assert out.tokens["x"] == plain[:cut] and out.finished["x"].reason == "stop"
    assert out.finished["x"].completion_tokens == cut


def test_rollbacks_under_preemption_keep_tokens_and_free_every_block(tiny):
    rng = random.Random(11)
    requests = {f"r{i}": ([rng.randrange(16) for _ in range(rng.randint(3, 20))],
                          SamplingParams(max_tokens=rng.randint(8, 30), temperature=0.0)) for i in range(12)}
    plain = {rid: run_requests(_generator(tiny), {rid: r}).tokens[rid] for rid, r in requests.items()}
    spec = OracleDrafts(plain, 16, seed=5)
    generator = _generator(tiny, spec, max_batch_size=8)
    assert run_requests(generator, requests).tokens == plain
    assert generator.preemptions > 0 and spec.counters.spec_drafts > 20
    assert generator.blocks.num_free_blocks == generator.blocks.num_blocks


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _check_distribution(counts: np.ndarray, probs: np.ndarray) -> None:
    n = counts.sum()
    expected = probs * n
    big = expected >= 5  # pool the rare tokens into one cell
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert stat < _chi_square_critical(int(keep.sum()) - 1), (stat, observed, expected)


def _next_logits(engine, context: list[int]) -> np.ndarray:
    """The raw logits after `context`, every vocabulary entry (the tiny model has 16)."""
    generator = _generator(engine)
    generator.add("probe", context, SamplingParams(max_tokens=1, temperature=0.0), top_logits=16)
    event = next(e for e in generator.step() if isinstance(e, TokenEvent))
    row = np.full(16, -np.inf)
    for token, value in event.top_logits:
        row[token] = value
    return row


def test_tokens_sampled_at_drafted_positions_follow_the_target_distribution(tiny):
    # A decode step after the first token t1 verifies the draft [d]: row 0 gives t2, and when
    # t2 == d row 1 (fed the draft) gives t3. Given t1 = a, t2 must follow p(.|P a) and, given
    # also t2 = d, t3 must follow p(.|P a d), as without speculation.
    prompt, temperature, n = [1, 2, 3], 0.6, 4000
    a = int(np.argmax(_next_logits(tiny, prompt)))
    after_a = _next_logits(tiny, prompt + [a])
    d = int(np.argmax(after_a))
    after_ad = _next_logits(tiny, prompt + [a, d])
    spec = FixedDrafts([d])
    generator = _generator(tiny, spec, max_batch_size=64, token_budget=512)
    requests = {f"r{i}": (prompt, SamplingParams(max_tokens=3, temperature=temperature, seed=i)) for i in range(n)}
    tokens = run_requests(generator, requests).tokens
    # Every request drafts once, but those whose decode step also admits the last of the queue
    # (it then fits in the batch: such steps carry no drafts) sample t2 and t3 in plain steps.
    assert n - 100 <= spec.counters.spec_drafts <= n

    def probs(row):
        p = np.exp((row - row.max()) / temperature)
        return p / p.sum()
    seconds = np.bincount([t[1] for t in tokens.values() if t[0] == a], minlength=16)
    thirds = np.bincount([t[2] for t in tokens.values() if t[:2] == [a, d]], minlength=16)  # verified rows
    assert seconds.sum() > 500 and thirds.sum() > 300
    _check_distribution(seconds, probs(after_a))
    _check_distribution(thirds, probs(after_ad))


def test_a_constrained_request_never_drafts_and_batches_with_drafted_ones(engines, smollm2_gguf):
    """Grammars and drafts in one step: the constrained request is sampled under its mask on one
    row (it is never offered a draft), the drafted one verifies its rows; each gives what it
    gives alone."""
    from shared.grammar import regex_grammar
    from shared.vocab import piece_table, read_vocab
    from worker.sched.constraint import Constraints

    engine = engines("smollm2")
    ref = load_reference("smollm2-135m-instruct-q4_1.json")
    eos = (ref["eos_id"],)
    prompt = ref["greedy"][0]["prompt_ids"]
    free = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=eos)
    digits = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=eos, grammar=regex_grammar(r"[0-9]{3,6}"))
    constraints = Constraints.from_gguf(str(smollm2_gguf), engine.vocab_size, 4)
    try:
        def generator(speculator=None):
            return BatchGenerator(engine, TuningState(SchedulerKnobs(batching_window_ms=0.0)),
                                  constraints=constraints, speculator=speculator)

        alone = {rid: run_requests(generator(), {rid: r}).tokens[rid]
                 for rid, r in {"free": (prompt, free), "digits": (prompt, digits)}.items()}
        spec = OracleDrafts({"free": alone["free"], "digits": alone["digits"]}, engine.vocab_size, seed=5)
        drafted = []  # requests that were given a draft to verify
        propose = spec.propose

        def recording(seq_id, tokens, limit):
            draft = propose(seq_id, tokens, limit)
            if draft:
                drafted.append(seq_id)
            return draft
        spec.propose = recording
        both = run_requests(generator(spec), {"free": (prompt, free), "digits": (prompt, digits)}).tokens
    finally:
        constraints.close()
    assert both == alone
    assert "digits" not in drafted and "free" in drafted and spec.counters.spec_accepted_tokens > 0
    pieces = piece_table(read_vocab(smollm2_gguf))
    text = b"".join(pieces[t] for t in alone["digits"] if t not in eos)
    assert text.isdigit() and 3 <= len(text) <= 6



def test_a_restarted_worker_drafts_from_its_first_request_as_it_did_before_the_restart(tiny, tmp_path):
    """The archive, the class records and the gate's verdicts outlive the worker (built and shut
    down as worker.main does); after a restart the first request drafts from the archive from its
    first decode step on, and on nearly every one, where a cold speculator spends half its first
    steps measuring plain ones.

    Steps are timed by a fixed cost model, not the clock: the gate and the break-even read step
    times, and on a loaded host real ones made the restarted worker draft in 2 of 28 steps."""
    from shared.config import Config, override
    from worker.speculative.gate import SAMPLES
    from worker.speculative.setup import build_speculator

    config = override(Config(), "speculative", archive_path=str(tmp_path / "archive"), archive_budget="1MiB")
    model = tiny.gguf.fingerprint()
    shared_start = [5, 9, 2, 7, 11, 3, 8, 1, 14, 6, 10, 4, 12, 13, 15, 0]  # one request class
    params = SamplingParams(max_tokens=30, temperature=0.0)
    requests = {f"r{i}": (shared_start + [i % 16, (3 * i) % 16], params) for i in range(12)}

    def drafting_steps(speculator, rid):
        """(decode steps, steps in which it verified a draft) of one request run alone."""
        counts = [0, 0]
        last = [speculator.counters.spec_drafts]
        observe_step = speculator.observe_step

        def fixed_cost(rows, sequences, seconds, **step):  # 10 ms a step + 1 ms a row, whatever the load
            observe_step(rows, sequences, 0.010 + 0.001 * rows, **step)
        speculator.observe_step = fixed_cost

        def each_step(generator):
            if generator.last_step.decode_rows:
                counts[0] += 1
                counts[1] += speculator.counters.spec_drafts > last[0]
                if counts[0] == 1:
                    first_step_sources.append(speculator.counters.spec_from_archive)
            last[0] = speculator.counters.spec_drafts
        out = run_requests(_generator(tiny, speculator), {rid: requests[rid]}, each_step)
        return out.tokens[rid], counts
    first_step_sources = []  # archive drafts so far, after each run's first decode step

    speculator, store = build_speculator(config, model)
    plain = {rid: run_requests(_generator(tiny), {rid: r}).tokens[rid] for rid, r in requests.items()}
    for rid in requests:
        assert drafting_steps(speculator, rid)[0] == plain[rid]
    # Which way the gate goes on this host is a measurement; this worker found drafting faster.
    speculator.gate.restore([([(1, 0.010)] * SAMPLES, [(3, 0.010)] * SAMPLES)])
    speculator.save()
    store.close()

    restarted, store = build_speculator(config, model)
    assert restarted.gate.snapshot()["gate_1+"] == "on"
    first_step_sources.clear()
    tokens, (steps, drafted) = drafting_steps(restarted, "r0")
    assert first_step_sources == [1]  # its first decode step verified a draft from the archive
    assert tokens == plain["r0"] and restarted.counters.spec_from_archive + restarted.counters.spec_from_prompt > 0
    assert drafted >= 0.8 * steps, (drafted, steps)
    store.close()

    cold = Speculator(max_draft=8)  # no memory: what a restart was before
    tokens, (cold_steps, cold_drafted) = drafting_steps(cold, "r0")
    assert tokens == plain["r0"] and cold_drafted <= 0.6 * cold_steps, (cold_drafted, cold_steps)


def test_drafts_and_what_they_learn_stay_in_the_requests_cache_namespace(tiny):
    """Issue 41: one archive per host, keyed by the last tokens alone, learned from every finished
    request ("speculative": false and constrained ones too), let another tenant recover a code from
    someone's answer. Now a completion teaches its own namespace only, and an opted-out one nothing."""
    from worker.speculative.archive import NgramArchive

    alice, mallory = b"a" * 32, b"m" * 32
    archive = NgramArchive()
    spec = Speculator(max_draft=4, adaptive=False, archive=archive)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompt, quiet_prompt = [5, 9, 2, 7, 11, 3], [1, 14, 6, 10, 4, 12]
    generator = _generator(tiny, spec)
    generator.add("alice", prompt, params, cache_namespace=alice)
    generator.add("quiet", quiet_prompt, params, cache_namespace=alice, speculative=False)
    out: dict[str, list[int]] = {"alice": [], "quiet": []}
    while generator.has_work:
        for event in generator.step():
            if isinstance(event, TokenEvent):
                out[event.request_id].append(event.token)

    def contexts(tokens):
        return [tuple(tokens[i - 3:i]) for i in range(3, len(tokens))]
    learned = contexts(prompt[-3:] + out["alice"])
    assert learned and all(archive.counts(ctx, alice) for ctx in learned)
    assert not any(archive.counts(ctx, mallory) or archive.counts(ctx, b"") for ctx in learned)
    quiet = set(contexts(quiet_prompt[-3:] + out["quiet"])) - set(learned)
    assert quiet and not any(archive.counts(ctx, alice) for ctx in quiet)  # opted out: taught nothing
    # The same prompt again: alice's request drafts from what hers produced, mallory's cannot.
    for tenant, namespace in (("mallory", mallory), ("alice", alice)):
        before = spec.counters.spec_from_archive
        tokens = run_requests(_generator(tiny, spec), {tenant: (prompt, params)}).tokens[tenant]
        assert tokens == out["alice"]
        if namespace == mallory:
            assert spec.counters.spec_from_archive == before
        else:
            assert spec.counters.spec_from_archive > before
