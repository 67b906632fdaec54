"""Workers on other hosts over tcp:// with CURVE: three "hosts" as network namespaces on this machine.

    root ns (this test, the HTTP client) ──veth── gw (gateway: HTTP + the workers' tcp:// socket)
                                                  ├──veth── h1 (a worker)
                                                  └──veth── h2 (a worker, and a stranger with an unknown key)

Requests are served by both workers; the stranger is refused and logged; cutting h2's link while
both workers run requests moves h2's requests to h1, and every request completes. Needs root (to
make namespaces); the names and addresses exist only inside this test and are removed after it.
"""
from __future__ import annotations

import concurrent.futures
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from shared.zmq_keys import generate
from tests import harness
from tests.e2e.servers import API_KEY, NO_END, auth, metric
from tests.system_tools import require_tool

HTTP_PORT, WORKER_PORT = 8000, 5557  # inside the namespaces, so fixed ports cannot collide
BATCH = 2  # requests per worker at once


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    require_tool("ip", package="iproute2")
    probe = f"reame-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """Namespaces gw, h1, h2 joined by veth pairs; `addr[ns]` is its address toward the gateway."""

    def __init__(self):
        tag = f"{os.getpid() % 10000}{random.randint(0, 99):02d}"
        self.ns = {name: f"reame-{name}-{tag}" for name in ("gw", "h1", "h2")}
        self.net = random.randint(16, 250)  # 10.<net>.0.0/16, only on this test's links
        self.http_host = f"10.{self.net}.0.2"  # the gateway's side of the link to this namespace
        self.addr: dict[str, str] = {}
        self.links: dict[str, tuple[str, str]] = {}  # host → (gateway's end, host's end)
        self._root_link = f"rg{tag}"

    def create(self) -> None:
        for ns in self.ns.values():
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        gw = self.ns["gw"]
        # The root namespace reaches the gateway's HTTP port.
        ip("link", "add", self._root_link, "type", "veth", "peer", "name", "http0", "netns", gw)
        ip("addr", "add", f"10.{self.net}.0.1/30", "dev", self._root_link)
        ip("link", "set", self._root_link, "up")
        ip("-n", gw, "addr", "add", f"{self.http_host}/30", "dev", "http0")
        ip("-n", gw, "link", "set", "http0", "up")
        for i, host in enumerate(("h1", "h2"), start=1):
            ns, gw_end, host_end = self.ns[host], f"to-{host}", "eth0"
            ip("-n", gw, "link", "add", gw_end, "type", "veth", "peer", "name", host_end, "netns", ns)
            ip("-n", gw, "addr", "add", f"10.{self.net}.{i}.1/24", "dev", gw_end)
            ip("-n", ns, "addr", "add", f"10.{self.net}.{i}.2/24", "dev", host_end)
            ip("-n", gw, "link", "set", gw_end, "up")
            ip("-n", ns, "link", "set", host_end, "up")
            self.addr[host] = f"10.{self.net}.{i}.1"  # the gateway, as this host reaches it
            self.links[host] = (gw_end, host_end)

    def cut(self, host: str) -> None:
        ip("-n", self.ns["gw"], "link", "set", self.links[host][0], "down")

    def remove(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # its veth ends go with it
        subprocess.run(["ip", "link", "del", self._root_link], capture_output=True)

    def run(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host], *argv]


@pytest.fixture
def hosts():
    why = _netns_unavailable()  # probed here, not at collection: it creates a namespace
    if why is not None:
        pytest.skip(why)
    hosts = Hosts()
    try:
        hosts.create()
        yield hosts
    finally:
        hosts.remove()


def config(directory: Path, model: Path, server: dict, **sections: dict) -> Path:
    return harness.write_config(directory, model, HTTP_PORT, {
        "server": {"heartbeat_interval": 0.3, "worker_timeout": 3, **server},
        "gateway": {"api_key": API_KEY, "queue_timeout": 120, "host": "0.0.0.0", "allow_remote": "true"},
        "logging": {"level": "info"},
        "engine": {"kv_cache_memory": "256MiB", "threads": 1, "context_length": 1024},
        "scheduler": {"max_batch_size": BATCH},
        "worker": {"drain_timeout": 5},
        "tuning": {"state_path": directory / "tuning"},
        "speculative": {"archive_path": directory / "spec-archive"},
        **sections,
    })


def test_curve_workers_on_other_hosts_refusal_and_failover(tmp_path, smollm2_gguf, hosts):
    keys = tmp_path / "keys"
    for name in ("gateway", "h1", "h2", "stranger"):
        generate(keys, name)
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    for name in ("h1", "h2"):
        shutil.copy(keys / f"{name}.key", authorized)

    gw_conf = config(tmp_path / "gw", smollm2_gguf, {
        "endpoint": f"tcp://0.0.0.0:{WORKER_PORT}", "curve_gateway_key": keys / "gateway.key_secret",
        "curve_authorized_keys": authorized})
    server = harness.Server("netns", tmp_path, HTTP_PORT)
    server.url = f"http://{hosts.http_host}:{HTTP_PORT}"
    try:
        server.start("gateway", hosts.run("gw", [sys.executable, "-m", "gateway.main", "--config", str(gw_conf)]))
        for i, host in enumerate(("h1", "h2")):
            conf = config(tmp_path / host, smollm2_gguf, {
                "endpoint": f"tcp://{hosts.addr[host]}:{WORKER_PORT}", "curve_gateway_key": keys / "gateway.key",
                "curve_worker_key": keys / f"{host}.key_secret"})
            cpus = ["--cpus", str(i % os.cpu_count())]
            server.start(f"worker-{host}", hosts.run(host, [sys.executable, "-m", "worker.main", "--config",
                                                            str(conf), "--numa-node", "0", *cpus]))
        server.wait_ready(workers=2)

        # A stranger on h2 with a key the gateway does not know: refused, logged, never a worker.
        stranger = subprocess.run(hosts.run("h2", [sys.executable, "-c", STRANGER, f"tcp://{hosts.addr['h2']}:{WORKER_PORT}",
                                                   str(keys / "gateway.key"), str(keys / "stranger.key_secret")]),
                                  capture_output=True, text=True, timeout=60, cwd=harness.REPO)
        assert stranger.returncode == 0, stranger.stderr
        assert stranger.stdout.strip() == "no answer", stranger.stdout
        stranger_key = (keys / "stranger.key").read_text()
        log = server.log("gateway")
        refusal = re.search(rf"refused a worker from 10\.{hosts.net}\.2\.2 \(CURVE public key (\S+)\)", log)
        assert refusal and refusal.group(1) in stranger_key, log[-3000:]
        assert requests.get(server.url + "/health", timeout=5).json()["workers"] == 2

        # Both workers serve; then h2's link is cut while each runs requests.
        body = {"model": "reame", "prompt": "Once upon a time", "max_tokens": 160, "temperature": 0,
                "logit_bias": NO_END}
        url = server.url + "/v1/completions"
        with concurrent.futures.ThreadPoolExecutor(2 * BATCH) as pool:
            futures = [pool.submit(requests.post, url, json=body, headers=auth(), timeout=240)
                       for _ in range(2 * BATCH)]
            deadline = time.monotonic() + 120
            while True:
                active = metric(server.url, "reame_worker_active_requests")
                if len(active) == 2 and all(v >= 1 for v in active.values()):
                    break
                assert time.monotonic() < deadline, f"both workers never ran requests: {active}"
                time.sleep(0.1)
            hosts.cut("h2")
            answers = [f.result(timeout=240) for f in futures]  # nothing hangs: each has an answer
        assert [a.status_code for a in answers] == [200] * len(answers), [a.text for a in answers]
        texts = {a.json()["choices"][0]["text"] for a in answers}
        assert len(texts) == 1 and all(a.json()["usage"]["completion_tokens"] == 160 for a in answers)
        log = server.log("gateway")
        dropped = re.search(r"worker \S+ dropped: silent for [0-9.]+s \(([0-9]+) requests running\)", log)
        assert dropped and int(dropped.group(1)) >= 1, log[-3000:]
        assert requests.get(server.url + "/health", timeout=5).json()["workers"] == 1
    finally:
        server.stop()


# A process with the right gateway key but an unknown key of its own, trying to register.
STRANGER = """
import sys, time, zmq, zmq.auth
from shared.protocol import Register, encode
endpoint, gateway_key, own_key = sys.argv[1:]
context = zmq.Context()
context.curve_serverkey = zmq.auth.load_certificate(gateway_key)[0]
context.curve_publickey, context.curve_secretkey = zmq.auth.load_certificate(own_key)
sock = context.socket(zmq.DEALER)
sock.connect(endpoint)
sock.send(encode(Register(worker_id="stranger", numa_node=0, cpus=[0], model_name="x", model_path="x",
                          arch="llama", n_ctx=1024, vocab_size=49152, capacity=8, host="h2", pid=1)))
print("answered" if sock.poll(3000) else "no answer")
sock.close(linger=0)
context.term()
"""
