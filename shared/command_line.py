"""What the command lines of Reame's processes share: the flags that name the config, the model
and the runtime directory, and how a start-up error ends the process."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from shared.config import Config, adaptive_flag, add_adaptive_flag, load_config, model_flag, override
from shared.errors import ReameError


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """--config, --model, --state-dir and --adaptive, the same on reame-gateway and reame-worker."""
    parser.add_argument("--config", help="reame.conf to read (default: ./reame.conf or $REAME_CONFIG)")
    parser.add_argument("--model", help="GGUF path or known model name ([model] model_path)")
    parser.add_argument("--state-dir", help="runtime directory for the worker socket ([server] state_dir)")
    add_adaptive_flag(parser)


def load_with_common_flags(args: argparse.Namespace) -> Config:
    """reame.conf with the common flags applied (paths taken relative to the current directory)."""
    config = load_config(args.config)
    config = override(config, "model", model_path=model_flag(args.model))
    state_dir = str(Path(args.state_dir).expanduser().resolve()) if args.state_dir else None
    config = override(config, "server", state_dir=state_dir)
    return override(config, "tuning", adaptive=adaptive_flag(args.adaptive))


def run_process(prog: str, body: Callable[[], int | None]) -> int:
    """A process's exit status: body's (None: 0); a ReameError (a bad key, a missing model) is
    one line on stderr and status 1, never a traceback; Ctrl-C is 130."""
    try:
        return int(body() or 0)
    except ReameError as exc:
        print(f"{prog}: error: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
