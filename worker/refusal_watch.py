"""Tells the operator when the gateway refuses this worker's CURVE key.

A refused CURVE handshake is invisible to the worker's code: ZeroMQ retries quietly, the worker
waits for a registration that never comes, and only the gateway's log says why. This thread
watches the socket's handshake events and logs the refusal (once, with the key to authorize)
and a later success.
"""
from __future__ import annotations

import logging
import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("reame.worker")

_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED


class RefusalWatch(threading.Thread):
    def __init__(self, sock: zmq.Socket, endpoint: str, public_key: bytes):
        super().__init__(name="reame-curve-watch", daemon=True)
        self.endpoint = endpoint
        self.public_key = public_key
        self.refused = 0  # handshakes the gateway refused
        self._monitor = sock.get_monitor_socket(_EVENTS)
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()
        self.join(2)

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._monitor.poll(200):
                    continue
                event = recv_monitor_message(self._monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self.refused += 1
                    if self.refused == 1:
                        log.error("the gateway at %s refused this worker's CURVE key %s: add this host's .key "
                                  "file to the gateway's [server] curve_authorized_keys directory", self.endpoint,
                                  self.public_key.decode())
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.refused:
                    log.info("the gateway at %s accepts this worker's CURVE key now", self.endpoint)
                    self.refused = 0
        finally:
            self._monitor.close(linger=0)
