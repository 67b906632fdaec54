"""OpenAI request validation: good bodies parse; each bad field is a 400 naming that field."""
from __future__ import annotations

import pytest

from gateway.requests import parse_chat, parse_completion
from shared.errors import InvalidRequestError

CHAT = {"model": "reame", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields):
    return parse_chat({**CHAT, **fields}, max_n=8)


def test_minimal_chat_defaults():
    req = chat()
    assert req.chat and req.n == 1 and not req.stream and req.max_tokens is None
    assert req.sampling.temperature == 1.0 and req.stop == ()
    assert req.messages == ({"role": "user", "content": "hi"},)


def test_all_parameters():
    req = chat(max_completion_tokens=7, max_tokens=99, temperature=0, top_p=0.9, top_k=40, min_p=0.05,
               presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, seed=3, stop="\n",
               logit_bias={"50": -100, "7": 2}, logprobs=True, top_logprobs=2, n=3, user="u", stream=True,
               stream_options={"include_usage": True}, unknown_field={"ignored": True})
    assert req.max_tokens == 7  # max_completion_tokens wins
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.0, 0.9, 40, 0.05, 3)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert s.logit_bias == {50: -100.0, 7: 2.0}
    assert req.stop == ("\n",) and req.n == 3 and req.include_usage and req.logprobs and req.top_logprobs == 2


def test_params_per_choice():
    req = chat(seed=10, logprobs=True)
    p = req.params(max_tokens=5, stop_token_ids=(2,), choice=1)
    assert (p.max_tokens, p.stop_token_ids, p.seed, p.logprobs) == (5, (2,), 11, 1)
    assert chat().params(5, (), 1).seed is None
    assert chat().params(5, (), 0).logprobs == 0


def test_content_parts_are_joined():
    req = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}]}, max_n=1)
    assert req.messages[0]["content"] == "ab"


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": {}, "content": "x"}]}, "messages[0].role"),  # unhashable: found by schemathesis
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
    ({"model": 5}, "model"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"n": 9}, "n"),
    ({"seed": "x"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"logit_bias": []}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {" 7": 1}}, "logit_bias"),  # int() would take these; the OpenAPI pattern does not
    ({"logit_bias": {"\u0663": 1}}, "logit_bias"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": []}, "stream_options"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"user": 1}, "user"),
])
def test_bad_chat_fields_name_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as info:
        chat(**fields)
    assert info.value.param == param
    assert info.value.status == 400


def test_body_must_be_an_object():
    with pytest.raises(InvalidRequestError):
        parse_chat([1, 2], max_n=1)


@pytest.mark.parametrize("prompt, expected", [
    ("hello", ("hello",)),
    (["a", "b"], ("a", "b")),
    ([1, 2, 3], ((1, 2, 3),)),
    ([[1, 2], [3]], ((1, 2), (3,))),
    ([7.0, 8], ((7, 8),)),  # JSON Schema's integers include 7.0
])
def test_completion_prompt_forms(prompt, expected):
    assert parse_completion({"prompt": prompt}, max_n=1).prompts == expected


@pytest.mark.parametrize("prompt", [None, 5, [], [1, "a"], [[]], [-1], [True], "", ["a", ""], [1.5]])
def test_bad_completion_prompts(prompt):
    with pytest.raises(InvalidRequestError) as info:
        parse_completion({"prompt": prompt}, max_n=1)
    assert info.value.param == "prompt"


def test_completion_logprobs_is_a_count():
    req = parse_completion({"prompt": "x", "logprobs": 3}, max_n=1)
    assert req.logprobs and req.top_logprobs == 3
    assert not parse_completion({"prompt": "x"}, max_n=1).logprobs
    with pytest.raises(InvalidRequestError):
        parse_completion({"prompt": "x", "logprobs": 6}, max_n=1)


def test_an_integer_beyond_64_bits_is_refused_not_rounded_into_range():
    import orjson

    body = orjson.loads(b'{"model": "reame", "messages": [{"role": "user", "content": "hi"}], '
                        b'"seed": -9223372036854775809}')
    with pytest.raises(InvalidRequestError, match="'seed' must be an integer"):
        parse_chat(body, max_n=8)
    assert chat(seed=5.0).sampling.seed == 5
