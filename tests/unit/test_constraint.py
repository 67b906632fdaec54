"""worker.sched.constraint and Sampler(mask=): over a small byte-level vocabulary, any logits
sampled under a grammar's masks spell a sentence of that grammar, and the grammar says when it is done."""
from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest

from gateway.tools import Tool, ToolRequest, call_constraint
from shared.grammar import (FRACTION_DIGITS, INTEGER_DIGITS, bounded_numbers, json_schema_grammar, lark_grammar,
                            regex_grammar, token_table)
from shared.sampling import SamplingParams
from shared.vocab import BYTE, CONTROL, NORMAL, Vocab
from worker.sched.constraint import Constraints
from worker.sched.sampler import Sampler

WORDS = ["ab", "abc", "12", "345", '{"', '":', "true", "false", ", "]
EOS = 256 + len(WORDS)


def vocab() -> Vocab:
    tokens = [f"<0x{b:02X}>" for b in range(256)] + WORDS + ["</s>"]
    types = [BYTE] * 256 + [NORMAL] * len(WORDS) + [CONTROL]
    return Vocab(model="llama", pre="default", tokens=tokens, types=types, scores=[0.0] * len(tokens), merges=[],
                 bos_id=None, eos_id=EOS, eot_id=None, add_bos=False, add_eos=False, add_space_prefix=False,
                 ignore_merges=False, chat_template=None, arch="llama", source="test")


def token_bytes(token: int) -> bytes:
    return bytes([token]) if token < 256 else WORDS[token - 256].encode()


@pytest.fixture(scope="module")
def constraints() -> Constraints:
    v = vocab()
    return Constraints(lambda: token_table(v, [EOS]), len(v.tokens), capacity=4)


def generate(constraints: Constraints, grammars: list[str], seed: int, limit: int = 60) -> list[bytes]:
    """Sample every grammar's row together, step by step, from random logits."""
    rng = np.random.default_rng(seed)
    rows = [constraints.compile(g, (EOS,)) for g in grammars]
    samplers = [Sampler(SamplingParams(temperature=1.0, seed=seed + i), constraints.vocab_size) for i in range(len(rows))]
    out = [b""] * len(rows)
    live = list(range(len(rows)))
    for _ in range(limit):
        if not live:
            break
        masks = constraints.masks(constraints.start([rows[i] for i in live]))
        still = []
        for j, i in enumerate(live):
            token = samplers[i].sample(rng.normal(size=constraints.vocab_size).astype(np.float32) * 3, masks[j])
            if token == EOS:
                continue
            out[i] += token_bytes(token)
            if not rows[i].advance(token):
                still.append(i)
        live = still
    assert not live, f"not finished within {limit} tokens: {out}"
    return out


