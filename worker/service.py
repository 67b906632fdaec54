"""The worker's serve loop: ZeroMQ messages in, one engine step at a time, token chunks out.

Generation is synchronous CPU work, so the loop interleaves: read every waiting message
(Generate, Abort, Heartbeat), then run one engine step. An Abort therefore takes effect within
one step. Heartbeats come from worker.pulse, a thread that keeps beating through long steps.
The engine's sequence runs one request at a time (capacity 1); further requests wait in a
FIFO here, so a burst from the gateway is never lost.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import zmq

from shared import protocol
from shared.errors import ReameError
from shared.protocol import Abort, Drain, Error, Finished, Generate, Heartbeat, Register, TokenChunk
from worker.sampling_params import SamplingParams

log = logging.getLogger("reame.worker")


class EngineLike(Protocol):
    """What the loop needs of worker.engine's Engine (a fake one in the unit tests)."""
    n_ctx: int
    vocab_size: int

    def validate(self, prompt_ids: list[int], max_tokens: int) -> None: ...

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator: ...


@dataclass
class _Running:
    request: Generate
    steps: Iterator  # the engine's generator; close() abandons the sequence
    started: float
    generated: int = 0


class WorkerService:
    def __init__(self, engine: EngineLike, socket: zmq.Socket, info: Register, *, drain_timeout: float = 120.0,
                 validate_params: Callable[[SamplingParams, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.socket = socket
        self.info = info
        self.drain_timeout = drain_timeout
        self.validate_params = validate_params
        self.clock = clock
        self.queue: deque[Generate] = deque()
        self.running: _Running | None = None
        self.drain_requested = False  # set from a signal handler; acted on by the loop
        self.stop_requested = False
        self.register_requested = False
        self._drain_deadline: float | None = None

    # ---- control (safe from a signal handler or the pulse thread: they only set flags) -------

    def request_drain(self) -> None:
        self.drain_requested = True

    def request_stop(self) -> None:
        self.stop_requested = True

    def request_register(self) -> None:
        self.register_requested = True

    def load(self) -> tuple[int, int]:
        """(running, queued), for heartbeats."""
        return int(self.running is not None), len(self.queue)

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        self._send(self.info)
        while not self.stop_requested:
            busy = self.running is not None or bool(self.queue) or self.drain_requested
            # Idle, wake every 100 ms anyway to notice a flag set by a signal or the pulse.
            self._read_messages(0 if busy else 100)
            if self.register_requested:
                self.register_requested = False
                self._send(self.info)
            if self.drain_requested and self._drain_deadline is None:
                self._begin_drain()
            if self._drain_deadline is not None:
                if self.running is None and not self.queue:
                    break
                if self.clock() >= self._drain_deadline:
                    self._fail_all()
                    break
            if self.running is None and self.queue:
                self._start(self.queue.popleft())
            if self.running is not None:
                self._step()
        if self.stop_requested:
            self._fail_all()
        self._send(Drain(self.info.worker_id, done=True))
        log.info("worker %s: leaving", self.info.worker_id)

    def _begin_drain(self) -> None:
        self._drain_deadline = self.clock() + self.drain_timeout
        log.info("worker %s: draining (%d running, %d queued)", self.info.worker_id,
                 int(self.running is not None), len(self.queue))
        self._send(Drain(self.info.worker_id))

    def _read_messages(self, timeout_ms: int) -> None:
        if not self.socket.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = protocol.decode(frame)
            except protocol.ProtocolError as exc:
                log.warning("worker %s: dropped a bad frame: %s", self.info.worker_id, exc)
                continue
            self._handle(message)

    def _handle(self, message: protocol.Message) -> None:
        if isinstance(message, Generate):
            self._accept(message)
        elif isinstance(message, Abort):
            self._abort(message.request_id)
        elif isinstance(message, Heartbeat):
            if not message.registered:  # a gateway that restarted does not know us yet
                self.register_requested = True
        else:
            log.warning("worker %s: unexpected %s", self.info.worker_id, type(message).__name__)

    def _accept(self, request: Generate) -> None:
        # Validate on arrival so a bad request fails at once, not after the queue ahead of it.
        try:
            self.engine.validate(request.prompt_ids, request.params.max_tokens)
            if self.validate_params is not None:
                self.validate_params(request.params, self.engine.vocab_size)
        except ReameError as exc:
            self._send_error(request.request_id, exc)
            return
        self.queue.append(request)

    def _abort(self, request_id: str) -> None:
        running = self.running
        if running is not None and running.request.request_id == request_id:
            running.steps.close()
            self.running = None
            self._send(Finished(request_id, "abort", len(running.request.prompt_ids), running.generated))
            return
        for queued in self.queue:
            if queued.request_id == request_id:
                self.queue.remove(queued)
                self._send(Finished(request_id, "abort", len(queued.prompt_ids), 0))
                return

    def _start(self, request: Generate) -> None:
        try:
            steps = self.engine.generate(request.prompt_ids, request.params)
        except ReameError as exc:
            self._send_error(request.request_id, exc)
            return
        self.running = _Running(request, steps, started=self.clock())
        log.debug("request %s: started (%d prompt tokens, max %d)", request.request_id,
                  len(request.prompt_ids), request.params.max_tokens)

    def _step(self) -> None:
        running = self.running
        request_id = running.request.request_id
        try:
            out = next(running.steps)
        except StopIteration:
            self._finish(running, "stop")
            return
        except ReameError as exc:
            self.running = None
            self._send_error(request_id, exc)
            return
        except Exception as exc:  # an engine bug must fail one request, not the worker
            log.exception("worker %s: request %s failed", self.info.worker_id, request_id)
            self.running = None
            self._send_error(request_id, ReameError(f"generation failed: {type(exc).__name__}: {exc}"))
            return
        running.generated += 1
        top = [[int(t), float(lp)] for t, lp in (out.top_logprobs or ())]
        logprob = None if out.logprob is None else float(out.logprob)
        self._send(TokenChunk(request_id, [int(out.token)], [logprob], [top]))
        if out.finish_reason is not None:
            self._finish(running, out.finish_reason)

    def _finish(self, running: _Running, reason: str) -> None:
        self.running = None
        running.steps.close()
        log.debug("request %s: %s after %d tokens in %.3fs", running.request.request_id, reason,
                  running.generated, self.clock() - running.started)
        self._send(Finished(running.request.request_id, reason,
                            len(running.request.prompt_ids), running.generated))

    def _fail_all(self) -> None:
        """Give up on every request. The Drain(done) that follows tells the gateway they are lost,
        so it re-runs those that have shown nothing to a client yet and fails the others."""
        if self.running is not None:
            self.running.steps.close()
            self.running = None
        self.queue.clear()

    def _send_error(self, request_id: str, exc: ReameError) -> None:
        self._send(Error(request_id, type(exc).__name__, exc.message, exc.param, exc.code))

    def _send(self, message: protocol.Message) -> None:
        self.socket.send(protocol.encode(message))
