"""Other sites' pages cannot drive the gateway (gateway/browsers.py): Host, Content-Type and CORS."""
from __future__ import annotations

import json

import pytest
import requests

from tests.fakes import FakeServer

CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = FakeServer(tmp_path_factory.mktemp("browsers"),
                     extra="allowed_hosts = api.example.com, Other.example\ncors_origins = https://app.example.com")
    yield srv
    srv.close()


def post(server, body=CHAT, **headers):
    return requests.post(server.url + "/v1/chat/completions", data=body, timeout=10,
                         headers={"Content-Type": "application/json", **headers})


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "10.0.0.1"])
def test_a_host_this_server_was_not_configured_for_is_refused(server, host):
    r = post(server, Host=host)
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    assert requests.get(server.url + "/health", headers={"Host": host}, timeout=10).status_code == 403


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:8000", "[::1]:8000", "api.example.com",
                                  "other.example.:443", "127.0.0.2"])
def test_configured_loopback_and_allowed_hosts_are_served(server, host):
    assert post(server, Host=host).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_that_is_not_json_is_refused(server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = requests.post(server.url + "/v1/chat/completions", data=CHAT.encode(), headers=headers, timeout=10)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert post(server, **{"Content-Type": "application/json; charset=utf-8"}).status_code == 200


def test_cors_answers_only_the_configured_origins(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    ok = requests.options(server.url + "/v1/chat/completions", timeout=10,
                          headers={"Origin": "https://app.example.com", **preflight})
    assert ok.status_code == 204 and ok.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
    assert "POST" in ok.headers["Access-Control-Allow-Methods"]
    refused = requests.options(server.url + "/v1/chat/completions", timeout=10,
                               headers={"Origin": "https://evil.example", **preflight})
    assert refused.status_code == 405 and "Access-Control-Allow-Origin" not in refused.headers
    r = post(server, Origin="https://app.example.com")
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
    error = post(server, body="{", Origin="https://app.example.com")
    assert error.status_code == 400 and error.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
    assert "Access-Control-Allow-Origin" not in post(server, Origin="https://evil.example").headers


def test_cors_is_off_by_default_and_a_key_replaces_the_host_check(tmp_path):
    srv = FakeServer(tmp_path, extra="api_key = k")
    try:
        r = requests.options(srv.url + "/v1/models", timeout=10,
                             headers={"Origin": "https://app.example.com", "Access-Control-Request-Method": "GET"})
        assert "Access-Control-Allow-Origin" not in r.headers
        # No other site's page knows the key, so any Host is served to a caller holding it.
        assert requests.get(srv.url + "/v1/models", timeout=10,
                            headers={"Host": "evil.example", "Authorization": "Bearer k"}).status_code == 200
    finally:
        srv.close()


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_bodyless_cross_site_post_cannot_freeze_the_strategy(tmp_path, content_type):
    """An empty form (or a bodyless fetch) from another site's page: no body to judge, so the
    Content-Type alone decides; before, it froze a server without keys."""
    server = FakeServer(tmp_path, extra=f"[tuning]\nstate_path = {tmp_path / 'tuning'}")
    try:
        headers = {"Origin": "https://evil.example"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        for action in ("freeze", "unfreeze"):
            r = requests.post(server.url + f"/admin/strategy/{action}", headers=headers, timeout=10)
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        assert server.state.tuning.coordinator.frozen is False
        own = requests.post(server.url + "/admin/strategy/freeze", headers={"Content-Type": "application/json"},
                            timeout=10)
        assert own.status_code == 200 and own.json()["frozen"] is True
    finally:
        server.close()
