"""Sampler: the llama.cpp-order chain, seeding, penalties, logprobs and parameter validation."""
from __future__ import annotations

import math

import numpy as np
import pytest

from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams, validate_params
from worker.sched.sampler import Sampler

VOCAB = 1000


def _logits(seed: int = 0, vocab: int = VOCAB, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def _draws(params: SamplingParams, logits: np.ndarray, n: int) -> list[int]:
    sampler = Sampler(params, logits.size)
    return [sampler.sample(logits) for _ in range(n)]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


# ---- greedy and seeding ----------------------------------------------------------------------

def test_greedy_is_argmax():
    for seed in range(5):
        logits = _logits(seed)
        assert _draws(SamplingParams(temperature=0.0), logits, 1) == [int(np.argmax(logits))]


def test_greedy_ties_go_to_the_lowest_id():
    logits = np.zeros(VOCAB, np.float32)
    logits[[7, 3, 900]] = 5.0
    assert Sampler(SamplingParams(temperature=0.0), VOCAB).sample(logits) == 3


def _biased_argmax(logits: np.ndarray, bias: dict[int, float]) -> int:
    x = logits.copy()
    for token, value in bias.items():
        x[token] += np.float32(value)
    return int(np.argmax(x))


@pytest.mark.parametrize("case", range(40))
def test_greedy_with_logit_bias_is_the_argmax_of_the_biased_logits(case):
    # The greedy path skips the copy of the vocabulary; its choice must be the full chain's,
    # ties and infinities included.
    rng = np.random.default_rng(case)
    logits = np.round(rng.standard_normal(VOCAB) * 3).astype(np.float32)  # rounded: many exact ties
    if case % 5 == 1:
        logits[rng.integers(VOCAB)] = np.inf
    ids = rng.choice(VOCAB, size=int(rng.integers(1, 6)), replace=False)
    if case % 3 == 0:  # bias the unbiased winner (down or up)
        ids[0] = int(np.argmax(logits))
    bias = {int(t): float(rng.choice([-100.0, -1.0, 0.5, 1.0, 3.0, 100.0])) for t in ids}
    if case % 4 == 2:  # a biased id that lands exactly on the unbiased best, below it in id order
        top = int(np.argmax(logits))
        low = int(np.argmin(logits[:top])) if top else 0
        if low < top:
            bias[low] = float(logits[top] - logits[low])
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias=bias), VOCAB)
    assert sampler.sample(logits) == _biased_argmax(logits, bias)


def test_greedy_with_penalties_still_applies_them():
    logits = np.zeros(VOCAB, np.float32)
    logits[[4, 9]] = [2.0, 1.5]
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), VOCAB)
    sampler.observe_prompt([4])
    assert sampler.sample(logits) == 9  # 4's logit is halved to 1.0


def test_same_seed_same_tokens_and_different_seeds_differ():
    logits = _logits(1, scale=1.0)
    params = SamplingParams(temperature=1.0, seed=1234)
    first = _draws(params, logits, 50)
    assert first == _draws(params, logits, 50)
    assert first != _draws(SamplingParams(temperature=1.0, seed=1235), logits, 50)
    # Negative seeds are accepted (OpenAI clients send them) and are deterministic too.
    assert _draws(SamplingParams(seed=-5), logits, 20) == _draws(SamplingParams(seed=-5), logits, 20)


def test_seeded_with_filters_is_deterministic():
    logits = _logits(2, vocab=5000, scale=0.3)  # flat: top_p needs a large nucleus
    params = SamplingParams(temperature=0.7, top_k=3000, top_p=0.9, min_p=0.01, seed=9)
    assert _draws(params, logits, 30) == _draws(params, logits, 30)


def test_caller_logits_are_not_modified():
    logits = _logits(3)
    before = logits.copy()
    sampler = Sampler(SamplingParams(logit_bias={5: 10.0}, repetition_penalty=1.3, presence_penalty=1.0), VOCAB)
    sampler.observe_prompt([1, 2, 3])
    for _ in range(5):
        sampler.sample(logits)
    sampler.logprobs(logits, 5, 3)
    np.testing.assert_array_equal(logits, before)


def test_wrong_logits_shape_is_refused():
    with pytest.raises(ValueError, match="expected \\(1000,\\)"):
        Sampler(SamplingParams(), VOCAB).sample(np.zeros(999, np.float32))


