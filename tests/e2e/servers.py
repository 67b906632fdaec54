"""What the e2e tests share: their config, the one gateway + worker they start (through
tests/harness.py, as the benchmarks do), and small helpers that read a live server."""
from __future__ import annotations

import json
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests import harness
from tests.harness import Server, free_port

API_KEY = "e2e-secret"
NO_END = {"0": -100, "1": -100, "2": -100}  # SmolLM2's end tokens banned: generation runs to max_tokens
BATCH = 2  # requests a test worker runs at once (small, so tests can fill the gateway's queue)


def write_config(directory: Path, model: Path, port: int, gateway: dict | None = None,
                 store: Path | None = None, prefix_cache: dict | None = None, scheduler: dict | None = None) -> Path:
    """A reame.conf for tests; `gateway`, `prefix_cache` and `scheduler` add keys to those sections.
    The prefix store is the test's own (`store`, else one in `directory`)."""
    sections = {
        "server": {"heartbeat_interval": 0.2, "worker_timeout": 5},
        "gateway": {"api_key": API_KEY, "max_queue": 4, "queue_timeout": 60, "max_body_bytes": 65536,
                    "read_timeout": 3, **(gateway or {})},
        # Debug lines are where prompts would leak (tests/e2e/test_logs.py); log_prompts stays off.
        "logging": {"level": "debug"},
        "worker": {"drain_timeout": 30},
        "serve": {"restart_backoff_max": 2},
        "engine": {
            # Enough for one 8192-token SmolLM2 context (377 MiB); every test worker reserves it.
            "kv_cache_memory": "512MiB",
            # Exact activations: the answers these tests expect ("Paris") follow float32 math. With
            # int8 activations (the default on VNNI hosts) the first token of that chat is a near-tie
            # (0.09 logits) that flips, as it does in llama.cpp, which answers "L'Étoile, ..." there.
            "matmul_activations": "float32",
        },
        "scheduler": {"max_batch_size": BATCH, **(scheduler or {})},
    }
    sections["prefix_cache"] = {**({"store_path": store} if store is not None else {}), **(prefix_cache or {})}
    return harness.write_config(directory, model, port, sections)


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


def raw_post(server: Server, path: str, body: dict) -> socket.socket:
    """Send a request and return the open socket without reading: closing it is a client hang-up."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n")
    sock.sendall(head.encode() + data)
    return sock


def wait_idle(server: Server, timeout: float = 10) -> None:
    """Until no request is queued or running (earlier tests' cancelled work is gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(metric(server.url, "reame_running_requests").values()) == 0 and \
                requests.get(server.url + "/health").json()["queued"] == 0:
            return
        time.sleep(0.05)
    raise TimeoutError("requests still running")


@contextmanager
def gateway_and_worker(directory: Path, model: Path, gateway: dict | None = None, store: Path | None = None,
                       prefix_cache: dict | None = None, scheduler: dict | None = None):
    """A real gateway and one worker on a free port, ready; stopped on exit."""
    port = free_port()
    config = write_config(directory, model, port, gateway=gateway, store=store, prefix_cache=prefix_cache,
                          scheduler=scheduler)
    with harness.gateway_and_worker("e2e", directory, config, port) as server:
        yield server
