"""`reame keys generate`: a CURVE key pair for the gateway or a host's workers (shared.zmq_keys).

    reame keys generate --name NAME [--dir DIR] [--force]

Writes DIR/NAME.key (the public key: copy it to the other side) and DIR/NAME.key_secret (both
keys, readable by its owner only: it never leaves this host), and prints the reame.conf lines
that use them.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from reame.commands.actions import add_actions
from shared.zmq_keys import generate


def add_parser(sub) -> None:
    actions = add_actions(sub, "keys", help="CURVE keys for workers on other hosts",
                          description="Key pairs that authenticate the gateway and its workers over tcp://.")
    gen = actions.add_parser("generate", help="write a key pair (NAME.key, NAME.key_secret)")
    gen.add_argument("--name", required=True, help="'gateway', or a name for a host's workers such as 'worker-host2'")
    gen.add_argument("--dir", default=".", help="where to write the files (default: the current directory)")
    gen.add_argument("--force", action="store_true", help="replace existing files of that name")
    gen.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    public, secret = generate(Path(args.dir).expanduser().resolve(), args.name, overwrite=args.force)
    print(f"public key: {public}")
    print(f"secret key: {secret} (mode 600; keep it on this host)")
    if args.name == "gateway":
        print("gateway's reame.conf:  [server] curve_gateway_key = " + str(secret))
        print("                       [server] curve_authorized_keys = DIR  (the workers' .key files)")
        print(f"workers' reame.conf:   [server] curve_gateway_key = {public.name}  (a copy of it)")
    else:
        print("workers' reame.conf:   [server] curve_worker_key = " + str(secret))
        print(f"gateway's host:        copy {public.name} into its curve_authorized_keys directory")
    return 0
