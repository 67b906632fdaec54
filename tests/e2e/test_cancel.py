"""A client that hangs up mid-stream stops its generation on the worker within a step."""
from __future__ import annotations

import time

import requests

from tests.e2e.servers import NO_END, auth, metric, wait_idle


def generated(server) -> float:
    return sum(metric(server.url, "reame_generated_tokens_total").values())


def test_disconnect_cancels_generation(server):
    wait_idle(server)
    before = generated(server)
    body = {"model": "reame", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 4000, "stream": True, "logit_bias": NO_END}
    with requests.post(server.url + "/v1/chat/completions", json=body, headers=auth(), stream=True,
                       timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith(b"data:")
            if seen >= 5:
                break
    wait_idle(server, timeout=2)  # the worker's slot is free again: it acknowledged the abort
    after = generated(server)
    time.sleep(0.5)
    assert generated(server) == after  # and nothing more is being generated
    assert after - before < 100


def test_disconnect_of_a_non_streamed_request_cancels_too(server):
    wait_idle(server)
    body = {"model": "reame", "prompt": "Once", "max_tokens": 4000, "logit_bias": NO_END}
    try:
        requests.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=1.0)
    except requests.Timeout:
        pass
    wait_idle(server, timeout=3)
