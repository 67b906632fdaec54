"""A standalone coordinator (`reame-coordinator`, a real process) shared by two gateways (each with
a fake worker over real ZeroMQ), on loopback: both workers' profiles reach it, its decisions reach
both workers, a freeze through one gateway freezes all, killing it leaves both gateways serving on
their last strategy, and a restarted one resumes the persisted strategy."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import zmq
import zmq.asyncio

from shared.config import Config, parse_config
from shared.errors import ConfigError
from gateway.coordinator.server import CoordinatorServer
from shared import protocol
from shared.protocol import AdminCall, AdminReply, Attach, Profile
from tests.fakes import FakeServer
from tests.unit.test_coordinator import SHORT, profile as synthetic

REPO = Path(__file__).resolve().parents[2]
KEY = {"Authorization": "Bearer k"}
WORKERS = {"a": "hostA/node0/1", "b": "hostB/node0/1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CoordinatorProcess:
    def __init__(self, conf: Path, log: Path):
        self.conf, self.log = conf, log
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with self.log.open("a") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "gateway.coordinator.main", "--config",
                                             str(self.conf)], cwd=REPO, env=env, stdout=out, stderr=out)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)  # no goodbye, no last save: what it persisted is all there is
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def profile_of(worker_id: str):
    """Many short requests that fill the batch: the "short requests" policy doubles it (8 → 16)."""
    def build(service) -> Profile:
        return synthetic(worker_id=worker_id, cpus=[0], knobs_version=service.tuning.version, **SHORT)
    return build


@pytest.fixture
def cluster(tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    conf = tmp_path / "coordinator.conf"
    conf.write_text(f"[server]\nheartbeat_interval = 0.1\nworker_timeout = 0.6\ninsecure_tcp = true\n"
                    f"[tuning]\ncoordinator = {endpoint}\nstate_path = {tmp_path / 'central'}\n"
                    f"profile_interval = 0.1\nreport_interval = 60\n")
    coordinator = CoordinatorProcess(conf, tmp_path / "coordinator.log")
    coordinator.start()
    gateways, workers = {}, {}
    try:
        for name, worker_id in WORKERS.items():
            home = tmp_path / name
            home.mkdir()
            extra = (f"api_key = k\n[tuning]\ncoordinator = {endpoint}\nstate_path = {home / 'tuning'}\n"
                     f"profile_interval = 0.1\n")
            gateways[name] = FakeServer(home, extra, workers=0)
            workers[name] = gateways[name].add_worker(worker_id, profile=profile_of(worker_id))
        yield coordinator, gateways, workers
    finally:
        for gateway in gateways.values():
            gateway.close()
        coordinator.stop()
        print((tmp_path / "coordinator.log").read_text())


def wait_until(condition, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.02)


def admin(gateway: FakeServer, method: str, path: str) -> requests.Response:
    return requests.request(method, gateway.url + path, headers=KEY, timeout=10)


def chat(gateway: FakeServer) -> requests.Response:
    return requests.post(gateway.url + "/v1/chat/completions", headers=KEY, timeout=10,
                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


def test_one_coordinator_advises_the_workers_of_two_gateways(cluster):
    coordinator, gateways, workers = cluster
    tunings = {name: w.service.tuning for name, w in workers.items()}
    # Both workers' profiles reached it, and each got its own decision back through its gateway.
    wait_until(lambda: all(t.current().max_batch_size == 16 for t in tunings.values()))
    assert all(t.reason.startswith("short requests") for t in tunings.values())
    versions = {name: t.version for name, t in tunings.items()}
    assert sorted(versions.values()) == [1, 2]  # versions are the coordinator's, one counter for all
    wait_until(lambda: all(g.state.pool.workers[WORKERS[n]].capacity == 16 for n, g in gateways.items()))
    # Either gateway shows the one central strategy.
    for gateway in gateways.values():
        strategy = admin(gateway, "GET", "/admin/strategy").json()
        assert set(strategy["workers"]) == {"hostA/node0/cpus0", "hostB/node0/cpus0"}
        assert {w["knobs"]["max_batch_size"] for w in strategy["workers"].values()} == {16}
    series = admin(gateways["a"], "GET", "/admin/series?bucket=5").json()
    assert series["bucket_s"] == 5 and series["points"] and len(series["changes"]) == 2
    report = admin(gateways["b"], "GET", "/admin/report").json()
    assert {d["slot"] for d in report["history"] if d["kind"] == "change"} == {"hostA/node0/cpus0",
                                                                               "hostB/node0/cpus0"}

    # A freeze through one gateway freezes the workers of both.
    assert admin(gateways["a"], "POST", "/admin/strategy/freeze").json()["frozen"] is True
    wait_until(lambda: all(w.service.frozen for w in workers.values()))
    assert admin(gateways["b"], "GET", "/admin/strategy").json()["frozen"] is True
    frozen_version = admin(gateways["b"], "GET", "/admin/strategy").json()["version"]

    # Killed: both gateways keep serving, their workers on the strategy they run.
    coordinator.kill()
    wait_until(lambda: not any(g.state.tuning.reachable for g in gateways.values()))
    for name, gateway in gateways.items():
        assert chat(gateway).status_code == 200
        assert tunings[name].current().max_batch_size == 16 and workers[name].service.frozen
        assert gateway.state.pool.workers[WORKERS[name]].capacity == 16
        gone = admin(gateway, "GET", "/admin/strategy")
        assert gone.status_code == 503 and "unreachable" in gone.json()["error"]["message"]

    # Restarted: it resumes the persisted strategy (version, knobs, freeze) and advises again.
    coordinator.start()
    wait_until(lambda: all(g.state.tuning.reachable for g in gateways.values()))
    strategy = admin(gateways["a"], "GET", "/admin/strategy").json()
    assert strategy["version"] == frozen_version and strategy["frozen"] is True
    assert {w["knobs"]["max_batch_size"] for w in strategy["workers"].values()} == {16}
    assert admin(gateways["b"], "POST", "/admin/strategy/unfreeze").json()["frozen"] is False
    wait_until(lambda: not any(w.service.frozen for w in workers.values()))
    assert all(t.version > frozen_version for t in tunings.values())  # the unfreeze is a new version each
    assert all(chat(g).status_code == 200 for g in gateways.values())


def test_over_curve_only_authorized_gateways_get_in(tmp_path):
    from shared.zmq_keys import generate

    keys, authorized, empty = tmp_path / "keys", tmp_path / "gateways", tmp_path / "workers"
    empty.mkdir()
    generate(keys, "coordinator")
    generate(keys, "gateway")
    generate(keys, "stranger")
    authorized.mkdir()
    (authorized / "gateway.key").write_bytes((keys / "gateway.key").read_bytes())
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    conf = tmp_path / "coordinator.conf"
    conf.write_text(f"[server]\nheartbeat_interval = 0.1\nworker_timeout = 0.6\n[tuning]\ncoordinator = {endpoint}\n"
                    f"state_path = {tmp_path / 'central'}\ncurve_coordinator_key = {keys / 'coordinator.key_secret'}\n"
                    f"curve_authorized_gateways = {authorized}\n")
    coordinator = CoordinatorProcess(conf, tmp_path / "coordinator.log")
    coordinator.start()
    gateways = []
    try:
        for name in ("gateway", "stranger"):
            home = tmp_path / name
            home.mkdir()
            curve = {"curve_gateway_key": str(keys / f"{name}.key_secret"), "curve_authorized_keys": str(empty)}
            gateways.append(FakeServer(home, f"api_key = k\n[tuning]\ncoordinator = {endpoint}\n"
                                             f"curve_coordinator_key = {keys / 'coordinator.key'}\n",
                                       workers=0, server=curve))
        member, stranger = gateways
        wait_until(lambda: member.state.tuning.reachable)
        assert admin(member, "GET", "/admin/strategy").json()["version"] == 0
        wait_until(lambda: "refused a gateway" in (tmp_path / "coordinator.log").read_text())
        assert not stranger.state.tuning.reachable
        assert admin(stranger, "GET", "/admin/strategy").status_code == 503
    finally:
        for gateway in gateways:
            gateway.close()
        coordinator.stop()


def test_a_tcp_coordinator_needs_curve_even_on_loopback():
    config = parse_config("[tuning]\ncoordinator = tcp://10.1.2.3:5560\n")
    from shared.zmq_keys import check_coordinator_transport

    with pytest.raises(ConfigError, match="curve_coordinator_key"):
        check_coordinator_transport(config)
    check_coordinator_transport(dataclasses.replace(config, server=dataclasses.replace(config.server,
                                                                                       insecure_tcp=True)))
    loopback = parse_config("[tuning]\ncoordinator = tcp://127.0.0.1:5560\n")
    with pytest.raises(ConfigError, match="open to every local user"):  # any local user could rewrite strategies
        check_coordinator_transport(loopback)
    check_coordinator_transport(dataclasses.replace(loopback, server=dataclasses.replace(loopback.server,
                                                                                         insecure_tcp=True)))
    check_coordinator_transport(parse_config("[tuning]\ncoordinator = ipc:///run/reame/coordinator.ipc\n"))


def test_reame_coordinator_without_an_endpoint_says_so():
    from gateway.coordinator.server import CoordinatorServer

    with pytest.raises(ConfigError, match=r"\[tuning\] coordinator is empty"):
        CoordinatorServer(Config())


def test_a_gateway_with_adaptivity_off_keeps_no_link_to_the_coordinator(tmp_path):
    """--adaptive off: nothing to coordinate, so the in-process service only reports (no decision)."""
    from gateway.coordinator.remote import RemoteTuning
    from gateway.coordinator.service import TuningService
    from gateway.state import tuning_service

    class Pool:
        on_profile = on_register = None

    on = parse_config("[tuning]\ncoordinator = tcp://127.0.0.1:5560\n")
    off = parse_config("[tuning]\ncoordinator = tcp://127.0.0.1:5560\nadaptive = false\n")
    assert isinstance(tuning_service(on, Pool()), RemoteTuning)
    assert isinstance(tuning_service(off, Pool()), TuningService)


def test_no_connection_takes_up_an_attached_gateways_routing_id(tmp_path):
    """No ROUTER_HANDOVER on reame-coordinator's socket (issue 41.5): a second connection under
    an attached gateway's routing id is not let in, so it gets neither its answers nor its advice,
    and the gateway keeps being answered."""
    config = parse_config(f"[tuning]\ncoordinator = ipc://{tmp_path}/coordinator.ipc\n"
                          f"state_path = {tmp_path / 'tuning'}\n")

    async def main():
        server = CoordinatorServer(config)
        await server.start()
        context = zmq.asyncio.Context()
        peers = []
        try:
            for _ in range(2):
                peer = context.socket(zmq.DEALER)
                peer.setsockopt(zmq.IDENTITY, b"gateway-1")
                peer.setsockopt(zmq.LINGER, 0)
                peer.connect(server.endpoint)
                peers.append(peer)
                await peer.send(protocol.encode(Attach("gateway-1")))
                if len(peers) == 1:
                    await asyncio.wait_for(peer.recv(), 5)  # attached
            gateway, intruder = peers
            await intruder.send(protocol.encode(AdminCall("1", "strategy", "")))
            await gateway.send(protocol.encode(AdminCall("2", "strategy", "")))
            answer = protocol.decode(await asyncio.wait_for(gateway.recv(), 5))
            while not isinstance(answer, AdminReply):
                answer = protocol.decode(await asyncio.wait_for(gateway.recv(), 5))
            assert answer.call_id == "2"
            assert await intruder.poll(500) == 0
        finally:
            for peer in peers:
                peer.close()
            context.term()
            await server.close()
    asyncio.run(main())
