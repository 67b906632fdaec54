"""ZeroMQ CURVE between the gateway and its workers: key files, and what each side needs of them.

Over `tcp://` the workers' socket is open to whoever reaches the port: a stranger could register
as a worker and be sent prompts. With CURVE every connection is encrypted, the gateway proves it
holds its secret key, and a worker is let in only if its public key is in the gateway's directory
of authorized keys (checked by gateway.worker_auth at each handshake).

Keys are ZeroMQ certificate files (`reame keys generate` writes them): NAME.key holds the public
key, NAME.key_secret both. reame.conf's [server] names them:
  curve_gateway_key      the gateway's: its .key_secret on the gateway's host, .key on workers' hosts
  curve_worker_key       this host's workers' .key_secret
  curve_authorized_keys  the gateway's directory of the workers' .key files
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from shared.config import Config, is_loopback
from shared.errors import ConfigError
from shared.private_state import check_secret_file

log = logging.getLogger("reame.curve")

ZAP_DOMAIN = "reame"  # the ZAP domain of the workers' socket


@dataclass(frozen=True)
class ServerKeys:
    """What the gateway needs: its key pair and the directory of authorized worker keys."""
    public: bytes
    secret: bytes
    authorized_dir: Path


@dataclass(frozen=True)
class ClientKeys:
    """What a worker needs: the gateway's public key (to know it talks to the gateway) and its own pair."""
    server_public: bytes
    public: bytes
    secret: bytes


