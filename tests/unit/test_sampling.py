"""One table of sampling limits: the gateway's validation, the OpenAPI document and the worker's
re-check all read shared.sampling.LIMITS, so a value one accepts the others accept too."""
import pytest

from gateway.openapi import openapi_document
from gateway.requests import parse_chat
from shared.config import Config
from shared.errors import InvalidRequestError
from shared.sampling import LIMITS, SamplingParams, validate_params

VOCAB = 1000
# The sampling fields a request body and SamplingParams both carry under the same name.
SHARED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "max_tokens")


def _edges(name: str) -> list[tuple[float, bool]]:
    """(value, allowed) pairs just inside and just outside each bound of LIMITS[name]."""
    limit = LIMITS[name]
    step = 1 if limit.integer else 0.01
    cases = []
    if limit.low is not None:
        cases += [(limit.low, not limit.low_open), (limit.low - step, False), (limit.low + step, True)]
    if limit.high is not None:
        cases += [(limit.high, True), (limit.high + step, False)]
    return cases


def _gateway_accepts(name: str, value) -> bool:
    try:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], name: value}, max_n=4)
    except InvalidRequestError as e:
        assert e.param == name
        return False
    return True


def _worker_accepts(name: str, value) -> bool:
    try:
        validate_params(SamplingParams(**{name: value}), VOCAB)
    except InvalidRequestError as e:
        assert e.param == name
        return False
    return True


def _schema_accepts(schema: dict, value) -> bool:
    if "minimum" in schema and value < schema["minimum"]:
        return False
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        return False
    return "maximum" not in schema or value <= schema["maximum"]


@pytest.mark.parametrize("name", SHARED_FIELDS)
def test_gateway_worker_and_openapi_agree_at_every_bound(name):
    properties = openapi_document(Config())["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    edges = _edges(name)
    assert edges, f"{name} has no bound to test"
    for value, allowed in edges:
        if name == "seed" and abs(value) >= 2 ** 63 - 1 and not allowed:
            continue  # a seed past int64 is refused by the integer type, checked by the gateway tests
        assert _gateway_accepts(name, value) is allowed, (name, value)
        assert _worker_accepts(name, value) is allowed, (name, value)
        assert _schema_accepts(properties[name], value) is allowed, (name, value)


def test_logit_bias_values_share_the_limit():
    limit = LIMITS["logit_bias"]
    assert _gateway_accepts("logit_bias", {"5": limit.high})
    assert not _gateway_accepts("logit_bias", {"5": limit.high + 1})
    assert _worker_accepts("logit_bias", {5: limit.low})
    assert not _worker_accepts("logit_bias", {5: limit.low - 1})
