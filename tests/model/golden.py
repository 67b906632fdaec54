"""The comparison rules of tests/data/reference/README.md, as code."""
from __future__ import annotations

from contextlib import closing

from shared.sampling import SamplingParams
from worker.engine.engine import Engine
from worker.sched.one_request import generate_one, solo_generator
from worker.speculative.speculator import Speculator

EXACT_RULE = (0.05, 0.1)  # (logit tolerance, near-tie gap) for the .f32-exact files
SHIPPED_RULE = (1.0, 1.0)  # for the as-shipped files
LOOKUP = 64  # how many of our best logits to fetch so every reference top-8 id is found


def check_greedy_case(engine: Engine, case: dict, eos_id: int, rule: tuple[float, float],
                      speculator: Speculator | None = None, through_agreeing_ties: bool = False) -> int:
    """Greedy-generate the case through the serving loop (drafting with `speculator` if given)
    and compare step by step; returns the steps compared.

    Raises AssertionError naming the step and token on a mismatch. Comparison of a case
    stops after the first step whose reference top-2 gap is a near-tie, or, with
    `through_agreeing_ties` (the Qwen files' rule), after the first near-tie where the
    tokens differ: a near-tie both sides resolved alike does not end it.
    """
    tolerance, near_tie = rule
    steps = case["steps"]
    params = SamplingParams(max_tokens=len(steps), temperature=0.0, stop_token_ids=(eos_id,))
    generator = solo_generator(engine, speculator=speculator)
    with closing(generate_one(generator, case["prompt_ids"], params, top_logits=LOOKUP)) as outputs:
        return _compare(outputs, steps, tolerance, near_tie, through_agreeing_ties)


def _compare(outputs, steps: list[dict], tolerance: float, near_tie: float, through_agreeing_ties: bool) -> int:
    compared = 0
    for out, step in zip(outputs, steps):
        ours = dict(out.top_logits)
        for token, logit in step["top"]:
            assert token in ours, f"step {compared}: reference top token {token} not among our best {LOOKUP}"
            assert abs(ours[token] - logit) <= tolerance, (
                f"step {compared}: token {token} logit {ours[token]:.4f} vs reference {logit:.4f}")
        compared += 1
        top = step["top"]
        if top[0][1] - top[1][1] < near_tie:
            if not through_agreeing_ties or out.token != step["token"]:
                return compared  # near-tie: the order may legitimately flip from here
            continue  # both chose the same token: the sequences are still the same
        assert out.token == step["token"], f"step {compared - 1}: chose {out.token}, reference {step['token']}"
    return compared
