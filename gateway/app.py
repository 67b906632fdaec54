"""The aiohttp application: middlewares in order, routes, and the worker pool's lifetime."""
from __future__ import annotations

from aiohttp import web

from gateway.admin import ADMIN_ROUTES
from gateway.anthropic_api import add_anthropic_routes, anthropic_middleware
from gateway.auth import auth_middleware, load_tenants
from gateway.browsers import browser_middleware
from gateway.cache_namespace import check_isolation
from gateway.errors import error_middleware
from gateway.request_id import add_header, request_id_middleware
from gateway.responses_api import add_responses_routes
from gateway.routes import ROUTES
from gateway.state import STATE, GatewayState


def build_app(state: GatewayState) -> web.Application:
    # Outermost first: name the request (its id is in every log line below), count every answer,
    # turn exceptions into OpenAI errors, then what browsers may do (before auth: a CORS preflight
    # carries no key), then auth (whose refusals are such exceptions).
    browser_guard, add_cors_headers = browser_middleware(state.config.gateway)
    # Anthropic's API rewrites the error middleware's answers into its own envelope.
    middlewares = [request_id_middleware, _count_requests, anthropic_middleware, error_middleware, browser_guard]
    tenants = load_tenants(state.config)
    check_isolation(state.config.prefix_cache.isolation, bool(tenants))
    if tenants:
        middlewares.append(auth_middleware(tenants))
    app = web.Application(middlewares=middlewares, client_max_size=state.config.gateway.max_body_bytes)
    app[STATE] = state
    app.add_routes(ROUTES)
    app.add_routes(ADMIN_ROUTES)
    add_anthropic_routes(app)
    add_responses_routes(app)
    app.on_response_prepare.append(add_header)
    app.on_response_prepare.append(add_cors_headers)
    app.on_startup.append(_start_pool)
    app.on_cleanup.append(_close_pool)
    return app


@web.middleware
async def _count_requests(request: web.Request, handler) -> web.StreamResponse:
    response = await handler(request)
    # Label by route, not raw path, so that stray URLs cannot blow up the series count.
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "other"
    request.app[STATE].metrics.requests.labels(endpoint, str(response.status)).inc()
    return response


async def _start_pool(app: web.Application) -> None:
    await app[STATE].pool.start()
    app[STATE].tuning.start()


async def _close_pool(app: web.Application) -> None:
    await app[STATE].tuning.close()
    await app[STATE].pool.close()
