"""Worker memory benchmark (issue 35.4): the resident memory of a worker serving a model with the
default context, beside what it must hold — the GGUF file and the KV pool.

    python bench/memory.py [--model qwen2.5-coder-1.5b] [--threads 2] [--max-tokens 64]

Starts `reame serve` with one worker on the model (every other setting at reame.conf's default),
reads the worker process's RSS (and its anonymous / file-backed split) once it is ready and again
after one chat request, and prints them beside file size + KV pool size (the pool's size from the
worker's own "KV cache: ..." log line) with the ratio. The issue's bound is
RSS <= (file + KV pool) x 1.15. The KV pool's pages are committed only as blocks are written, so a
short request touches little of it; "weights" compares RSS less the touched KV with the file alone.
Not a test: other work on a shared host hardly moves RSS, but numbers differ between hosts.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

import psutil

from benchlib import say  # bench/, the script's directory, is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.harness import free_port, reame_serve, write_config  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()
MB = 1e6
BOUND = 1.15


def worker_memory(serve_pid: int) -> dict[str, int]:
    """RSS, anonymous and file-backed resident bytes of the (only) worker under `reame serve`."""
    workers = [p for p in psutil.Process(serve_pid).children(recursive=True)
               if "worker.main" in " ".join(p.cmdline())]
    if len(workers) != 1:
        raise SystemExit(f"expected one worker process, found {len(workers)}")
    status = Path(f"/proc/{workers[0].pid}/status").read_text()
    fields = dict(re.findall(r"^(VmRSS|RssAnon|RssFile|RssShmem):\s+(\d+) kB", status, re.M))
    return {key: int(value) * 1024 for key, value in fields.items()}


def kv_pool_bytes(log: str) -> int:
    """The KV pool's size from the worker's load log ("KV cache: ... 1024 MiB (...)"), plus the
    window pool's when there is one."""
    main = re.findall(r"KV cache: .*?, (\d+) MiB", log)
    if not main:
        raise SystemExit("the worker's log names no KV cache size (is [logging] level above info?)")
    window = re.findall(r"KV window pool: .*?, (\d+) MiB", log)
    return (int(main[-1]) + (int(window[-1]) if window else 0)) * 2**20


def chat(url: str, max_tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": "Write a Python function that reverses a linked list."}],
            "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return int(json.loads(response.read())["usage"]["completion_tokens"])


def row(label: str, mem: dict[str, int], file_bytes: int, kv_bytes: int) -> str:
    rss = mem["VmRSS"]
    return (f"{label:<14} {rss / MB:>8.0f} {mem.get('RssAnon', 0) / MB:>8.0f} {mem.get('RssFile', 0) / MB:>8.0f} "
            f"{(file_bytes + kv_bytes) / MB:>10.0f} {rss / (file_bytes + kv_bytes):>8.2f} "
            f"{rss / file_bytes:>9.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from shared.model_store import ensure_model
    path = ensure_model(args.model, MODELS_DIR, progress=say)
    file_bytes = path.stat().st_size
    with tempfile.TemporaryDirectory(prefix="reame-memory-") as tmp:
        port = free_port()
        config = write_config(Path(tmp), path, port, {"engine": {"threads": args.threads},
                                                      "serve": {"workers": 1}, "logging": {"level": "info"}})
        with reame_serve("reame serve", Path(tmp), config, port, progress=say) as server:
            serve_pid = server.processes[0].popen.pid
            loaded = worker_memory(serve_pid)
            tokens = chat(server.url, args.max_tokens)
            served = worker_memory(serve_pid)
            kv_bytes = kv_pool_bytes(server.log("serve"))
            packed = re.findall(r"packed weights .*", server.log("serve"))

    print(f"\n{path.name}: file {file_bytes / MB:.0f} MB, KV pool {kv_bytes / MB:.0f} MB "
          f"(reame.conf defaults), one worker, {args.threads} threads")
    if packed:
        print(packed[-1])
    header = (f"{'worker':<14} {'RSS MB':>8} {'anon MB':>8} {'file MB':>8} {'file+KV MB':>10} "
              f"{'RSS/(f+KV)':>8} {'RSS/file':>9}")
    print(header)
    print("-" * len(header))
    print(row("after load", loaded, file_bytes, kv_bytes))
    print(row(f"after {tokens} tok", served, file_bytes, kv_bytes))
    ratio = served["VmRSS"] / (file_bytes + kv_bytes)
    verdict = "holds" if ratio <= BOUND else "does not hold"
    print(f"bound RSS <= (file + KV pool) x {BOUND}: {ratio:.2f} -> {verdict}; weights alone (RSS after load "
          f"/ file): {loaded['VmRSS'] / file_bytes:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
