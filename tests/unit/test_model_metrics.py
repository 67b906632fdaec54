"""gateway.model_metrics: the front's /metrics is one valid Prometheus text holding every loaded
model's series, each labelled with its model, and a gauge per served model."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import Metrics
from gateway.model_metrics import front_families, labelled, render


def gateway_text(requests: int) -> str:
    metrics = Metrics()
    metrics.requests.labels("/v1/chat/completions", "200").inc(requests)
    metrics.kv_bytes_total.labels("w0").set(512 * 2**20)
    metrics.ttft.observe(0.25)
    return generate_latest(metrics.registry).decode()


def samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_each_models_series_carry_its_name_under_one_family():
    text = render(labelled({"smol": gateway_text(3), "gemma": gateway_text(5)})).decode()
    # The text format allows each family once: merged, not concatenated.
    assert text.count("# TYPE reame_requests_total counter") == 1
    assert text.count("# TYPE reame_time_to_first_token_seconds histogram") == 1
    got = samples(text)
    route = (("endpoint", "/v1/chat/completions"),)
    assert got[("reame_requests_total", (*route, ("model", "smol"), ("status", "200")))] == 3
    assert got[("reame_requests_total", (*route, ("model", "gemma"), ("status", "200")))] == 5
    assert got[("reame_kv_cache_total_bytes", (("model", "gemma"), ("worker", "w0")))] == 512 * 2**20
    assert got[("reame_time_to_first_token_seconds_count", (("model", "smol"),))] == 1


def test_the_fronts_gauges_cover_every_served_model():
    listing = [{"id": "smol", "state": "loaded", "size": 606 * 2**20, "running": 2},
               {"id": "gemma", "state": "unloaded", "size": 0, "running": 0}]
    got = samples(render(front_families(listing, 1000 * 2**20, {"smol": True})).decode())
    assert got[("reame_model_state", (("model", "smol"), ("state", "loaded")))] == 1
    assert got[("reame_model_state", (("model", "gemma"), ("state", "loaded")))] == 0
    assert got[("reame_model_state", (("model", "gemma"), ("state", "unloaded")))] == 1
    assert got[("reame_model_bytes", (("model", "smol"),))] == 606 * 2**20
    assert got[("reame_model_running_requests", (("model", "smol"),))] == 2
    assert got[("reame_model_metrics_up", (("model", "smol"),))] == 1
    assert ("reame_model_metrics_up", (("model", "gemma"),)) not in got  # not loaded: not scraped
    assert got[("reame_models_budget_bytes", ())] == 1000 * 2**20