@pytest.mark.parametrize("seed", range(5))
def test_sampled_text_follows_each_grammar_in_one_batch(constraints, seed):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 999}},
              "required": ["ok", "n"], "additionalProperties": False}
    regex, json_text = generate(constraints, [regex_grammar("ab(c|12)[0-9]{2}"), json_schema_grammar(schema, "s")],
                                seed)
    assert re.fullmatch(rb"ab(c|12)[0-9]{2}", regex)
    value = json.loads(json_text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 999


def test_mask_allows_the_stop_token_only_once_complete(constraints):
    row = constraints.compile(regex_grammar("[0-9]+"), (EOS,))

    def allowed() -> np.ndarray:
        mask = constraints.masks(constraints.start([row]))[0]
        return np.unpackbits(mask.view(np.uint8), bitorder="little")[:constraints.vocab_size]

    first = allowed()
    assert not first[EOS] and first[ord("7")] and not first[ord("a")]
    assert row.advance(ord("7")) is False
    assert allowed()[EOS]


def test_sampler_mask_wins_over_the_best_logit():
    sampler = Sampler(SamplingParams(temperature=0.0), 64)
    logits = np.zeros(64, np.float32)
    logits[5] = 100.0
    mask = np.zeros(2, np.int32)
    mask[0] = 1 << 9
    assert sampler.sample(logits, mask) == 9


CITY = {"title": "City", "type": "object", "required": ["name", "population", "area"],  # as Pydantic writes it
        "properties": {"name": {"title": "Name", "type": "string"},
                       "population": {"title": "Population", "type": "integer"},
                       "area": {"title": "Area", "type": "number"}}}


def longest_run(constraints: Constraints, grammar: str, prefix: str, digit: str = "1") -> int:
    """How many `digit`s the grammar lets follow `prefix` (issue 41, item 10: greedy SmolLM2 wrote
    "population": 1111... until max_tokens)."""
    row = constraints.compile(grammar, (EOS,))
    for byte in prefix.encode():
        assert row.advance(byte) is False
    for written in range(200):
        mask = constraints.masks(constraints.start([row]))[0]
        if not np.unpackbits(mask.view(np.uint8), bitorder="little")[ord(digit)]:
            return written
        row.advance(ord(digit))
    return written + 1


def test_json_numbers_have_bounded_digits(constraints):
    grammar = json_schema_grammar(CITY, "response_format")
    assert longest_run(constraints, grammar, '{"name": "x", "population": ') == INTEGER_DIGITS
    assert longest_run(constraints, grammar, '{"name": "x", "population": -') == INTEGER_DIGITS
    assert longest_run(constraints, grammar, '{"name": "x", "population": 7, "area": 3.') == FRACTION_DIGITS


def test_a_schema_keeps_its_own_number_bounds():
    schema = {"type": "object", "properties": {
        "big": {"type": "integer", "minimum": 10 ** 20},
        "step": {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 4},
        "list": {"type": "array", "items": {"type": ["number", "null"]}},
        "const": {"const": {"type": "integer"}}}}
    bounded = bounded_numbers(schema)
    assert bounded["properties"]["big"] == {"type": "integer", "minimum": 10 ** 20}  # no maximum below its minimum
    assert bounded["properties"]["step"] == {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 4,
                                             "minimum": -(10 ** INTEGER_DIGITS - 1)}
    assert bounded["properties"]["list"]["items"]["multipleOf"] == 10.0 ** -FRACTION_DIGITS
    assert bounded["properties"]["const"] == {"const": {"type": "integer"}}  # data, not a schema
    assert "minimum" not in schema["properties"]["list"]["items"]  # the caller's schema is left alone


def test_a_deep_schema_is_bounded_without_recursion():
    schema: dict = {"type": "integer"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    node = bounded_numbers(schema)
    while "items" in node:
        node = node["items"]
    assert node["maximum"] == 10 ** INTEGER_DIGITS - 1


@pytest.mark.parametrize("family, prefix", [
    ("hermes", '<tool_call>\n{"name": "count", "arguments": {"n": '),
    ("llama3", '{"name": "count", "parameters": {"n": '),
])
def test_forced_tool_call_numbers_have_bounded_digits(constraints, family, prefix):
    """A tool schema's numbers are bounded as response_format's are: a forced call to a tool
    with an integer argument once let greedy decoding write digits until max_tokens."""
    tool = Tool("count", "", {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
                              "required": ["n", "x"], "additionalProperties": False})
    grammar = lark_grammar(call_constraint(ToolRequest((tool,), "required", False), family).source)
    assert longest_run(constraints, grammar, prefix) == INTEGER_DIGITS
    assert longest_run(constraints, grammar, prefix + '7, "x": 0.') == FRACTION_DIGITS


def test_the_mask_thread_rests_after_a_costly_mask_as_long_as_it_took():
    """A costly grammar's masks keep the mask thread busy half the time at most (a busy mask
    thread took time slices from the engine's threads); a cheap mask never rests."""
    now = [0.0]
    rests: list[float] = []
    rested = threading.Event()

    def rest(seconds: float) -> None:
        rests.append(seconds)
        rested.set()
    constraints = Constraints(lambda: token_table(vocab(), [EOS]), len(vocab().tokens), capacity=2,
                              clock=lambda: now[0], rest=rest)
    try:
        cheap = constraints.compile(regex_grammar("[0-9]+"), (EOS,))
        constraints.masks(constraints.start([cheap]))
        costly = constraints.compile(regex_grammar("[0-9]+"), (EOS,))
        fill = costly.fill

        def slow_fill():  # 40 ms of the fake clock
            now[0] += 0.04
            fill()
        costly.fill = slow_fill
        constraints.masks(constraints.start([costly]))
        assert rested.wait(5)
        assert rests == [pytest.approx(0.04)]
    finally:
        constraints.close()


def test_closing_waits_for_the_token_table_being_built(smollm2_gguf):
    """from_gguf builds the table on a thread at once; a process that exits while that thread is
    inside llguidance's native code crashes (SIGSEGV, reproduced by exiting 0.4 s after from_gguf),
    so close() — the worker's last step before it exits — returns only once the build is over."""
    before = set(threading.enumerate())
    constraints = Constraints.from_gguf(str(smollm2_gguf), 49152, capacity=2)
    builds = [t for t in threading.enumerate() if t.name == "grammar-table" and t not in before]
    assert len(builds) == 1 and builds[0].is_alive()  # the build is under way
    constraints.close()
    assert not builds[0].is_alive()