# ---- filters -----------------------------------------------------------------------------------

def test_top_k_1_is_greedy():
    for seed in range(5):
        logits = _logits(seed)
        assert set(_draws(SamplingParams(temperature=1.5, top_k=1, seed=seed), logits, 20)) == {int(np.argmax(logits))}


def test_tiny_top_p_is_greedy():
    for seed in range(5):
        logits = _logits(seed)
        assert set(_draws(SamplingParams(temperature=1.5, top_p=1e-6, seed=seed), logits, 20)) == {int(np.argmax(logits))}


def test_top_p_keeps_the_fewest_tokens_reaching_p():
    logits = np.full(VOCAB, -1e4, np.float32)
    logits[[10, 20, 30, 40]] = np.log([0.5, 0.3, 0.15, 0.05])
    assert set(_draws(SamplingParams(top_p=0.79, seed=0), logits, 300)) == {10, 20}
    assert set(_draws(SamplingParams(top_p=0.81, seed=0), logits, 300)) == {10, 20, 30}


def test_top_p_on_a_flat_distribution_matches_a_full_sort():
    # The nucleus is far bigger than the first candidate prefix, so the prefix has to grow.
    logits = _logits(4, vocab=20000, scale=0.2)
    probs = _softmax(logits)
    order = np.argsort(-probs)
    nucleus = set(order[:int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1].tolist())
    assert len(nucleus) > 2000
    draws = set(_draws(SamplingParams(top_p=0.5, seed=3), logits, 2000))
    assert draws <= nucleus and len(draws) > 500


def test_top_p_renormalises_within_top_k():
    # With top_k=2 the two survivors hold all the mass, so top_p=0.7 keeps only the best.
    logits = np.full(VOCAB, -1e4, np.float32)
    logits[[1, 2, 3]] = np.log([0.4, 0.35, 0.25])
    assert set(_draws(SamplingParams(top_k=2, top_p=0.5, seed=0), logits, 200)) == {1}
    assert set(_draws(SamplingParams(top_k=2, top_p=0.6, seed=0), logits, 200)) == {1, 2}


def test_min_p_filters_relative_to_the_best():
    logits = np.full(VOCAB, -1e4, np.float32)
    logits[[1, 2, 3]] = np.log([0.6, 0.3, 0.1])
    # min_p=0.2 → keep p >= 0.12: token 3 (0.1) goes.
    assert set(_draws(SamplingParams(min_p=0.2, seed=0), logits, 500)) == {1, 2}
    assert set(_draws(SamplingParams(min_p=0.1, seed=0), logits, 500)) == {1, 2, 3}


# ---- bias and penalties -----------------------------------------------------------------------

def test_logit_bias_forces_and_forbids():
    logits = _logits(5)
    best = int(np.argmax(logits))
    assert set(_draws(SamplingParams(logit_bias={123: 100.0}, seed=0), logits, 50)) == {123}
    forbidden = _draws(SamplingParams(temperature=0.0, logit_bias={best: -100.0}), logits, 1)[0]
    assert forbidden == int(np.argsort(-logits)[1])
    assert best not in _draws(SamplingParams(logit_bias={best: -100.0}, seed=0, top_k=3), logits, 200)


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = np.full(VOCAB, -10.0, np.float32)
    logits[[1, 2]] = [2.0, 1.8]
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.2), VOCAB)
    sampler.observe_prompt([1])  # 2.0 / 1.2 = 1.67 < 1.8
    assert sampler.sample(logits) == 2
    logits = np.full(VOCAB, -10.0, np.float32)
    logits[[1, 2]] = [-1.0, -1.1]
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.2), VOCAB)
    sampler.observe_prompt([1])  # -1.0 * 1.2 = -1.2 < -1.1 (dividing would have raised it)
    assert sampler.sample(logits) == 2


def test_repetition_penalty_counts_generated_tokens_once_each():
    logits = np.full(VOCAB, -10.0, np.float32)
    logits[[1, 2, 3]] = [3.0, 2.6, 2.2]
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.5), VOCAB)
    # Once all three are seen they read 2.0, 1.73, 1.47: token 1 wins again, and keeps winning
    # because the penalty depends on having been seen, not on how often.
    assert [sampler.sample(logits) for _ in range(5)] == [1, 2, 3, 1, 1]


