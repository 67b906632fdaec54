"""Several models behind one URL (`reame serve` with [models] serve): SmolLM2 and Gemma 3 answer
alternately, loaded on demand, with a memory budget that fits only one of them at a time.

Greedy answers through the front equal those of each model served alone; switching unloads the
idle model; 8 concurrent first requests cause one load; a model with a request running is not
unloaded under it (the admin's unload is refused, another model's request waits, then gets 503
with Retry-After); a bad path fails that model alone. A front killed outright takes its models'
processes with it. /metrics and /dashboard show every model, to the operator only.
"""
from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import requests

from tests import harness
from tests.e2e.servers import API_KEY, NO_END, auth, gateway_and_worker, metric, write_config
from tests.harness import free_port, reame_serve

# SmolLM2 or Gemma 3, not both. A model counts its measured RSS once loaded, never less than its
# estimate (gateway.model_backends.estimate_bytes: 1.4 x file + 512 MiB KV pool + 512 MiB): 1155 and
# 1362 MiB, 2517 together, over the budget whatever they measure; alone each measured ~1.0 and
# ~1.4 GiB (bench/model_switch.py), with room for a worker that compiled kernels at start.
BUDGET_MIB = 2300
PROMPTS = ["What is the capital of France?", "Name three colours."]


def chat(url: str, model: str | None, content: str, max_tokens: int = 12, **extra) -> requests.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return requests.post(url + "/v1/chat/completions", json=body, headers=auth(), timeout=300)


def answer(url: str, model: str | None, content: str) -> str:
    r = chat(url, model, content)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def gemma_alone(gemma3_gguf, tmp_path_factory):
    with gateway_and_worker(tmp_path_factory.mktemp("gemma-alone"), gemma3_gguf) as server:
        yield {p: answer(server.url, None, p) for p in PROMPTS}


@pytest.fixture(scope="module")
def smol_alone(server):
    return {p: answer(server.url, None, p) for p in PROMPTS}


@pytest.fixture(scope="module")
def front(smollm2_gguf, gemma3_gguf, tmp_path_factory, gemma_alone, smol_alone):
    directory = tmp_path_factory.mktemp("front")
    port = free_port()
    serve = (f"\n    smol = {smollm2_gguf}  aliases=small\n    gemma = {gemma3_gguf}"
             f"\n    bad = {directory}/missing.gguf")
    config = write_config(directory, smollm2_gguf, port, gateway={"max_queue": 16})
    with open(config, "a") as f:
        # Each model's tuning state under its own state directory (the default state_path). A long
        # load_timeout: a worker whose kernels are not in the numba cache compiles them for minutes.
        f.write(f"[models]\nserve = {serve}\nmemory_budget = {BUDGET_MIB}MiB\nload_timeout = 900\n")
    text = config.read_text().replace(f"state_path = {directory / 'tuning'}\n", "")
    config.write_text(text)
    with reame_serve("reame serve (front)", directory, config, port, workers=0) as server:
        yield server


def models(url: str) -> dict[str, dict]:
    r = requests.get(url + "/admin/models", headers=auth(), timeout=10)
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["models"]}


def loads(server, name: str) -> int:
    return (server.directory / "serve.log").read_text().count(f"model {name}: loading ")


def test_v1_models_lists_every_model_with_its_state(front):
    r = requests.get(front.url + "/v1/models", headers=auth(), timeout=10)
    assert r.status_code == 200
    data = {m["id"]: m for m in r.json()["data"]}
    assert list(data) == ["smol", "gemma", "bad"]
    assert data["smol"]["aliases"] == ["small"]
    assert {m["state"] for m in data.values()} <= {"loaded", "loading", "unloaded"}


