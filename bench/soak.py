"""Soak: N streaming clients against a `reame serve` for a fixed time; nothing lost, memory flat.

    python bench/soak.py [--model smollm2-135m] [--clients 16] [--duration 1800] [--sample 60]
                         [--workers 0] [--warmup 120] [--json FILE]

Starts `reame serve` on loopback (a fresh port, state and key, in a temporary directory), then
runs the clients, each a thread with the official `openai` client that streams one request after
another from a mix of chat and completion prompts, short and long, greedy and sampled. Every
`--sample` seconds it records the RSS of each process of the server (serve, gateway, workers) and
the requests finished since the last sample. At the end the clients finish their current request,
the server is stopped, and a table is printed.

Passes (exit 0) when no request was lost (every one ended with a finish_reason; an error of any
kind counts as lost), each process's RSS at the end is within 10% + 32 MB of its RSS at the end
of the warm-up, and the server's log has no traceback and no child that exited (a crashed worker
would be restarted quietly otherwise). tests/e2e/test_soak.py runs a short version.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai
import psutil

from benchlib import percentile  # bench/, the script's directory, is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.harness import Server, free_port, reame_serve, write_config  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()
RSS_SLACK = (0.10, 32 << 20)  # allowed growth after warm-up: fraction, plus bytes

STORY = ("The lighthouse keeper climbed the stairs every evening, counting the steps as his father had, "
         "and at the top he wound the clockwork that turned the lamp. ") * 12
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Summarise this story:\n" + STORY}],
    [{"role": "user", "content": "Write a haiku about autumn."},
     {"role": "assistant", "content": "Red leaves drift and fall"},
     {"role": "user", "content": "Another one, about winter."}],
]
PROMPTS = ["Once upon a time", "def fibonacci(n):", STORY, "The three primary colours are"]


@dataclass
class Outcome:
    finished: float  # seconds since the start of the soak
    ok: bool
    ttft: float  # seconds to the first token (or to the failure)
    total: float
    tokens: int
    error: str = ""


@dataclass
class Sample:
    at: float
    rss: dict[str, int]  # process label -> bytes


@dataclass
class Report:
    clients: int
    duration: float
    requests: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    ttft_p50: float = 0.0
    ttft_p95: float = 0.0
    latency_p50: float = 0.0
    latency_p95: float = 0.0
    latency_p99: float = 0.0
    tokens_per_s: float = 0.0
    rss_start: dict[str, int] = field(default_factory=dict)  # at the end of the warm-up
    rss_end: dict[str, int] = field(default_factory=dict)
    rss_flat: bool = True
    server_problems: int = 0  # tracebacks and child exits in the server's log
    passed: bool = False


# ---- the server ---------------------------------------------------------------------------------


def start_server(directory: Path, model: Path, workers: int, clients: int, key: str) -> Server:
    port = free_port()
    # The queue holds every client's request, so a client waits rather than being refused (429).
    config = write_config(directory, model, port, {"gateway": {"api_key": key, "max_queue": 4 * clients},
                                                   "serve": {"workers": workers}})
    return reame_serve("reame serve", directory, config, port, workers=max(workers, 1))


def rss_by_process(root: int) -> dict[str, int]:
    """RSS of `reame serve` and each of its children, labelled by role and pid."""
    out = {}
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for proc in procs:
        try:
            cmd = " ".join(proc.cmdline())
            role = "gateway" if "gateway.main" in cmd else "worker" if "worker.main" in cmd else "serve"
            out[f"{role}/{proc.pid}"] = proc.memory_info().rss
        except psutil.Error:
            continue  # exited between listing and reading
    return out


# ---- the clients --------------------------------------------------------------------------------

def one_request(client: openai.OpenAI, rng: random.Random) -> tuple[bool, float, int, str]:
    """One streamed request from the mix: (finished properly, seconds to the first token, tokens, error)."""
    started = time.perf_counter()
    ttft = None
    tokens = 0
    reason = None
    sampled = rng.random() < 0.5
    common = dict(model="reame", max_tokens=rng.randint(8, 64), stream=True,
                  temperature=0.8 if sampled else 0.0, seed=rng.randrange(1 << 30) if sampled else None)
    try:
        if rng.random() < 0.6:
            stream = client.chat.completions.create(messages=rng.choice(CHATS), **common)
        else:
            stream = client.completions.create(prompt=rng.choice(PROMPTS), **common)
        for chunk in stream:
            for choice in chunk.choices:
                text = choice.delta.content if hasattr(choice, "delta") else choice.text
                if text:
                    tokens += 1  # chunks with text: about one token each
                    if ttft is None:
                        ttft = time.perf_counter() - started
                reason = choice.finish_reason or reason
    except openai.APIError as exc:
        return False, ttft or 0.0, tokens, type(exc).__name__
    if reason is None:
        return False, ttft or 0.0, tokens, "no finish_reason"
    return True, ttft if ttft is not None else time.perf_counter() - started, tokens, ""


def client_loop(url: str, key: str, seed: int, stop: threading.Event, t0: float, outcomes: list[Outcome],
                lock: threading.Lock) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)
    rng = random.Random(seed)
    while not stop.is_set():
        started = time.perf_counter()
        ok, ttft, tokens, error = one_request(client, rng)
        outcome = Outcome(time.monotonic() - t0, ok, ttft, time.perf_counter() - started, tokens, error)
        with lock:
            outcomes.append(outcome)


# ---- the run ------------------------------------------------------------------------------------

def soak(model: Path, clients: int, duration: float, sample_every: float, warmup: float, workers: int) -> tuple[
        Report, list[Sample], list[Outcome]]:
    key = secrets.token_hex(8)
    with tempfile.TemporaryDirectory(prefix="reame-soak-") as tmp:
        server = start_server(Path(tmp), model, workers, clients, key)
        url, serve_pid = server.url, server.processes[0].pid
        try:
            outcomes: list[Outcome] = []
            samples: list[Sample] = []
            lock = threading.Lock()
            stop = threading.Event()
            t0 = time.monotonic()
            threads = [threading.Thread(target=client_loop, args=(url, key, i, stop, t0, outcomes, lock), daemon=True)
                       for i in range(clients)]
            for t in threads:
                t.start()
            samples.append(Sample(0.0, rss_by_process(serve_pid)))
            while (now := time.monotonic() - t0) < duration:
                time.sleep(min(sample_every, duration - now))
                samples.append(Sample(time.monotonic() - t0, rss_by_process(serve_pid)))
            stop.set()  # each client finishes the request it has under way
            for t in threads:
                t.join(600)
        finally:
            server.stop()
        log = server.log("serve")
    report = summarise(clients, duration, warmup, samples, outcomes)
    report.server_problems = log.count("Traceback") + log.count(" exited (")
    report.passed = report.passed and report.server_problems == 0
    return report, samples, outcomes


def summarise(clients: int, duration: float, warmup: float, samples: list[Sample], outcomes: list[Outcome]) -> Report:
    report = Report(clients, duration, requests=len(outcomes))
    for o in outcomes:
        if not o.ok:
            report.errors += 1
            report.error_kinds[o.error] = report.error_kinds.get(o.error, 0) + 1
    ok = [o for o in outcomes if o.ok]
    report.ttft_p50 = percentile([o.ttft for o in ok], 0.50, empty=0.0)
    report.ttft_p95 = percentile([o.ttft for o in ok], 0.95, empty=0.0)
    report.latency_p50 = percentile([o.total for o in ok], 0.50, empty=0.0)
    report.latency_p95 = percentile([o.total for o in ok], 0.95, empty=0.0)
    report.latency_p99 = percentile([o.total for o in ok], 0.99, empty=0.0)
    report.tokens_per_s = sum(o.tokens for o in ok) / max(duration, 1e-9)
    warm = next((s for s in samples if s.at >= warmup), samples[-1])
    report.rss_start, report.rss_end = warm.rss, samples[-1].rss
    fraction, extra = RSS_SLACK
    # A process that was restarted has a new label, so a crash shows as a missing one, not as growth.
    report.rss_flat = all(report.rss_end.get(name, 0) <= rss * (1 + fraction) + extra
                          for name, rss in report.rss_start.items())
    report.passed = report.requests > 0 and report.errors == 0 and report.rss_flat
    return report


def print_table(report: Report, samples: list[Sample], outcomes: list[Outcome]) -> None:
    names = sorted({name for s in samples for name in s.rss})
    print(f"\nsoak: {report.clients} clients for {report.duration:.0f} s")
    print(f"{'t (s)':>7} {'done':>6} {'errors':>6} {'p95 s':>7}  " + "  ".join(f"{n:>16}" for n in names))
    previous = 0.0
    for s in samples:
        window = [o for o in outcomes if previous < o.finished <= s.at]
        lat = percentile([o.total for o in window if o.ok], 0.95, empty=0.0)
        cells = "  ".join(f"{s.rss[n] / 2**20:>13.0f} MB" if n in s.rss else f"{'-':>16}" for n in names)
        print(f"{s.at:>7.0f} {len(window):>6} {sum(not o.ok for o in window):>6} {lat:>7.2f}  {cells}")
        previous = s.at
    print(f"\nrequests {report.requests}, errors {report.errors} {report.error_kinds or ''}")
    print(f"latency p50 {report.latency_p50:.2f} s, p95 {report.latency_p95:.2f} s, p99 {report.latency_p99:.2f} s; "
          f"time to first token p50 {report.ttft_p50:.2f} s, p95 {report.ttft_p95:.2f} s; "
          f"{report.tokens_per_s:.1f} tokens/s in all")
    slowest = sorted((o for o in outcomes if o.ok), key=lambda o: o.total)[-3:]
    print("slowest: " + ", ".join(f"{o.total:.1f} s (first token {o.ttft:.1f} s, {o.tokens} tokens, done at "
                                  f"{o.finished:.0f} s)" for o in reversed(slowest)))
    for name in sorted(report.rss_start):
        end = report.rss_end.get(name)
        end_text = f"{end / 2**20:.0f} MB" if end is not None else "gone"
        print(f"RSS {name}: {report.rss_start[name] / 2**20:.0f} MB after warm-up -> {end_text} at the end")
    if report.server_problems:
        print(f"the server's log has {report.server_problems} tracebacks or child exits")
    print("PASS" if report.passed else "FAIL: " + ("requests lost" if report.errors else "RSS grew" if not
                                                   report.rss_flat else "server problems"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="GGUF path or known model name")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=1800, help="seconds")
    parser.add_argument("--sample", type=float, default=60, help="seconds between RSS samples")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds (default: a tenth of the run, at least one sample)")
    parser.add_argument("--workers", type=int, default=0, help="0 = one per NUMA node")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    from shared.model_store import ensure_model

    model = Path(args.model) if args.model.endswith(".gguf") else ensure_model(args.model, MODELS_DIR)
    warmup = args.warmup if args.warmup is not None else max(args.sample, args.duration / 10)
    report, samples, outcomes = soak(model, args.clients, args.duration, args.sample, warmup, args.workers)
    print_table(report, samples, outcomes)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=1))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
