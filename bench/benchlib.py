"""Small helpers the benchmarks share (they run as scripts: `python bench/NAME.py`)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT = 600  # seconds for a server to answer /health (a cold numba cache compiles first)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, chars: int = 3000) -> str:
    """The end of a log file, for error messages ('' if it does not exist)."""
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def percentile(values: list[float], q: float, empty: float = float("nan")) -> float:
    """Nearest-rank percentile, q in [0, 1]; `empty` when there are no values."""
    if not values:
        return empty
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Server:
    """A child server process in its own session (Ctrl-C reaches only us; we stop it in order)."""

    def __init__(self, name: str, argv: list[str], log: Path, url: str):
        self.name, self.log, self.url = name, log, url
        say(f"starting {name}: {' '.join(argv)}")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self) -> None:
        started = time.monotonic()
        shown = started
        while (waited := time.monotonic() - started) < START_TIMEOUT:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; its log ends:\n{tail(self.log)}")
            if healthy(self.url):
                say(f"{self.name} ready after {waited:.1f} s")
                return
            if time.monotonic() - shown >= 5:
                shown = time.monotonic()
                say(f"  waiting for {self.name} /health: {waited:.0f} s")
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not ready after {START_TIMEOUT} s; its log ends:\n{tail(self.log)}")

    def stop(self) -> None:
        """SIGTERM, then after a minute SIGKILL for it and whatever it started (`reame serve` puts its
        gateway and workers in sessions of their own, so they are found by parentage, not group)."""
        if self.proc.poll() is not None:
            return
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            say(f"{self.name} did not stop within 60 s: killing it")
            self.proc.kill()
            self.proc.wait()
        for child in children:
            try:
                child.kill()  # only those still alive: they were orphaned
            except psutil.NoSuchProcess:
                pass


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


