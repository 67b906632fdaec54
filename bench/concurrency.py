"""Concurrency: aggregate output tok/s, TTFT and ITL at 1, 2, 4 ... concurrent streams, beside llama-server.

    python bench/concurrency.py [--model smollm2-135m] [--threads 2] [--levels 1,2,4,8,16]
                                [--requests-per-stream 2] [--max-tokens 128] [--url URL]
                                [--peer PATH/TO/llama-server] [--json FILE]

Starts `reame serve` on loopback (a fresh port and state directory; or uses `--url`), sends one
warm-up request, then for each level N runs N client streams at once: each sends
`--requests-per-stream` streamed /v1/completions requests one after another. Prompts are fixed
ordinary English (~70 tokens), different for every request of the run (so no prefix cache can
serve one from another); greedy, and the end-of-text tokens are banned (`logit_bias` -100; plus
llama-server's `ignore_eos`) so that every request yields exactly `--max-tokens` tokens.

Per request: TTFT (request sent -> first streamed text), the gaps between successive text chunks
(ITL), and the completion tokens (`usage` of the last chunk, else the chunk count). Per level:
aggregate tok/s = all completion tokens / wall time of the level, TTFT and ITL p50/p95, and the
median per-request decode rate; for a server it started, the CPU its gateway and its workers spent
per completion token (CPU time moves far less than tok/s with a shared host's load).

After the last level it reads the workers' KV pool from /metrics: with no request running, no block
may be held (a leak fails the run when the benchmark started the server itself).

With `--peer`, the same run also starts llama-server on the same GGUF for each level, with N slots
(`-np N`, `-c N x --peer-ctx`) and the same threads, and sends it the identical load right after
Reame's: levels are interleaved so that a change in the machine's load hits both alike.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson
import psutil

from benchlib import percentile, say  # bench/, the script's directory, is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.harness import Server, free_port, health, reame_serve, start_server, write_config  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()

# Prompts are four of these in a per-request order; the first two differ for every request.
SENTENCES = [
    "The bakery on the corner opens at six, and by seven the queue reaches the bus stop.",
    "My grandmother kept every letter she ever received in a tin box under her bed.",
    "The river froze early that winter, so the children skated to school for a month.",
    "A good map tells you not only where things are but also what the maker thought mattered.",
    "The old library smelled of dust and rain, and the floorboards creaked at every step.",
    "She planted tomatoes along the south wall, where the bricks held the warmth of the afternoon.",
    "The train was late again, so the passengers shared sandwiches and stories on the platform.",
    "In the evening the harbour lights came on one by one as the fishing boats returned.",
    "He repaired bicycles in his garage and never charged the neighbours for small jobs.",
    "The museum's newest exhibit explains how people measured time before clocks were common.",
    "Every spring the village holds a fair with music, games and a contest for the largest pumpkin.",
    "The teacher asked the class to describe their favourite place without naming it.",
    "Our neighbour's dog waits by the gate each afternoon for the postman's familiar whistle.",
    "The mountain path is steep at first, but the view from the top rewards the effort.",
    "At the market, the farmers sell honey, cheese and bread baked in a wood-fired oven.",
    "The storm knocked out the power, so we played cards by candlelight until midnight.",
    "A small cafe near the station serves the best soup in town on cold Tuesday evenings.",
    "The gardener explained that roses need sunlight, patience and a little careful pruning.",
    "When the festival ended, volunteers spent the whole morning collecting paper lanterns.",
    "The lighthouse keeper wrote down the weather twice a day for more than thirty years.",
    "Our town's first bridge was built of timber and had to be rebuilt after every flood.",
    "The choir practised in the church hall, and the sound carried across the empty square.",
    "Reading aloud to a friend is a simple way to share a story and an afternoon.",
    "The ferry crossed the bay four times a day, carrying cars, bicycles and curious tourists.",
]


def prompt(k: int) -> str:
    """Prompt number k: ordinary English, deterministic; the first two sentences differ for k < 552."""
    n = len(SENTENCES)
    first = k % n
    second = (first + 1 + (k // n) % (n - 1)) % n
    rest = random.Random(k).sample([i for i in range(n) if i not in (first, second)], 2)
    return " ".join(SENTENCES[i] for i in (first, second, *rest))


def start_reame(directory: Path, model: Path, threads: int, workers: int, speculative: str = "auto") -> Server:
    port = free_port()
    config = write_config(directory, model, port, {"engine": {"threads": threads}, "logging": {"level": "warning"},
                                                   "serve": {"workers": workers},
                                                   "speculative": {"enabled": speculative}})
    return reame_serve("reame serve", directory, config, port, workers=max(workers, 1), progress=say)


def start_peer(binary: str, directory: Path, model: Path, threads: int, slots: int, slot_ctx: int) -> Server:
    port = free_port()
    argv = [binary, "-m", str(model), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "-c", str(slots * slot_ctx), "--host", "127.0.0.1", "--port", str(port)]
    # llama-server's /health answers 200 once the model is loaded; it counts no workers.
    return start_server(f"llama-server ({slots} slots)", directory, port, {f"peer-{slots}": argv}, workers=0,
                        progress=say)


# ---- the clients --------------------------------------------------------------------------------

@dataclass
class Result:
    stream: int
    prompt: int  # index for `prompt()`
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds from sending the request to the first text chunk
    total: float = 0.0
    tokens: int = 0  # completion tokens (usage, else text chunks)
    prompt_tokens: int | None = None
    chunks: int = 0  # text chunks received
    itl: list[float] = field(default_factory=list)  # seconds between successive text chunks
    finish_reason: str | None = None


@dataclass
class Level:
    server: str
    streams: int
    wall: float
    client_cpu: float  # seconds of this process's CPU during the level
    results: list[Result]
    server_cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds by server role (started servers)
    requests: int = 0
    errors: int = 0
    short: int = 0  # requests that ended with fewer tokens than asked
    tokens: int = 0
    tok_s: float = 0.0
    ttft_p50: float = 0.0
    ttft_p95: float = 0.0
    itl_p50: float = 0.0
    itl_p95: float = 0.0
    decode_p50: float = 0.0  # median per-request tok/s after the first token

    def summarise(self, max_tokens: int) -> Level:
        ok = [r for r in self.results if r.ok]
        self.requests, self.errors = len(self.results), len(self.results) - len(ok)
        self.short = sum(r.tokens < max_tokens for r in ok)
        self.tokens = sum(r.tokens for r in ok)
        self.tok_s = self.tokens / max(self.wall, 1e-9)
        self.ttft_p50, self.ttft_p95 = percentile([r.ttft for r in ok], 0.5), percentile([r.ttft for r in ok], 0.95)
        gaps = [g for r in ok for g in r.itl]
        self.itl_p50, self.itl_p95 = percentile(gaps, 0.5), percentile(gaps, 0.95)
        rates = [(r.tokens - 1) / (r.total - r.ttft) for r in ok if r.tokens > 1 and r.total > r.ttft]
        self.decode_p50 = statistics.median(rates) if rates else float("nan")
        return self


def request_body(k: int, max_tokens: int, end_ids: list[int]) -> bytes:
    return orjson.dumps({
        "prompt": prompt(k), "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": {str(i): -100 for i in end_ids},  # Reame: no end-of-text token can win
        "ignore_eos": True, "n_predict": max_tokens,  # llama-server's own fields; Reame ignores them
    })


async def one_request(session: aiohttp.ClientSession, url: str, result: Result, body: bytes) -> Result:
    started = time.perf_counter()
    last = None
    done = False
    try:
        async with session.post(url + "/v1/completions", data=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}"
                say(f"  request failed: HTTP {response.status}: {(await response.text())[:300]}")
                return result
            async for raw in response.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                event = orjson.loads(data)
                if "error" in event:
                    result.error = "error event: " + str(event["error"].get("message", ""))[:200]
                    return result
                for choice in event.get("choices") or ():
                    if choice.get("text"):
                        result.chunks += 1
                        if last is None:
                            result.ttft = now - started
                        else:
                            result.itl.append(now - last)
                        last = now
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                usage = event.get("usage")
                if usage:
                    result.tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = type(exc).__name__
        return result
    result.total = time.perf_counter() - started
    result.tokens = result.tokens or result.chunks
    if not done or result.finish_reason is None:
        result.error = "stream ended without [DONE]" if not done else "no finish_reason"
    else:
        result.ok = True
    return result


async def run_level(name: str, url: str, headers: dict, streams: int, per_stream: int, first_prompt: int,
                    max_tokens: int, end_ids: list[int], timeout: float) -> Level:
    results: list[Result] = []
    # A connection per request: llama-server closes kept-alive connections after a stream, and a
    # request sent on such a connection failed (ClientOSError) instead of measuring anything.
    connector = aiohttp.TCPConnector(limit=streams + 1, force_close=True)
    client_timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout,
                                     headers={"Content-Type": "application/json", **headers}) as session:
        async def stream(s: int) -> None:
            for r in range(per_stream):
                k = first_prompt + s * per_stream + r
                results.append(await one_request(session, url, Result(s, k), request_body(k, max_tokens, end_ids)))

        async def progress() -> None:
            while True:
                await asyncio.sleep(10)
                say(f"  {name}, {streams} streams: {len(results)}/{streams * per_stream} requests done, "
                    f"{time.perf_counter() - started:.0f} s")

        cpu, started = time.process_time(), time.perf_counter()
        ticker = asyncio.create_task(progress())
        try:
            await asyncio.gather(*(stream(s) for s in range(streams)))
        finally:
            ticker.cancel()
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return Level(name, streams, wall, cpu, sorted(results, key=lambda r: r.prompt)).summarise(max_tokens)


def warm_up(name: str, url: str, headers: dict, end_ids: list[int], timeout: float) -> None:
    say(f"warm-up request on {name}")
    level = asyncio.run(run_level(name, url, headers, 1, 1, 0, 8, end_ids, timeout))
    if level.errors:
        raise RuntimeError(f"the warm-up request on {name} failed: {level.results[0].error}")


# ---- the report ---------------------------------------------------------------------------------

def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def print_table(levels: list[Level], title: str) -> None:
    if not levels:
        return
    base = levels[0]
    print(f"\n{title}")
    print(f"{'streams':>7} {'requests':>8} {'errors':>6} {'tokens':>6} {'wall s':>7} {'tok/s':>7} "
          f"{'x base':>6} {'TTFT p50 s':>10} {'TTFT p95 s':>10} {'ITL p50 ms':>10} {'ITL p95 ms':>10} "
          f"{'req tok/s':>9}")
    for lv in levels:
        print(f"{lv.streams:>7} {lv.requests:>8} {lv.errors:>6} {lv.tokens:>6} {lv.wall:>7.1f} {lv.tok_s:>7.1f} "
              f"{lv.tok_s / max(base.tok_s, 1e-9):>6.2f} {lv.ttft_p50:>10.2f} {lv.ttft_p95:>10.2f} "
              f"{ms(lv.itl_p50):>10} {ms(lv.itl_p95):>10} {lv.decode_p50:>9.1f}")


def server_cpu(server: Server | None) -> dict[str, float]:
    """CPU seconds (user + system) so far of a started server's processes, by role: the gateway,
    the workers, the rest (`reame serve` itself). Unlike tok/s these hardly move with a shared
    host's load, so they show where each token's CPU goes (None: a --url server, not ours)."""
    totals: dict[str, float] = {}
    if server is None:
        return totals
    for process in server.processes:
        try:
            root = psutil.Process(process.pid)
            tree = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for p in tree:
            try:
                cmdline = " ".join(p.cmdline())
                times = p.cpu_times()
            except psutil.NoSuchProcess:  # a process that just left
                continue
            role = "gateway" if "gateway.main" in cmdline else "workers" if "worker.main" in cmdline else "other"
            totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


def print_cpu(levels: list[Level]) -> None:
    """CPU per completion token by server role: what each token costs whatever the load."""
    if not any(lv.server_cpu for lv in levels):
        return
    roles = sorted({role for lv in levels for role in lv.server_cpu})
    print("\nReame's CPU per completion token by process (CPU seconds of the level / its tokens)")
    print(f"{'streams':>7} " + " ".join(f"{role + ' ms/tok':>16}" for role in roles) + f" {'gateway share':>13}")
    for lv in levels:
        per_token = {role: 1e3 * lv.server_cpu.get(role, 0.0) / max(lv.tokens, 1) for role in roles}
        total = sum(lv.server_cpu.values())
        share = lv.server_cpu.get("gateway", 0.0) / total if total else float("nan")
        print(f"{lv.streams:>7} " + " ".join(f"{per_token[role]:>16.2f}" for role in roles) + f" {share:>13.1%}")


def print_comparison(ours: list[Level], peer: list[Level]) -> None:
    print("\nReame beside llama-server (same GGUF, threads and load; slots = streams)")
    print(f"{'streams':>7} {'reame tok/s':>11} {'peer tok/s':>10} {'reame/peer':>10} {'reame TTFT p50':>14} "
          f"{'peer TTFT p50':>13} {'reame ITL p50 ms':>16} {'peer ITL p50 ms':>15}")
    for a, b in zip(ours, peer):
        print(f"{a.streams:>7} {a.tok_s:>11.1f} {b.tok_s:>10.1f} {a.tok_s / max(b.tok_s, 1e-9):>9.2f}x "
              f"{a.ttft_p50:>14.2f} {b.ttft_p50:>13.2f} {ms(a.itl_p50):>16} {ms(b.itl_p50):>15}")


def scaling(name: str, levels: list[Level]) -> str:
    base = levels[0]
    label = "one stream" if base.streams == 1 else f"{base.streams} streams"
    return f"{name}: " + ", ".join(f"{lv.streams} streams: {lv.tok_s / max(base.tok_s, 1e-9):.1f}x {label}"
                                   for lv in levels[1:]) if len(levels) > 1 else f"{name}: one level only"


def machine() -> dict:
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "cpu": cpu,
            "load_start": os.getloadavg()}


def notes(levels: list[Level], max_tokens: int) -> list[str]:
    out = []
    for lv in levels:
        if lv.errors:
            kinds: dict[str, int] = {}
            for r in lv.results:
                if not r.ok:
                    kinds[r.error] = kinds.get(r.error, 0) + 1
            out.append(f"{lv.server}, {lv.streams} streams: {lv.errors} errors {kinds}")
        if lv.short:
            out.append(f"{lv.server}, {lv.streams} streams: {lv.short} requests ended before {max_tokens} tokens")
        ok = [r for r in lv.results if r.ok]
        if sum(r.chunks for r in ok) < lv.tokens:
            out.append(f"{lv.server}, {lv.streams} streams: {lv.tokens} tokens came in "
                       f"{sum(r.chunks for r in ok)} chunks (ITL is per chunk)")
    return out


# ---- the run ------------------------------------------------------------------------------------

def kv_pool(url: str, headers: dict, wait: float = 5.0) -> dict[str, int] | None:
    """The workers' KV pool blocks by state (used, cached, free; summed over workers) from /metrics,
    once no block is in use or after `wait` seconds (workers report with their heartbeats, about
    once a second). None when the server does not export them."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + wait
    while True:
        with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers), timeout=10) as r:
            text = r.read().decode()
        states: dict[str, int] = {}
        for family in text_string_to_metric_families(text):
            if family.name == "reame_kv_cache_blocks":
                for sample in family.samples:
                    state = sample.labels["state"]
                    states[state] = states.get(state, 0) + int(sample.value)
        if not states:
            return None
        if states.get("used", 0) == 0 or time.monotonic() >= deadline:
            return states
        time.sleep(0.25)


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers separated by commas, e.g. 1,2,4,8,16")
    return levels


