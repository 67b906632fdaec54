"""Real server processes on loopback, for the e2e tests and the benchmarks alike (bench/ imports this
file too, so it needs nothing from pytest): a config file on a free port, children whose output goes
to log files, waiting until /health shows the workers ready (a child that dies first is raised with
the end of its log), and stopping them all (SIGTERM, then SIGKILL for the whole process group).

    port = free_port()
    config = write_config(directory, model, port, {"engine": {"threads": 2}})
    with reame_serve("reame serve", directory, config, port, "--workers", "2", workers=2) as server:
        ...  # server.url, server.log("serve"), server.processes[0].pid

A peer such as llama-server goes through the same `start_server` with its own argv (its /health
answers 200 once the model is loaded; it has no worker count, so pass workers=0).
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import psutil

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 600.0  # seconds until /health shows the workers (a cold numba cache compiles first)
STOP_TIMEOUT = 60.0  # seconds a child may take to exit after SIGTERM (a worker drains its requests)
LOG_TAIL = 3000  # characters of each log in error messages


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(directory: Path, model: Path, port: int, sections: dict[str, dict] | None = None) -> Path:
    """`directory/reame.conf` for `model` on `port`, with the state, the prefix store, the tuning
    strategy and the speculation archive (with what drafting learned) inside `directory` (nothing
    is shared with the user's own, or between two servers); `sections` ({section: {key: value}})
    add keys or replace these."""
    config: dict[str, dict] = {"model": {"model_path": model}, "server": {"state_dir": directory / "state"},
                               "gateway": {"port": port}, "prefix_cache": {"store_path": directory / "prefix-store"},
                               "tuning": {"state_path": directory / "tuning"},
                               "speculative": {"archive_path": directory / "spec-archive"}}
    for name, keys in (sections or {}).items():
        config.setdefault(name, {}).update(keys)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "reame.conf"
    path.write_text("".join(f"[{name}]\n" + "".join(f"{key} = {value}\n" for key, value in keys.items())
                            for name, keys in config.items()))
    return path


def health(url: str, timeout: float = 2.0) -> tuple[int, dict]:
    """GET /health: (status, JSON body); (0, {}) while nothing answers. Reame answers 503 with its
    body until a worker is ready."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as response:
            return response.status, _json(response.read())
    except urllib.error.HTTPError as error:
        return error.code, _json(error.read())
    except (urllib.error.URLError, http.client.HTTPException, OSError):
        return 0, {}


def _json(data: bytes) -> dict:
    try:
        body = json.loads(data)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class ServerProcess:
    """One child in a session of its own, so a Ctrl-C reaches only its parent, which then stops it in
    order. Its output is appended to `log` (a restart under the same name keeps the earlier run's)."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.name, self.argv, self.log = name, argv, log
        self.stopped = False  # stopped on purpose: its exit is no failure
        self._descendants: list[psutil.Process] = []
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> bool:
        return self.popen.poll() is not None

    def tail(self, chars: int = LOG_TAIL) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def terminate(self) -> None:
        """SIGTERM to its process group. `reame serve` starts its gateway and workers in sessions of
        their own; they are remembered here so `wait_stopped` can kill any it leaves behind."""
        self.stopped = True
        if self.exited():  # reaped: its pid, and so its group id, may belong to another process now
            return
        try:
            self._descendants = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            self._descendants = []
        _signal_group(self.pid, signal.SIGTERM)

    def wait_stopped(self, timeout: float = STOP_TIMEOUT) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(self.pid, signal.SIGKILL)
            self.popen.wait()
        for child in self._descendants:
            try:
                child.kill()  # psutil checks the start time too: only our orphans, never a reused pid
            except psutil.NoSuchProcess:
                pass
        self._descendants = []

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        self.terminate()
        self.wait_stopped(timeout)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class Server:
    """The processes behind one URL on loopback: `reame serve`, a gateway and its workers, or a peer.
    Their logs are `directory/<process name>.log`; leaving a `with` block stops them all."""

    def __init__(self, name: str, directory: Path, port: int, progress: Callable[[str], None] | None = None):
        self.name, self.directory, self.port = name, directory, port
        self.url = f"http://127.0.0.1:{port}"
        self.processes: list[ServerProcess] = []
        self.progress = progress or (lambda _message: None)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        log = self.directory / f"{name}.log"
        self.progress(f"starting {self.name}: {' '.join(argv)} (log {log})")
        process = ServerProcess(name, argv, log, env)
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        """The whole log of the process called `name`."""
        return (self.directory / f"{name}.log").read_text(errors="replace")

    def logs(self, chars: int = LOG_TAIL) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.tail(chars)}" for p in self.processes)

    def wait_ready(self, workers: int = 1, timeout: float = START_TIMEOUT) -> None:
        """Until /health answers 200 with at least `workers` workers ready (0: any 200, for a peer).
        Raises RuntimeError when one of the processes exits first, TimeoutError after `timeout`."""
        started = time.monotonic()
        shown = started
        while (waited := time.monotonic() - started) < timeout:
            for process in self.processes:
                if not process.stopped and process.exited():
                    raise RuntimeError(f"{self.name}: {process.name} exited with {process.popen.returncode}; "
                                       f"the logs end:\n{self.logs()}")
            status, body = health(self.url)
            if status == 200 and body.get("workers", 0) >= workers:
                self.progress(f"{self.name} ready after {waited:.1f} s")
                return
            if time.monotonic() - shown >= 5:
                shown = time.monotonic()
                self.progress(f"  waiting for {self.name} /health: {waited:.0f} s")
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s; the logs end:\n{self.logs()}")

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM to every process at once (the last started first), then wait for each."""
        for process in reversed(self.processes):
            process.terminate()
        for process in reversed(self.processes):
            process.wait_stopped(timeout)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()


def start_server(name: str, directory: Path, port: int, processes: dict[str, list[str]], workers: int = 1,
                 progress: Callable[[str], None] | None = None, timeout: float = START_TIMEOUT) -> Server:
    """Start `processes` (log name → argv) and return once ready (see `Server.wait_ready`); on a
    failure they are stopped before the error is raised."""
    server = Server(name, directory, port, progress)
    try:
        for process_name, argv in processes.items():
            server.start(process_name, argv)
        server.wait_ready(workers, timeout)
    except BaseException:
        server.stop()
        raise
    return server


def reame_serve(name: str, directory: Path, config: Path, port: int, *flags: str, workers: int = 1,
                progress: Callable[[str], None] | None = None) -> Server:
    """`reame serve` (log `serve`), ready once `workers` workers are."""
    argv = [sys.executable, "-m", "reame.cli", "serve", "--config", str(config), *flags]
    return start_server(name, directory, port, {"serve": argv}, workers, progress)


def gateway_and_worker(name: str, directory: Path, config: Path, port: int,
                       progress: Callable[[str], None] | None = None) -> Server:
    """A gateway and one worker started directly (logs `gateway` and `worker`), ready."""
    return start_server(name, directory, port, {
        "gateway": [sys.executable, "-m", "gateway.main", "--config", str(config)],
        "worker": [sys.executable, "-m", "worker.main", "--config", str(config), "--numa-node", "0"],
    }, progress=progress)
