"""Bearer-token authentication, when `api_key` or `api_keys_file` is set. `/health` stays open for
load balancers and `/openapi.json` for client generators; every other route needs a key.

Each key names a tenant: the prefix cache can be isolated per tenant (gateway.cache_namespace)
and the worker queue shares its slots fairly between tenants (gateway.workers).

Keys are of two kinds. The operator's (`[gateway] api_key`, and lines of `api_keys_file` marked
`admin`) reach everything; a tenant's reach the API (/v1/*) only. OPERATOR_PATHS (the strategy
and report under /admin/, the dashboard, and /metrics, whose series are all host-wide: queue
depth, workers, prefix hits and the speculation counters a tenant could read others' answers
from) answer a tenant's key with 403. The dashboard page itself holds no data and is served
without a key, so a browser can open it; what it plots comes from /admin/*.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from gateway.errors import AuthenticationError, PermissionDeniedError
from shared.config import Config
from shared.errors import ConfigError
from shared.private_state import check_secret_file

log = logging.getLogger("reame.gateway")

OPEN_PATHS = frozenset({"/health", "/openapi.json", "/dashboard"})  # /dashboard: a page without data
OPERATOR_PATHS = frozenset({"/dashboard", "/metrics"})  # and everything under /admin/
ADMIN_MARK = "admin"  # the third field of an operator's line in api_keys_file


@dataclass(frozen=True)
class Tenant:
    name: str  # for logs and fair queueing; never the key itself
    key_digest: bytes  # SHA-256 of the key: what isolates its cached prefixes
    admin: bool = False  # the operator's key: /admin/*, /dashboard and /metrics too


# The Tenant whose key a request carried (typed request storage: aiohttp 3.14).
TENANT = web.RequestKey("tenant", Tenant)


def load_tenants(config: Config) -> list[tuple[bytes, Tenant]]:
    """(key, tenant) for `[gateway] api_key` (tenant "default", the operator) and every line of
    `api_keys_file`.

    The file holds one key per line, optionally after a name (`NAME KEY`), and `NAME KEY admin`
    for an operator's key; blank lines and lines starting with # are skipped. Without a name, a
    key is called `key<line number>`. The lone api_key is the operator's: a server with one key
    is one operator's, who uses the API and runs the server alike.
    """
    keys: list[tuple[bytes, Tenant]] = []
    if config.gateway.api_key:
        keys.append(_tenant("default", config.gateway.api_key, admin=True))
    if config.gateway.api_keys_file:
        path = config.resolve_path(config.gateway.api_keys_file)
        check_secret_file(path, "[gateway] api_keys_file", log)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(f"[gateway] api_keys_file {path}: {exc.strerror or exc}") from None
        from_file = _parse_keys(lines, path)
        if not from_file:
            raise ConfigError(f"[gateway] api_keys_file {path} holds no key")
        keys += from_file
    seen: dict[bytes, str] = {}
    for key, tenant in keys:
        if key in seen:
            raise ConfigError(f"API key of {tenant.name!r} is also the key of {seen[key]!r}: keys must differ")
        seen[key] = tenant.name
    return keys


def _parse_keys(lines: list[str], path: Path) -> list[tuple[bytes, Tenant]]:
    keys = []
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 3 or (len(fields) == 3 and fields[2] != ADMIN_MARK):
            raise ConfigError(f"{path}:{number}: expected 'KEY' or 'NAME KEY', or 'NAME KEY {ADMIN_MARK}' for an "
                              f"operator's key; got {len(fields)} fields")
        name, key = (fields[0], fields[1]) if len(fields) >= 2 else (f"key{number}", fields[0])
        keys.append(_tenant(name, key, admin=len(fields) == 3))
    return keys


def _tenant(name: str, key: str, admin: bool = False) -> tuple[bytes, Tenant]:
    return key.encode(), Tenant(name, hashlib.sha256(key.encode()).digest(), admin)


def is_operator_path(path: str) -> bool:
    return path in OPERATOR_PATHS or path == "/admin" or path.startswith("/admin/")


def auth_middleware(tenants: list[tuple[bytes, Tenant]]):
    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        if request.path not in OPEN_PATHS or header:
            scheme, _, token = header.partition(" ")
            if not header:
                raise AuthenticationError("Missing API key: send it as 'Authorization: Bearer <key>'")
            tenant = _match(token.strip().encode(), tenants) if scheme.lower() == "bearer" else None
            if tenant is None:
                if request.path in OPEN_PATHS:
                    return await handler(request)  # an open page does not judge what it was sent
                raise AuthenticationError("Incorrect API key provided")
            if not tenant.admin and is_operator_path(request.path):
                raise PermissionDeniedError(f"{request.path} is the operator's: this API key is a tenant's "
                                            f"(mark an operator's key '{ADMIN_MARK}' in api_keys_file, or use "
                                            "[gateway] api_key)")
            request[TENANT] = tenant
        return await handler(request)

    return check_key


def tenant_name(request: web.Request) -> str:
    """The name of the tenant whose key the request carried; "" on a server without keys."""
    tenant = request.get(TENANT)
    return tenant.name if tenant is not None else ""


def _match(token: bytes, tenants: list[tuple[bytes, Tenant]]) -> Tenant | None:
    # Every key is compared, each with compare_digest, so the time taken does not tell which key
    # (or which byte of it) was close.
    found = None
    for key, tenant in tenants:
        if hmac.compare_digest(token, key):
            found = tenant
    return found
