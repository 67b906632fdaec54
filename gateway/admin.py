"""The operator's routes: the tuning strategy (read, freeze, import), the adaptive report, and
the dashboard. All need the API key when one is set (gateway.auth), except the dashboard page
itself, which holds no data: it asks for the key and sends it with each of its requests. With a
standalone coordinator ([tuning] coordinator) every call is answered by it: any gateway shows and
changes the one strategy all of them share (503 while it is unreachable).

    GET  /admin/strategy           the knobs per worker, the version, frozen or not
    POST /admin/strategy           pin a strategy, frozen (`reame strategy import FILE`)
    POST /admin/strategy/freeze    no more changes, knobs or kernels; /unfreeze lets them resume
    GET  /admin/report             the adaptive report as JSON, with the strategy history
    GET  /admin/series?bucket=S    the dashboard's curves (one point per S seconds)
    GET  /dashboard                a self-contained page plotting the curves live
"""
from __future__ import annotations

import orjson
from aiohttp import web

from gateway.errors import ConflictError
from gateway.html_pages import page_response
from gateway.json_response import json_response
from gateway.state import STATE
from shared.errors import ConfigError, InvalidRequestError

ADMIN_ROUTES = web.RouteTableDef()  # the operator's routes (gateway.auth.OPERATOR_PATHS)
MAX_STRATEGY_BYTES = 1 << 20


@ADMIN_ROUTES.get("/admin/strategy")
async def get_strategy(request: web.Request) -> web.Response:
    return json_response(await request.app[STATE].tuning.call("strategy"))


@ADMIN_ROUTES.post("/admin/strategy")
async def put_strategy(request: web.Request) -> web.Response:
    tuning = request.app[STATE].tuning
    if request.content_length is not None and request.content_length > MAX_STRATEGY_BYTES:
        raise InvalidRequestError(f"a strategy is at most {MAX_STRATEGY_BYTES} bytes")
    try:
        doc = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"the strategy is not valid JSON: {exc}") from None
    try:
        body = await tuning.call("import", doc)
    except ConfigError as exc:
        raise (ConflictError if "adaptivity is off" in exc.message else InvalidRequestError)(exc.message) from None
    return json_response(body)


@ADMIN_ROUTES.post("/admin/strategy/freeze")
async def freeze(request: web.Request) -> web.Response:
    return await _set_frozen(request, "freeze")


@ADMIN_ROUTES.post("/admin/strategy/unfreeze")
async def unfreeze(request: web.Request) -> web.Response:
    return await _set_frozen(request, "unfreeze")


async def _set_frozen(request: web.Request, action: str) -> web.Response:
    try:
        return json_response(await request.app[STATE].tuning.call(action))
    except ConfigError as exc:
        raise ConflictError(exc.message) from None


@ADMIN_ROUTES.get("/admin/report")
async def report(request: web.Request) -> web.Response:
    return json_response(await request.app[STATE].tuning.call("report"))


@ADMIN_ROUTES.get("/admin/series")
async def series(request: web.Request) -> web.Response:
    raw = request.query.get("bucket", "5")
    try:
        bucket = float(raw)
    except ValueError:
        bucket = 0.0
    if not 1.0 <= bucket <= 3600.0:
        raise InvalidRequestError(f"bucket must be seconds in 1..3600, got {raw!r}", param="bucket")
    return json_response(await request.app[STATE].tuning.call("series", bucket))


@ADMIN_ROUTES.get("/dashboard")
async def dashboard(request: web.Request) -> web.Response:
    return page_response("dashboard.html")
