"""Server-sent events in the shape OpenAI clients parse: `data: <json>\\n\\n`, then `data: [DONE]`.

The response is prepared lazily, on the first event: until then a request can still fail
with a normal HTTP status, or be moved to another worker without the client noticing.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Awaitable, Callable

import orjson
from aiohttp import web

from shared.errors import ReameError

log = logging.getLogger("reame.gateway")

_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx and friends must not buffer a token stream
}


class ClientStoppedReading(ConnectionError):
    """The client did not take a write within `write_timeout` seconds."""


async def until_the_client_leaves(out: EventStream, request_id: str,
                                  send: Callable[[], Awaitable[None]]) -> web.StreamResponse | None:
    """Run `send` over `out`. A client that stopped reading or left mid-stream ends it quietly:
    the connection is gone, and the caller (`completion.complete`) releases the jobs, so their
    workers stop generating. Answering, not raising, spares aiohttp's error log a traceback for
    an ordinary event (bench/abuse.py counted 24 in 30 s of clients closing after [DONE]). One
    that left before the first event raises, as any failed request."""
    try:
        await send()
    except ClientStoppedReading as exc:
        log.info("request %s: cancelled: %s", request_id, exc)
    except ConnectionError as exc:
        if not out.started:
            raise
        log.debug("request %s: the client left mid-stream (%s)", request_id, exc)
    return out.response


class EventStream:
    def __init__(self, request: web.Request, write_timeout: float):
        self.request = request
        self.write_timeout = write_timeout
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    async def send(self, event: dict) -> None:
        await self._write(b"data: " + orjson.dumps(event) + b"\n\n")

    async def done(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def fail(self, exc: ReameError) -> None:
        """End a stream that is under way with an error event (the openai client raises on it)."""
        await self.send(exc.to_openai())
        await self.response.write_eof()

    async def _write(self, data: bytes) -> None:
        if self.response is None:
            self.response = web.StreamResponse(status=200, headers=_HEADERS)
            _bound_send_buffer(self.request)
            await self.response.prepare(self.request)
        # A write waits only while the socket's buffers are full, i.e. while the client is not
        # reading; without a limit a client that never reads would hold its generation (and
        # every token queued for it) for as long as the connection lives.
        try:
            await asyncio.wait_for(self.response.write(data), self.write_timeout)
        except asyncio.TimeoutError:
            _reset(self.request)
            raise ClientStoppedReading(f"the client read nothing for {self.write_timeout:g} s") from None


# A token stream needs little buffer (chunks of ~200 bytes), but Linux grows an unread loopback
# socket's send buffer up to tcp_wmem's maximum (4 MiB here), and asyncio buffers 64 KiB more
# before a write waits: at ~25 KB/s of SSE a client that never read held its generation for
# minutes before write_timeout even started to count. A fixed socket buffer turns the growth off
# (the kernel doubles it: 64 KiB) and asyncio's share is cut to 16 KiB.
_STREAM_SEND_BUFFER = 32 * 1024
_STREAM_WRITE_BUFFER = 16 * 1024


def _bound_send_buffer(request: web.Request) -> None:
    transport = request.transport
    if transport is None:
        return
    transport.set_write_buffer_limits(high=_STREAM_WRITE_BUFFER)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _STREAM_SEND_BUFFER)
        except OSError:
            pass  # not every transport is a TCP socket (unix sockets, tests); nothing to bound


def _reset(request: web.Request) -> None:
    """Drop the connection at once, with what the kernel still holds for it: a plain close queues
    its FIN behind the unread bytes, which a client that never reads never receives, so the
    socket and its 64 KiB would linger as an orphan and the client could not tell it was cut."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        except OSError:
            pass
    transport.abort()
