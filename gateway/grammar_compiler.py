"""Grammar compiles in processes that can be killed: a bounded pool, a share of it per tenant, and a
time limit that counts the compile's own CPU time, not its wait for a process.

Before, compiles ran on threads with a wall-clock limit: seven slow schemas filled the threads, a
small valid schema then waited past the limit in their queue and was refused as "too complex",
and a timed-out thread ran on, burning a core, until llguidance's fuel ran out.

Here each compile runs in one of `size` processes ('spawn': the gateway has ZeroMQ's and asyncio's
threads), at nice 19 in a session of their own like the tokenizing processes (gateway.prompts): a
compile takes CPU from streams only while they leave it idle. A process whose compile has used more
than `cpu_limit` seconds of CPU is killed at once (its CPU time is read from /proc: a compile
starved by busy workers is not refused for the time it waited), and so is one past `wall_limit`
seconds in all. A tenant holds at most `share` processes at a time; its further compiles wait for
one of its own, so a tenant flooding slow schemas waits behind itself, never the others. Without
API keys (tenant "") there is one tenant and it may use every process.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from gateway.errors import OverloadedError, ServiceUnavailableError
from shared.errors import InvalidRequestError

log = logging.getLogger("reame.structured")

COMPILE_PROCESSES = 2
CPU_LIMIT_S = 2.0  # CPU seconds one compile may take; llguidance's own limits stop most well before
WALL_LIMIT_S = 30.0  # a compile that has not finished in this long is stopped whatever its CPU time
WAIT_LIMIT_S = 30.0  # how long a compile may wait for a process of its tenant's share
START_LIMIT_S = 60.0  # a new process imports llguidance first (~0.3 s on an idle host)
_CHECK_S = 0.05  # how often a running compile's CPU time is read


class CompileTimeout(InvalidRequestError):
    """A compile ran past its CPU limit: too complex for this server, but only its sender learns so
    (gateway.structured remembers it per tenant, never for everyone)."""
    code = "grammar_too_complex"


class CompilePool:
    """compiler: a module-level function (it is pickled by name into each process) taking what
    `compile` is given and returning the grammar, or raising InvalidRequestError to refuse it."""

    def __init__(self, compiler: Callable[[Any], str], size: int = COMPILE_PROCESSES, share: int | None = None,
                 cpu_limit: float = CPU_LIMIT_S, wall_limit: float = WALL_LIMIT_S, wait_limit: float = WAIT_LIMIT_S):
        self._compiler = compiler
        self.size = max(1, size)
        self.share = share if share is not None else max(1, self.size // 2)
        self.cpu_limit = cpu_limit
        self.wall_limit = wall_limit
        self.wait_limit = wait_limit
        self._idle: list[_Process] = []
        self._running: Counter[str] = Counter()  # tenant -> processes it holds
        self._waiting: list[tuple[str, asyncio.Future]] = []
        self.killed = 0  # compiles stopped over a limit, for tests and logs

    async def compile(self, what: Any, param: str, tenant: str = "") -> str:
        """The compiler's answer for `what`, from a process within `tenant`'s share.

        Raises the compiler's InvalidRequestError; CompileTimeout past cpu_limit;
        ServiceUnavailableError past wall_limit or when a process died; OverloadedError when no
        process of the share came free within wait_limit."""
        await self._acquire(tenant, param)
        process = None
        try:
            while self._idle and not self._idle[-1].process.is_alive():
                self._idle.pop().kill()
            process = self._idle.pop() if self._idle else await asyncio.to_thread(_Process.start, self._compiler)
            answer = await self._run(process, what, param)
            self._idle.append(process)
            process = None
            return answer
        finally:
            if process is not None:
                process.kill()
            self._release(tenant)

    def close(self) -> None:
        for process in self._idle:
            process.kill()
        self._idle = []

    # ---- one compile ---------------------------------------------------------------------------

    async def _run(self, process: _Process, what: Any, param: str) -> str:
        # On a thread: a 400 KB schema does not fit the pipe's buffer, and a process at nice 19 on
        # a busy host reads and writes it slowly; the event loop must not wait for that.
        kind, *rest = await asyncio.to_thread(self._exchange, process, what, param)
        if kind == "ok":
            return rest[0]
        if kind == "refused":
            message, refused_param, code = rest
            raise InvalidRequestError(message, param=refused_param, code=code)
        log.error("a %s compile failed: %s", param, rest[0])
        raise InvalidRequestError(f"'{param}' could not be compiled", param=param)

    def _exchange(self, process: _Process, what: Any, param: str) -> tuple:
        """Blocking: send `what`, watch the compile's CPU and wall time, and read the answer."""
        lost = ServiceUnavailableError(f"the process compiling '{param}' stopped unexpectedly; the request "
                                       "may be retried")
        try:
            process.conn.send(what)
            started, cpu_started = time.monotonic(), process.cpu_seconds()
            while not process.conn.poll(_CHECK_S):
                cpu = process.cpu_seconds() - cpu_started
                if cpu > self.cpu_limit:
                    self.killed += 1
                    log.info("a %s compile used %.1f s of CPU: stopped", param, cpu)
                    raise CompileTimeout(f"'{param}' is too complex to enforce: it did not compile within "
                                         f"{self.cpu_limit:g} s of CPU time", param=param)
                if time.monotonic() - started > self.wall_limit:
                    self.killed += 1
                    log.warning("a %s compile ran %.0f s (%.1f s of CPU): stopped", param, self.wall_limit, cpu)
                    raise ServiceUnavailableError(f"'{param}' could not be compiled within {self.wall_limit:g} s: "
                                                  "the server is busy; the request may be retried")
            return process.conn.recv()
        except (EOFError, OSError):
            raise lost from None

    # ---- the share of each tenant --------------------------------------------------------------

    def _limit(self, tenant: str) -> int:
        return self.size if tenant == "" else min(self.share, self.size)

    def _free(self, tenant: str) -> bool:
        return sum(self._running.values()) < self.size and self._running[tenant] < self._limit(tenant)

    async def _acquire(self, tenant: str, param: str) -> None:
        if self._free(tenant) and not any(t == tenant for t, _ in self._waiting):
            self._running[tenant] += 1
            return
        granted = asyncio.get_running_loop().create_future()
        entry = (tenant, granted)
        self._waiting.append(entry)
        try:
            await asyncio.wait_for(granted, self.wait_limit)
        except TimeoutError:
            self._waiting.remove(entry)  # not granted: wait_for returns a result that came in time
            raise OverloadedError(f"'{param}': this key's grammar compiles left no room for this one within "
                                  f"{self.wait_limit:g} s; retry later") from None
        except asyncio.CancelledError:  # the request went away while it waited
            if entry in self._waiting:
                self._waiting.remove(entry)
            elif granted.done() and not granted.cancelled():
                self._release(tenant)  # granted as it was cancelled: hand the place on
            raise

    def _release(self, tenant: str) -> None:
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]
        for entry in list(self._waiting):  # the first waiter of each tenant with room, in arrival order
            waiting_tenant, granted = entry
            if not granted.done() and self._free(waiting_tenant):
                self._waiting.remove(entry)
                self._running[waiting_tenant] += 1
                granted.set_result(None)


