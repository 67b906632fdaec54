"""`reame tune show` and `reame tune reset`: the kernel tables workers learned on this host."""
from __future__ import annotations

import argparse
import time

from reame.commands.actions import add_actions
from shared.config import load_config


def add_parser(sub) -> None:
    actions = add_actions(sub, "tune", help="show or clear the learned kernel tables",
                          description="The kernel variant and thread count each worker learned per rows bucket, "
                                      "saved under [tuning] state_path per host, model and Reame version.")
    show = actions.add_parser("show", help="print every saved kernel table")
    show.set_defaults(handler=_show)
    reset = actions.add_parser("reset", help="delete every saved kernel table (workers recalibrate at start)")
    reset.set_defaults(handler=_reset)


def _directory(args: argparse.Namespace):
    from worker.engine.tuning.kernel_table_store import table_directory
    return table_directory(load_config(args.config))


def _show(args: argparse.Namespace) -> int:
    from worker.engine.tuning.kernel_table_store import saved_tables
    directory = _directory(args)
    tables = saved_tables(directory)
    if not tables:
        print(f"no kernel tables under {directory} (workers calibrate at start and save one)")
        return 0
    for path, record in tables:
        print(path)
        if "error" in record:
            print(f"  unreadable: {record['error']}")
            continue
        key = record.get("key", {})
        print(f"  cpu {key.get('cpu')} (flags {key.get('cpu_flags')}), model {str(key.get('model_sha256'))[:16]}, "
              f"reame {key.get('reame')} (engine {key.get('engine_code')}), {key.get('numerics')} activations, "
              f"{key.get('threads')} threads")
        saved = record.get("saved_at")
        if saved:
            print(f"  saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(saved))}")
        print(f"  {'rows':>6}  {'matmul variant':<16} threads")
        for bucket, (variant, threads) in record.get("choices", {}).items():
            print(f"  {bucket:>6}  {variant:<16} {threads}")
    return 0


def _reset(args: argparse.Namespace) -> int:
    from worker.engine.tuning.kernel_table_store import reset_tables
    directory = _directory(args)
    print(f"removed {reset_tables(directory)} kernel table(s) from {directory}")
    return 0
