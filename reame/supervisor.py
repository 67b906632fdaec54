"""Child processes kept running: started, restarted with back-off when they crash, stopped in order.

Children run in sessions of their own, so a Ctrl-C in the terminal reaches only the
supervisor, which then stops them gracefully (SIGTERM: workers drain, the gateway finishes the
requests under way). On Linux they also get SIGTERM should the supervisor die without doing so.
A child that fails with exit code 1 soon after its first start has reported a configuration
problem on stderr; restarting would only repeat it, so that is fatal.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

from shared.parent_death import exit_with_parent

log = logging.getLogger("reame.serve")

STARTUP_GRACE_S = 15.0  # a first run shorter than this that exits 1 is a start-up failure
STABLE_S = 60.0  # a run this long resets the back-off


def next_backoff(previous: float, ran_for: float, maximum: float) -> float:
    """Seconds to wait before restarting a child: 1, 2, 4 ... up to `maximum`; 1 again after a long run."""
    if previous <= 0 or ran_for >= STABLE_S:
        return min(1.0, maximum)
    return min(previous * 2, maximum)


class FatalChildError(Exception):
    def __init__(self, name: str, code: int):
        super().__init__(f"{name} could not start (exit code {code}); see its message above")
        self.name = name
        self.code = code


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    starts: int = 0
    backoff: float = 0.0
    restart_at: float | None = None  # when a crashed child is due to start again

    def returncode_unknown(self) -> bool:
        return self.process is not None and self.process.returncode is None


class Supervisor:
    def __init__(self, children: list[Child], backoff_max: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.children = children
        self.backoff_max = backoff_max
        self.clock = clock

    def start_all(self) -> None:
        for child in self.children:
            self._start(child)

    def poll(self) -> None:
        """Notice exits and restart what is due. Raises FatalChildError for a start-up failure."""
        now = self.clock()
        for child in self.children:
            if child.process is not None:
                code = child.process.poll()
                if code is None:
                    continue
                ran_for = now - child.started_at
                child.process = None
                if code == 1 and child.starts == 1 and ran_for < STARTUP_GRACE_S:
                    raise FatalChildError(child.name, code)
                child.backoff = next_backoff(child.backoff, ran_for, self.backoff_max)
                child.restart_at = now + child.backoff
                log.warning("%s exited (%s) after %.0fs; restarting in %.0fs", child.name, _describe(code),
                            ran_for, child.backoff)
            elif child.restart_at is not None and now >= child.restart_at:
                self._start(child)

    def stop(self, timeout: float) -> None:
        """SIGTERM every child, wait up to `timeout` for them to finish, then SIGKILL the rest."""
        running = [c for c in self.children if c.process is not None and c.process.poll() is None]
        for child in running:
            child.process.send_signal(signal.SIGTERM)
        deadline = self.clock() + timeout
        for child in running:
            try:
                child.process.wait(max(0.0, deadline - self.clock()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", child.name, timeout)
                child.process.kill()
                child.process.wait()

    def kill(self) -> None:
        """SIGKILL every child now (safe in a signal handler: it does not wait; `stop` reaps)."""
        for child in self.children:
            if child.process is not None and child.returncode_unknown():
                child.process.kill()

    def _start(self, child: Child) -> None:
        child.restart_at = None
        child.starts += 1
        child.started_at = self.clock()
        child.process = subprocess.Popen(child.argv, env={**os.environ, **child.env}, start_new_session=True,
                                         preexec_fn=exit_with_parent())
        log.info("started %s (pid %d)", child.name, child.process.pid)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
