"""A gateway's link to a standalone coordinator (`[tuning] coordinator = tcp://host:port`).

The gateway stays between its workers and the coordinator: it forwards their Register and
Profile frames, relays each Advice to the worker it names, and turns its /admin calls into
AdminCalls. Workers never connect to the coordinator, so they need no route, no key and no
retry logic for it; when it is gone, nothing reaches them and they keep the knobs they run
(which is all the coordinator ever promised: it only advises).

The gateway learns that the coordinator is gone when Attached answers stop for
`worker_timeout`; /admin calls then fail at once with 503 instead of waiting. When it answers
again with `fresh` (it restarted), the gateway forwards its workers' Register again so the
coordinator knows whom to advise; the coordinator resumes its persisted strategy, and workers
already on it ignore the repeat (a Strategy version not newer than theirs changes nothing).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
from typing import Any, Callable

import orjson
import zmq
import zmq.asyncio

from gateway.errors import ServiceUnavailableError
from shared import protocol
from shared.config import Config
from shared.zmq_keys import coordinator_client_keys, secure_clients
from shared.errors import ConfigError
from shared.protocol import (COORDINATOR_PROTOCOL_VERSION, AdminCall, AdminReply, Advice, Attach, Attached, Profile,
                             Register, Strategy)

log = logging.getLogger("reame.coordinator")

CALL_TIMEOUT_S = 5.0  # an /admin call the coordinator does not answer in this time is a 503
SEND_HWM = 1000  # frames queued for the coordinator before new ones are dropped


class RemoteTuning:
    """The gateway's tuning service when the coordinator runs elsewhere (TuningService's twin for
    gateway.admin and gateway.app: start, close, call)."""

    def __init__(self, config: Config, pool, clock: Callable[[], float] = time.monotonic):
        """pool: gateway.workers.WorkerPool (send_strategy, set_capacity, workers, on_profile, on_register)."""
        self.config = config
        self.pool = pool
        self.clock = clock
        self.endpoint = config.tuning.coordinator
        self.gateway_id = f"{socket.gethostname()}/gateway/{os.getpid()}/{id(self):x}"
        self.heartbeat_s = config.server.heartbeat_interval
        self.timeout_s = config.server.worker_timeout
        self.keys = coordinator_client_keys(config)
        self.last_heard: float | None = None  # monotonic time of the coordinator's last answer
        self.relayed: dict[str, Strategy] = {}  # worker id → the last Strategy relayed to it
        self._calls: dict[str, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._lost_logged = False
        pool.on_profile = self.on_profile
        pool.on_register = self.on_register

    @property
    def reachable(self) -> bool:
        return self.last_heard is not None and self.clock() - self.last_heard <= self.timeout_s

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._context = zmq.asyncio.Context()
        if self.keys is not None:
            secure_clients(self._context, self.keys)
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.gateway_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        # Queue nothing for a coordinator that is not connected: a profile is stale by the time it
        # comes back, and a send must never block the event loop that serves requests.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.connect(self.endpoint)
        self._socket = sock
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive_loop()), loop.create_task(self._attach_loop())]
        log.info("coordinator: this gateway (%s) is advised by the coordinator at %s%s", self.gateway_id,
                 self.endpoint, " over CURVE" if self.keys is not None else "")

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for future in self._calls.values():
            future.cancel()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._context.term()

    # ---- the pool's hooks ----------------------------------------------------------------------

    def on_register(self, info: Register) -> None:
        self._send(info)

    def on_profile(self, profile: Profile) -> None:
        self._send(profile)
        # The worker's capacity in the gateway follows the batch size only once the worker says it
        # runs the strategy (its profile's version), as with the in-process coordinator.
        relayed = self.relayed.get(profile.worker_id)
        if relayed is not None and profile.knobs_version == relayed.version:
            self.pool.set_capacity(profile.worker_id, relayed.knobs.max_batch_size)

    # ---- operator controls ---------------------------------------------------------------------

    async def call(self, action: str, argument: Any = None) -> dict[str, Any]:
        """Ask the coordinator; its JSON answer, ConfigError when it refused, 503 when it is gone."""
        if not self.reachable:
            raise ServiceUnavailableError(f"the tuning coordinator at {self.endpoint} is unreachable; "
                                          "the workers keep their current strategy")
        call_id = str(next(self._call_ids))
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            encoded = "" if argument is None else orjson.dumps(argument).decode()
            if not self._send(AdminCall(call_id, action, encoded)):
                raise ServiceUnavailableError(f"the tuning coordinator at {self.endpoint} is unreachable")
            reply: AdminReply = await asyncio.wait_for(future, CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError(f"the tuning coordinator at {self.endpoint} did not answer in "
                                          f"{CALL_TIMEOUT_S:g} s") from None
        finally:
            self._calls.pop(call_id, None)
        if reply.error == "ConfigError":
            raise ConfigError(reply.message)
        if reply.error:  # a bug's text (paths, values) is for the operator's log, not for callers
            log.warning("coordinator: %s failed there: %s: %s", action, reply.error, reply.message)
            raise ServiceUnavailableError(f"the tuning coordinator failed to answer {action!r}; the "
                                          "gateway's and the coordinator's logs have the detail")
        return orjson.loads(reply.body)

    # ---- the socket ----------------------------------------------------------------------------

    def _send(self, message: protocol.Message) -> bool:
        """Send without waiting; False when it was dropped (not connected, under IMMEDIATE, or the
        queue is full): advice can wait for the next profile."""
        future = self._socket.send(protocol.encode(message), zmq.NOBLOCK)
        if future.done():  # zmq.asyncio settles a NOBLOCK send at once, an Again as its exception
            return future.exception() is None
        future.add_done_callback(_consume_result)
        return True

    async def _attach_loop(self) -> None:
        while True:
            self._send(Attach(self.gateway_id))
            if self.last_heard is not None and not self.reachable and not self._lost_logged:
                self._lost_logged = True
                log.warning("coordinator: no answer from %s for %.1f s; the workers keep their current "
                            "strategy", self.endpoint, self.clock() - self.last_heard)
            await asyncio.sleep(self.heartbeat_s)

    async def _receive_loop(self) -> None:
        while True:
            frame = await self._socket.recv()
            try:
                message = protocol.decode(frame)
            except protocol.ProtocolError as exc:
                log.warning("coordinator: dropped a bad frame from %s: %s", self.endpoint, exc)
                continue
            try:
                self._on_message(message)
            except Exception:  # advice is optional; serving must not depend on handling it
                log.exception("coordinator: failed to handle %s", type(message).__name__)

    def _on_message(self, message: protocol.Message) -> None:
        if isinstance(message, Attached):
            self._on_attached(message)
        elif isinstance(message, Advice):
            self.last_heard = self.clock()
            if self.pool.send_strategy(message.worker_id, message.strategy):
                self.relayed[message.worker_id] = message.strategy
        elif isinstance(message, AdminReply):
            future = self._calls.get(message.call_id)
            if future is not None and not future.done():
                future.set_result(message)
        else:
            log.warning("coordinator: unexpected %s from %s", type(message).__name__, self.endpoint)

    def _on_attached(self, message: Attached) -> None:
        if message.version != COORDINATOR_PROTOCOL_VERSION:
            if not self._lost_logged:
                self._lost_logged = True
                log.error("coordinator: %s speaks coordinator protocol %d, this gateway %d: its advice is ignored",
                          self.endpoint, message.version, COORDINATOR_PROTOCOL_VERSION)
            return
        if self.last_heard is None or not self.reachable:
            log.info("coordinator: %s answers", self.endpoint)
        self.last_heard = self.clock()
        self._lost_logged = False
        if message.fresh:  # it (re)started: tell it whom it advises
            for worker in list(self.pool.workers.values()):
                self._send(worker.info)


def _consume_result(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
