"""`reame`: the umbrella command (models, generate, tokenize, chat, serve, strategy, coordinator,
perplexity).

Each subcommand lives in `reame/commands/<name>.py` with `add_parser(subparsers)` that
registers it and sets `handler`. Errors from Reame become one clear line and exit code 1
(shared.command_line.run_process, as for reame-gateway and reame-worker).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from shared import blas_env
from shared.command_line import run_process

blas_env.prefer_native_blas()  # before anything imports numpy

COMMANDS = ("models", "generate", "tokenize", "chat", "serve", "keys", "strategy", "tune", "coordinator",
            "perplexity")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reame", description="CPU LLM inference server that gets faster as it runs.")
    parser.add_argument("--config", default=None, help="reame.conf to read (default: ./reame.conf or $REAME_CONFIG)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"reame.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_process("reame", lambda: args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
