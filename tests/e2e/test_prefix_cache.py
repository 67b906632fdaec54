"""Prefix reuse through the real gateway: a repeated system prompt is served from the worker's RAM,
from the host's store by another worker, and from the store after a full restart; every time
with the same greedy answer as the first, cold request."""
from __future__ import annotations

import time

import openai
import pytest
import requests

from tests.e2e.servers import API_KEY, auth, gateway_and_worker, metric

BLOCK = 16
# ~400 tokens of instructions that several requests share, as an agent's tool descriptions would.
SYSTEM = " ".join(
    f"Tool {i}: given a city name, the tool returns its population, its country and the river it "
    f"stands on, if any; call it once per city." for i in range(12))
SYSTEM_MESSAGES = [{"role": "system", "content": SYSTEM}]


def chat(url: str, question: str, **kw):
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    return client.chat.completions.create(
        model="reame", temperature=0, max_tokens=12,
        messages=SYSTEM_MESSAGES + [{"role": "user", "content": question}], **kw)


def hits(url: str, tier: str, at_least: float, timeout: float = 10.0) -> float:
    """The gateway's hit counter for a tier, once it shows at_least (counters come with the
    worker's heartbeats, a moment after the request), else its value at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        seen = dict(metric(url, "reame_prefix_hit_tokens_total")).get((("tier", tier),), 0)
        if seen >= at_least or time.monotonic() > deadline:
            return seen
        time.sleep(0.1)


def warm(url: str, body: dict) -> requests.Response:
    return requests.post(url + "/v1/warm", json=body, headers=auth(), timeout=120)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("shared-store")


@pytest.fixture(scope="module")
def first(smollm2_gguf, tmp_path_factory, store):
    """Worker A answers cold, again (RAM), another question, and a warm call; meanwhile worker B
    (another process on the same store, nothing in its RAM) answers the first question. Both stop."""
    question = "Which tool gives a city's river?"
    with gateway_and_worker(tmp_path_factory.mktemp("a"), smollm2_gguf, store=store) as a:
        out = {"cold": chat(a.url, question), "again": chat(a.url, question),
               "other": chat(a.url, "How often may the tool be called?")}
        out.update(ram_hits=hits(a.url, "ram", out["again"].usage.prompt_tokens_details.cached_tokens),
                   warmed=warm(a.url, {"messages": SYSTEM_MESSAGES + [{"role": "user", "content": "Warm me."}]}))
        with gateway_and_worker(tmp_path_factory.mktemp("b"), smollm2_gguf, store=store) as b:
            out["b"] = chat(b.url, question)
            out["b_hits"] = hits(b.url, "store", out["b"].usage.prompt_tokens_details.cached_tokens)
            out["b_bytes"] = metric(b.url, "reame_prefix_store_bytes")
    return out


def test_the_same_prompt_again_reuses_the_cached_prefix_with_the_same_answer(first):
    cold, again = first["cold"], first["again"]
    prompt = cold.usage.prompt_tokens
    assert prompt > 300 and cold.usage.prompt_tokens_details.cached_tokens == 0
    # All but the last token (it gives the logits): full blocks, then the first tokens of the next.
    assert again.usage.prompt_tokens_details.cached_tokens == prompt - 1
    assert again.choices[0].message.content == cold.choices[0].message.content


def test_another_question_after_the_same_system_prompt_reuses_the_system_prompt(first):
    other = first["other"]
    assert other.usage.prompt_tokens_details.cached_tokens >= len_system_tokens(first) - BLOCK
    assert first["ram_hits"] >= first["again"].usage.prompt_tokens_details.cached_tokens


def test_warm_reports_what_is_now_cached(first):
    response = first["warmed"]
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "prefix.warm" and body["prompt_tokens"] > 300
    assert body["cached_tokens"] == body["prompt_tokens"] // BLOCK * BLOCK
    assert body["reused_tokens"] >= len_system_tokens(first) - BLOCK


def test_another_worker_reuses_what_the_first_one_stored(first):
    cold, answer = first["cold"], first["b"]
    assert answer.usage.prompt_tokens_details.cached_tokens == (cold.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert answer.choices[0].message.content == cold.choices[0].message.content
    assert first["b_hits"] >= answer.usage.prompt_tokens_details.cached_tokens
    assert sum(first["b_bytes"].values()) > 0


def test_after_a_full_restart_the_prefix_comes_from_the_store(first, smollm2_gguf, tmp_path_factory, store):
    """Every process of the first two stacks has stopped; a new one starts on the same store."""
    with gateway_and_worker(tmp_path_factory.mktemp("c"), smollm2_gguf, store=store) as c:
        answer = chat(c.url, "Which tool gives a city's river?")
        missing = warm(c.url, {"model": "reame"})
        too_long = warm(c.url, {"prompt": list(range(1000, 1000 + 9000))})
        after_errors = chat(c.url, "Which tool gives a city's river?")
    cold = first["cold"]
    assert answer.usage.prompt_tokens_details.cached_tokens == (cold.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert answer.choices[0].message.content == cold.choices[0].message.content
    # Bad warm requests get OpenAI errors and lose nothing.
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert after_errors.choices[0].message.content == cold.choices[0].message.content


def len_system_tokens(first) -> int:
    """Tokens of the shared part: the longer prompt minus its question differs by a few tokens."""
    return min(first["cold"].usage.prompt_tokens, first["other"].usage.prompt_tokens) - 16


def test_tenants_never_share_cached_prefixes(smollm2_gguf, tmp_path):
    """[prefix_cache] isolation = key with two API keys: the same system prompt is reused within a
    key, never across keys (cached_tokens 0), and a cache_salt splits a key's prefixes further."""
    keys = {"alice": "alice-key", "bob": "bob-key"}
    keys_file = tmp_path / "keys"
    keys_file.write_text("".join(f"{name} {key}\n" for name, key in keys.items()))
    with gateway_and_worker(tmp_path / "server", smollm2_gguf, gateway={"api_keys_file": keys_file},
                            prefix_cache={"isolation": "key"}) as server:
        def cached(tenant: str, **kw) -> int:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=keys[tenant], max_retries=0, timeout=120)
            answer = client.chat.completions.create(
                model="reame", temperature=0, max_tokens=2,
                messages=SYSTEM_MESSAGES + [{"role": "user", "content": "Which tool gives a river?"}], **kw)
            return answer.usage.prompt_tokens_details.cached_tokens

        assert cached("alice") == 0
        assert cached("bob") == 0  # alice's blocks are in the worker's RAM and the store: not for bob
        assert cached("alice") >= len(SYSTEM) // 8  # within a key: reused (SmolLM2: ~4 characters a token)
        assert cached("bob") > 0
        assert cached("alice", extra_body={"cache_salt": "project-x"}) == 0
        assert cached("alice", extra_body={"cache_salt": "project-x"}) > 0
