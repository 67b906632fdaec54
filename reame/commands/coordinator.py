"""`reame coordinator`: run the tuning coordinator for several gateways (as `reame-coordinator`)."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from gateway.coordinator.main import add_arguments

    parser = sub.add_parser("coordinator", help="run the tuning coordinator shared by several gateways",
                            description="Bind [tuning] coordinator; gateways naming it share one strategy.")
    add_arguments(parser)
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from gateway.coordinator.main import run

    return run(args)
