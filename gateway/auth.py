"""Bearer-token authentication, when `api_key` or `api_keys_file` is set. `/health` stays open for
load balancers and `/openapi.json` for client generators; every other route, /v1/* and any
/admin/* included, needs a key.

Each key names a tenant: the prefix cache can be isolated per tenant (gateway.cache_namespace)
and the worker queue shares its slots fairly between tenants (gateway.workers).
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from gateway.errors import AuthenticationError
from shared.config import Config
from shared.errors import ConfigError

OPEN_PATHS = frozenset({"/health", "/openapi.json", "/dashboard"})  # /dashboard: a page without data


@dataclass(frozen=True)
class Tenant:
    name: str  # for logs and fair queueing; never the key itself
    key_digest: bytes  # SHA-256 of the key: what isolates its cached prefixes


# The Tenant whose key a request carried (typed request storage: aiohttp 3.14).
TENANT = web.RequestKey("tenant", Tenant)


def load_tenants(config: Config) -> list[tuple[bytes, Tenant]]:
    """(key, tenant) for `[gateway] api_key` (tenant "default") and every line of `api_keys_file`.

    The file holds one key per line, optionally after a name (`NAME KEY`); blank lines and lines
    starting with # are skipped. Without a name, a key is called `key<line number>`.
    """
    keys: list[tuple[bytes, Tenant]] = []
    if config.gateway.api_key:
        keys.append(_tenant("default", config.gateway.api_key))
    if config.gateway.api_keys_file:
        path = config.resolve_path(config.gateway.api_keys_file)
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
        if len(fields) > 2:
            raise ConfigError(f"{path}:{number}: expected 'KEY' or 'NAME KEY', got {len(fields)} fields")
        name, key = (fields[0], fields[1]) if len(fields) == 2 else (f"key{number}", fields[0])
        keys.append(_tenant(name, key))
    return keys


def _tenant(name: str, key: str) -> tuple[bytes, Tenant]:
    return key.encode(), Tenant(name, hashlib.sha256(key.encode()).digest())


def auth_middleware(tenants: list[tuple[bytes, Tenant]]):
    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if not header:
                raise AuthenticationError("Missing API key: send it as 'Authorization: Bearer <key>'")
            tenant = _match(token.strip().encode(), tenants) if scheme.lower() == "bearer" else None
            if tenant is None:
                raise AuthenticationError("Incorrect API key provided")
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
