"""GET /v1/models, /health and /metrics."""
from __future__ import annotations

import requests

from tests.e2e.servers import auth, metric


def test_models_lists_the_configured_id(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["reame"] and models[0].owned_by == "reame"


def test_health(server):
    r = requests.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["workers"] == 1


def test_metrics_count_requests_and_tokens(server, client):
    before = sum(metric(server.url, "reame_generated_tokens_total").values())
    client.completions.create(model="reame", prompt="Hi", max_tokens=3, temperature=0)
    assert sum(metric(server.url, "reame_generated_tokens_total").values()) == before + 3
    text = requests.get(server.url + "/metrics", headers=auth()).text
    for name in ("reame_requests_total{", "reame_prompt_tokens_total", "reame_time_to_first_token_seconds_bucket",
                 "reame_time_per_output_token_seconds_bucket", "reame_queue_depth", "reame_workers_ready 1.0",
                 'reame_worker_state{', "reame_worker_active_requests{"):
        assert name in text, name
    ok = metric(server.url, "reame_requests_total")
    assert any(dict(k).get("endpoint") == "/v1/completions" and dict(k).get("status") == "200" for k in ok)
