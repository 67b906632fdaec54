"""What a web browser may do with this server: the defences against other sites' pages.

A page on any site can make the visitor's browser send requests to 127.0.0.1:8000. Two ways in,
the class of Ollama's CVE-2024-28224, and what closes each:

- DNS rebinding: the page's own name is re-pointed at 127.0.0.1, so the browser treats the server
  as same-origin and reads its answers. The request still carries the page's name in `Host`,
  so, without an api_key, a Host other than the configured host, a loopback name or one of
  `[gateway] allowed_hosts` is refused (403). With an api_key the key protects: no other site's
  page knows it. A bare IP address is accepted when listening on every interface (0.0.0.0, ::):
  rebinding needs a name.
- Cross-site "simple" requests: a form or fetch() may POST text/plain or form bodies without a
  CORS preflight, and a completion would run even though the page cannot read it. A POST body
  that is not JSON is refused (415); a JSON body from another origin needs a preflight, which
  only `[gateway] cors_origins` answers. So is a POST without a body and without a JSON
  Content-Type, unless it carries an Authorization header (or the server has keys, and so
  refuses it without one): an empty form or a bodyless fetch() froze the strategy of a server
  without keys (/admin/strategy/freeze takes no body), and no page can add that header to
  another site's request without a preflight.
"""
from __future__ import annotations

import ipaddress

from aiohttp import web

from gateway.errors import HostNotAllowedError, UnsupportedMediaTypeError
from shared.config import GatewaySection, is_loopback

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
# Preflight answers may be cached this long (seconds) by the browser.
PREFLIGHT_MAX_AGE = "600"


def names(setting: str) -> frozenset[str]:
    """A comma-separated reame.conf list, each entry lowercased."""
    return frozenset(part.strip().lower() for part in setting.split(",") if part.strip())


def browser_middleware(config: GatewaySection):
    check_host = not config.authenticated and "*" not in names(config.allowed_hosts)
    keys = config.authenticated  # then a request without Authorization is refused anyway (401)
    hosts = LOOPBACK_NAMES | {config.host.lower()} | names(config.allowed_hosts)
    any_address = config.host in WILDCARD_HOSTS
    origins = frozenset(part.strip() for part in config.cors_origins.split(",") if part.strip())

    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        if check_host and not _host_allowed(request.host, hosts, any_address):
            raise HostNotAllowedError(f"this server does not answer to the Host {request.host[:100]!r}; "
                                      "add it to [gateway] allowed_hosts")
        origin = request.headers.get("Origin")
        if (request.method == "OPTIONS" and origin in origins
                and "Access-Control-Request-Method" in request.headers):
            return web.Response(status=204, headers=_preflight_headers(origin, request))
        if (request.method == "POST" and not _is_json(request.content_type)
                and (request.body_exists or not (keys or "Authorization" in request.headers))):
            raise UnsupportedMediaTypeError(f"the request body must be JSON (Content-Type: application/json), "
                                            f"not {request.content_type[:100]}")
        return await handler(request)

    async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
        # On every answer, errors and streams included, so the page can read what went wrong.
        origin = request.headers.get("Origin")
        if origin in origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "X-Request-Id, Retry-After"
            response.headers.add("Vary", "Origin")

    return guard, add_cors_headers


def _host_allowed(host: str, hosts: frozenset[str], any_address: bool) -> bool:
    if not host:
        return True     # HTTP/1.0 without Host: no browser sends that
    name = _strip_port(host).lower().rstrip(".")
    if name in hosts or is_loopback(name):
        return True
    if any_address:
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False
    return False


def _strip_port(host: str) -> str:
    if host.startswith("["):            # [::1]:8000
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:            # name:8000 (a bare IPv6 address has several colons)
        return host.split(":", 1)[0]
    return host


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


def _preflight_headers(origin: str, request: web.Request) -> dict[str, str]:
    return {"Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                "Authorization, Content-Type"),
            "Access-Control-Max-Age": PREFLIGHT_MAX_AGE, "Vary": "Origin"}
