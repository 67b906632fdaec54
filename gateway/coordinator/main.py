"""`reame-coordinator` (also `reame coordinator`): the tuning coordinator for several gateways.

    reame-coordinator [--config FILE] [--endpoint tcp://HOST:PORT] [--adaptive on|off]

It binds `[tuning] coordinator` (or --endpoint); each gateway whose reame.conf names the same
endpoint forwards its workers' profiles and relays the strategies decided here. The strategy is
saved under `[tuning] state_path` and resumed at start. SIGTERM or Ctrl-C saves it and exits; the
workers keep the knobs they run.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from shared.command_line import run_process
from shared.config import Config, adaptive_flag, add_adaptive_flag, load_config, override
from shared.zmq_keys import is_tcp
from shared.logs import setup_logging

log = logging.getLogger("reame.coordinator")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", help="ZeroMQ endpoint to bind ([tuning] coordinator), e.g. tcp://0.0.0.0:5560")
    add_adaptive_flag(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reame-coordinator",
                                     description="Reame's tuning coordinator, shared by several gateways.")
    parser.add_argument("--config", help="reame.conf to read (default: ./reame.conf or $REAME_CONFIG)")
    add_arguments(parser)
    return parser


def configure(args: argparse.Namespace) -> Config:
    config = load_config(args.config)
    return override(config, "tuning", coordinator=args.endpoint, adaptive=adaptive_flag(args.adaptive))


async def serve(config: Config) -> None:
    from gateway.coordinator.server import CoordinatorServer

    server = CoordinatorServer(config)
    if is_tcp(config.tuning.coordinator) and not config.tuning.curve_coordinator_key:
        log.warning("coordinator: %s without CURVE (insecure_tcp = true): whoever reaches it may change every "
                    "worker's strategy", config.tuning.coordinator)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("coordinator: stopping; the strategy is saved and the workers keep their knobs")
    finally:
        await server.close()


def run(args: argparse.Namespace) -> int:
    """Shared by reame-coordinator and `reame coordinator`."""
    config = configure(args)
    setup_logging(config.logging.level, "coordinator")
    asyncio.run(serve(config))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_process("reame-coordinator", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
