"""The OpenAI Responses API (gateway.responses_api) against the fake workers, with the official
`openai` client: response and stream shapes, stored responses per API key across a gateway
restart, previous_response_id, errors; and the store's retention (gateway.response_store)."""
from __future__ import annotations

import json

import openai
import pytest
import requests

from gateway.response_store import ResponseStore, StoredResponse
from gateway.responses_requests import parse_responses
from shared.errors import InvalidRequestError
from tests.fakes import REPLY, FakeServer

ALICE, BOB = "alice-key", "bob-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("responses")
    keys = directory / "keys"
    keys.write_text(f"alice {ALICE}\nbob {BOB}\n")
    srv = FakeServer(directory, extra=f"api_keys_file = {keys}", server={"state_dir": str(directory / "state")})
    yield srv
    srv.close()


def client_of(server, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=10)


@pytest.fixture
def client(server):
    return client_of(server)


def test_create_and_retrieve(client):
    r = client.responses.create(model="reame", input="hi", instructions="Be brief.", temperature=0,
                                metadata={"k": "v"})
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == REPLY and [item.type for item in r.output] == ["message"]
    assert r.instructions == "Be brief." and r.metadata == {"k": "v"}
    # FakeTemplate: "<system>Be brief.\n<user>hi\n<assistant>" after BOS.
    assert r.usage.input_tokens == 1 + len("<system>Be brief.\n<user>hi\n<assistant>")
    assert r.usage.output_tokens == len(REPLY.encode()) + 1
    again = client.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == REPLY
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "hi")]


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="reame", input="hi", instructions="Be brief.", temperature=0)
    second = client.responses.create(model="reame", input="more", instructions="Be brief.", temperature=0,
                                     previous_response_id=first.id)
    history = f"<system>Be brief.\n<user>hi\n<assistant>{REPLY}\n<user>more\n<assistant>"
    assert second.usage.input_tokens == 1 + len(history.encode())
    assert second.previous_response_id == first.id
    third = client.responses.create(model="reame", input="end", temperature=0, previous_response_id=second.id)
    # Instructions are not carried over (as OpenAI's API does); the conversation is.
    assert third.usage.input_tokens == 1 + len(f"<user>hi\n<assistant>{REPLY}\n<user>more\n<assistant>{REPLY}\n"
                                                f"<user>end\n<assistant>".encode())