def test_presence_penalty_applies_to_generated_tokens_only():
    logits = np.full(VOCAB, -10.0, np.float32)
    logits[[1, 2]] = [2.0, 1.5]
    sampler = Sampler(SamplingParams(temperature=0.0, presence_penalty=1.0), VOCAB)
    sampler.observe_prompt([1])  # the prompt does not count (OpenAI semantics)
    assert sampler.sample(logits) == 1
    assert sampler.sample(logits) == 2  # 2.0 - 1.0 < 1.5


def test_frequency_penalty_grows_with_the_count():
    logits = np.full(VOCAB, -10.0, np.float32)
    logits[[1, 2]] = [2.0, 1.0]
    sampler = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.4), VOCAB)
    # 2.0, then 1.6, then 1.2 still beat 1.0; after three uses 0.8 does not.
    assert [sampler.sample(logits) for _ in range(4)] == [1, 1, 1, 2]


def test_observe_records_tokens_chosen_elsewhere():
    logits = np.full(VOCAB, -10.0, np.float32)
    logits[[1, 2]] = [2.0, 1.5]
    sampler = Sampler(SamplingParams(temperature=0.0, presence_penalty=1.0), VOCAB)
    sampler.observe(1)
    assert sampler.sample(logits) == 2


# ---- the distribution --------------------------------------------------------------------------

def _chi_square(draws: list[int], probs: np.ndarray) -> float:
    counts = np.bincount(draws, minlength=probs.size)
    expected = probs * len(draws)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature):
    logits = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 0.2], np.float32)
    draws = _draws(SamplingParams(temperature=temperature, seed=42), logits, 30_000)
    # 5 degrees of freedom: chi-square above 20.5 has probability 0.001. The seed is fixed,
    # so this never flakes; it fails only if the sampler draws from the wrong distribution.
    assert _chi_square(draws, _softmax(logits / temperature)) < 20.5


def test_top_k_distribution_is_renormalised_softmax():
    logits = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 0.2], np.float32)
    draws = _draws(SamplingParams(top_k=3, seed=7), logits, 20_000)
    assert set(draws) == {0, 1, 5}
    kept = np.array([0, 1, 5])
    assert _chi_square([int(np.flatnonzero(kept == d)[0]) for d in draws], _softmax(logits[kept])) < 13.8  # df 2


# ---- logprobs -----------------------------------------------------------------------------------

def test_logprobs_are_log_softmax_after_bias():
    logits = _logits(6)
    sampler = Sampler(SamplingParams(logit_bias={4: 3.0}, temperature=0.3, presence_penalty=2.0), VOCAB)
    sampler.sample(logits)  # penalties and temperature must not leak into logprobs
    biased = logits.astype(np.float64)
    biased[4] += 3.0
    reference = np.log(_softmax(biased))
    lp, top = sampler.logprobs(logits, 17, 5)
    assert lp == pytest.approx(reference[17], abs=1e-5)
    assert [i for i, _ in top] == np.argsort(-reference)[:5].tolist()
    assert [v for _, v in top] == pytest.approx(np.sort(reference)[::-1][:5].tolist(), abs=1e-5)
    assert sampler.logprobs(logits, 17, 0) == (lp, [])


def test_logprobs_ties_are_ordered_by_id():
    logits = np.zeros(VOCAB, np.float32)
    lp, top = Sampler(SamplingParams(), VOCAB).logprobs(logits, 0, 3)
    assert [i for i, _ in top] == [0, 1, 2]
    assert lp == pytest.approx(-math.log(VOCAB))


# ---- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("top_k", -2),
    ("temperature", 2.5),
    ("repetition_penalty", 10.5),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("logit_bias", {VOCAB: 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {5: 101.0}),
    ("seed", 1.5),
    ("stop_token_ids", (VOCAB,)),
    ("logprobs", 21),
    ("logprobs", -1),
])
def test_validation_names_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        validate_params(SamplingParams(**{field: value}), VOCAB)
    assert info.value.param == field
    assert info.value.message.startswith(f"'{field}'")
    assert info.value.status == 400


def test_valid_params_pass():
    validate_params(SamplingParams(), VOCAB)
    validate_params(SamplingParams(temperature=0.0, top_k=40, top_p=1.0, min_p=0.05, repetition_penalty=1.1,
                                   presence_penalty=-2.0, frequency_penalty=2.0, logit_bias={0: -100.0, 999: 100},
                                   seed=-3, stop_token_ids=(0, 999), logprobs=20), VOCAB)
