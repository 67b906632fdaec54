"""`reame serve` with two workers: losing a worker mid-request, draining one, stopping everything.

SIGKILL one of two workers while requests are in flight: the non-streamed requests (one running,
two queued) are re-run elsewhere and succeed, the stream already under way ends with an error,
the gateway stays healthy and `reame serve` restarts the worker. SIGSTOP one: its heartbeats
stop, the gateway drops it after worker_timeout (5 s here) and re-runs its request on the other
worker; after SIGCONT it registers again.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest
import requests

from tests.e2e.servers import API_KEY, NO_END, metric, worker_processes, write_config
from tests.harness import REPO, free_port, reame_serve


@pytest.fixture(scope="module")
def serve(smollm2_gguf, tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve")
    port = free_port()
    config = write_config(directory, smollm2_gguf, port)
    with reame_serve("reame serve", directory, config, port, "--workers", "2", workers=2) as server:
        yield server


@pytest.fixture
def client(serve):
    return openai.OpenAI(base_url=serve.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def serve_pid(serve) -> int:
    return serve.processes[0].pid


def busy_workers(serve) -> dict[int, float]:
    """pid → requests running, from the gateway's per-worker gauge (worker id = host/nodeN/pid)."""
    samples = metric(serve.url, "reame_worker_active_requests")
    return {int(dict(k)["worker"].rsplit("/", 1)[1]): v for k, v in samples.items()}


def wait_for(condition, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def healthy_workers(serve) -> int:
    r = requests.get(serve.url + "/health", timeout=2)
    return r.json()["workers"] if r.status_code == 200 else 0


def test_prints_the_url_and_runs_two_pinned_workers(serve):
    ready = f"Reame is ready: point an OpenAI client at {serve.url}/v1"
    wait_for(lambda: ready in serve.log("serve"), timeout=10, what="the URL")
    workers = worker_processes(serve_pid(serve))
    assert len(workers) == 2
    assert sorted(len(w.cpu_affinity()) for w in workers) == [1, 1]  # the one node's CPUs, split


def test_sigkill_with_requests_in_flight(serve, client):
    story = [{"role": "user", "content": "Tell me a long story."}]
    stream = client.chat.completions.create(model="reame", messages=story, max_tokens=3000, stream=True,
                                            logit_bias=NO_END)
    chunks = iter(stream)
    next(chunks)
    wait_for(lambda: sum(busy_workers(serve).values()) == 1, what="the stream to start")
    stream_pid = next(pid for pid, n in busy_workers(serve).items() if n)
    with cf.ThreadPoolExecutor(3) as pool:
        # Each worker runs BATCH = 2 at once: the three spread over both workers, none may be lost.
        plains = [pool.submit(client.completions.create, model="reame", prompt="Once", max_tokens=40,
                              logit_bias=NO_END, temperature=0) for _ in range(3)]
        wait_for(lambda: sum(busy_workers(serve).values()) == 4, what="both workers busy")
        plain_pid = next(pid for pid, n in busy_workers(serve).items() if n and pid != stream_pid)
        os.kill(plain_pid, signal.SIGKILL)
        # The other worker still serves: the gateway is healthy while the killed one restarts.
        assert requests.get(serve.url + "/health").status_code == 200
        for plain in plains:  # re-run from scratch once a worker is free
            result = plain.result(timeout=180)
            assert result.usage.completion_tokens == 40 and result.choices[0].finish_reason == "length"
    os.kill(stream_pid, signal.SIGKILL)
    with pytest.raises(openai.APIError):
        for _ in chunks:
            pass
    stream.close()
    assert requests.get(serve.url + "/health").status_code in (200, 503)
    wait_for(lambda: healthy_workers(serve) == 2, what="both workers restarted")
    assert metric(serve.url, "reame_workers_lost_total")[()] >= 2


def test_sigterm_drains_the_worker(serve, client):
    with cf.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.completions.create, model="reame", prompt="Once", max_tokens=60,
                              logit_bias=NO_END, temperature=0)
        wait_for(lambda: sum(busy_workers(serve).values()) == 1, what="the request to start")
        pid = next(pid for pid, n in busy_workers(serve).items() if n)
        os.kill(pid, signal.SIGTERM)
        result = pending.result(timeout=120)
    assert result.usage.completion_tokens == 60  # finished, not cut off
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
             timeout=30, what="the drained worker to exit")
    assert "draining" in serve.log("serve")
    wait_for(lambda: healthy_workers(serve) == 2, what="the worker to be restarted")


def test_sigstop_worker_is_dropped_and_its_request_moved(serve, client):
    wait_for(lambda: healthy_workers(serve) == 2, what="two workers")
    with cf.ThreadPoolExecutor(2) as pool:
        first = pool.submit(client.completions.create, model="reame", prompt="Once", max_tokens=60,
                            logit_bias=NO_END, temperature=0)
        wait_for(lambda: sum(busy_workers(serve).values()) == 1, what="the first request to start")
        stopped = next(pid for pid, n in busy_workers(serve).items() if n)
        os.kill(stopped, signal.SIGSTOP)
        try:
            second = pool.submit(client.completions.create, model="reame", prompt="Twice", max_tokens=20,
                                 logit_bias=NO_END, temperature=0)
            results = [first.result(timeout=120), second.result(timeout=120)]
            assert [r.usage.completion_tokens for r in results] == [60, 20]
            assert healthy_workers(serve) == 1
            assert "silent for" in serve.log("serve")
        finally:
            os.kill(stopped, signal.SIGCONT)
    # Its next heartbeat reaches a gateway that dropped it, which asks it to register again.
    wait_for(lambda: healthy_workers(serve) == 2, timeout=30, what="the stopped worker to rejoin")
    assert psutil.Process(stopped).is_running()  # the same process: nobody restarted it
    assert client.completions.create(model="reame", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_unknown_numa_node_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "worker.main", "--numa-node", "7"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "NUMA node 7 does not exist" in r.stderr


def test_sigterm_stops_everything(serve):
    proc = serve.processes[0].popen
    children = psutil.Process(proc.pid).children(recursive=True)
    commands = [" ".join(c.cmdline()) for c in children]
    # The gateway, two workers, and the gateway's own helpers (its tokenizing processes): all must go.
    assert sum("gateway.main" in c for c in commands) == 1 and sum("worker.main" in c for c in commands) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


def test_a_killed_reame_serve_leaves_no_gateway_or_worker(smollm2_gguf, tmp_path):
    """SIGKILL runs no cleanup in `reame serve`: its gateway and worker must still leave
    (shared.parent_death), not hold the port and the model's memory for ever."""
    port = free_port()
    config = write_config(tmp_path, smollm2_gguf, port)
    with reame_serve("reame serve", tmp_path, config, port) as server:
        supervisor = psutil.Process(server.processes[0].pid)
        children = supervisor.children(recursive=True)
        roles = {" ".join(p.cmdline()[1:3]) for p in children}
        assert {"-m gateway.main", "-m worker.main"} <= roles, roles
        supervisor.kill()
        supervisor.wait(10)
        deadline = time.monotonic() + 15
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for process in left:
            process.kill()
        assert not left, [p.cmdline()[:3] for p in left]
