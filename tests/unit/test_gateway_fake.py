"""The gateway end to end against fake workers (real ZeroMQ, real aiohttp, scripted engine).

These pin down the HTTP contract quickly; tests/e2e repeats the important ones on the real model.
"""
from __future__ import annotations

import json
import time

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes import BOS, EOS, OFFSET, REPLY, FakeServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = FakeServer(tmp_path_factory.mktemp("gw"))
    yield srv
    srv.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server, path, body, **kw):
    return requests.post(server.url + path, data=body if isinstance(body, (bytes, str)) else json.dumps(body),
                         headers={"Content-Type": "application/json"}, timeout=10, **kw)


def chat_body(**fields):
    return {"model": "reame", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_chat_non_streamed(client):
    r = client.chat.completions.create(model="reame", messages=[{"role": "user", "content": "hi"}], temperature=0)
    assert r.choices[0].message.content == REPLY
    assert r.choices[0].finish_reason == "stop"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.completion_tokens == len(REPLY.encode()) + 1  # the text and the end token
    assert r.usage.prompt_tokens == len("<user>hi\n<assistant>") + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streamed_equals_non_streamed(client):
    stream = client.chat.completions.create(model="reame", messages=[{"role": "user", "content": "hi"}],
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(REPLY.encode()) + 1


def test_length_finish(client):
    r = client.chat.completions.create(model="reame", messages=[{"role": "user", "content": "hi"}],
                                       temperature=0, max_tokens=5)
    assert r.choices[0].message.content == REPLY[:5] and r.choices[0].finish_reason == "length"


def test_stop_string_across_tokens_is_not_leaked(client):
    # Each fake token is one byte, so "world" spans five tokens.
    r = client.chat.completions.create(model="reame", messages=[{"role": "user", "content": "hi"}],
                                       temperature=0, stop=["world", "zzz"])
    assert r.choices[0].message.content == "Hello, " and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="reame", messages=[{"role": "user", "content": "hi"}],
                                            temperature=0, stop="world", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Hello, "


def test_multibyte_characters_survive_token_splits(client):
    r = client.completions.create(model="reame", prompt="x", temperature=0)
    assert r.choices[0].text == REPLY  # "é" is two byte-tokens


def test_seed_and_n(client):
    def run(**kw):
        return client.completions.create(model="reame", prompt="x", temperature=1, max_tokens=20, **kw)

    a, b = run(seed=7), run(seed=7)
    assert a.choices[0].text == b.choices[0].text
    two = run(seed=7, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == a.choices[0].text  # choice i uses seed + i
    assert two.choices[1].text != two.choices[0].text
    assert two.usage.completion_tokens == 40


def test_n_streamed(client):
    stream = client.chat.completions.create(model="reame", messages=[{"role": "user", "content": "hi"}],
                                            temperature=0, n=2, stream=True)
    texts = {0: "", 1: ""}
    for c in stream:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: REPLY, 1: REPLY}


def test_completions_prompt_forms(client):
    r = client.completions.create(model="reame", prompt=["a", "b"], temperature=0, max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[1].text == REPLY[:3]
    r = client.completions.create(model="reame", prompt=[OFFSET + 65, OFFSET + 66], temperature=0, max_tokens=2)
    assert r.usage.prompt_tokens == 2 and r.object == "text_completion"


def test_logprobs(client):
    r = client.chat.completions.create(model="reame", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                       max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == list(REPLY[:3])
    assert content[0].logprob == -0.5 and len(content[0].top_logprobs) == 2 and content[0].bytes == [ord("H")]
    r = client.completions.create(model="reame", prompt="x", temperature=0, max_tokens=3, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens == list(REPLY[:3]) and lp.text_offset == [0, 1, 2] and lp.top_logprobs[0] == {"H": -0.5}


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["reame"]
    health = requests.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["workers"] == 1
    text = requests.get(server.url + "/metrics").text
    for name in ("reame_requests_total", "reame_generated_tokens_total", "reame_time_to_first_token_seconds",
                 "reame_time_per_output_token_seconds", "reame_queue_depth", 'reame_worker_state{'):
        assert name in text


def test_model_aliases(client):
    for name in ("fake.gguf", "fake", "fake-model"):
        client.completions.create(model=name, prompt="x", max_tokens=1)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1]", 400, None),
    (chat_body(temperature=5), 400, "temperature"),
    (chat_body(messages=[]), 400, "messages"),
    (chat_body(model="gpt-9"), 404, "model"),
    (chat_body(max_tokens=10_000), 400, "messages"),
    (chat_body(logit_bias={"99999": 1}), 400, "logit_bias"),
    (b'{"prompt": "' + b"x" * 30000 + b'"}', 413, None),
])
def test_errors_use_the_openai_envelope(server, body, status, param):
    completion = isinstance(body, bytes) and body.startswith(b'{"prompt"')
    path = "/v1/completions" if completion else "/v1/chat/completions"
    r = post(server, path, body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    if isinstance(body, dict) and body.get("max_tokens"):
        assert error["code"] == "context_length_exceeded" and "10000" in error["message"]


def test_unknown_route_and_method(server):
    assert requests.get(server.url + "/v1/nothing").json()["error"]["code"] == "not_found"
    assert requests.get(server.url + "/v1/chat/completions").status_code == 405


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="reame", prompt="x", max_tokens=100_000)
    assert info.value.code == "context_length_exceeded"


def test_disconnect_aborts_the_generation(tmp_path):
    srv = FakeServer(tmp_path, step_s=0.01)
    try:
        generator = srv.workers[0].generator
        body = chat_body(stream=True, logit_bias={str(EOS): -100}, max_tokens=200, temperature=0)
        with requests.post(srv.url + "/v1/chat/completions", json=body, timeout=10, stream=True) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data:") and '"content":"H' in line:
                    break
        srv.wait_until(lambda: generator.closed == 1, timeout=2)
        steps = generator.steps
        time.sleep(0.1)
        assert generator.steps == steps < 100
        srv.wait_until(lambda: sum(len(w.jobs) for w in srv.state.pool.workers.values()) == 0)
    finally:
        srv.close()


def test_overload_is_429_with_retry_after(tmp_path):
    srv = FakeServer(tmp_path, step_s=0.05)
    try:
        srv.state.pool.max_queue = 0  # nothing may wait
        r = post(srv, "/v1/completions", {"prompt": "x", "n": 2, "max_tokens": 2})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        srv.close()


def test_more_choices_than_can_ever_wait_is_400_not_429(server):
    r = post(server, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2})  # max_queue 8
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_auth(tmp_path):
    srv = FakeServer(tmp_path, extra="api_key = s3cret")
    try:
        assert requests.get(srv.url + "/health").status_code == 200
        assert requests.get(srv.url + "/v1/models").status_code == 401
        wrong = requests.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert requests.get(srv.url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()
    finally:
        srv.close()


def test_lost_worker_reroutes_and_fails_streams(tmp_path):
    srv = FakeServer(tmp_path, workers=2, step_s=0.02)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        body = dict(model="reame", messages=[{"role": "user", "content": "hi"}], max_tokens=60,
                    logit_bias={str(EOS): -100})
        import concurrent.futures as cf
        with cf.ThreadPoolExecutor(2) as pool:
            stream = client.chat.completions.create(stream=True, **body)
            first = next(iter(stream))  # role chunk: the stream is under way on some worker
            assert first.choices[0].delta.role == "assistant"
            plain = pool.submit(client.chat.completions.create, **body)
            srv.wait_until(lambda: all(len(w.jobs) == 1 for w in srv.state.pool.workers.values()))
            delivered = {j.request_id for h in srv.state.pool.workers.values() for j in h.jobs.values()
                         if j.delivered}
            victim = next(w for w in srv.workers if set(w.generator.request_ids) & delivered)
            victim.crash()
            with pytest.raises(openai.APIError):
                for _ in stream:
                    pass
            assert plain.result(10).choices[0].finish_reason == "length"
        assert requests.get(srv.url + "/health").status_code == 200
    finally:
        srv.close()


def test_no_worker_is_503_then_health_recovers(tmp_path):
    srv = FakeServer(tmp_path)
    try:
        srv.workers[0].stop()
        srv.wait_until(lambda: not srv.state.pool.ready)
        assert requests.get(srv.url + "/health").status_code == 503
        started = time.monotonic()
        r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and time.monotonic() - started >= 1.5
        srv.add_worker("w-new")
        srv.wait_until(lambda: requests.get(srv.url + "/health").status_code == 200)
    finally:
        srv.close()


def test_drain_finishes_work_in_flight(tmp_path):
    srv = FakeServer(tmp_path, step_s=0.01)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        import concurrent.futures as cf
        with cf.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.completions.create, model="reame", prompt="x", max_tokens=30,
                                  logit_bias={str(EOS): -100})
            srv.wait_until(lambda: srv.workers[0].generator.steps > 2)
            srv.workers[0].service.request_drain()
            assert pending.result(10).usage.completion_tokens == 30
        srv.workers[0].thread.join(5)
        assert not srv.workers[0].thread.is_alive()
        srv.wait_until(lambda: not srv.state.pool.workers)
    finally:
        srv.close()


def test_a_step_longer_than_the_timeout_keeps_its_worker(tmp_path):
    # worker_timeout is 0.6 s here; the pulse thread beats while the engine is busy.
    srv = FakeServer(tmp_path, step_s=0.8)
    try:
        r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY[:2]
        assert srv.state.pool.metrics.workers_lost._value.get() == 0
    finally:
        srv.close()


def test_workers_register_again_with_a_restarted_gateway(tmp_path):
    srv = FakeServer(tmp_path, workers=2)
    try:
        srv.restart_gateway()
        srv.wait_until(lambda: len(srv.state.pool.ready) == 2)
        r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0})
        assert r.json()["choices"][0]["text"] == REPLY[:3]
    finally:
        srv.close()


