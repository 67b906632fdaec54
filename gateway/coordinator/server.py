"""The standalone coordinator (`reame-coordinator`): one strategy for the workers of several gateways.

It owns what the in-process coordinator owns inside a gateway (the Coordinator, the strategy
store under `[tuning] state_path`, the adaptive report) and is driven by the same TuningService;
only the pool differs: GatewayLinks reaches a worker through the gateway that last forwarded its
Register or Profile. It binds `[tuning] coordinator` (a ROUTER; CURVE with
`curve_coordinator_key`, letting in only the gateways whose keys are in
`curve_authorized_gateways`) and answers each gateway's Attach, Register, Profile and AdminCall
(shared.protocol). Gateways silent for `[server] worker_timeout` are forgotten, with the routes
to their workers; they are told to forward their workers again when they come back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Callable

import orjson
import zmq
import zmq.asyncio

from gateway.coordinator.service import TuningService
from gateway.worker_auth import WorkerAuthenticator
from gateway.workers import bind_private
from shared import protocol
from shared.config import Config
from shared.zmq_keys import check_coordinator_transport, coordinator_server_keys, secure_server
from shared.errors import ConfigError, ReameError
from shared.protocol import (COORDINATOR_PROTOCOL_VERSION, AdminCall, AdminReply, Advice, Attach, Attached, Profile,
                             Register, Strategy)

log = logging.getLogger("reame.coordinator")


class GatewayLinks:
    """The gateways, as TuningService sees a worker pool: a Strategy for a worker becomes an
    Advice to the gateway it came through."""

    def __init__(self, send: Callable[[bytes, protocol.Message], None]):
        self._send = send
        self.route: dict[str, bytes] = {}  # worker id → the routing id of its gateway
        self.on_profile: Callable[[Profile], None] | None = None  # set by TuningService
        self.on_register: Callable[[Register], None] | None = None

    def send_strategy(self, worker_id: str, strategy: Strategy) -> bool:
        gateway = self.route.get(worker_id)
        if gateway is None:
            return False
        self._send(gateway, Advice(worker_id, strategy))
        return True

    def set_capacity(self, worker_id: str, capacity: int) -> None:
        """Each gateway sets its workers' capacity itself, from the Strategies it relays."""

    def forget_gateway(self, gateway: bytes) -> None:
        for worker_id in [w for w, g in self.route.items() if g == gateway]:
            del self.route[worker_id]


