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
    _CURRENT.set(sanitize(request.headers.get(HEADER)) or uuid.uuid4().hex)
    return await handler(request)


async def add_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare hook: every response, streamed or not, error or not, carries the id."""
    rid = _CURRENT.get()
    if rid is not None:
        response.headers[HEADER] = rid
