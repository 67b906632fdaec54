"""Real Reame processes on loopback for the e2e tests: a config file, a free port, and waiting
until /health says a worker is ready (or a process died, whose log is then shown)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import requests
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
API_KEY = "e2e-secret"
NO_END = {"0": -100, "1": -100, "2": -100}  # SmolLM2's end tokens banned: generation runs to max_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BATCH = 2  # requests a test worker runs at once (small, so tests can fill the gateway's queue)


def write_config(directory: Path, model: Path, port: int, extra: str = "", gateway: str = "",
                 store: Path | None = None) -> Path:
    """A reame.conf for tests; `gateway` adds keys to [gateway], `extra` adds sections. The prefix
    store is the test's own (`store`, else one in `directory`)."""
    path = directory / "reame.conf"
    prefix = f"[prefix_cache]\nstore_path = {store or directory / 'prefix-store'}"
    path.write_text(f"""
[model]
model_path = {model}
[server]
state_dir = {directory}/state
heartbeat_interval = 0.2
worker_timeout = 5
[gateway]
port = {port}
api_key = {API_KEY}
max_queue = 4
queue_timeout = 60
max_body_bytes = 65536
read_timeout = 3
{gateway}
[logging]
# Debug lines are where prompts would leak (tests/e2e/test_logs.py); log_prompts stays off.
level = debug
[worker]
drain_timeout = 30
[serve]
restart_backoff_max = 2
[engine]
# Enough for one 8192-token SmolLM2 context (377 MiB); every test worker reserves it.
kv_cache_memory = 512MiB
# Exact activations: the answers these tests expect ("Paris") follow float32 math. With int8
# activations (the default on VNNI hosts) the first token of that chat is a near-tie (0.09
# logits) that flips, as it does in llama.cpp, which answers "L'Étoile, ..." there.
matmul_activations = float32
[scheduler]
max_batch_size = {BATCH}
{prefix}
{extra}
""")
    return path


class Processes:
    """Started children, their logs in files, all stopped (and reaped) at the end."""

    def __init__(self, directory: Path, port: int):
        self.directory = directory
        self.url = f"http://127.0.0.1:{port}"
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.directory / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append((name, proc))
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n" + (self.directory / f"{name}.log").read_text(errors="replace")[-3000:]
                         for name, _ in self.procs)

    def wait_ready(self, workers: int = 1, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.logs()}")
            try:
                health = requests.get(self.url + "/health", timeout=1)
                if health.status_code == 200 and health.json()["workers"] >= workers:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s\n{self.logs()}")

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def metric(url: str, name: str) -> dict[tuple, float]:
    """One metric's samples from /metrics, keyed by their label values."""
    text = requests.get(url + "/metrics", headers=auth(), timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def worker_processes(parent: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(parent).children(recursive=True) if "worker.main" in " ".join(p.cmdline())]


def raw_post(server: "Processes", path: str, body: dict) -> socket.socket:
    """Send a request and return the open socket without reading: closing it is a client hang-up."""
    data = json.dumps(body).encode()
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n")
    sock.sendall(head.encode() + data)
    return sock


def wait_idle(server: "Processes", timeout: float = 10) -> None:
    """Until no request is queued or running (earlier tests' cancelled work is gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(metric(server.url, "reame_running_requests").values()) == 0 and \
                requests.get(server.url + "/health").json()["queued"] == 0:
            return
        time.sleep(0.05)
    raise TimeoutError("requests still running")


@contextmanager
def gateway_and_worker(directory: Path, model: Path, gateway: str = "", store: Path | None = None):
    """A real gateway and one worker on a free port, ready; stopped on exit."""
    port = free_port()
    config = write_config(directory, model, port, gateway=gateway, store=store)
    procs = Processes(directory, port)
    procs.start("gateway", "-m", "gateway.main", "--config", str(config))
    procs.start("worker", "-m", "worker.main", "--config", str(config), "--numa-node", "0")
    try:
        procs.wait_ready()
        yield procs
    finally:
        procs.stop()