def find_peer(path: str) -> str:
    found = shutil.which(path)
    if found is None:
        why = "is not executable" if Path(path).is_file() else "does not exist (and is not on PATH)"
        raise SystemExit(f"--peer {path}: {why}. Build llama.cpp's llama-server (docs/benchmarks.md says how "
                         "its runs were built), or leave --peer out.")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="GGUF path or known model name")
    parser.add_argument("--threads", type=int, default=2, help="engine threads (Reame and the peer)")
    parser.add_argument("--workers", type=int, default=0, help="Reame workers; 0 = one per NUMA node")
    parser.add_argument("--levels", type=parse_levels, default=[1, 2, 4, 8, 16], help="concurrent streams, e.g. 1,2,4")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--speculative", choices=["auto", "on", "off"], default="auto",
                        help="[speculative] enabled for the server it starts: off measures batching alone "
                             "(drafting speeds one stream up more than eight)")
    parser.add_argument("--url", help="use this running Reame server instead of starting one")
    parser.add_argument("--api-key", default=os.environ.get("REAME_API_KEY"), help="for --url ($REAME_API_KEY)")
    parser.add_argument("--peer", help="llama-server binary: run the same load on it")
    parser.add_argument("--peer-ctx", type=int, default=0, help="context per llama-server slot (0: fit the prompts)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per request")
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args()
    if args.requests_per_stream < 1 or args.max_tokens < 1 or args.threads < 1:
        parser.error("--requests-per-stream, --max-tokens and --threads must be at least 1")
    peer_binary = find_peer(args.peer) if args.peer else None
    # A SIGTERM (e.g. from `timeout`) must still stop the servers we started; so must SIGINT even when
    # a shell started us in the background with it ignored.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from gateway.tokenizer import Tokenizer
    from shared.model_store import ensure_model

    model = ensure_model(args.model, MODELS_DIR, progress=say)
    tokenizer = Tokenizer.from_gguf(model)
    end_ids = sorted(set(tokenizer.eot_ids) | ({tokenizer.eos_id} if tokenizer.eos_id is not None else set()))
    firsts = [1 + sum(args.levels[:i]) * args.requests_per_stream for i in range(len(args.levels))]
    used = range(1, firsts[-1] + args.levels[-1] * args.requests_per_stream)
    lengths = [len(tokenizer.encode(prompt(k))) for k in used]
    slot_ctx = args.peer_ctx or max(512, -(-(max(lengths) + args.max_tokens + 16) // 256) * 256)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.url and args.api_key else {}
    info = {**machine(), "model": str(model), "model_mb": round(model.stat().st_size / 2**20, 1),
            "threads": None if args.url else args.threads, "levels": args.levels,
            "requests_per_stream": args.requests_per_stream, "max_tokens": args.max_tokens,
            "prompt_tokens": {"min": min(lengths), "mean": round(statistics.mean(lengths), 1), "max": max(lengths)},
            "banned_end_ids": end_ids, "peer": peer_binary, "peer_slot_ctx": slot_ctx if peer_binary else None}

    ours: list[Level] = []
    peers: list[Level] = []
    status = 0
    with tempfile.TemporaryDirectory(prefix="reame-concurrency-") as tmp:
        reame = peer = None
        try:
            if args.url:
                url = args.url.rstrip("/")
                if health(url)[0] != 200:
                    raise SystemExit(f"--url {url}: /health does not answer 200")
            else:
                reame = start_reame(Path(tmp), model, args.threads, args.workers, args.speculative)
                url = reame.url
            warm_up("reame", url, headers, end_ids, args.timeout)
            for i, (n, first) in enumerate(zip(args.levels, firsts)):
                say(f"level {i + 1}/{len(args.levels)}: {n} streams x {args.requests_per_stream} requests "
                    f"x {args.max_tokens} tokens on reame")
                cpu_before = server_cpu(reame)
                lv = asyncio.run(run_level("reame", url, headers, n, args.requests_per_stream, first,
                                           args.max_tokens, end_ids, args.timeout))
                lv.server_cpu = {role: seconds - cpu_before.get(role, 0.0)
                                 for role, seconds in server_cpu(reame).items()}
                ours.append(lv)
                say(f"  reame: {lv.tok_s:.1f} tok/s, TTFT p50 {lv.ttft_p50:.2f} s, errors {lv.errors}")
                if peer_binary:
                    peer = start_peer(peer_binary, Path(tmp), model, args.threads, n, slot_ctx)
                    warm_up("llama-server", peer.url, {}, end_ids, args.timeout)
                    say(f"level {i + 1}/{len(args.levels)}: the same on llama-server")
                    lv = asyncio.run(run_level("llama-server", peer.url, {}, n, args.requests_per_stream, first,
                                               args.max_tokens, end_ids, args.timeout))
                    peers.append(lv)
                    say(f"  llama-server: {lv.tok_s:.1f} tok/s, TTFT p50 {lv.ttft_p50:.2f} s, errors {lv.errors}")
                    peer.stop()
                    peer = None
            info["kv_blocks_after"] = kv_after = kv_pool(url, headers)
            if kv_after is not None and kv_after.get("used", 0) and not args.url:
                say(f"the KV pool still has {kv_after['used']} blocks in use with no request running")
                status = 1
        except KeyboardInterrupt:
            say("interrupted: stopping the servers; the table shows the levels that finished")
            status = 130
        except (RuntimeError, TimeoutError) as exc:
            say(f"failed: {exc}")
            status = 1
        finally:
            for server in (peer, reame):
                if server is not None:
                    say(f"stopping {server.name}")
                    server.stop()
    info["load_end"] = os.getloadavg()

    threads = f"{args.threads} threads" if not args.url else f"the server at {args.url}"
    print(f"\nmachine: {info['cpus']} CPUs ({info['usable_cpus']} usable), {info['cpu']}; load average "
          f"{info['load_start'][0]:.2f} at the start, {info['load_end'][0]:.2f} at the end")
    print(f"model: {model.name} ({info['model_mb']} MB), {threads}; prompts {min(lengths)}-{max(lengths)} tokens "
          f"(mean {info['prompt_tokens']['mean']}), {args.max_tokens} output tokens each (greedy, end-of-text banned), "
          f"{args.requests_per_stream} request(s) per stream one after another")
    print_table(ours, "Reame through the gateway (/v1/completions, streamed)")
    print_cpu(ours)
    if peer_binary:
        print_table(peers, f"llama-server ({peer_binary}; slots = streams, {slot_ctx} context per slot)")
        print_comparison(ours, peers)
    for line in notes(ours + peers, args.max_tokens):
        print("note: " + line)
    if ours:
        cpu = sum(lv.client_cpu for lv in ours) / max(sum(lv.wall for lv in ours), 1e-9)
        print(f"\nthe clients (this process) used {cpu:.1%} of one CPU during Reame's levels")
        print("tok/s = completion tokens of the level / its wall time; x base = tok/s over the first level's; "
              "req tok/s = median per-request tokens/s after its first token")
        print(scaling("reame", ours))
        if peers:
            print(scaling("llama-server", peers))
    if not peer_binary:
        print("llama-server: not run (give --peer PATH to compare in the same run)")
    if info.get("kv_blocks_after"):
        kv = info["kv_blocks_after"]
        print(f"KV pool after the run (/metrics): {kv.get('used', 0)} blocks held by requests, "
              f"{kv.get('cached', 0)} free holding reusable prefixes, {kv.get('free', 0)} empty")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "reame": [asdict(lv) for lv in ours],
                                               "peer": [asdict(lv) for lv in peers]}, indent=1))
    if status == 0 and any(lv.errors for lv in ours + peers):
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
