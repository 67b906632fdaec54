"""Several API keys (`api_keys_file`): each is a tenant whose cached prefixes can be kept apart
(`[prefix_cache] isolation`), that shares the worker slots fairly with the others, and whose
single request cannot fill the queue (`max_jobs_per_request`)."""
from __future__ import annotations

import threading

import pytest
import requests

from gateway.auth import load_tenants
from gateway.cache_namespace import cache_namespace, check_isolation
from shared.config import parse_config
from shared.errors import ConfigError
from tests.fakes import FakeServer

KEYS = {"alice": "key-of-alice", "bob": "key-of-bob"}


def _keys_file(tmp_path) -> str:
    path = tmp_path / "keys"
    path.write_text("# tenants\n\n" + "".join(f"{name} {key}\n" for name, key in KEYS.items()), encoding="utf-8")
    return str(path)


def _config(text: str):
    return parse_config(f"[gateway]\n{text}\n")


def test_keys_file_names_each_key_and_keeps_api_key_as_default(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\nalice a-key\n\nlonely-key\n", encoding="utf-8")
    tenants = load_tenants(_config(f"api_key = main-key\napi_keys_file = {path}"))
    assert [(key, t.name) for key, t in tenants] == [(b"main-key", "default"), (b"a-key", "alice"),
                                                      (b"lonely-key", "key4")]
    assert len({t.key_digest for _, t in tenants}) == 3


@pytest.mark.parametrize("content, message", [
    ("alice same\nbob same\n", "keys must differ"),
    ("alice a b\n", "expected 'KEY' or 'NAME KEY'"),
    ("# only a comment\n", "holds no key"),
])
def test_bad_keys_files_are_start_up_errors(tmp_path, content, message):
    path = tmp_path / "keys"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        load_tenants(_config(f"api_keys_file = {path}"))


def test_a_missing_keys_file_is_a_start_up_error(tmp_path):
    with pytest.raises(ConfigError, match="api_keys_file"):
        load_tenants(_config(f"api_keys_file = {tmp_path / 'nope'}"))


def test_namespaces_by_mode():
    a, b = b"a" * 32, b"b" * 32
    assert cache_namespace("none", a, None) == b""  # one shared namespace
    assert cache_namespace("none", a, "s") == cache_namespace("none", b, "s") != b""  # a salt splits it off
    assert cache_namespace("key", a, None) != cache_namespace("key", b, None)
    assert cache_namespace("key", a, None) == cache_namespace("key", a, None)
    assert cache_namespace("key", a, "s") not in (cache_namespace("key", a, None), cache_namespace("key", b, "s"))
    assert cache_namespace("request", a, None) != cache_namespace("request", a, None)  # alone without a salt
    assert cache_namespace("request", a, "s") == cache_namespace("request", a, "s")


def test_isolation_by_key_needs_keys():
    check_isolation("key", has_keys=True)
    with pytest.raises(ConfigError, match="api_key"):
        check_isolation("key", has_keys=False)
    with pytest.raises(ConfigError, match="expected one of"):
        check_isolation("tenant", has_keys=True)


@pytest.fixture
def tenants_server(tmp_path):
    srv = FakeServer(tmp_path, extra=f"api_keys_file = {_keys_file(tmp_path)}\nmax_jobs_per_request = 4\n"
                                     "[prefix_cache]\nisolation = key", step_s=0.02)
    yield srv
    srv.close()


def _post(srv, tenant: str, **body):
    body = {"prompt": "the same prompt", "max_tokens": 2, **body}
    return requests.post(srv.url + "/v1/completions", json=body, timeout=30,
                         headers={"Authorization": f"Bearer {KEYS[tenant]}"})


def _namespaces(srv) -> list[bytes]:
    generator = srv.workers[0].generator
    return [generator.namespaces[request_id] for request_id, *_ in generator.added]


def test_isolation_by_key_gives_each_tenant_its_own_namespace(tenants_server):
    for tenant in ("alice", "bob", "alice"):
        assert _post(tenants_server, tenant).status_code == 200
    assert _post(tenants_server, "alice", cache_salt="project-x").status_code == 200
    alice, bob, alice_again, salted = _namespaces(tenants_server)
    assert alice == alice_again and alice != bob and len(alice) == 32
    assert salted not in (alice, bob)


def test_one_request_cannot_ask_for_more_jobs_than_allowed(tenants_server):
    r = _post(tenants_server, "alice", prompt=["a", "b", "c"], n=2)  # 6 jobs, max_jobs_per_request 4
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "at most 4" in r.json()["error"]["message"]
    bad_salt = _post(tenants_server, "alice", cache_salt="x" * 300)
    assert bad_salt.status_code == 400 and bad_salt.json()["error"]["param"] == "cache_salt"


def test_a_burst_of_one_tenant_takes_turns_with_another(tenants_server):
    """One worker slot; alice asks for 4 choices, then bob for one: bob's runs second, not fifth."""
    srv = tenants_server
    burst = threading.Thread(target=_post, args=(srv, "alice"), kwargs={"n": 4, "max_tokens": 5})
    burst.start()
    srv.wait_until(lambda: len(srv.workers[0].generator.added) == 1)
    assert _post(srv, "bob").status_code == 200
    burst.join(30)
    order = _namespaces(srv)
    alice = order[0]
    assert [ns == alice for ns in order] == [True, False, True, True, True]


# ---- the operator's keys and the tenants' (issue 41, item 1) --------------------------------------

OPERATOR = "key-of-the-operator"
TENANT_ONLY = [("get", "/admin/strategy", None), ("post", "/admin/strategy", {"workers": {}}),
               ("post", "/admin/strategy/freeze", None), ("post", "/admin/strategy/unfreeze", None),
               ("get", "/admin/report", None), ("get", "/admin/series?bucket=5", None), ("get", "/metrics", None),
               ("get", "/dashboard", None)]


def test_an_admin_mark_makes_an_operator_key_and_the_lone_api_key_is_the_operators(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"alice a-key\nops {OPERATOR} admin\nlonely-key\n", encoding="utf-8")
    tenants = load_tenants(_config(f"api_key = main-key\napi_keys_file = {path}"))
    assert [(t.name, t.admin) for _, t in tenants] == [("default", True), ("alice", False), ("ops", True),
                                                       ("key3", False)]
    path.write_text("alice a-key root\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="'NAME KEY admin'"):
        load_tenants(_config(f"api_keys_file = {path}"))


@pytest.fixture
def operator_server(tmp_path):
    path = tmp_path / "keys"
    path.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()) + f"ops {OPERATOR} admin\n")
    srv = FakeServer(tmp_path, extra=f"api_keys_file = {path}\n[prefix_cache]\nisolation = key\n"
                                     f"[tuning]\nstate_path = {tmp_path / 'tuning'}")
    yield srv
    srv.close()


