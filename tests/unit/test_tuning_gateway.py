"""The tuning coordinator inside a real gateway (fake workers over real ZeroMQ): strategies reach
the workers, the controls under /admin, a restart that resumes, adaptivity off, and serving that
does not depend on the coordinator."""
from __future__ import annotations

import asyncio

import pytest
import requests

from shared.protocol import Profile
from tests.fakes import FakeServer
from tests.unit.test_coordinator import SHORT, profile as synthetic
from worker.sched.tuning_state import SchedulerKnobs, TuningState

KEY = {"Authorization": "Bearer k"}
WORKER = "h/node0/1"


def make_server(tmp_path, adaptive: bool = True) -> FakeServer:
    extra = f"api_key = k\n[tuning]\nadaptive = {str(adaptive).lower()}\nstate_path = {tmp_path / 'tuning'}\n"
    return FakeServer(tmp_path, extra, workers=0)


def add_tuned_worker(server: FakeServer, name: str) -> TuningState:
    # A TuningState from the start, as worker.main gives a real worker: set after the worker thread
    # started, a strategy sent on its registration could arrive first and be ignored.
    worker = server.add_worker(name, tuned=True)
    server.wait_until(lambda: name in server.state.pool.workers)
    return worker.service.tuning


def feed(server: FakeServer, n: int, **fields) -> None:
    """Profiles as the worker's pulse would send them, reporting the version it runs."""
    for _ in range(n):
        slot = next(iter(server.state.tuning.coordinator.slots.values()), None)
        version = slot.version if slot is not None else 0
        p: Profile = synthetic(worker_id=WORKER, cpus=[0], knobs_version=version, **fields)
        asyncio.run_coroutine_threadsafe(_call(server.state.tuning.on_profile, p), server.loop).result(5)


async def _call(fn, *args):
    return fn(*args)


def chat(server: FakeServer) -> requests.Response:
    return requests.post(server.url + "/v1/chat/completions", headers=KEY, timeout=10,
                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


@pytest.fixture
def server(tmp_path):
    srv = make_server(tmp_path)
    yield srv
    srv.close()


def test_a_decision_reaches_the_worker_and_raises_its_gateway_capacity(server):
    tuning = add_tuned_worker(server, WORKER)
    feed(server, 2, **SHORT)
    server.wait_until(lambda: tuning.version == 1)
    assert tuning.current().max_batch_size == 16 and tuning.reason.startswith("short requests")
    assert server.state.pool.workers[WORKER].capacity == 1  # not before the worker says it runs v1
    feed(server, 1, **SHORT)
    assert server.state.pool.workers[WORKER].capacity == 16
    report = requests.get(server.url + "/admin/report", headers=KEY, timeout=5).json()
    assert [(d["version"], d["kind"], d["policy"], d["outcome"]) for d in report["history"]] == \
        [(1, "change", "short requests", "measuring")]
    assert report["text"].startswith("[reame] adaptive report @ ")


def test_admin_routes_need_the_key(server):
    for method, path in (("get", "/admin/strategy"), ("post", "/admin/strategy/freeze"), ("get", "/admin/report")):
        assert getattr(requests, method)(server.url + path, timeout=5).status_code == 401
    assert requests.get(server.url + "/dashboard", timeout=5).status_code == 200  # the page holds no data


def test_freeze_stops_every_change_and_tells_the_workers(server):
    tuning = add_tuned_worker(server, WORKER)
    feed(server, 1)
    body = requests.post(server.url + "/admin/strategy/freeze", headers=KEY, timeout=5).json()
    assert body["frozen"] is True
    server.wait_until(lambda: tuning.reason == "freeze")
    assert server.state.tuning.coordinator.frozen
    feed(server, 10, **SHORT)
    assert tuning.current() == SchedulerKnobs()
    assert [d["kind"] for d in requests.get(server.url + "/admin/report", headers=KEY, timeout=5).json()["history"]] \
        == ["freeze"]
    assert requests.post(server.url + "/admin/strategy/unfreeze", headers=KEY, timeout=5).json()["frozen"] is False
    feed(server, 2, **SHORT)
    server.wait_until(lambda: tuning.current().max_batch_size == 16)


def test_import_pins_a_strategy_and_bad_ones_are_400(server):
    tuning = add_tuned_worker(server, WORKER)
    feed(server, 1)
    knobs = {**SchedulerKnobs().as_dict(), "max_batch_size": 4}
    ok = requests.post(server.url + "/admin/strategy", headers=KEY, timeout=5, json={"workers": {"*": {"knobs": knobs}}})
    assert ok.status_code == 200 and ok.json()["frozen"] is True
    server.wait_until(lambda: tuning.current().max_batch_size == 4)
    bad = requests.post(server.url + "/admin/strategy", headers=KEY, timeout=5,
                        json={"workers": {"*": {"knobs": {**knobs, "max_batch_size": -1}}}})
    assert bad.status_code == 400 and "max_batch_size" in bad.json()["error"]["message"]
    not_json = requests.post(server.url + "/admin/strategy", headers={**KEY, "Content-Type": "application/json"},
                             timeout=5, data=b"{")
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]


def test_a_restarted_gateway_resumes_the_persisted_strategy(server):
    tuning = add_tuned_worker(server, WORKER)
    feed(server, 2, **SHORT)
    server.wait_until(lambda: tuning.version == 1)
    server.restart_gateway()
    assert server.state.tuning.coordinator.version == 1
    # The worker process restarted too (a new pid, the same node and CPUs): it gets v1 on registering.
    fresh = add_tuned_worker(server, "h/node0/2")
    server.wait_until(lambda: fresh.version == 1)
    assert fresh.current().max_batch_size == 16


def test_adaptive_off_makes_no_decision_and_refuses_the_controls(tmp_path):
    server = make_server(tmp_path, adaptive=False)
    try:
        tuning = add_tuned_worker(server, WORKER)
        feed(server, 10, **SHORT)
        assert tuning.version == 0 and server.state.tuning.coordinator.history == []
        assert requests.post(server.url + "/admin/strategy/freeze", headers=KEY, timeout=5).status_code == 409
        knobs = SchedulerKnobs().as_dict()
        assert requests.post(server.url + "/admin/strategy", headers=KEY, timeout=5,
                             json={"workers": {"*": {"knobs": knobs}}}).status_code == 409
        assert not (tmp_path / "tuning" / "strategy.json").exists()
    finally:
        server.close()


def test_workers_serve_when_the_coordinator_fails(server):
    tuning = add_tuned_worker(server, WORKER)
    feed(server, 2, **SHORT)
    server.wait_until(lambda: tuning.version == 1)

    def broken(_profile):
        raise RuntimeError("coordinator down")

    server.state.pool.on_profile = broken
    feed_raw = synthetic(worker_id=WORKER, cpus=[0], knobs_version=1)
    server.loop.call_soon_threadsafe(server.state.pool._on_message, b"h/node0/1#pulse", feed_raw)
    assert chat(server).status_code == 200
    assert tuning.version == 1  # the worker keeps what it last got
