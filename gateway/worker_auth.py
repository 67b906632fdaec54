"""The gateway's ZAP handler: which workers may connect over CURVE (ZeroMQ RFC 27).

libzmq asks this handler at every CURVE handshake on the workers' socket, with the peer's
address and public key. A key is let in when a `.key` file of the authorized directory holds it;
the directory is read again when it changes, so adding or removing a worker's key takes effect
at its next connection without a restart. A refused worker is logged once per (address, key) at
warning level (a restarted or reconnecting worker would repeat it) and counted in `refused`.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.utils.z85

from shared.zmq_keys import ZAP_DOMAIN, authorized_keys

log = logging.getLogger("reame.gateway")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the RFC: libzmq looks for the handler here
_VERSION = b"1.0"


class WorkerAuthenticator:
    """Answers ZAP requests on the context of the workers' socket; start before that socket binds."""

    def __init__(self, context: zmq.asyncio.Context, authorized_dir: Path, peer: str = "worker"):
        """peer: what connects ("worker"; "gateway" at a standalone coordinator), for the log."""
        self.context = context
        self.peer = peer
        self.authorized_dir = authorized_dir
        self.refused = 0  # handshakes refused so far
        self._keys: dict[bytes, str] = {}
        self._stamp: tuple | None = None  # the directory's state when _keys was read
        self._logged: set[tuple[str, bytes]] = set()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._socket = self.context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        self._reload()
        log.info("%ss authenticate with CURVE; %d authorized keys in %s", self.peer, len(self._keys),
                 self.authorized_dir)
        self._task = asyncio.create_task(self._serve())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)

    async def _serve(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                reply = self.answer(frames)
            except Exception:  # a handler that stops answering would stall every handshake
                log.exception("gateway: ZAP request failed; refusing it")
                reply = [_VERSION, frames[1] if len(frames) > 1 else b"", b"500", b"internal error", b"", b""]
            await self._socket.send_multipart(reply)

    def answer(self, frames: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request: 200 with the public key (Z85) as user id, or 400. The
        user id comes with every message of that connection: the pool binds a worker id to it."""
        if len(frames) < 6:
            return [_VERSION, b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        peer = address.decode(errors="replace")

        def reply(code: bytes, text: str, user: str = "") -> list[bytes]:
            return [_VERSION, request_id, code, text.encode(), user.encode(), b""]

        if version != _VERSION:
            return reply(b"500", "unsupported ZAP version")
        if domain.decode(errors="replace") != ZAP_DOMAIN or mechanism != b"CURVE" or len(credentials) != 1:
            return self._refuse(reply, peer, b"", f"mechanism {mechanism.decode(errors='replace')} is not CURVE")
        key = zmq.utils.z85.encode(credentials[0])
        self._reload()
        name = self._keys.get(key)
        if name is None:
            return self._refuse(reply, peer, key, f"its key is not in {self.authorized_dir}")
        return reply(b"200", "OK", key.decode())

    def name_of(self, key: bytes) -> str:
        """The file name of an authorized public key (Z85), for the log."""
        return self._keys.get(key, "no longer authorized")

    def _refuse(self, reply, peer: str, key: bytes, why: str) -> list[bytes]:
        self.refused += 1
        if (peer, key) not in self._logged:
            self._logged.add((peer, key))
            log.warning("refused a %s from %s (CURVE public key %s): %s", self.peer, peer,
                        key.decode() or "-", why)
        return reply(b"400", "not authorized")

    def _reload(self) -> None:
        """Read the directory again if a file was added, removed or changed since the last read."""
        try:
            entries = sorted(self.authorized_dir.glob("*.key"))
            stamp = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in entries)
        except OSError as exc:
            log.error("cannot read the authorized %s keys in %s: %s", self.peer, self.authorized_dir, exc)
            return
        if stamp == self._stamp:
            return
        keys = authorized_keys(self.authorized_dir)
        unreadable = {p.name for p in entries} - set(keys.values())
        if unreadable:
            log.warning("gateway: not ZeroMQ public keys, ignored: %s", ", ".join(sorted(unreadable)))
        if self._stamp is not None:
            log.info("authorized %s keys reloaded: %d (%s)", self.peer, len(keys), ", ".join(keys.values()))
        self._keys, self._stamp = keys, stamp