def front_rss(server) -> int:
    root = psutil.Process(server.processes[0].pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass
    return total


def test_two_models_alternate_under_a_budget_for_one(front, smol_alone, gemma_alone):
    for round_ in range(2):
        for name, alone in (("smol", smol_alone), ("gemma", gemma_alone)):
            for prompt in PROMPTS:
                assert answer(front.url, name, prompt) == alone[prompt], (round_, name, prompt)
            state = models(front.url)
            loaded = [m for m in state if state[m]["state"] == "loaded"]
            assert loaded == [name]  # the other was unloaded to make room
            assert sum(m["size"] for m in state.values()) <= BUDGET_MIB * 2**20
            # What the host holds, measured: every process of the front (the models' included).
            assert front_rss(front) <= BUDGET_MIB * 2**20, (round_, name, front_rss(front) / 2**20)
    # A request without `model` goes to the first; an alias selects its model.
    assert answer(front.url, None, PROMPTS[0]) == smol_alone[PROMPTS[0]]
    assert answer(front.url, "small", PROMPTS[0]) == smol_alone[PROMPTS[0]]


def test_eight_concurrent_first_requests_load_once(front, gemma_alone):
    answer(front.url, "smol", PROMPTS[0])  # gemma is unloaded now
    assert models(front.url)["gemma"]["state"] == "unloaded"
    before = loads(front, "gemma")
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(answer, front.url, "gemma", PROMPTS[0]) for _ in range(8)]
        answers = [f.result() for f in futures]
    assert answers == [gemma_alone[PROMPTS[0]]] * 8
    assert loads(front, "gemma") == before + 1


def test_a_running_request_keeps_its_model(front):
    answer(front.url, "smol", PROMPTS[0])
    with cf.ThreadPoolExecutor(1) as pool:
        # SmolLM2's end tokens banned: it runs to max_tokens, long enough to act meanwhile.
        running = pool.submit(chat, front.url, "smol", "Count slowly.", 200, logit_bias=NO_END)
        while models(front.url)["smol"]["running"] == 0:
            pass
        unload = requests.post(front.url + "/admin/models", json={"model": "smol", "action": "unload"},
                               headers=auth(), timeout=10)
        assert unload.status_code == 409 and "running" in unload.json()["error"]["message"]
        other = chat(front.url, "gemma", PROMPTS[0])  # gemma does not fit beside a busy smol
        assert other.status_code == 503 and other.headers["Retry-After"], other.text
        done = running.result()
    assert done.status_code == 200, done.text
    assert done.json()["choices"][0]["finish_reason"] == "length"
    unload = requests.post(front.url + "/admin/models", json={"model": "smol", "action": "unload"},
                           headers=auth(), timeout=30)
    assert unload.status_code == 200 and unload.json()["models"][0]["state"] == "unloaded"


def test_a_bad_path_fails_that_model_alone(front, smol_alone):
    r = chat(front.url, "bad", PROMPTS[0])
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable"
    assert "missing.gguf" in r.json()["error"]["message"]
    assert answer(front.url, "smol", PROMPTS[0]) == smol_alone[PROMPTS[0]]


def test_unknown_model_and_admin_key(front):
    r = chat(front.url, "gpt-4", "hi")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == \
        "The model 'gpt-4' does not exist; this server serves 'smol', 'gemma', 'bad'"
    r = requests.get(front.url + "/admin/models", timeout=10)
    assert r.status_code == 401
    assert API_KEY not in r.text


@contextmanager
def smol_front(directory: Path, smollm2_gguf: Path, gateway: dict | None = None):
    """`gateway.model_front` itself (no `reame serve` above it) serving SmolLM2 as "smol", unloaded."""
    port = free_port()
    config = write_config(directory, smollm2_gguf, port, gateway=gateway)
    with open(config, "a") as f:
        f.write(f"[models]\nserve = smol = {smollm2_gguf}\nload_timeout = 900\n")
    argv = [sys.executable, "-m", "gateway.model_front", "--config", str(config)]
    with harness.start_server("front", directory, port, {"front": argv}, workers=0) as server:
        yield server


