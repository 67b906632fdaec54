"""Who may use the gateway, and what clients can put into its logs.

The auth test walks the app's own route table, so a route added later is covered without
anyone remembering to add it here.
"""
from __future__ import annotations

import http.client
import logging

import pytest
import requests

from gateway.auth import OPEN_PATHS
from gateway.main import check_exposure
from gateway.request_id import MAX_LENGTH, sanitize
from shared.config import Config, parse_config
from shared.errors import ConfigError
from shared.logs import SafeFormatter
from tests.fakes import FakeServer

KEY = "s3cret"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = FakeServer(tmp_path_factory.mktemp("sec"), extra=f"api_key = {KEY}")
    yield srv
    srv.close()


def test_every_route_but_the_open_ones_refuses_a_missing_or_wrong_key(server):
    checked = 0
    for route in server.app.router.routes():
        path = route.resource.canonical
        if path in OPEN_PATHS:
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
            r = requests.request(route.method, server.url + path, headers=headers, timeout=5)
            assert r.status_code == 401, (route.method, path, headers)
            if route.method != "HEAD":
                assert r.json()["error"]["code"] == "invalid_api_key"
        checked += 1
    assert checked >= 4  # the two completions, models, metrics (and their HEADs)
    ok = requests.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
    assert ok.status_code == 200


def test_no_api_or_admin_route_is_open():
    assert not [p for p in OPEN_PATHS if p.startswith(("/v1/", "/admin/"))]


def test_request_id_is_echoed_sanitized_or_made_up(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = requests.get(server.url + "/v1/models", headers={**auth, "X-Request-Id": "abc-123"}, timeout=5)
    assert r.headers["X-Request-Id"] == "abc-123"
    made_up = requests.get(server.url + "/v1/models", headers=auth, timeout=5).headers["X-Request-Id"]
    assert len(made_up) == 32
    refused = requests.get(server.url + "/v1/models", headers={"X-Request-Id": "x y"}, timeout=5)
    assert refused.status_code == 401 and refused.headers["X-Request-Id"] == "xy"
    streamed = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True},
                             headers={**auth, "X-Request-Id": "s-1"}, timeout=5)
    assert streamed.headers["X-Request-Id"] == "s-1" and streamed.text.endswith("data: [DONE]\n\n")
    odd = requests.get(server.url + "/v1/models", headers={**auth, "X-Request-Id": "a\tb <i>;%0A"}, timeout=5)
    assert odd.headers["X-Request-Id"] == "abi0A"
    # Bytes a client library would refuse to send: aiohttp's parser answers 400 before any handler.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.putrequest("GET", "/v1/models")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("X-Request-Id", "id\x1b[2J\x0bFORGED\x7f")
    conn.endheaders()
    assert conn.getresponse().status == 400
    conn.close()


@pytest.mark.parametrize("raw, clean", [
    ("abc", "abc"), ("a\nb\r\nINFO forged", "abINFOforged"), ("\x00\x1b\u2028", None), ("", None), (None, None),
    ("x" * 500, "x" * MAX_LENGTH), ("req:1/2@host=+.-_", "req:1/2@host=+.-_"), ("é中", None),
])
def test_sanitize(raw, clean):
    assert sanitize(raw) == clean


def test_log_messages_cannot_forge_lines():
    formatter = SafeFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord("reame", logging.INFO, __file__, 1, "request %s: done", ("x\nERROR forged\x1b[0m",),
                               None)
    line = formatter.format(record)
    assert "\n" not in line and "\x1b" not in line and line == "INFO request x\\nERROR forged\\x1b[0m: done"


def conf(gateway: str = "", server: str = "") -> Config:
    return parse_config(f"[gateway]\n{gateway}\n[server]\n{server}\n")


def test_loopback_listens_quietly_and_workers_meet_on_ipc():
    config = conf()
    assert check_exposure(config) == []
    assert config.endpoint.startswith("ipc://")
    assert check_exposure(conf("host = ::1")) == [] and check_exposure(conf("host = localhost")) == []


def test_other_addresses_need_allow_remote_and_warn_without_a_key():
    with pytest.raises(ConfigError, match="allow_remote"):
        check_exposure(conf("host = 0.0.0.0"))
    warnings = check_exposure(conf("host = 0.0.0.0\nallow_remote = true"))
    assert len(warnings) == 1 and "without an api_key" in warnings[0]
    assert check_exposure(conf("host = 10.1.2.3\nallow_remote = true\napi_key = k")) == []


def test_a_tcp_worker_endpoint_needs_curve_or_insecure_tcp_even_on_loopback():
    assert check_exposure(conf(server="endpoint = ipc:///run/reame/workers.ipc")) == []
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://0.0.0.0:5557"):
        with pytest.raises(ConfigError, match="insecure_tcp"):
            check_exposure(conf(server=f"endpoint = {endpoint}"))
        warnings = check_exposure(conf(server=f"endpoint = {endpoint}\ninsecure_tcp = true"))
        assert len(warnings) == 1 and endpoint in warnings[0] and "without CURVE" in warnings[0]


@pytest.mark.parametrize("log_prompts", [False, True])
def test_prompt_text_is_logged_only_with_log_prompts(tmp_path, caplog, log_prompts):
    srv = FakeServer(tmp_path, extra=f"[logging]\nlog_prompts = {str(log_prompts).lower()}")
    try:
        with caplog.at_level(logging.DEBUG, logger="reame"):
            r = requests.post(srv.url + "/v1/completions", json={"prompt": "zebra-quartz", "max_tokens": 3},
                              headers={"X-Request-Id": "rq1"}, timeout=10)
            assert r.status_code == 200
            srv.wait_until(lambda: "request rq1 (" in caplog.text)
    finally:
        srv.close()
    assert ("zebra-quartz" in caplog.text) == log_prompts