def _call(srv, method: str, path: str, body, key: str) -> requests.Response:
    return getattr(requests, method)(srv.url + path, json=body, timeout=10,
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def test_a_tenants_key_reaches_the_api_but_not_the_operators_routes(operator_server):
    """Before, any key could POST /admin/strategy: knobs of 1 and a 1 s window took another
    tenant's request from 4.6 s to 94.6 s, frozen and saved across restarts."""
    srv = operator_server
    assert _post(srv, "alice").status_code == 200
    for method, path, body in TENANT_ONLY:
        r = _call(srv, method, path, body, KEYS["alice"])
        assert r.status_code == 403, (method, path)
        assert r.json()["error"]["code"] == "permission_denied" and "operator" in r.json()["error"]["message"]
    assert srv.state.tuning.coordinator.frozen is False
    for method, path, body in TENANT_ONLY:
        if path != "/admin/strategy" or method == "get":  # an empty import is a 400 of its own
            assert _call(srv, method, path, body, OPERATOR).status_code == 200, (method, path)
    assert _call(srv, "get", "/metrics", None, OPERATOR).text.count("reame_spec_drafted_tokens") > 0
    # What needs no key stays open; a wrong key on an open page changes nothing.
    assert requests.get(srv.url + "/dashboard", timeout=10).status_code == 200
    assert requests.get(srv.url + "/health", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 200
    assert requests.get(srv.url + "/metrics", timeout=10).status_code == 401
