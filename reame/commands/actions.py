"""A command made of actions (`reame models pull|list`, `reame keys generate`, `reame strategy
show|export|import`, `reame tune show|reset`): its parser, and the one its actions are added to."""
from __future__ import annotations

import argparse


def add_actions(sub, name: str, *, help: str, description: str) -> argparse._SubParsersAction:
    """Register command `name` under `sub`; one of the actions added to the result must be named."""
    parser = sub.add_parser(name, help=help, description=description)
    return parser.add_subparsers(dest="action", metavar="ACTION", required=True)
