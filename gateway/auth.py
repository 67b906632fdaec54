"""Bearer-token authentication, when `api_key` is set. `/health` stays open for load balancers and
`/openapi.json` for client generators; every other route, /v1/* and any /admin/* included, needs the key."""
from __future__ import annotations

import hmac

from aiohttp import web

from gateway.errors import AuthenticationError

OPEN_PATHS = frozenset({"/health", "/openapi.json"})


def auth_middleware(api_key: str):
    expected = api_key.encode()

    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if not header:
                raise AuthenticationError("Missing API key: send it as 'Authorization: Bearer <key>'")
            # compare_digest takes the same time wherever the first wrong byte is.
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
                raise AuthenticationError("Incorrect API key provided")
        return await handler(request)

    return check_key
