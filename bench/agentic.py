"""Agentic traffic against Reame with adaptivity on and off: does it get faster as it runs?

    python bench/agentic.py [--model PATH] [--threads 2] [--minutes 10] [--bucket 60]
                            [--workload agentic|low-overlap|both] [--modes on,off] [--repeats N]
                            [--peer URL] [--temperature T] [--json FILE] [--png FILE]

agentic: several long system prompts (an agent's rules and a list of tool descriptions, ~700
tokens each), short user turns, multi-turn conversations (each turn resends the history with the
assistant's streamed answer), and a number of concurrent clients that changes every phase
(PHASES, repeated). low-overlap: every request has a prompt of its own (random words), so
prefix caching cannot help; it shows what remains, and that adaptivity never makes it slower.

Each mode runs a fresh gateway and worker (own state directory: no learned strategy, no prefix
store carried over) for the same duration, the same seeded traffic. Per bucket (one minute by
default) it records output tokens/s, TTFT p50/p95, request latency p95 and the cached share of
prompt tokens; prints a table per run and a comparison, writes the per-bucket JSON and a PNG of
the curves. With --peer URL the same traffic also runs against that server (an OpenAI-compatible
one already running). The last adaptive report of each Reame run is printed too.

On a shared host the load drifts between runs, so --repeats N runs the modes N times in
alternating order (on,off then off,on, ...): each on/off pair is compared over its whole run
(the output tokens of every request over the time from the first request to the last answer, not
per-minute buckets of a few requests), and the comparison is the median of the pairs' ratios,
with each ratio listed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from benchlib import percentile, say  # bench/, the script's directory, is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.harness import free_port, gateway_and_worker, write_config  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()
PHASES = (2, 6, 3, 8, 4)  # concurrent clients, one phase each PHASE_S seconds, repeated
PHASE_S = 30.0
TURNS = (2, 4)  # user turns per conversation (inclusive range)
MAX_TOKENS = 48
AGENTS = 4

WORDS = ("file", "search", "query", "result", "user", "project", "branch", "commit", "issue", "report",
         "table", "column", "record", "request", "answer", "server", "client", "error", "value", "list")
TOOLS = ("read_file", "write_file", "search_code", "run_tests", "list_directory", "git_diff", "git_commit",
         "open_issue", "http_get", "sql_query", "send_email", "calendar_lookup", "translate", "summarize")
QUESTIONS = ("Find where the config is parsed.", "Run the unit tests and tell me what fails.",
             "Summarize the last three commits.", "Which files changed in this branch?",
             "Open an issue for the flaky test.", "What does the error in the log mean?",
             "Look up my meetings tomorrow.", "Translate the README intro into French.")
FOLLOW_UPS = ("And then?", "Do it.", "Show me the diff.", "Why?", "Try the other tool.", "Thanks, next step?")


def system_prompt(agent: int) -> str:
    rng = random.Random(1000 + agent)
    tools = rng.sample(TOOLS, 10)
    lines = [f"You are agent #{agent}, an assistant that completes software tasks with tools. Think step by step, "
             "call one tool at a time, and answer briefly. Never invent tool results.", "", "Tools:"]
    for tool in tools:
        args = ", ".join(f"{w}: string" for w in rng.sample(WORDS, 3))
        desc = " ".join(rng.choice(WORDS) for _ in range(28))
        lines.append(f"- {tool}({args}): {desc}.")
    lines += ["", "Rules: keep answers under three sentences; quote file names exactly; ask before writing."]
    return "\n".join(lines)


def unique_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(120)) + "\nSummarize the above."


@dataclass
class Sample:
    start: float  # seconds since the run began
    ttft: float
    latency: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Run:
    name: str
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    report: str = ""
    elapsed: float = 0.0  # seconds from the first request to the last answer (traffic, then its drain)


async def chat(session: aiohttp.ClientSession, url: str, messages: list[dict], run: Run, t0: float,
               temperature: float) -> str:
    body = {"model": "reame", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, text, usage = None, [], {}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                run.errors += 1
                await response.read()
                return ""
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        first = first or time.perf_counter()
                        text.append(delta)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        run.errors += 1
        return ""
    done = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    run.samples.append(Sample(started - t0, (first or done) - started, done - started,
                              usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0),
                              details.get("cached_tokens", 0)))
    return "".join(text)


async def client(url: str, workload: str, seed: int, run: Run, t0: float, stop_at: float, active,
                 temperature: float) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.perf_counter() < stop_at:
            if not active():
                await asyncio.sleep(0.2)
                continue
            if workload == "low-overlap":
                await chat(session, url, [{"role": "user", "content": unique_prompt(rng)}], run, t0, temperature)
                continue
            messages = [{"role": "system", "content": system_prompt(rng.randrange(AGENTS))},
                        {"role": "user", "content": rng.choice(QUESTIONS)}]
            for turn in range(rng.randint(*TURNS)):
                if time.perf_counter() >= stop_at:
                    return
                answer = await chat(session, url, messages, run, t0, temperature)
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": rng.choice(FOLLOW_UPS)}]


async def drive(url: str, workload: str, seconds: float, run: Run, temperature: float) -> None:
    t0 = time.perf_counter()
    stop_at = t0 + seconds
    most = max(PHASES)

    def active_for(i: int):
        def active() -> bool:
            phase = int((time.perf_counter() - t0) // PHASE_S) % len(PHASES)
            return i < PHASES[phase]
        return active

    await asyncio.gather(*(client(url, workload, 7919 * i + 1, run, t0, stop_at, active_for(i), temperature)
                           for i in range(most)))
    run.elapsed = time.perf_counter() - t0


def buckets(run: Run, seconds: float, bucket: float) -> list[dict]:
    rows = []
    for b in range(int(seconds // bucket)):
        lo, hi = b * bucket, (b + 1) * bucket
        chosen = [s for s in run.samples if lo <= s.start + s.latency < hi]  # by finish time
        prompt = sum(s.prompt_tokens for s in chosen)
        rows.append({"minute": round(hi / 60, 2), "requests": len(chosen),
                     "output_tok_s": round(sum(s.output_tokens for s in chosen) / bucket, 2),
                     "ttft_p50_ms": round(1000 * percentile([s.ttft for s in chosen], 0.5, 0.0)),
                     "ttft_p95_ms": round(1000 * percentile([s.ttft for s in chosen], 0.95, 0.0)),
                     "latency_p95_ms": round(1000 * percentile([s.latency for s in chosen], 0.95, 0.0)),
                     "cached_fraction": round(sum(s.cached_tokens for s in chosen) / prompt, 3) if prompt else 0.0})
    return rows


def run_reame(model: Path, threads: int, adaptive: bool, workload: str, seconds: float, bucket: float,
              directory: Path, temperature: float, screenshot: Path | None = None) -> tuple[Run, list[dict]]:
    port = free_port()
    config = write_config(directory, model, port, {
        "engine": {"threads": threads}, "logging": {"level": "info"},
        "tuning": {"adaptive": str(adaptive).lower(), "state_path": directory / "tuning",
                   "profile_interval": 3, "report_interval": bucket}})
    run = Run(f"reame adaptive {'on' if adaptive else 'off'} ({workload})")
    with gateway_and_worker(run.name, directory, config, port, progress=say) as server:
        say(f"{run.name}: {seconds:.0f} s of traffic")
        asyncio.run(drive(server.url, workload, seconds, run, temperature))
        try:
            with urllib.request.urlopen(server.url + "/admin/report", timeout=10) as response:
                report = json.loads(response.read())
            run.report = report.get("text", "")
            changes = [d for d in report.get("history", []) if d["kind"] in ("change", "revert")]
            for d in changes:
                say(f"  v{d['version']} {d['kind']} {d['policy']}: {d['outcome']} {d.get('effect') or ''}")
        except OSError as exc:
            say(f"  no report: {exc}")
        drafting = speculation_totals(server.url)
        if drafting:
            say(f"  speculation: {drafting}")
        if screenshot:
            take_screenshot(server.url + "/dashboard", screenshot)
    return run, buckets(run, seconds, bucket)


def speculation_totals(url: str) -> str:
    """What drafting did over the run, from /metrics: drafts, tokens drafted and accepted."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return ""
    from prometheus_client.parser import text_string_to_metric_families

    values = {family.name[len("reame_spec_"):]: sum(s.value for s in family.samples if s.name.endswith("_total"))
              for family in text_string_to_metric_families(text)
              if family.name in ("reame_spec_drafts", "reame_spec_drafted_tokens", "reame_spec_accepted_tokens")}
    if not values.get("drafts"):
        return "no drafts" if values else ""
    return (f"{values['drafts']:.0f} drafts of {values['drafted_tokens']:.0f} tokens, "
            f"{values['accepted_tokens']:.0f} accepted ({values['accepted_tokens'] / values['drafted_tokens']:.0%})")


