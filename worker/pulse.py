"""Heartbeats from a thread and a socket of their own.

The serve loop cannot send anything while the engine is inside one long step (a prefill of
thousands of tokens takes seconds), and a gateway that heard nothing for `worker_timeout` would
drop a healthy worker. This thread keeps beating as long as the process is alive; the engine's
native calls release the GIL often enough for it to run. (ZeroMQ sockets must not be shared
between threads, hence the second socket, whose routing id is the worker id + "#pulse".)

Each beat says what the serve loop last read (Heartbeat.read_request, read_ms): the gateway
judges the data path by that, not by the beats alone. Each also carries the worker's prefix-cache
counters, read from this thread: `counters` must be safe to call while the engine steps (reading
ints is). Every `profile_interval` the same socket carries the worker's Profile
(worker.profiler) for the tuning coordinator.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import zmq

from shared import protocol
from shared.protocol import HEARTBEAT_COUNTERS, Heartbeat, Profile

log = logging.getLogger("reame.worker")


class Pulse(threading.Thread):
    def __init__(self, context: zmq.Context, endpoint: str, service, interval: float,
                 counters: Callable[[], dict[str, int]] | None = None,
                 profile: Callable[[], Profile] | None = None, profile_interval: float = 5.0):
        super().__init__(name="reame-pulse", daemon=True)
        self.context = context
        self.endpoint = endpoint
        self.service = service  # WorkerService: its load is read, and it is asked to re-register
        self.interval = interval
        self.counters = counters  # Heartbeat counter field → cumulative value
        self._counters_failed = False
        self.profile = profile  # the profile of the window since the last call
        self.profile_interval = profile_interval
        self._profile_failed = False
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()
        self.join(2)

    def run(self) -> None:
        sock = self.context.socket(zmq.DEALER)
        worker_id = self.service.info.worker_id
        sock.setsockopt(zmq.IDENTITY, f"{worker_id}#pulse".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        next_profile = time.monotonic() + self.profile_interval
        try:
            while not self._stopping.is_set():
                active, queued = self.service.load()
                read_ms = self.service.read_ms()  # before the id: a read in between only makes it conservative
                beat = Heartbeat(worker_id, active=active, queued=queued, read_request=self.service.read_request,
                                 read_ms=read_ms, **self._read_counters())
                sock.send(protocol.encode(beat))
                if self.profile is not None and time.monotonic() >= next_profile:
                    next_profile = time.monotonic() + self.profile_interval
                    self._send_profile(sock)
                self._listen(sock, time.monotonic() + self.interval)
        finally:
            sock.close()

    def _read_counters(self) -> dict[str, int]:
        """The counters that are Heartbeat fields; none when they cannot be read."""
        if self.counters is None:
            return {}
        try:
            return {name: int(value) for name, value in self.counters().items() if name in HEARTBEAT_COUNTERS}
        except Exception:
            # Beats keep the worker registered: a broken counter costs the counters, not the worker.
            if not self._counters_failed:
                self._counters_failed = True
                log.exception("pulse: reading the counters failed; heartbeats go without them")
            return {}

    def _send_profile(self, sock: zmq.Socket) -> None:
        try:
            profile = self.profile()
        except Exception:
            # Like a broken counter: profiles stop, heartbeats (and serving) go on.
            if not self._profile_failed:
                self._profile_failed = True
                log.exception("pulse: building the profile failed; no profiles are sent")
            return
        sock.send(protocol.encode(profile))

    def _listen(self, sock: zmq.Socket, until: float) -> None:
        """Wait out the interval, answering the gateway's "who are you?" by asking the loop to register."""
        while not self._stopping.is_set():
            left = until - time.monotonic()
            if left <= 0:
                return
            if not sock.poll(min(left, 0.1) * 1000):
                continue
            try:
                message = protocol.decode(sock.recv())
            except protocol.ProtocolError as exc:
                log.warning("pulse: dropped a bad frame: %s", exc)
                continue
            if isinstance(message, Heartbeat) and not message.registered:
                self.service.request_register()