def test_a_tenant_never_reads_another_tenants_responses(server, client):
    mine = client.responses.create(model="reame", input="hi", temperature=0)
    bob = client_of(server, BOB)
    for call in (lambda: bob.responses.retrieve(mine.id), lambda: bob.responses.input_items.list(mine.id),
                 lambda: bob.responses.delete(mine.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as caught:
        bob.responses.create(model="reame", input="x", previous_response_id=mine.id)
    assert caught.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(mine.id).id == mine.id  # still there for its owner


def test_stored_responses_survive_a_gateway_restart(server, client):
    kept = client.responses.create(model="reame", input="hi", temperature=0)
    server.restart_gateway()
    fresh = client_of(server)
    assert fresh.responses.retrieve(kept.id).output_text == REPLY
    fresh.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        fresh.responses.retrieve(kept.id)


def test_store_false_is_not_kept(client):
    r = client.responses.create(model="reame", input="hi", temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_stream_events(client):
    stream = client.responses.create(model="reame", input="hi", temperature=0, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY
    final = events[-1].response
    assert final.output_text == REPLY and client.responses.retrieve(final.id).output_text == REPLY
    cut = list(client.responses.create(model="reame", input="hi", temperature=0, max_output_tokens=5, stream=True))
    assert cut[-1].type == "response.incomplete"  # as OpenAI ends a reply cut at max_output_tokens
    done = cut[-1].response
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == REPLY[:5]


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}}},
     "text.format.name"),
    ({"input": "hi", "previous_response_id": "resp_nothing"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "include": "message.output_text.logprobs"}, "include"),
    ({"input": "hi", "include": ["message.output_text.logprobs", "everything"]}, "include[1]"),
    ({"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 99}, "top_logprobs"),
    ({"input": "hi", "model": "gpt-5"}, "model"),
])
def test_bad_requests_in_openai_envelope(server, body, param):
    r = requests.post(server.url + "/v1/responses", data=json.dumps(body), timeout=10,
                      headers={"Content-Type": "application/json", "Authorization": f"Bearer {ALICE}"})
    assert 400 <= r.status_code < 500
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_include_logprobs_whole_and_streamed(client):
    kw = {"model": "reame", "input": "hi", "temperature": 0, "top_logprobs": 2,
          "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}
    plain = client.responses.create(**kw)
    (part,) = plain.output[0].content
    # The fake worker: one token per byte of REPLY, each at -0.5, its runner-up at -2.0.
    assert b"".join(bytes(lp.bytes) for lp in part.logprobs).decode() == REPLY
    assert all(lp.logprob == -0.5 and [t.logprob for t in lp.top_logprobs] == [-0.5, -2.0] for lp in part.logprobs)
    events = list(client.responses.create(**kw, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in streamed] == [lp.model_dump() for lp in done.logprobs] == \
        [lp.model_dump() for lp in part.logprobs]
    # Not asked for: none.
    assert client.responses.create(model="reame", input="hi", temperature=0).output[0].content[0].logprobs == []


def test_input_items_paging(client):
    r = client.responses.create(model="reame", temperature=0, input=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
    newest_first = client.responses.input_items.list(r.id, limit=2)
    assert [i.content[0].text for i in newest_first.data] == ["c", "b"] and newest_first.has_more
    rest = client.responses.input_items.list(r.id, limit=2, after=newest_first.last_id)
    assert [i.content[0].text for i in rest.data] == ["a"] and not rest.has_more
    assert [i.content[0].text for i in client.responses.input_items.list(r.id, order="asc")] == ["a", "b", "c"]
    listed = client.responses.input_items.list(r.id, include=["message.input_image.image_url"], order="asc")
    assert [i.content[0].text for i in listed] == ["a", "b", "c"] and listed.first_id == listed.data[0].id
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_items.list(r.id, include=["everything"])
    assert caught.value.body["param"] == "include[0]"


# ---- pure parts -------------------------------------------------------------------------------------

def test_items_become_chat_messages():
    parsed = parse_responses({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "noon"}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
                  {"type": "function", "name": "get_time"}],
        "tool_choice": {"type": "function", "name": "get_time"}, "max_output_tokens": 7})
    assert parsed.messages == (
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"})
    assert [i["type"] for i in parsed.items] == ["message", "function_call", "function_call", "function_call_output",
                                                 "function_call_output"]
    assert parsed.chat.tools.choice == "get_time" and parsed.chat.max_tokens == 7 and parsed.store


def test_text_format_takes_the_response_format_path():
    parsed = parse_responses({"input": "x", "text": {"format": {"type": "json_schema", "name": "person", "strict": True,
                                                                "schema": {"type": "object"}}}})
    assert parsed.chat.constraint.kind == "json_schema"
    with pytest.raises(InvalidRequestError) as caught:
        parse_responses({"input": "x", "text": {"format": {"type": "xml"}}})
    assert caught.value.param == "text.format.type"


def test_store_retention(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite", max_age_hours=1, max_per_owner=2)
    for i, created in enumerate((100.0, 200.0, 300.0)):
        store.put("a", StoredResponse(f"r{i}", created, {"n": i}, [], []), now=created)
    assert store.get("a", "r0", now=300) is None  # the oldest of three went when the third came
    assert store.get("a", "r2", now=300).response == {"n": 2}
    assert store.get("b", "r2", now=300) is None  # another owner
    store.put("b", StoredResponse("x", 5000.0, {}, [], []), now=5000.0)
    assert store.get("a", "r2", now=5000) is None  # past an hour: deleted on the next write
    store.close()
    reopened = ResponseStore(tmp_path / "r.sqlite", max_age_hours=1, max_per_owner=2)
    assert reopened.get("b", "x", now=5000) is not None and not reopened.delete("a", "x")
    reopened.close()


def test_a_stream_whose_worker_is_lost_ends_with_an_error_event(tmp_path):
    # The reply's 20 tokens take a second.
    srv = FakeServer(tmp_path, workers=1, step_s=0.05, server={"state_dir": str(tmp_path / "state")})
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=20)
        events = iter(client.responses.create(model="reame", input="hi", temperature=0, max_output_tokens=200,
                                              stream=True))
        assert next(events).type == "response.created"
        srv.workers[0].crash()
        rest = list(events)
        assert rest[-1].type == "error" and rest[-1].code == "worker_lost"
        assert "response.completed" not in [e.type for e in rest]
    finally:
        srv.close()


def test_stored_responses_path_is_where_the_store_lives(tmp_path):
    path = tmp_path / "kept" / "responses.sqlite"
    srv = FakeServer(tmp_path, extra=f"stored_responses_path = {path}", server={"state_dir": str(tmp_path / "run")})
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=10)
        r = client.responses.create(model="reame", input="hi", temperature=0)
        assert path.exists() and not (tmp_path / "run" / "responses.sqlite").exists()
        assert ResponseStore(path, 1, 10).get("", r.id) is not None
    finally:
        srv.close()