def take_screenshot(url: str, path: Path) -> None:
    """The live dashboard after the run, in headless Chromium (Debian's `chromium`)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        say("  no screenshot: chromium is not installed")
        return
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--virtual-time-budget=5000", "--window-size=1400,1000", f"--screenshot={path}", url],
                   capture_output=True, timeout=120)
    say(f"  dashboard screenshot: {path}" if path.exists() else "  the screenshot failed")


def run_peer(url: str, workload: str, seconds: float, bucket: float, temperature: float) -> tuple[Run, list[dict]]:
    run = Run(f"peer {url} ({workload})")
    asyncio.run(drive(url, workload, seconds, run, temperature))
    return run, buckets(run, seconds, bucket)


def print_table(name: str, rows: list[dict], errors: int) -> None:
    print(f"\n{name}  (errors: {errors})")
    print(f"{'min':>5} {'reqs':>5} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p95':>9} {'lat p95':>8} {'cached':>7}")
    for r in rows:
        print(f"{r['minute']:>5} {r['requests']:>5} {r['output_tok_s']:>10.1f} {r['ttft_p50_ms']:>7}ms "
              f"{r['ttft_p95_ms']:>7}ms {r['latency_p95_ms']:>6}ms {r['cached_fraction']:>7.2f}")


def whole_run(run: Run) -> dict:
    """The run as one number per metric, over every request: output tokens over the time from the
    first request to the last answer. (On a loaded host a request of the low-overlap workload can
    outlast a bucket, or the whole traffic window: counting only what finished inside it says nothing.)"""
    done = run.samples
    return {"requests": len(done), "errors": run.errors, "elapsed_s": round(run.elapsed, 1),
            "output_tok_s": round(sum(s.output_tokens for s in done) / run.elapsed, 2) if run.elapsed else 0.0,
            "latency_p50_ms": round(1000 * percentile([s.latency for s in done], 0.5, 0.0)),
            "latency_p95_ms": round(1000 * percentile([s.latency for s in done], 0.95, 0.0)),
            "ttft_p95_ms": round(1000 * percentile([s.ttft for s in done], 0.95, 0.0))}


def pair_ratios(totals: list[tuple[str, dict]]) -> list[float]:
    """on/off output tok/s of consecutive on-off (or off-on) runs of one workload."""
    ratios = []
    for (mode_a, a), (mode_b, b) in zip(totals[::2], totals[1::2]):
        on, off = (a, b) if mode_a == "on" else (b, a)
        if {mode_a, mode_b} == {"on", "off"} and off["output_tok_s"]:
            ratios.append(round(on["output_tok_s"] / off["output_tok_s"], 3))
    return ratios


def steady(rows: list[dict]) -> dict:
    """The second half of the run, the 'steady state' (medians of its buckets)."""
    half = rows[len(rows) // 2:] or rows
    return {"output_tok_s": statistics.median(r["output_tok_s"] for r in half),
            "latency_p95_ms": statistics.median(r["latency_p95_ms"] for r in half),
            "ttft_p95_ms": statistics.median(r["ttft_p95_ms"] for r in half)}


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, rows in results.items():
        x = [r["minute"] for r in rows]
        axes[0].plot(x, [r["output_tok_s"] for r in rows], marker="o", label=name)
        axes[1].plot(x, [r["latency_p95_ms"] for r in rows], marker="o", label=name)
        axes[2].plot(x, [r["cached_fraction"] for r in rows], marker="o", label=name)
    for ax, title in zip(axes, ("output tok/s", "latency p95 (ms)", "cached share of prompt tokens")):
        ax.set_title(title)
        ax.set_xlabel("minutes")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODELS_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=10.0, help="traffic per run")
    parser.add_argument("--bucket", type=float, default=60.0, help="seconds per row of the tables")
    parser.add_argument("--workload", choices=("agentic", "low-overlap", "both"), default="both")
    parser.add_argument("--modes", default="on,off", help="adaptivity settings to run, in order")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the modes this many times, alternating their order (load drifts on a shared host)")
    parser.add_argument("--peer", help="also drive this OpenAI-compatible server's URL")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="every request's sampling temperature (0: greedy, as agents that call tools often ask)")
    parser.add_argument("--json", type=Path, default=Path("bench-agentic.json"))
    parser.add_argument("--png", type=Path, default=Path("bench-agentic.png"))
    parser.add_argument("--screenshot", type=Path,
                        help="save the dashboard of the (first) adaptive-on run as this PNG (headless Chromium)")
    args = parser.parse_args()
    seconds = args.minutes * 60
    workloads = ("agentic", "low-overlap") if args.workload == "both" else (args.workload,)
    results: dict[str, list[dict]] = {}
    summary: dict[str, dict] = {}
    totals: dict[str, list[tuple[str, dict]]] = {w: [] for w in workloads}  # workload → (mode, whole run)
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="reame-agentic-") as tmp:
        for workload in workloads:
            for repeat in range(args.repeats):
                for mode in (modes if repeat % 2 == 0 else modes[::-1]):
                    shot = args.screenshot if mode == "on" and repeat == 0 and workload == workloads[0] else None
                    run, rows = run_reame(Path(args.model), args.threads, mode == "on", workload, seconds,
                                          args.bucket, Path(tmp) / f"{workload}-{mode}-{repeat}", args.temperature, shot)
                    if args.repeats > 1:
                        run.name += f" #{repeat + 1}"
                    print_table(run.name, rows, run.errors)
                    if run.report:
                        print(run.report)
                    results[run.name], summary[run.name] = rows, steady(rows)
                    totals[workload].append((mode, whole_run(run)))
                    say(f"{run.name}: whole run {totals[workload][-1][1]}")
            if args.peer:
                run, rows = run_peer(args.peer, workload, seconds, args.bucket, args.temperature)
                print_table(run.name, rows, run.errors)
                results[run.name], summary[run.name] = rows, steady(rows)
    print("\nsteady state (medians of the second half's buckets):")
    for name, s in summary.items():
        print(f"  {name:45} {s['output_tok_s']:8.1f} tok/s  latency p95 {s['latency_p95_ms']:6.0f} ms  "
              f"TTFT p95 {s['ttft_p95_ms']:6.0f} ms")
    whole: dict[str, dict] = {}
    for workload in workloads:
        ratios = pair_ratios(totals[workload])
        if ratios:
            whole[workload] = {"runs": totals[workload], "on_off_ratios": ratios,
                               "median_on_off": statistics.median(ratios)}
            print(f"  {workload}: adaptive on / off over whole runs (output tok/s), pairs {ratios}: "
                  f"median {statistics.median(ratios):.2f}x")
            for mode, t in totals[workload]:
                print(f"    {mode:3} {t['requests']:4} requests  {t['output_tok_s']:7.1f} tok/s  "
                      f"latency p50 {t['latency_p50_ms']:6} ms  p95 {t['latency_p95_ms']:6} ms  errors {t['errors']}")
    for workload in workloads:
        if args.repeats > 1:
            continue  # the per-run names carry #N: the whole-run pairs above are the comparison
        on, off = (summary.get(f"reame adaptive {m} ({workload})") for m in ("on", "off"))
        if on and off and off["output_tok_s"]:
            print(f"  {workload}: adaptive on / off = {on['output_tok_s'] / off['output_tok_s']:.2f}x output tok/s")
        rows = results.get(f"reame adaptive on ({workload})")
        if rows and rows[0]["output_tok_s"]:
            print(f"  {workload}: adaptive on, steady / first bucket = {on['output_tok_s'] / rows[0]['output_tok_s']:.2f}x")
    args.json.write_text(json.dumps({"buckets": results, "steady": summary, "whole_runs": whole, "bucket_s": args.bucket,
                                     "phases": PHASES, "phase_s": PHASE_S}, indent=1))
    plot(results, args.png)
    say(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
