"""Every error class in the OpenAI envelope with the right status; never a traceback or a 500."""
from __future__ import annotations

import json
import time

import openai
import pytest
import requests

from tests.e2e.servers import NO_END, auth, raw_post, wait_idle

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


@pytest.mark.parametrize("body, param", [
    (b"{oops", None),
    (b'"a string"', None),
    ({**CHAT, "messages": "hi"}, "messages"),
    ({**CHAT, "temperature": "warm"}, "temperature"),
    ({**CHAT, "temperature": 9}, "temperature"),
    ({**CHAT, "max_tokens": -5}, "max_tokens"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "stop": {"a": 1}}, "stop"),
    ({**CHAT, "logit_bias": {"999999": 5}}, "logit_bias"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
])
def test_bad_input_is_400_naming_the_field(server, body, param):
    assert envelope(post(server, body), 400)["param"] == param


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


def test_auth(server):
    assert requests.get(server.url + "/health").status_code == 200  # open
    missing = envelope(post(server, CHAT, headers={}), 401)
    wrong = envelope(post(server, CHAT, headers={"Authorization": "Bearer nope"}), 401)
    assert missing["code"] == wrong["code"] == "invalid_api_key"
    assert requests.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_overload_is_429_with_retry_after(server):
    # One request runs and max_queue = 4 may wait; the next is refused. Raw sockets, because a
    # queued stream sends no headers until it starts, and closing them must cancel the requests.
    body = {"model": "reame", "prompt": "Count:", "max_tokens": 4000, "stream": True, "logit_bias": NO_END}
    sockets = [raw_post(server, "/v1/completions", body) for _ in range(5)]
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


def test_garbage_never_yields_500(server):
    bodies = [b"", b"null", b"[]", b"{}", b'{"messages": null}', b'{"messages": [null]}', b'{"messages": [{}]}',
              b'{"messages": [{"role": "user", "content": "x"}], "stream_options": 5}', b"\xff\xfe",
              b'{"prompt": []}', b'{"prompt": [[1], "a"]}', b'{"prompt": "a", "logprobs": true}']
    for body in bodies:
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = post(server, body, path=path)
            assert r.status_code == 400, (body, path, r.text)
            assert "Traceback" not in r.text