class _Process:
    """One compiling process and the parent's end of its pipe."""

    def __init__(self, process: multiprocessing.process.BaseProcess, conn):
        self.process = process
        self.conn = conn
        self._stat = f"/proc/{process.pid}/stat"

    @classmethod
    def start(cls, compiler: Callable[[Any], str]) -> _Process:
        """Blocking: started and ready (its imports done). Run off the event loop."""
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child, compiler, os.getpid()), daemon=True,
                                  name="reame-grammar")
        process.start()
        child.close()
        if not parent.poll(START_LIMIT_S):
            process.kill()
            raise ServiceUnavailableError("a grammar-compiling process did not start; the request may be retried")
        try:
            parent.recv()  # "ready"
        except (EOFError, OSError):
            raise ServiceUnavailableError("a grammar-compiling process did not start; the request may be "
                                          "retried") from None
        return cls(process, parent)

    def cpu_seconds(self) -> float:
        """CPU time the process has used (user + system), from /proc; 0 where it cannot be read
        (then only the wall limit stops a compile)."""
        try:
            with open(self._stat) as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def kill(self) -> None:
        """Now: a compile past its limit must not keep a CPU busy. The zombie is reaped by a thread."""
        self.process.kill()
        self.conn.close()
        threading.Thread(target=self.process.join, daemon=True).start()


# ---- inside a compiling process -----------------------------------------------------------------

def _serve(conn, compiler: Callable[[Any], str], parent: int) -> None:
    from gateway.prompts import _exit_with_parent, _lower_priority

    _lower_priority()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the gateway's to handle
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    conn.send(("ready",))
    while True:
        try:
            what = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer: tuple = ("ok", compiler(what))
        except InvalidRequestError as exc:
            answer = ("refused", exc.message, exc.param, exc.code)
        except Exception as exc:  # a compiler bug: the parent logs it, the client gets a 400 without it
            answer = ("failed", f"{type(exc).__name__}: {exc}"[:1000])
        conn.send(answer)