# ---- /v1/warm -------------------------------------------------------------------------------------

def test_warm_messages_prefill_the_prompt_a_chat_then_sends(server):
    generator = server.workers[0].generator
    generator.cached_tokens, generator.prefix_tokens = 3, 16
    try:
        r = post(server, "/v1/warm", {"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        prompt_tokens = len("<user>hi\n<assistant>") + 1
        assert r.json() == {"object": "prefix.warm", "model": "reame", "prompt_tokens": prompt_tokens,
                            "cached_tokens": 16, "reused_tokens": 3}
        _, warmed, params, warm = generator.added[-1]
        assert warm and params.max_tokens == 1 and params.temperature == 0.0 and len(warmed) == prompt_tokens
        chat = post(server, "/v1/chat/completions", chat_body(max_tokens=2)).json()
        assert generator.added[-1][1] == warmed and not generator.added[-1][3]  # the same tokens, for real
        assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    finally:
        generator.cached_tokens, generator.prefix_tokens = 0, 0


@pytest.mark.parametrize("prompt, ids", [
    ("ab", [BOS, OFFSET + ord("a"), OFFSET + ord("b")]),  # tokenized as /v1/completions does
    ([OFFSET + 65, OFFSET + 66], [OFFSET + 65, OFFSET + 66]),
])
def test_warm_prompt(server, prompt, ids):
    generator = server.workers[0].generator
    generator.prefix_tokens = 2
    try:
        r = post(server, "/v1/warm", {"model": "fake.gguf", "prompt": prompt, "messages": None})
        assert r.json() == {"object": "prefix.warm", "model": "reame", "prompt_tokens": len(ids),
                            "cached_tokens": 2, "reused_tokens": 0}
        _, sent, _, warm = generator.added[-1]
        assert sent == ids and warm
    finally:
        generator.prefix_tokens = 0


def test_warm_routes_like_the_requests_it_prepares_for(tmp_path):
    srv = FakeServer(tmp_path, workers=2)
    try:
        system = [{"role": "system", "content": "You answer in French. " * 4}]
        for question in ("hi", "bye"):
            post(srv, "/v1/warm", {"messages": system})
            post(srv, "/v1/chat/completions", chat_body(messages=system + [{"role": "user", "content": question}],
                                                        max_tokens=1))
        warmed = [w for w in srv.workers if any(warm for *_, warm in w.generator.added)]
        assert len(warmed) == 1 and len(warmed[0].generator.added) == 4  # the chats followed their prefix
    finally:
        srv.close()


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, status, param", [
    ({}, 400, "messages"),
    ({"messages": None, "prompt": None}, 400, "messages"),
    ({"messages": HI, "prompt": "x"}, 400, "prompt"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [[OFFSET]]}, 400, "prompt"),
    ({"prompt": [99999]}, 400, "prompt"),
    ({"prompt": "x" * 300}, 400, "prompt"),  # with its one token, over the fake's 256 context
    ({"prompt": "x", "model": 5}, 400, "model"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
    (b"{not json", 400, None),
    (b"[1]", 400, None),
    (b'{"prompt": "' + b"x" * 30000 + b'"}', 413, None),
])
def test_warm_refuses_bad_bodies(server, body, status, param):
    r = post(server, "/v1/warm", body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    if body == {"prompt": "x" * 300}:
        assert error["code"] == "context_length_exceeded"


# ---- prefix-cache counters from heartbeats --------------------------------------------------------

PREFIX_SERIES = [("reame_prefix_query_tokens_total", ()), ("reame_prefix_hit_tokens_total", ("ram",)),
                 ("reame_prefix_hit_tokens_total", ("store",)), ("reame_prefix_restore_choices_total", ("restore",)),
                 ("reame_prefix_restore_choices_total", ("recompute",)), ("reame_prefix_store_evictions_total", ()),
                 ("reame_prefix_store_writes_total", ()), ("reame_prefix_store_bytes", ())]
COUNTERS = ["prefix_query_tokens", "prefix_hit_tokens_ram", "prefix_hit_tokens_store", "prefix_restores",
            "prefix_recomputes", "store_evictions", "store_writes", "store_bytes"]


def prefix_metrics(srv) -> list[float]:
    """The prefix series of /metrics, in PREFIX_SERIES order."""
    samples = {(s.name, tuple(s.labels.values())): s.value
               for family in text_string_to_metric_families(requests.get(srv.url + "/metrics").text)
               for s in family.samples}
    return [samples[series] for series in PREFIX_SERIES]


def test_heartbeat_counters_become_prometheus_counters(tmp_path):
    srv = FakeServer(tmp_path)
    try:
        generator = srv.workers[0].generator

        def report(*values, expect):
            generator.counters = dict(zip(COUNTERS, values), unknown_key=1)
            srv.wait_until(lambda: prefix_metrics(srv) == expect)

        # Counted from 0: the first report adds all it shows; the store size is a level, shown as is.
        report(0, 0, 0, 0, 0, 0, 0, 4096, expect=[0, 0, 0, 0, 0, 0, 0, 4096])
        report(100, 40, 20, 2, 1, 3, 7, 8192, expect=[100, 40, 20, 2, 1, 3, 7, 8192])
        report(150, 40, 30, 2, 1, 3, 9, 8000, expect=[150, 40, 30, 2, 1, 3, 9, 8000])
        # The worker restarted: its totals start again, and what they show now is all new.
        report(10, 5, 0, 1, 0, 0, 1, 8000, expect=[160, 45, 30, 3, 1, 3, 10, 8000])
    finally:
        srv.close()


def test_speculative_false_reaches_the_worker_and_a_non_boolean_is_400(server, client):
    generator = server.workers[0].generator
    client.chat.completions.create(model="reame", messages=[{"role": "user", "content": "a"}],
                                   extra_body={"speculative": False})
    client.completions.create(model="reame", prompt="b")
    flags = [generator.speculative[rid] for rid, *_ in generator.added[-2:]]
    assert flags == [False, True]
    r = post(server, "/v1/chat/completions", chat_body(speculative="no"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"


def test_spec_counters_become_metrics_with_acceptance_and_mean_accepted_length(tmp_path):
    srv = FakeServer(tmp_path)
    try:
        generator = srv.workers[0].generator

        def spec_metrics():
            families = {f.name: f for f in text_string_to_metric_families(requests.get(srv.url + "/metrics").text)}
            return [families[name].samples[0].value for name in (
                "reame_spec_drafts", "reame_spec_drafted_tokens", "reame_spec_accepted_tokens",
                "reame_spec_switched_off", "reame_spec_acceptance_rate", "reame_spec_mean_accepted_length")]

        generator.counters = dict(spec_drafts=10, spec_drafted_tokens=40, spec_accepted_tokens=30, spec_switched_off=1)
        srv.wait_until(lambda: spec_metrics() == [10, 40, 30, 1, 0.75, 3.0])
        generator.counters = dict(spec_drafts=20, spec_drafted_tokens=100, spec_accepted_tokens=40, spec_switched_off=1)
        srv.wait_until(lambda: spec_metrics() == [20, 100, 40, 1, 0.4, 2.0])
    finally:
        srv.close()


def test_a_workers_kv_pool_bytes_reach_metrics_through_its_heartbeats(tmp_path):
    srv = FakeServer(tmp_path)
    try:
        generator = srv.workers[0].generator
        worker = srv.workers[0].service.info.worker_id

        def kv_bytes():
            samples = {(s.name, s.labels.get("worker")): s.value
                       for family in text_string_to_metric_families(requests.get(srv.url + "/metrics").text)
                       for s in family.samples}
            return [samples.get((name, worker)) for name in ("reame_kv_cache_used_bytes", "reame_kv_cache_total_bytes")]

        generator.counters = dict(kv_blocks=64, kv_blocks_used=16, kv_bytes=64 << 16, kv_bytes_used=16 << 16)
        srv.wait_until(lambda: kv_bytes() == [16 << 16, 64 << 16])
        generator.counters = dict(kv_blocks=64, kv_blocks_used=0, kv_bytes=64 << 16, kv_bytes_used=0)
        srv.wait_until(lambda: kv_bytes() == [0, 64 << 16])
    finally:
        srv.close()
