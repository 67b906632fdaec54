"""A JSON answer, written the one way every route writes one: orjson, application/json."""
from __future__ import annotations

import orjson
from aiohttp import web


def json_response(body: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)