class CoordinatorServer:
    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic):
        if not config.tuning.coordinator:
            raise ConfigError("[tuning] coordinator is empty: give the endpoint reame-coordinator binds "
                              "(e.g. tcp://0.0.0.0:5560), or --endpoint")
        check_coordinator_transport(config)
        self.config = config
        self.endpoint = config.tuning.coordinator
        self.clock = clock
        self.keys = coordinator_server_keys(config)
        self.links = GatewayLinks(self._send)
        self.tuning = TuningService(config, self.links, clock=clock)
        self.gateways: dict[bytes, float] = {}  # routing id → monotonic time of its last Attach
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._authenticator: WorkerAuthenticator | None = None
        self._tasks: list[asyncio.Task] = []
        self._calls: set[asyncio.Task] = set()  # AdminCalls being answered
        self._refused_versions: set[bytes] = set()

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # No ROUTER_HANDOVER: no connection takes up a gateway's routing id while it is connected (a
        # restarted gateway comes back under a new one: gateway.coordinator.remote's gateway_id).
        if self.keys is not None:
            self._authenticator = WorkerAuthenticator(self._context, self.keys.authorized_dir, peer="gateway")
            self._authenticator.start()  # before the bind: libzmq lets everyone in while no handler answers
            secure_server(sock, self.keys)
        try:
            if self.endpoint.startswith("ipc://") and not self.endpoint.startswith("ipc://@"):
                bind_private(sock, Path(self.endpoint[len("ipc://"):]))
            else:
                sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(f"[tuning] coordinator = {self.endpoint}: cannot bind it: {exc}") from None
        self._socket = sock
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive_loop()), loop.create_task(self._sweep_loop())]
        self.tuning.start()
        log.info("coordinator: waiting for gateways on %s%s (strategy v%d, adaptive %s)", self.endpoint,
                 " over CURVE" if self.keys is not None else "", self.tuning.coordinator.version,
                 "on" if self.config.tuning.adaptive else "off")

    async def close(self) -> None:
        tasks = [*self._tasks, *self._calls]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.tuning.close()  # saves the strategy
        if self._authenticator is not None:
            await self._authenticator.close()
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._context is not None:
            self._context.term()

    # ---- messages from gateways ----------------------------------------------------------------

    def _send(self, gateway: bytes, message: protocol.Message) -> None:
        # Never blocks: a message for a gateway that is gone or not reading is dropped (advice is
        # optional; the next profile brings it again, and a gateway's /admin call times out).
        future = self._socket.send_multipart([gateway, protocol.encode(message)], zmq.NOBLOCK)
        future.add_done_callback(_consume_result)

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 2:
                log.warning("coordinator: dropped a message of %d frames", len(frames))
                continue
            gateway, frame = frames
            try:
                message = protocol.decode(frame)
            except protocol.ProtocolError as exc:
                log.warning("coordinator: dropped a bad frame from %r: %s", gateway, exc)
                continue
            try:
                self._on_message(gateway, message)
            except Exception:  # one bad message must not stop the loop every gateway depends on
                log.exception("coordinator: failed to handle %s from %r", type(message).__name__, gateway)

    def _on_message(self, gateway: bytes, message: protocol.Message) -> None:
        if isinstance(message, Attach):
            self._attach(gateway, message)
            return
        if gateway not in self.gateways:
            return  # a gateway forgotten (or never attached) hears Attached(fresh) first
        if isinstance(message, Register):
            self.links.route[message.worker_id] = gateway
            self.tuning.on_register(message)
        elif isinstance(message, Profile):
            self.links.route[message.worker_id] = gateway
            self.tuning.on_profile(message)
        elif isinstance(message, AdminCall):
            # Answered in a task: an import's checks and the series run in a thread (TuningService.call)
            # while this loop goes on relaying profiles.
            task = asyncio.get_running_loop().create_task(self._answer(gateway, message))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        else:
            log.warning("coordinator: unexpected %s from %r", type(message).__name__, gateway)

    def _attach(self, gateway: bytes, message: Attach) -> None:
        if message.version != COORDINATOR_PROTOCOL_VERSION:
            if gateway not in self._refused_versions:
                self._refused_versions.add(gateway)
                log.error("coordinator: gateway %s speaks coordinator protocol %d, this coordinator %d: ignored",
                          message.gateway_id, message.version, COORDINATOR_PROTOCOL_VERSION)
            self._send(gateway, Attached(fresh=False))  # carries our version: the gateway logs the mismatch
            return
        fresh = gateway not in self.gateways
        if fresh:
            log.info("coordinator: gateway %s attached", message.gateway_id)
        self.gateways[gateway] = self.clock()
        self._send(gateway, Attached(fresh=fresh))

    async def _answer(self, gateway: bytes, call: AdminCall) -> None:
        self._send(gateway, await self._reply(call))

    async def _reply(self, call: AdminCall) -> AdminReply:
        try:
            argument: Any = None
            if call.argument:
                try:
                    argument = orjson.loads(call.argument)
                except orjson.JSONDecodeError as exc:
                    raise ConfigError(f"the argument is not valid JSON: {exc}") from None
            body = await self.tuning.call(call.action, argument)
            return AdminReply(call.call_id, orjson.dumps(body).decode())
        except ReameError as exc:
            return AdminReply(call.call_id, error=type(exc).__name__, message=exc.message)
        except Exception:  # a bug answers as an error, never as silence (the gateway would wait)
            # Its text (paths, values, keys) stays in this log: the reply travels to the gateway,
            # whose logs and callers are not the coordinator's operator's.
            log.exception("coordinator: %s (call %s) failed", call.action, call.call_id)
            return AdminReply(call.call_id, error="InternalError",
                              message=f"the coordinator failed to answer {call.action!r} (call {call.call_id}); "
                                      "its log has the detail")

    # ---- liveness ------------------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        timeout = self.config.server.worker_timeout
        while True:
            await asyncio.sleep(max(0.05, timeout / 4))
            now = self.clock()
            for gateway, seen in list(self.gateways.items()):
                if now - seen > timeout:
                    del self.gateways[gateway]
                    self.links.forget_gateway(gateway)
                    log.warning("coordinator: gateway %r silent for %.1f s: forgotten (its workers keep their "
                                "strategy)", gateway.decode(errors="replace"), now - seen)


def _consume_result(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
