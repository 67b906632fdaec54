"""The bad-input matrix: every error class in the OpenAI envelope with the right status, never a
traceback or a 500, and the server healthy afterwards. Slow clients are in test_slow_clients.py,
clients that hang up in test_cancel.py."""
from __future__ import annotations

import json
import time

import openai
import pytest
import requests

from tests.e2e.servers import BATCH, NO_END, auth, raw_post, wait_idle

CHAT = {"model": "reame", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(server, body, path="/v1/chat/completions", headers=None):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(server.url + path, data=data, timeout=30,
                         headers={"Content-Type": "application/json", **(auth() if headers is None else headers)})


def envelope(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def healthy(server) -> bool:
    r = requests.get(server.url + "/health", timeout=5)
    return r.status_code == 200 and r.json()["workers"] == 1


COMPLETION = "/v1/completions"
# (path, body, the `param` the error names). Each must be a 400 in the OpenAI envelope that
# leaves the server healthy.
BAD_INPUT = {
    "invalid JSON": (None, b"{oops", None),
    "not an object": (None, b'"a string"', None),
    "invalid UTF-8 in a string": (None, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    "messages missing": (None, {"model": "reame"}, "messages"),
    "prompt missing": (COMPLETION, {"model": "reame", "max_tokens": 2}, "prompt"),
    "messages not an array": (None, {**CHAT, "messages": "hi"}, "messages"),
    "messages empty": (None, {**CHAT, "messages": []}, "messages"),
    "unknown role": (None, {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    "content missing": (None, {**CHAT, "messages": [{"role": "user"}]}, "messages[0].content"),
    "image content": (None, {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                      "messages[0].content[0]"),
    "empty prompt list": (COMPLETION, {"prompt": [], "max_tokens": 2}, "prompt"),
    "temperature a string": (None, {**CHAT, "temperature": "warm"}, "temperature"),
    "temperature too high": (None, {**CHAT, "temperature": 9}, "temperature"),
    "stream a string": (None, {**CHAT, "stream": "yes"}, "stream"),
    "max_tokens negative": (None, {**CHAT, "max_tokens": -5}, "max_tokens"),
    "max_tokens zero": (COMPLETION, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "max_tokens fractional": (None, {**CHAT, "max_tokens": 2.5}, "max_tokens"),
    "max_tokens huge": (None, {**CHAT, "max_tokens": 10 ** 12}, "messages"),  # over the context
    "n zero": (None, {**CHAT, "n": 0}, "n"),
    "n over max_n": (None, {**CHAT, "n": 17}, "n"),
    "stop an object": (None, {**CHAT, "stop": {"a": 1}}, "stop"),
    "stop list too long": (None, {**CHAT, "stop": [f"s{i}" for i in range(17)]}, "stop"),
    "logit_bias id outside the vocabulary": (None, {**CHAT, "logit_bias": {"999999": 5}}, "logit_bias"),
    "logit_bias id not a number": (None, {**CHAT, "logit_bias": {"abc": 5}}, "logit_bias"),
    "logit_bias id negative": (None, {**CHAT, "logit_bias": {"-1": 5}}, "logit_bias"),
    "logit_bias value out of range": (None, {**CHAT, "logit_bias": {"5": 500}}, "logit_bias"),
    "prompt token outside the vocabulary": (COMPLETION, {"prompt": [1, 999999], "max_tokens": 2}, "prompt"),
}


@pytest.mark.parametrize("path, body, param", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_is_400_naming_the_field(server, path, body, param):
    assert envelope(post(server, body, path=path or "/v1/chat/completions"), 400)["param"] == param
    assert healthy(server)


def test_context_length_exceeded_gives_the_counts(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="reame", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=100_000)
    error = info.value.body
    assert info.value.code == "context_length_exceeded" and error["param"] == "messages"
    assert "8192" in error["message"] and "100000" in error["message"]
    long_prompt = "word " * 9000
    r = post(server, {"model": "reame", "prompt": long_prompt, "max_tokens": 1}, path="/v1/completions")
    assert envelope(r, 400)["code"] == "context_length_exceeded"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"


def test_gguf_name_is_accepted_as_model(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", prompt="Hi", max_tokens=1)
    assert r.model == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_body_over_the_limit_is_413(server):
    r = post(server, {"model": "reame", "prompt": "x" * 70_000}, path="/v1/completions")
    assert envelope(r, 413)["code"] == "request_too_large"
    assert healthy(server)


def test_auth(server):
    assert requests.get(server.url + "/health").status_code == 200  # open
    missing = envelope(post(server, CHAT, headers={}), 401)
    wrong = envelope(post(server, CHAT, headers={"Authorization": "Bearer nope"}), 401)
    assert missing["code"] == wrong["code"] == "invalid_api_key"
    assert requests.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_overload_is_429_with_retry_after(server):
    # BATCH requests run and max_queue = 4 may wait; the next is refused. Raw sockets, because a
    # queued stream sends no headers until it starts, and closing them must cancel the requests.
    body = {"model": "reame", "prompt": "Count:", "max_tokens": 4000, "stream": True, "logit_bias": NO_END}
    sockets = [raw_post(server, "/v1/completions", body) for _ in range(BATCH + 4)]
    try:
        deadline = time.monotonic() + 30
        while requests.get(server.url + "/health").json()["queued"] < 4:
            assert time.monotonic() < deadline, "the queue did not fill"
            time.sleep(0.1)
        r = post(server, {"model": "reame", "prompt": "x", "max_tokens": 1}, path="/v1/completions")
        error = envelope(r, 429)
        assert r.headers["Retry-After"] and error["type"] == "rate_limit_error"
    finally:
        for sock in sockets:
            sock.close()
    wait_idle(server)
    assert post(server, {"model": "reame", "prompt": "x", "max_tokens": 1}, path="/v1/completions").status_code == 200


def test_garbage_never_yields_500(server):
    bodies = [b"", b"null", b"[]", b"{}", b'{"messages": null}', b'{"messages": [null]}', b'{"messages": [{}]}',
              b'{"messages": [{"role": "user", "content": "x"}], "stream_options": 5}', b"\xff\xfe",
              b'{"prompt": []}', b'{"prompt": [[1], "a"]}', b'{"prompt": "a", "logprobs": true}']
    for body in bodies:
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = post(server, body, path=path)
            assert r.status_code == 400, (body, path, r.text)
            assert "Traceback" not in r.text