def load_smol(server) -> None:
    r = requests.post(server.url + "/admin/models", json={"model": "smol", "action": "load"},
                      headers=auth(), timeout=900)
    assert r.status_code == 200 and r.json()["models"][0]["state"] == "loaded", r.text


def running(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


PARENT = """
import subprocess, sys, time
from shared.parent_death import exit_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=exit_with_parent())
print(child.pid, flush=True)
time.sleep(60)
"""


def test_exit_with_parent_signals_the_child_of_a_killed_process():
    """The mechanism alone, in a second: a child started with exit_with_parent() ends when its
    parent is SIGKILLed (without it, it would sleep on for a minute)."""
    parent = psutil.Popen([sys.executable, "-c", PARENT], cwd=harness.REPO, stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while running([child]) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = running([child])
    for process in left:
        process.kill()
    assert not left, "the child outlived its SIGKILLed parent"


def test_a_killed_front_leaves_no_model_processes(smollm2_gguf, tmp_path):
    """SIGKILL runs no cleanup in the front: its model's gateway and worker must still leave, not
    hold the model's memory and port for ever (PR_SET_PDEATHSIG in gateway.model_backends)."""
    with smol_front(tmp_path, smollm2_gguf) as server:
        load_smol(server)
        front = psutil.Process(server.processes[0].pid)
        children = running(front.children(recursive=True))
        roles = {" ".join(p.cmdline()[1:3]) for p in children}
        assert {"-m gateway.main", "-m worker.main"} <= roles, roles  # and their own helpers
        front.kill()
        deadline = time.monotonic() + 10
        while running(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [(p, " ".join(p.cmdline()[1:3])) for p in running(children)]
        for process, _ in left:  # not to leak them into the next tests when this one fails
            process.kill()
        assert not left, [role for _, role in left]


def test_operators_see_every_models_metrics_tenants_do_not(smollm2_gguf, tmp_path):
    """Through the front, /metrics holds the front's gauges per model and each loaded model's own
    series labelled with it, /dashboard lists the models and /admin/models/NAME/... reaches a
    loaded model's admin routes: the operator's key only, as on a single model's gateway."""
    keys_file = tmp_path / "keys"
    keys_file.write_text("alice alice-key\n")
    keys_file.chmod(0o600)
    tenant = {"Authorization": "Bearer alice-key"}
    with smol_front(tmp_path / "front", smollm2_gguf, gateway={"api_keys_file": keys_file}) as server:
        assert metric(server.url, "reame_model_state")[(("model", "smol"), ("state", "unloaded"))] == 1
        load_smol(server)
        r = requests.post(server.url + "/v1/chat/completions", headers=tenant, timeout=300, json={
            "model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": PROMPTS[0]}]})
        assert r.status_code == 200, r.text  # a tenant reaches the API

        assert metric(server.url, "reame_model_state")[(("model", "smol"), ("state", "loaded"))] == 1
        assert metric(server.url, "reame_model_bytes")[(("model", "smol"),)] > 0
        assert metric(server.url, "reame_model_metrics_up") == {(("model", "smol"),): 1}
        served = metric(server.url, "reame_requests_total")  # the model's gateway's own counter
        assert served[(("endpoint", "/v1/chat/completions"), ("model", "smol"), ("status", "200"))] == 1
        assert all(dict(labels)["model"] == "smol" for labels in metric(server.url, "reame_kv_cache_total_bytes"))
        report = requests.get(server.url + "/admin/models/smol/report", headers=auth(), timeout=10)
        assert report.status_code == 200 and "text" in report.json(), report.text
        page = requests.get(server.url + "/dashboard", timeout=10)  # a page without data, as the gateway's
        assert page.status_code == 200 and "/admin/models" in page.text

        for path in ("/metrics", "/dashboard", "/admin/models", "/admin/models/smol/report"):
            r = requests.get(server.url + path, headers=tenant, timeout=10)
            assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", (path, r.text)
        for path in ("/metrics", "/admin/models", "/admin/models/smol/report"):
            assert requests.get(server.url + path, timeout=10).status_code == 401, path
