"""Heartbeats from a thread and a socket of their own.

The serve loop cannot send anything while the engine is inside one long step (a prefill of
thousands of tokens takes seconds), and a gateway that heard nothing for `worker_timeout` would
drop a healthy worker. This thread keeps beating as long as the process is alive; the engine's
native calls release the GIL often enough for it to run. (ZeroMQ sockets must not be shared
between threads, hence the second socket, whose routing id is the worker id + "#pulse".)
"""
from __future__ import annotations

import logging
import threading
import time

import zmq

from shared import protocol
from shared.protocol import Heartbeat

log = logging.getLogger("reame.worker")


class Pulse(threading.Thread):
    def __init__(self, context: zmq.Context, endpoint: str, service, interval: float):
        super().__init__(name="reame-pulse", daemon=True)
        self.context = context
        self.endpoint = endpoint
        self.service = service  # WorkerService: its load is read, and it is asked to re-register
        self.interval = interval
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
        try:
            while not self._stopping.is_set():
                active, queued = self.service.load()
                sock.send(protocol.encode(Heartbeat(worker_id, active=active, queued=queued)))
                self._listen(sock, time.monotonic() + self.interval)
        finally:
            sock.close()

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
