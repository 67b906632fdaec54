"""The worker's serve loop: ZeroMQ messages in, one batched engine step at a time, tokens out.

Generation is synchronous CPU work, so the loop interleaves: read every waiting message
(Generate, Abort, Heartbeat), then run one step of the generator (worker.sched.generation), which
advances every running request by one chunk. A request that arrives joins the next step; an
Abort takes effect before it. Heartbeats come from worker.pulse, a thread that keeps beating
through long steps.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

import zmq

from shared import protocol
from shared.errors import InvalidRequestError, ReameError
from shared.protocol import Abort, Drain, Error, Finished, Generate, Heartbeat, Register, TokenChunk
from shared.sampling import SamplingParams
from worker.sched.generation import Event, FinishEvent, TokenEvent

log = logging.getLogger("reame.worker")


class GeneratorLike(Protocol):
    """What the loop needs of worker.sched.generation's BatchGenerator (a fake one in the unit tests)."""
    hold_until: float | None

    @property
    def has_work(self) -> bool: ...

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, warm: bool = False,
            cache_namespace: bytes = b"", speculative: bool = True) -> None: ...

    def abort(self, request_id: str) -> FinishEvent | None: ...

    def abort_all(self) -> list[FinishEvent]: ...

    def load(self) -> tuple[int, int]: ...

    def step(self) -> list[Event]: ...


class WorkerService:
    def __init__(self, generator: GeneratorLike, socket: zmq.Socket, info: Register, *, drain_timeout: float = 120.0,
                 clock: Callable[[], float] = time.monotonic):
        self.generator = generator
        self.socket = socket
        self.info = info
        self.drain_timeout = drain_timeout
        self.clock = clock
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
        return self.generator.load()

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        self._send(self.info)
        while not self.stop_requested:
            self._read_messages(self._poll_ms())
            if self.register_requested:
                self.register_requested = False
                self._send(self.info)
            if self.drain_requested and self._drain_deadline is None:
                self._begin_drain()
            if self._drain_deadline is not None:
                if not self.generator.has_work:
                    break
                if self.clock() >= self._drain_deadline:
                    self._fail_all()
                    break
            if self.generator.has_work:
                self._emit(self.generator.step())
        if self.stop_requested:
            self._fail_all()
        self._send(Drain(self.info.worker_id, done=True))
        log.info("worker %s: leaving", self.info.worker_id)

    def _poll_ms(self) -> int:
        """How long to wait for messages: not at all while there is work, until the batching
        window closes while a lone request waits for company, else 100 ms (to notice flags)."""
        if self.drain_requested and self._drain_deadline is None:
            return 0
        if self.generator.has_work:
            hold = self.generator.hold_until
            return 0 if hold is None else max(0, min(100, int((hold - self.clock()) * 1000) + 1))
        return 100

    def _begin_drain(self) -> None:
        self._drain_deadline = self.clock() + self.drain_timeout
        running, queued = self.generator.load()
        log.info("worker %s: draining (%d running, %d queued)", self.info.worker_id, running, queued)
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
            finished = self.generator.abort(message.request_id)
            if finished is not None:
                self._emit([finished])
        elif isinstance(message, Heartbeat):
            if not message.registered:  # a gateway that restarted does not know us yet
                self.register_requested = True
        elif isinstance(message, Error) and message.fatal:
            # The gateway refused us (a model its tokenizer does not fit): waiting would not change that.
            log.error("worker %s: %s; leaving", self.info.worker_id, message.message)
            self.stop_requested = True
        else:
            log.warning("worker %s: unexpected %s", self.info.worker_id, type(message).__name__)

    def _accept(self, request: Generate) -> None:
        # Validated on arrival, so a bad request fails at once, not after the requests ahead of it.
        try:
            namespace = _namespace(request.cache_namespace)
            self.generator.add(request.request_id, request.prompt_ids, request.params, warm=request.warm,
                               cache_namespace=namespace, speculative=request.speculative)
        except ReameError as exc:
            self._send_error(request.request_id, exc)
            return
        log.debug("request %s: queued (%d prompt tokens, max %d%s)", request.request_id,
                  len(request.prompt_ids), request.params.max_tokens, ", warm only" if request.warm else "")

    def _emit(self, events: list[Event]) -> None:
        """Send one step's events as one multipart message (a frame each, in order): the gateway
        wakes once per step instead of once per running request."""
        if events:
            self._send_many([self._message_of(event) for event in events])

    def _message_of(self, event: Event) -> protocol.Message:
        if isinstance(event, TokenEvent):
            top = [[int(t), float(lp)] for t, lp in (event.top_logprobs or ())]
            logprob = None if event.logprob is None else float(event.logprob)
            return TokenChunk(event.request_id, [int(event.token)], [logprob], [top])
        if isinstance(event, FinishEvent):
            log.debug("request %s: %s after %d tokens", event.request_id, event.reason, event.completion_tokens)
            return Finished(event.request_id, event.reason, event.prompt_tokens, event.completion_tokens,
                            cached_tokens=event.cached_tokens, prefix_tokens=event.prefix_tokens)
        return self._error(event.request_id, event.error)

    def _fail_all(self) -> None:
        """Give up on every request. The Drain(done) that follows tells the gateway they are lost,
        so it re-runs those that have shown nothing to a client yet and fails the others."""
        self.generator.abort_all()

    def _send_error(self, request_id: str, exc: ReameError) -> None:
        self._send(self._error(request_id, exc))

    @staticmethod
    def _error(request_id: str, exc: ReameError) -> Error:
        return Error(request_id, type(exc).__name__, exc.message, exc.param, exc.code)

    def _send(self, message: protocol.Message) -> None:
        self.socket.send(protocol.encode(message))

    def _send_many(self, messages: list[protocol.Message]) -> None:
        self.socket.send_multipart([protocol.encode(m) for m in messages])


def _namespace(text: str) -> bytes:
    """A Generate's cache namespace: hex of at most 32 bytes (a digest), "" for the shared one."""
    try:
        namespace = bytes.fromhex(text)
    except ValueError:
        namespace = None
    if namespace is None or len(namespace) > 32:
        raise InvalidRequestError("cache_namespace must be the hex of at most 32 bytes", param="cache_namespace")
    return namespace
