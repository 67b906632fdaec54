"""The Anthropic Messages API (gateway.anthropic_api) against the fake workers, with the official
`anthropic` client: its shapes, event stream, stop reasons, errors in Anthropic's envelope, and
the translation of its blocks into the chat request every API shares."""
from __future__ import annotations

import json

import anthropic
import pytest
import requests

from gateway.anthropic_requests import parse_messages
from shared.errors import InvalidRequestError
from tests.fakes import REPLY, FakeServer

KEY = "anthropic-test-key"
HI = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0}  # this SDK version has no temperature argument: it goes in the body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = FakeServer(tmp_path_factory.mktemp("messages"), extra=f"api_key = {KEY}")
    yield srv
    srv.close()


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=10)


def post(server, body, path="/v1/messages", headers=None):
    return requests.post(server.url + path, data=json.dumps(body), timeout=10,
                         headers={"Content-Type": "application/json", "x-api-key": KEY, **(headers or {})})


def test_create(client):
    r = client.messages.create(model="reame", max_tokens=64, messages=HI, system="Be brief.", extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == REPLY
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    # FakeTemplate: "<system>Be brief.\n<user>hi\n<assistant>" after BOS; the text and the end token out.
    assert r.usage.input_tokens == 1 + len("<system>Be brief.\n<user>hi\n<assistant>")
    assert r.usage.output_tokens == len(REPLY.encode()) + 1


def test_stream_event_sequence(server, client):
    raw = post(server, {"model": "reame", "max_tokens": 64, "messages": HI, "stream": True, **GREEDY})
    assert raw.headers["Content-Type"].startswith("text/event-stream")
    events = [line[len("event: "):] for line in raw.text.splitlines() if line.startswith("event: ")]
    deltas = events[3:-3]
    assert events[:3] == ["message_start", "ping", "content_block_start"] and set(deltas) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    with client.messages.stream(model="reame", max_tokens=64, messages=HI, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == REPLY and final.content[0].text == REPLY and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(REPLY.encode()) + 1


def test_stop_sequence_and_max_tokens(client):
    r = client.messages.create(model="reame", max_tokens=64, messages=HI, stop_sequences=["world", "zz"],
                               extra_body=GREEDY)
    assert r.content[0].text == "Hello, " and r.stop_reason == "stop_sequence" and r.stop_sequence == "world"
    with client.messages.stream(model="reame", max_tokens=64, messages=HI, stop_sequences=["world"],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "world"
    r = client.messages.create(model="reame", max_tokens=5, messages=HI, extra_body=GREEDY)
    assert r.content[0].text == REPLY[:5] and r.stop_reason == "max_tokens"


def test_count_tokens(client):
    counted = client.messages.count_tokens(model="reame", messages=HI, system="Be brief.")
    assert counted.input_tokens == 1 + len("<system>Be brief.\n<user>hi\n<assistant>")


def test_bearer_key_works_too(server):
    r = requests.post(server.url + "/v1/messages/count_tokens", json={"messages": HI}, timeout=10,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


@pytest.mark.parametrize("body, headers, status, kind, words", [
    ({"messages": HI}, {}, 400, "invalid_request_error", "'max_tokens' is required"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     {}, 400, "invalid_request_error", "text-only"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, {}, 400, "invalid_request_error", "role"),
    ({"max_tokens": 8, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, {}, 400,
     "invalid_request_error", "server tools"),
    ({"max_tokens": 8, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 1024}}, {}, 400,
     "invalid_request_error", "thinking"),
    ({"max_tokens": 8, "messages": HI, "temperature": 9}, {}, 400, "invalid_request_error", "temperature"),
    ({"max_tokens": 8, "messages": HI, "stop_sequences": ["s"] * 17}, {}, 400, "invalid_request_error",
     "'stop_sequences' has 17 entries"),
    ({"max_tokens": 8, "messages": HI, "model": "claude-opus"}, {}, 404, "not_found_error", "claude-opus"),
    ({"max_tokens": 8, "messages": HI}, {"x-api-key": "wrong"}, 401, "authentication_error", "Incorrect API key"),
])
def test_bad_requests_in_anthropic_envelope(server, body, headers, status, kind, words):
    r = post(server, body, headers=headers)
    assert r.status_code == status
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and words in error["error"]["message"]
    if status == 401:
        assert error["error"]["code"] == "invalid_api_key"


def test_unknown_route_under_messages_is_anthropic_shaped(server):
    r = post(server, {}, path="/v1/messages/batches")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_sdk_raises_typed_errors(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=8, messages=HI)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=client.base_url, api_key="wrong", max_retries=0).messages.create(
            model="reame", max_tokens=8, messages=HI)


# ---- the translation into a chat request (pure) ---------------------------------------------------

def test_blocks_become_chat_messages():
    req = parse_messages({"max_tokens": 10, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
                          "stop_sequences": ["END"], "top_k": 5, "metadata": {"user_id": "u1"}, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "and tomorrow?"}]}],
        "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}, max_n=1)
    assert req.messages == (
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "and tomorrow?"})
    assert req.stop == ("END",) and req.sampling.top_k == 5 and req.user == "u1" and req.max_tokens == 10
    assert req.tools.choice == "required" and not req.tools.parallel
    assert [t.name for t in req.tools.tools] == ["get_weather"]


def test_named_tool_choice_and_output_format():
    req = parse_messages({"max_tokens": 5, "messages": HI, "tools": [{"name": "f", "input_schema": {}}],
                          "tool_choice": {"type": "tool", "name": "f"}}, max_n=1)
    assert req.tools.choice == "f" and req.tools.parallel
    req = parse_messages({"max_tokens": 5, "messages": HI,
                          "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, max_n=1)
    assert req.constraint is not None and req.constraint.kind == "json_schema"


def test_count_tokens_needs_no_max_tokens():
    assert parse_messages({"messages": HI}, max_n=1, count_only=True).messages == tuple(HI)
    with pytest.raises(InvalidRequestError, match="tool_result"):
        parse_messages({"max_tokens": 5, "messages": [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}]}, max_n=1)


def test_a_reply_moved_to_another_worker_is_whole_once(tmp_path):
    """A worker lost after a non-streamed reply's first tokens: the job runs again on the other
    worker, and the answer is that run's text, not the lost tokens followed by it."""
    import concurrent.futures as cf

    srv = FakeServer(tmp_path, workers=2, step_s=0.03)
    try:
        claude = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=20)
        with cf.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(claude.messages.create, model="reame", max_tokens=64, messages=HI, extra_body=GREEDY)
            srv.wait_until(lambda: any(len(out) >= 3 for w in srv.workers
                                       for _, _, out in w.generator._requests.values()))
            victim = next(w for w in srv.workers if w.generator.request_ids)
            victim.crash()
            r = reply.result(20)
        assert r.content[0].text == REPLY and r.stop_reason == "end_turn"
    finally:
        srv.close()


def test_a_stream_whose_worker_is_lost_ends_with_an_error_event(tmp_path):
    srv = FakeServer(tmp_path, workers=1, step_s=0.05)  # the reply's 20 tokens take a second
    try:
        claude = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=20)
        with claude.messages.stream(model="reame", max_tokens=200, messages=HI, extra_body=GREEDY) as stream:
            events = iter(stream)
            assert next(events).type == "message_start"
            srv.workers[0].crash()
            with pytest.raises(anthropic.APIStatusError) as caught:
                for _ in events:
                    pass
        assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "overloaded_error"
    finally:
        srv.close()
