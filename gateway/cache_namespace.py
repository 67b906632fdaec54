"""Whose cached prefixes a request may reuse: `[prefix_cache] isolation`, the caller's API key and
the request's `cache_salt`, turned into the namespace that roots its block-hash chain.

Without isolation, `cached_tokens`, `/v1/warm`'s `reused_tokens` and the time to first token
tell a caller whether anyone else sent the same prefix (even before a restart, through the host
store). A namespace makes other callers' blocks unfindable, so there is nothing to time:
  none     one namespace for everyone, unless a request sends a `cache_salt`;
  key      one per API key (`api_key` / `api_keys_file`), split further by `cache_salt`;
  request  a request reuses only blocks of requests that sent its `cache_salt` under its key;
           without a salt it reuses nothing and leaves nothing for others.
The workers see only a digest: never the key or the salt.
"""
from __future__ import annotations

import hashlib
import os

from aiohttp import web

from gateway.auth import TENANT
from shared.errors import ConfigError

ISOLATION_MODES = ("none", "key", "request")


def check_isolation(mode: str, has_keys: bool) -> None:
    if mode not in ISOLATION_MODES:
        raise ConfigError(f"[prefix_cache] isolation = {mode!r}; expected one of {', '.join(ISOLATION_MODES)}")
    if mode != "none" and not has_keys:
        raise ConfigError(f"[prefix_cache] isolation = {mode} tells callers apart by API key: set [gateway] "
                          "api_key or api_keys_file")


def cache_namespace(mode: str, key_digest: bytes | None, salt: str | None) -> bytes:
    """32 bytes naming the namespace, or b"" for the shared one."""
    parts = []
    if mode != "none" and key_digest is not None:
        parts.append(b"key:" + key_digest)
    if salt:
        parts.append(b"salt:" + salt.encode())
    elif mode == "request":
        parts.append(b"alone:" + os.urandom(16))
    if not parts:
        return b""
    return hashlib.sha256(b"\n".join(parts)).digest()


def request_namespace(mode: str, request: web.Request, salt: str | None) -> bytes:
    tenant = request.get(TENANT)
    return cache_namespace(mode, tenant.key_digest if tenant is not None else None, salt)
