"""`reame models pull NAME|URL` and `reame models list`: fetch models, show what is on disk."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reame.commands.actions import add_actions
from shared.config import load_config
from shared.model_store import CATALOGUE, ModelStatus, list_models, pull, pull_url
from shared.url_fetch import is_url


def add_parser(sub) -> None:
    actions = add_actions(sub, "models", help="pull or list the known models",
                          description="Download, verify and list the models Reame knows by name.")

    pull_parser = actions.add_parser("pull", help="download, verify and store a known model or a GGUF URL")
    pull_parser.add_argument("name", metavar="NAME|URL",
                             help=f"one of: {', '.join(CATALOGUE)}; or an https:// URL of a .gguf file "
                                  "(a Hugging Face 'resolve' link), resumed if interrupted")
    pull_parser.add_argument("--sha256", metavar="HEX", default=None,
                             help="with a URL: keep the file only if its SHA-256 is this")
    _add_models_dir(pull_parser)
    pull_parser.set_defaults(handler=_pull)

    list_parser = actions.add_parser("list", help="show the known models and whether they are on disk")
    _add_models_dir(list_parser)
    list_parser.set_defaults(handler=_list)


def _add_models_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models-dir", metavar="DIR", default=None,
                        help="where model files live (default: [model] models_dir in reame.conf)")


def _models_dir(args: argparse.Namespace) -> Path:
    if args.models_dir:
        return Path(args.models_dir).expanduser().resolve()
    config = load_config(args.config)
    return config.resolve_path(config.model.models_dir)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _pull(args: argparse.Namespace) -> int:
    if is_url(args.name):
        path = pull_url(args.name, _models_dir(args), args.sha256, progress=_stderr)
    else:
        if args.sha256:
            print("--sha256 is for URLs: a known model's checksum is built in", file=sys.stderr)
            return 2
        path = pull(args.name, _models_dir(args), progress=_stderr)
    print(path)  # stdout carries only the result, so scripts can capture it
    return 0


def _list(args: argparse.Namespace) -> int:
    models_dir = _models_dir(args)
    print(f"models dir: {models_dir}")
    print(format_table(list_models(models_dir)))
    return 0


def format_table(rows: list[ModelStatus]) -> str:
    header = ("NAME", "FILE", "SIZE", "PRESENT", "VERIFIED")
    cells = [header] + [(r.name, r.file, f"{r.size / 1e6:.1f} MB", _yes(r.present), _yes(r.verified)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in cells)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
