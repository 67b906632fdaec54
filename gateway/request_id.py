"""Request ids: the client's `X-Request-Id` when it sends a usable one, else a fresh one.

The id names the request in every log line and comes back in the response's `X-Request-Id`, so
a client can quote it in a bug report. A client-supplied id is reduced to a short run of plain
characters: it is client data that ends up in logs and response headers, and must not be able
to forge log lines or smuggle headers (shared.logs escapes control characters as a second guard).
"""
from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

from aiohttp import web

HEADER = "X-Request-Id"
MAX_LENGTH = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9._:@+=/-]")
# aiohttp runs a request's middlewares, handler and response preparation in one task, so a
# context variable set by the middleware names the request everywhere below it.
_CURRENT: ContextVar[str | None] = ContextVar("request_id", default=None)


def sanitize(value: str | None) -> str | None:
    """The client's id without unsafe characters, cut to MAX_LENGTH; None if nothing usable is left."""
    if not value:
        return None
    cleaned = _UNSAFE.sub("", value)[:MAX_LENGTH]
    return cleaned or None


def current_request_id() -> str:
    """The id of the request being handled ("-" outside one)."""
    return _CURRENT.get() or "-"


@web.middleware
async def request_id_middleware(request: web.Request, handler) -> web.StreamResponse:
    rid = sanitize(request.headers.get(HEADER)) or uuid.uuid4().hex
    token = _CURRENT.set(rid)
    try:
        response = await handler(request)
    finally:
        # Reset, so that an answer aiohttp makes itself (a 400 for a malformed next request on the
        # same connection) is not labelled with this request's id.
        _CURRENT.reset(token)
    if not response.prepared:
        response.headers[HEADER] = rid
    return response


async def add_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare hook: a stream sends its headers from inside the handler."""
    rid = _CURRENT.get()
    if rid is not None:
        response.headers[HEADER] = rid
