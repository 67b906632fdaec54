"""Small ways a client could get a 500, a traceback or internals out of the gateway (issue 17, item 12)."""
from __future__ import annotations

import json

import pytest
import requests

from gateway.chat_template import ChatTemplate
from shared.errors import ReameError
from tests.fakes import FakeServer
from worker.sched.generation import ErrorEvent


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = FakeServer(tmp_path_factory.mktemp("hardening"))
    yield srv
    srv.close()


def post(server, body: dict, path: str = "/v1/completions", **headers):
    return requests.post(server.url + path, data=json.dumps(body), timeout=10,
                         headers={"Content-Type": "application/json", **headers})


def test_a_logit_bias_key_too_long_for_int_is_a_400(server):
    r = post(server, {"prompt": "x", "max_tokens": 1, "logit_bias": {"9" * 5000: 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert len(r.json()["error"]["message"]) < 200


def test_stop_strings_are_limited_in_length_as_well_as_count(server):
    r = post(server, {"prompt": "x", "max_tokens": 1, "stop": ["a" * 257]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert post(server, {"prompt": "x", "max_tokens": 1, "stop": ["a" * 256] * 16}).status_code == 200


def test_a_worker_failure_reaches_the_client_without_its_internals(server, caplog):
    generator = server.workers[0].generator
    real_step = generator.step

    def fail_all():
        events = [ErrorEvent(rid, ReameError("generation failed: FloatingPointError: overflow encountered in exp"))
                  for rid in list(generator._requests)]
        generator._requests.clear()
        return events

    generator.step = fail_all
    try:
        with caplog.at_level("ERROR", logger="reame.gateway"):
            r = post(server, {"prompt": "x", "max_tokens": 4}, **{"X-Request-Id": "req-77"})
    finally:
        generator.step = real_step
    error = r.json()["error"]
    assert r.status_code == 500 and error["type"] == "server_error"
    assert "FloatingPointError" not in error["message"] and "req-77" in error["message"]
    assert "FloatingPointError: overflow encountered in exp" in caplog.text and "req-77" in caplog.text


def test_a_chat_template_overflow_is_a_400(server):
    template = ChatTemplate("{% for i in range(200000) %}{% endfor %}")
    saved = server.state.prompts.template
    server.state.prompts.template = template
    try:
        r = post(server, {"messages": [{"role": "user", "content": "hi"}]}, path="/v1/chat/completions")
    finally:
        server.state.prompts.template = saved
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
