"""`reame strategy export FILE` and `reame strategy import FILE`: pin a known-good tuning strategy.
`reame strategy show`: the strategy this deployment saved (what a restart resumes), read from its
tuning directory: its age, whether it is frozen and since when, and what it pins.

Both talk to a running gateway's /admin/strategy (the URL from reame.conf's [gateway] host and
port, or --url; the API key from --api-key, $REAME_API_KEY or reame.conf). An imported strategy
is frozen, so nothing learns it away; `POST /admin/strategy/unfreeze` lets learning resume from it.
"""
from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

from reame.commands.actions import add_actions
from shared.config import load_config
from shared.errors import ConfigError, ReameError

TIMEOUT_S = 10.0


def add_parser(sub) -> None:
    actions = add_actions(sub, "strategy", help="export or import the tuning strategy of a running server",
                          description="Save the scheduler knobs the tuning coordinator chose, or pin saved ones.")
    show = actions.add_parser("show", help="print the strategy this deployment saved (what a restart resumes)")
    show.set_defaults(handler=_show)
    for name, handler, help_text in (("export", _export, "write the running strategy to FILE (JSON)"),
                                     ("import", _import, "pin the strategy in FILE (frozen)")):
        action = actions.add_parser(name, help=help_text)
        action.add_argument("file", metavar="FILE")
        action.add_argument("--url", help="the gateway (default: http://[gateway] host:port from reame.conf)")
        action.add_argument("--api-key", help="the gateway's API key (default: $REAME_API_KEY, then reame.conf)")
        action.set_defaults(handler=handler)


def _show(args: argparse.Namespace) -> int:
    from gateway.coordinator.store import StrategyStore, describe, legacy_strategy
    store = StrategyStore(load_config(args.config).tuning_path)
    doc = store.load()
    if doc is None:
        print(f"no saved strategy in {store.path.parent} (workers start on reame.conf's knobs)")
    else:
        print(store.path)
        print("\n".join(describe(doc)))
    old = legacy_strategy(store.path.parent)
    if old is not None:
        print(f"ignored: {old} (an older Reame's per-user strategy; this deployment never reads it)")
    return 0


def _export(args: argparse.Namespace) -> int:
    doc = _call(args, "GET", None)
    Path(args.file).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"strategy v{doc.get('version', 0)} ({len(doc.get('workers', {}))} workers"
          f"{', frozen' if doc.get('frozen') else ''}) written to {args.file}")
    return 0


def _import(args: argparse.Namespace) -> int:
    try:
        body = Path(args.file).read_bytes()
        json.loads(body)
    except OSError as exc:
        raise ConfigError(f"{args.file}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{args.file} is not JSON: {exc}") from None
    doc = _call(args, "POST", body)
    print(f"strategy v{doc.get('version', 0)} in force{' (frozen)' if doc.get('frozen') else ''}")
    return 0


def _call(args: argparse.Namespace, method: str, body: bytes | None) -> dict:
    config = load_config(args.config)
    url = (args.url or f"http://{config.gateway.host}:{config.gateway.port}").rstrip("/") + "/admin/strategy"
    key = args.api_key or os.environ.get("REAME_API_KEY") or config.gateway.api_key
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise ReameError(f"{url}: {exc.code} {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ReameError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None

