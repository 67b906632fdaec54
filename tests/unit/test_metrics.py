"""Workers' cumulative prefix-cache counters become gateway counters that only ever grow; their
KV pool levels become per-worker gauges."""
from __future__ import annotations

from gateway.metrics import Metrics
from shared.protocol import Heartbeat


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels)


def test_each_worker_adds_what_grew_since_its_last_report():
    metrics = Metrics()
    metrics.observe_heartbeat(Heartbeat("a", prefix_query_tokens=500))  # served before its first beat
    metrics.observe_heartbeat(Heartbeat("b", prefix_query_tokens=0))
    metrics.observe_heartbeat(Heartbeat("a", prefix_query_tokens=520, prefix_hit_tokens_store=8))
    metrics.observe_heartbeat(Heartbeat("b", prefix_query_tokens=30, prefix_recomputes=1))
    assert value(metrics, "reame_prefix_query_tokens_total") == 550
    assert value(metrics, "reame_prefix_hit_tokens_total", tier="store") == 8
    assert value(metrics, "reame_prefix_hit_tokens_total", tier="ram") == 0
    assert value(metrics, "reame_prefix_restore_choices_total", choice="recompute") == 1
    metrics.observe_heartbeat(Heartbeat("b", prefix_query_tokens=4))  # b restarted
    assert value(metrics, "reame_prefix_query_tokens_total") == 554


def test_a_worker_dropped_and_back_is_not_counted_twice():
    metrics = Metrics()
    metrics.observe_heartbeat(Heartbeat("a", store_writes=1))
    metrics.observe_heartbeat(Heartbeat("a", store_writes=3))
    metrics.set_worker("a", 0, None)
    metrics.observe_heartbeat(Heartbeat("a", store_writes=10))  # back after a drop: only what grew
    metrics.observe_heartbeat(Heartbeat("a", store_writes=11))
    assert value(metrics, "reame_prefix_store_writes_total") == 11


def test_store_size_is_the_latest_report_not_a_sum():
    metrics = Metrics()
    metrics.observe_heartbeat(Heartbeat("a", store_bytes=1000))
    metrics.observe_heartbeat(Heartbeat("b", store_bytes=1200))
    assert value(metrics, "reame_prefix_store_bytes") == 1200


def test_kv_pool_gauges_are_each_workers_latest_levels_and_leave_with_it():
    metrics = Metrics()
    metrics.observe_heartbeat(Heartbeat("a", kv_blocks=100, kv_blocks_used=30, kv_blocks_cached=20))
    metrics.observe_heartbeat(Heartbeat("b", kv_blocks=50, kv_blocks_used=5))
    metrics.observe_heartbeat(Heartbeat("a", kv_blocks=100, kv_blocks_used=0, kv_blocks_cached=45))
    assert [value(metrics, "reame_kv_cache_blocks", worker="a", state=s) for s in ("used", "cached", "free")] == \
        [0, 45, 55]
    assert value(metrics, "reame_kv_cache_blocks", worker="b", state="free") == 45
    metrics.set_worker("a", 0, None)
    assert value(metrics, "reame_kv_cache_blocks", worker="a", state="used") is None
    assert value(metrics, "reame_kv_cache_blocks", worker="b", state="used") == 5


def test_kv_pool_bytes_are_each_workers_latest_used_and_total_and_leave_with_it():
    metrics = Metrics()
    metrics.observe_heartbeat(Heartbeat("a", kv_blocks=100, kv_bytes=100 << 20, kv_bytes_used=30 << 20))
    metrics.observe_heartbeat(Heartbeat("b", kv_blocks=50, kv_bytes=25 << 20, kv_bytes_used=0))
    metrics.observe_heartbeat(Heartbeat("a", kv_blocks=100, kv_bytes=100 << 20, kv_bytes_used=2 << 20))
    assert value(metrics, "reame_kv_cache_used_bytes", worker="a") == 2 << 20
    assert value(metrics, "reame_kv_cache_total_bytes", worker="a") == 100 << 20
    assert (value(metrics, "reame_kv_cache_used_bytes", worker="b"), value(metrics, "reame_kv_cache_total_bytes",
                                                                             worker="b")) == (0, 25 << 20)
    metrics.set_worker("a", 0, None)
    assert value(metrics, "reame_kv_cache_used_bytes", worker="a") is None
    assert value(metrics, "reame_kv_cache_total_bytes", worker="a") is None
    assert value(metrics, "reame_kv_cache_total_bytes", worker="b") == 25 << 20
