"""`reame-gateway`: the OpenAI-compatible HTTP server in front of the workers.

    reame-gateway [--config FILE] [--host H] [--port P] [--model PATH|NAME] [--api-key K] [--state-dir DIR]
                  [--adaptive on|off]

The API key may also come from $REAME_API_KEY (so that it need not appear in `ps`). SIGTERM or
Ctrl-C stops accepting connections, lets requests under way finish (up to `drain_timeout`),
then exits.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from shared.command_line import add_common_flags, load_with_common_flags, run_process
from shared.config import Config, is_loopback, override
from shared.zmq_keys import (check_coordinator_transport, check_transport, coordinator_client_keys, insecure_endpoints,
                             server_keys)
from shared.errors import ConfigError
from shared.logs import setup_logging

log = logging.getLogger("reame.gateway")

LINGER_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reame-gateway", description="Reame's OpenAI-compatible HTTP gateway.")
    add_common_flags(parser)
    parser.add_argument("--host", help="address to listen on ([gateway] host)")
    parser.add_argument("--port", type=int, help="port to listen on ([gateway] port)")
    parser.add_argument("--model-id", help="the name clients use for the model ([model] model_id)")
    parser.add_argument("--api-key", help="require this bearer token ([gateway] api_key; or $REAME_API_KEY)")
    return parser


def configure(args: argparse.Namespace) -> Config:
    """reame.conf, then $REAME_API_KEY, then flags."""
    config = load_with_common_flags(args)
    config = override(config, "model", model_id=args.model_id)
    config = override(config, "gateway", host=args.host, port=args.port,
                      api_key=args.api_key or os.environ.get("REAME_API_KEY") or None)
    check_exposure(config)
    return config


def check_exposure(config: Config) -> list[str]:
    """Refuse a non-loopback HTTP address unless `allow_remote` is set; return the warnings to log
    about what is reachable from other machines (`reame serve` checks before starting anything)."""
    host = config.gateway.host
    warnings = []
    if not is_loopback(host):
        if not config.gateway.allow_remote:
            raise ConfigError(f"[gateway] host = {host} is reachable from other machines; set [gateway] "
                              "allow_remote = true to listen there, or use 127.0.0.1")
        if not config.gateway.authenticated:
            warnings.append(f"listening on {host} without an api_key: anyone who can reach port "
                            f"{config.gateway.port} may use this server (set [gateway] api_key or $REAME_API_KEY)")
    check_transport(config)
    server_keys(config)  # the key files are checked before the model loads
    check_coordinator_transport(config)
    coordinator_client_keys(config)
    return warnings + insecure_endpoints(config)  # what insecure_tcp allowed


def model_path(config: Config) -> Path:
    from shared.model_store import resolve_model

    path = resolve_model(config.model_reference(), config.resolve_path(config.model.models_dir))
    if not path.is_file():
        raise ConfigError(f"model file not found: {path} (fetch it with `reame models pull`)")
    return path


async def serve(config: Config, path: Path) -> None:
    from gateway.app import build_app
    from gateway.state import load_state

    if config.endpoint.startswith("ipc://"):
        Path(config.endpoint[len("ipc://"):]).parent.mkdir(parents=True, exist_ok=True)
    for warning in check_exposure(config):
        log.warning("gateway: %s", warning)
    state = load_state(config, path)
    # Slow clients: keepalive_timeout also bounds how long a new connection may take to send its
    # headers (aiohttp starts that timer on connect), and the body has its own deadline in routes.
    # After an answer to a body we did not read (401, 408, 413), aiohttp keeps reading ("lingers")
    # so the client sees the answer rather than a reset; 2 s, not its 10, so a trickling client
    # is let go soon.
    runner = web.AppRunner(build_app(state), access_log=None, handler_cancellation=True,
                           shutdown_timeout=config.worker.drain_timeout,
                           keepalive_timeout=config.gateway.read_timeout, lingering_time=LINGER_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.gateway.host, config.gateway.port)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {config.gateway.host}:{config.gateway.port}: {exc.strerror}") from None
        log.info("gateway: serving %s (%s) on http://%s:%d/v1", config.model.model_id, path.name,
                 config.gateway.host, config.gateway.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("gateway: stopping; letting requests under way finish")
    finally:
        await runner.cleanup()
        state.prompts.close()   # its tokenizing processes


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def start() -> None:
        config = configure(args)
        setup_logging(config.logging.level, "gateway")
        asyncio.run(serve(config, model_path(config)))

    return run_process("reame-gateway", start)


if __name__ == "__main__":
    sys.exit(main())
