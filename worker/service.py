"""The worker's serve loop: ZeroMQ messages in, one batched engine step at a time, tokens out.

Generation is synchronous CPU work, so the loop interleaves: read every waiting message
(Generate, Abort, Heartbeat), then run one step of the generator (worker.sched.generation), which
advances every running request by one chunk. A request that arrives joins the next step; an
Abort takes effect before it. Heartbeats come from worker.pulse, a thread that keeps beating
through long steps. A Strategy from the tuning coordinator is applied here too, between two steps,
and each step is recorded for the worker's profile (worker.profiler) when one is kept.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

import zmq

from shared import protocol
from shared.errors import ConfigError, InvalidRequestError, ReameError
from shared.protocol import Abort, Drain, Error, Finished, Generate, Heartbeat, Register, Strategy, TokenChunk
from shared.sampling import SamplingParams
from worker.placement import Placement
from worker.profiler import ProfileCollector
from worker.sched.generation import Event, FinishEvent, TokenEvent
from worker.sched.tuning_state import TuningState

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
                 clock: Callable[[], float] = time.monotonic, tuning: TuningState | None = None,
                 profiler: ProfileCollector | None = None, adaptive: bool = True,
                 placement: Placement | None = None):
        """tuning: where a coordinator's Strategy lands (None: Strategies are ignored); adaptive
        False ignores them too ([tuning] adaptive = false: the knobs stay as reame.conf says).
        placement: where a Strategy's CPU set and memory binding land (None: they are ignored);
        the thread count follows it through on_cpus' listeners (the kernel tuner decides it)."""
        self.generator = generator
        self.tuning = tuning
        self._started = tuning.current() if tuning is not None else None  # what the engine was sized for
        self.profiler = profiler
        self.adaptive = adaptive
        self.frozen = False  # an operator froze the strategy: nothing here may learn until unfrozen
        self.placement = placement
        self._cpu_listeners: list[Callable[[int], None]] = []
        self._freeze_listeners: list[Callable[[bool], None]] = []
        self.socket = socket
        self.info = info
        self.drain_timeout = drain_timeout
        self.clock = clock
        self.drain_requested = False  # set from a signal handler; acted on by the loop
        self.stop_requested = False
        self.register_requested = False
        self._drain_deadline: float | None = None
        # What the pulse reports of the data path (Heartbeat.read_request, read_ms): the last
        # Generate read, and when the loop last finished reading its socket.
        self.read_request = ""
        self._read_at = clock()

    # ---- control (safe from a signal handler or the pulse thread: they only set flags) -------

    def request_drain(self) -> None:
        self.drain_requested = True

    def request_stop(self) -> None:
        self.stop_requested = True

    def request_register(self) -> None:
        self.register_requested = True

    def on_freeze(self, listener: Callable[[bool], None]) -> None:
        """Call listener(frozen) when a Strategy freezes or unfreezes learning (the kernel tuner
        stops exploring while frozen). Called from the serve loop, between steps."""
        self._freeze_listeners.append(listener)

    def on_cpus(self, listener: Callable[[int], None]) -> None:
        """Call listener(n) when a Strategy's placement changes how many CPUs the worker runs on
        (the kernel tuner, the one decider of the thread count, keeps it within them). Called
        from the serve loop, between steps."""
        self._cpu_listeners.append(listener)

    def load(self) -> tuple[int, int]:
        """(running, queued), for heartbeats."""
        return self.generator.load()

    def read_ms(self) -> int:
        """Milliseconds since the loop last finished reading its socket (long during a long step):
        whatever the gateway sent before then has been read."""
        return max(0, int((self.clock() - self._read_at) * 1000))

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
                self._emit(self._step())
        if self.stop_requested:
            self._fail_all()
        self._send(Drain(self.info.worker_id, done=True))
        log.info("worker %s: leaving", self.info.worker_id)

    def _step(self) -> list[Event]:
        if self.profiler is None:
            return self.generator.step()
        started = time.perf_counter()
        events = self.generator.step()
        generator = self.generator
        self.profiler.stepped(generator.last_step, time.perf_counter() - started, events, generator.load()[1],
                              [s.seq_id for s in generator.scheduler.running], generator.blocks.num_used_blocks)
        return events

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
        try:
            self._drain_socket(timeout_ms)
        finally:
            self._read_at = self.clock()

    def _drain_socket(self, timeout_ms: int) -> None:
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
            self.read_request = message.request_id
            self._accept(message)
        elif isinstance(message, Abort):
            finished = self.generator.abort(message.request_id)
            if self.profiler is not None:
                self.profiler.forget(message.request_id)
            if finished is not None:
                self._emit([finished])
        elif isinstance(message, Heartbeat):
            if not message.registered:  # a gateway that restarted does not know us yet
                self.register_requested = True
        elif isinstance(message, Strategy):
            self._apply(message)
        elif isinstance(message, Error) and message.fatal:
            # The gateway refused us (a model its tokenizer does not fit): waiting would not change that.
            log.error("worker %s: %s; leaving", self.info.worker_id, message.message)
            self.stop_requested = True
        else:
            log.warning("worker %s: unexpected %s", self.info.worker_id, type(message).__name__)

    def _apply(self, strategy: Strategy) -> None:
        """Adopt the coordinator's knobs from the next step on; a bad or stale one changes nothing."""
        if self.tuning is None or not self.adaptive:
            log.debug("worker %s: ignored strategy %d (adaptivity is off)", self.info.worker_id, strategy.version)
            return
        if self._started is None:  # a TuningState given after construction: still its start values
            self._started = self.tuning.current()
        knobs = strategy.knobs.scheduler  # within shared.knobs' bounds: Knobs checks them when built
        try:
            knobs.check_fits(self._started, "strategy")
            adopted = self.tuning.apply(knobs, strategy.version, strategy.reason)
        except ConfigError as exc:
            log.warning("worker %s: refused strategy %d: %s", self.info.worker_id, strategy.version, exc.message)
            return
        if not adopted:
            return
        if self.placement is not None:
            self._place(strategy)
        log.info("worker %s: strategy %d (%s): %s", self.info.worker_id, strategy.version,
                 strategy.reason, ", ".join(f"{k}={v}" for k, v in knobs.as_dict().items()))
        if strategy.frozen != self.frozen:
            self.frozen = strategy.frozen
            for listener in self._freeze_listeners:
                try:
                    listener(self.frozen)
                except Exception:  # a listener's bug must not stop the serve loop
                    log.exception("worker %s: a freeze listener failed", self.info.worker_id)

    def _place(self, strategy: Strategy) -> None:
        """Move the worker's threads to the strategy's CPUs and bind (or unbind) its memory; a
        placement this host refuses is logged and the worker stays where it is."""
        placement = self.placement
        before, was_bound = list(placement.in_use), placement.bound
        try:
            changed = placement.apply(list(strategy.knobs.cpus), strategy.knobs.bind_memory)
        except ConfigError as exc:
            log.warning("worker %s: strategy %d: placement unchanged (CPUs %s): %s", self.info.worker_id,
                        strategy.version, _cpus(placement.in_use), exc.message)
            return
        if changed:
            log.info("worker %s: strategy %d: runs on CPUs %s (was %s), memory %s", self.info.worker_id,
                     strategy.version, _cpus(placement.in_use), _cpus(before),
                     f"bound to node {placement.node}" if placement.bound else
                     ("unbound" if was_bound else "not bound"))
        if len(placement.in_use) != len(before):
            for listener in self._cpu_listeners:
                try:
                    listener(len(placement.in_use))
                except Exception:  # a listener's bug must not stop the serve loop
                    log.exception("worker %s: a CPU-count listener failed", self.info.worker_id)

    def _accept(self, request: Generate) -> None:
        # Validated on arrival, so a bad request fails at once, not after the requests ahead of it.
        try:
            namespace = _namespace(request.cache_namespace)
            self.generator.add(request.request_id, request.prompt_ids, request.params, warm=request.warm,
                               cache_namespace=namespace, speculative=request.speculative)
        except ReameError as exc:
            self._send_error(request.request_id, exc)
            return
        if self.profiler is not None:
            self.profiler.arrived(request.request_id, len(request.prompt_ids))
        log.debug("request %s: queued (%d prompt tokens, max %d%s)", request.request_id,
                  len(request.prompt_ids), request.params.max_tokens, ", warm only" if request.warm else "")

    def _emit(self, events: list[Event]) -> None:
        """Send one step's events as one multipart message (a frame each, in order): the gateway
        wakes once per step instead of once per running request."""
        if events:
            self._send_many(self._messages_of(events))

    def _messages_of(self, events: list[Event]) -> list[protocol.Message]:
        """One message per event, except that a request's consecutive tokens (a drafted chunk's
        accepted tokens and the one sampled after them) share one TokenChunk: one frame to
        encode, send and decode instead of one per token (up to 1 + max_draft per step)."""
        messages: list[protocol.Message] = []
        for event in events:
            if (isinstance(event, TokenEvent) and messages and isinstance(messages[-1], TokenChunk)
                    and messages[-1].request_id == event.request_id):
                chunk = messages[-1]
                chunk.tokens.append(int(event.token))
                chunk.logprobs.append(_logprob(event))
                chunk.top_logprobs.append(_top_logprobs(event))
            else:
                messages.append(self._message_of(event))
        return messages

    def _message_of(self, event: Event) -> protocol.Message:
        if isinstance(event, TokenEvent):
            return TokenChunk(event.request_id, [int(event.token)], [_logprob(event)], [_top_logprobs(event)])
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


def _logprob(event: TokenEvent) -> float | None:
    return None if event.logprob is None else float(event.logprob)


def _top_logprobs(event: TokenEvent) -> list[list[float]]:
    return [[int(t), float(lp)] for t, lp in (event.top_logprobs or ())]


def _namespace(text: str) -> bytes:
    """A Generate's cache namespace: hex of at most 32 bytes (a digest), "" for the shared one."""
    try:
        namespace = bytes.fromhex(text)
    except ValueError:
        namespace = None
    if namespace is None or len(namespace) > 32:
        raise InvalidRequestError("cache_namespace must be the hex of at most 32 bytes", param="cache_namespace")
    return namespace


def _cpus(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))