def generate(directory: Path, name: str, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write NAME.key (public) and NAME.key_secret (readable by the owner only); their paths."""
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"key name {name!r}: give a plain file name such as 'gateway' or 'worker-host2'")
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    existing = [str(p) for p in (public, secret) if p.exists()]
    if existing and not overwrite:
        raise ConfigError(f"{', '.join(existing)} already exist (a worker or gateway may be using them); "
                          "pass --force to replace them")
    directory.mkdir(parents=True, exist_ok=True)
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        for path in (public, secret):
            path.unlink(missing_ok=True)
        zmq.auth.create_certificates(str(directory), name)
    finally:
        os.umask(old_umask)
    public.chmod(0o644)
    return public, secret


def load_key(path: Path, *, need_secret: bool, what: str) -> tuple[bytes, bytes | None]:
    """(public, secret) from a certificate file; ConfigError naming the setting when unusable."""
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} = {path}: cannot read a ZeroMQ key from it ({exc})") from None
    if need_secret and not secret:
        raise ConfigError(f"{what} = {path} holds no secret key: name the .key_secret file here")
    if need_secret:  # one an older version (or a loose umask) left readable by others
        check_secret_file(path, what, log)
    return public, secret


def authorized_keys(directory: Path) -> dict[bytes, str]:
    """The public keys of the .key files in `directory` → their file names."""
    keys = {}
    for path in sorted(directory.glob("*.key")):
        try:
            public, _ = zmq.auth.load_certificate(str(path))
        except (OSError, ValueError):
            continue  # gateway.worker_auth reports the unreadable files
        keys[public] = path.name
    return keys


def enabled(config: Config) -> bool:
    return bool(config.server.curve_gateway_key)


def server_keys(config: Config) -> ServerKeys | None:
    """The gateway's CURVE keys, or None when CURVE is off."""
    if not enabled(config):
        return None
    return _server_keys(config, "server", "curve_gateway_key", "curve_authorized_keys", "workers")


def client_keys(config: Config) -> ClientKeys | None:
    """A worker's CURVE keys, or None when CURVE is off."""
    if not enabled(config):
        return None
    server = config.server
    return _client_keys(config, "[server] curve_gateway_key", server.curve_gateway_key,
                        "[server] curve_worker_key", server.curve_worker_key,
                        "curve_worker_key is not: name this host's worker key (.key_secret, from "
                        "`reame keys generate`)")


def coordinator_server_keys(config: Config) -> ServerKeys | None:
    """A standalone coordinator's CURVE keys ([tuning] curve_coordinator_key), or None when off."""
    if not config.tuning.curve_coordinator_key:
        return None
    return _server_keys(config, "tuning", "curve_coordinator_key", "curve_authorized_gateways", "gateways")


def _server_keys(config: Config, section: str, key: str, authorized: str, peers: str) -> ServerKeys:
    """The key pair named by [section] key and the directory of the peers' public keys named by
    [section] authorized; ConfigError naming the setting that is missing or unusable."""
    settings = getattr(config, section)
    public, secret = load_key(config.resolve_path(getattr(settings, key)), need_secret=True,
                              what=f"[{section}] {key}")
    if not getattr(settings, authorized):
        raise ConfigError(f"[{section}] {key} is set but {authorized} is not: name the directory of the "
                          f"{peers}' public keys (.key files)")
    directory = config.resolve_path(getattr(settings, authorized))
    if not directory.is_dir():
        raise ConfigError(f"[{section}] {authorized} = {directory}: not a directory")
    return ServerKeys(public, secret, directory)


def coordinator_client_keys(config: Config) -> ClientKeys | None:
    """What a gateway needs to reach a CURVE coordinator: its public key, and the gateway's own
    pair ([server] curve_gateway_key, the one its workers know); None when off."""
    if not config.tuning.curve_coordinator_key:
        return None
    return _client_keys(config, "[tuning] curve_coordinator_key", config.tuning.curve_coordinator_key,
                        "[server] curve_gateway_key", config.server.curve_gateway_key,
                        "[server] curve_gateway_key is not: the gateway authenticates to the coordinator with its "
                        "own key pair (`reame keys generate`)")


def _client_keys(config: Config, server_what: str, server_path: str, own_what: str, own_path: str,
                 missing: str) -> ClientKeys:
    """The server's public key (server_path) and this side's pair (own_path), each named by its
    setting in errors; `missing` ends the error when own_path is not set."""
    server_public, _ = load_key(config.resolve_path(server_path), need_secret=False, what=server_what)
    if not own_path:
        raise ConfigError(f"{server_what} is set but {missing}")
    public, secret = load_key(config.resolve_path(own_path), need_secret=True, what=own_what)
    return ClientKeys(server_public, public, secret)


def check_coordinator_transport(config: Config) -> None:
    """As check_transport, for [tuning] coordinator: strategies and the operator's calls (freeze,
    import) would otherwise be open to whoever reaches the port (on loopback: any local user)."""
    endpoint = config.tuning.coordinator
    if is_tcp(endpoint) and not config.tuning.curve_coordinator_key and not config.server.insecure_tcp:
        raise ConfigError(f"[tuning] coordinator = {endpoint} {_reachable_by(endpoint)} without authentication: "
                          "set curve_coordinator_key and curve_authorized_gateways (`reame keys generate`), "
                          "use an ipc:// endpoint, or set [server] insecure_tcp = true to accept that")


def secure_server(sock: zmq.Socket, keys: ServerKeys) -> None:
    """Make `sock` a CURVE server whose peers are checked by the ZAP handler (set before bind)."""
    sock.curve_server = True
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    sock.zap_domain = ZAP_DOMAIN.encode()


def secure_clients(context: zmq.Context, keys: ClientKeys) -> None:
    """Every socket `context` makes from now on connects as a CURVE client with these keys."""
    context.curve_serverkey = keys.server_public
    context.curve_publickey = keys.public
    context.curve_secretkey = keys.secret


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def exposed_tcp(endpoint: str) -> bool:
    """A tcp:// endpoint other machines can reach (anything but a loopback address)."""
    if not is_tcp(endpoint):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
    return not is_loopback(host)


def _reachable_by(endpoint: str) -> str:
    # A loopback port is no boundary: every local user (and every container sharing the host's
    # network) can connect to it, where an ipc:// socket is the owner's alone.
    return "is reachable from other machines" if exposed_tcp(endpoint) else "is open to every local user"


def check_transport(config: Config) -> None:
    """Refuse a tcp:// workers' endpoint without CURVE, loopback included, unless reame.conf says
    `insecure_tcp = true`: anyone who reached the port could join as a worker (or take over a
    worker's id) and be sent prompts; beyond loopback, prompts and answers cross the network in
    the clear. An ipc:// endpoint needs none of this: its socket is the owner's alone."""
    if is_tcp(config.endpoint) and not enabled(config) and not config.server.insecure_tcp:
        raise ConfigError(f"[server] endpoint = {config.endpoint} {_reachable_by(config.endpoint)} without "
                          "authentication: set curve_gateway_key, curve_worker_key and curve_authorized_keys "
                          "(`reame keys generate`), use an ipc:// endpoint (the default), or set insecure_tcp = "
                          "true to accept that")


def insecure_endpoints(config: Config) -> list[str]:
    """A warning for each tcp:// endpoint that insecure_tcp lets run without CURVE, for the log."""
    warnings = []
    if is_tcp(config.endpoint) and not enabled(config):
        warnings.append(f"workers connect over {config.endpoint} without CURVE (insecure_tcp = true): whoever "
                        "reaches it may join as a worker, or take over a worker's id, and see prompts; keep it "
                        "on a network (and a host) you trust")
    if is_tcp(config.tuning.coordinator) and not config.tuning.curve_coordinator_key:
        warnings.append(f"the tuning coordinator at {config.tuning.coordinator} is reached without CURVE "
                        "(insecure_tcp = true): whoever reaches it may change every worker's strategy")
    return warnings
