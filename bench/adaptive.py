"""Scenarios where the shipped defaults are wrong: adaptivity on against off on the same traffic.

    python bench/adaptive.py --scenario neighbour|traffic-shift|new-model|restart
                             [--model qwen2.5-coder-1.5b] [--minute 60] [--modes on,off]
                             [--repeats 1] [--clients 3] [--json FILE] [--png FILE]

Each mode runs a fresh gateway and worker (own state directory: no learned strategy, kernel
table, prefix store or speculation archive carried in) through the same seeded traffic and the
same scenario timeline, in scenario minutes of --minute seconds (60: the timeline as written;
less compresses the phases, not the tuner's own clocks, so a recovery "within a minute" is
judged in real seconds either way):

  neighbour      a CPU-bound process on the worker's last CPU from minute 3 to minute 6 (of 9)
  traffic-shift  short agentic turns, then from minute 3 (of 6) 3-4k-token documents with
                 one-line answers (RAG-style)
  new-model      5 minutes of agentic turns on a model no shipped table covers; judged from
                 minute 2
  restart        the worker is stopped at minute 5 (of 8) and started again on the same state
                 directory (the learned kernel table, the coordinator's knobs, the speculation
                 archive and the prefix store survive it); its first minute serving again is
                 compared with its steady state before

Traffic: closed-loop clients (--clients), each a multi-turn chat under one of a few long system
prompts; every user turn is generated from seeded random words, at temperature 0.7, so answers
differ and the speculation archive cannot replay whole answers in either mode.

Modes: on, off (`[tuning] adaptive = false`: the shipped defaults, fixed), and for each layer's
share on with one layer fixed: no-kernels (`[tuning] kernels = fixed`: kernels and threads
as loaded), no-drafting (`[speculative] enabled = off`). The scheduler knobs' share is what is
left of on/off once those two are taken out.

Prints per-bucket tables, a per-phase comparison (output tok/s, p95 latency, p95 TTFT), the
tuner's actions (from the logs), and writes one PNG: tok/s and p95 latency over time, both modes,
the scenario's events shaded and the moments the tuner acted marked.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import aiohttp

from benchlib import percentile, say  # bench/, the script's directory, is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from gateway.tokenizer import Tokenizer  # noqa: E402
from shared.model_store import resolve_model  # noqa: E402
from tests.harness import free_port, gateway_and_worker, health, write_config  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()
AGENTS = 4
TEMPERATURE = 0.7
CHAT_TOKENS = 64
DOCUMENT_TOKENS = 16
WORDS = ("file", "search", "query", "result", "user", "project", "branch", "commit", "issue", "report", "table",
         "column", "record", "request", "answer", "server", "client", "error", "value", "list", "cache", "token",
         "thread", "socket", "buffer", "parser", "schema", "index", "window", "signal", "budget", "worker")
VERBS = ("sorts", "merges", "validates", "parses", "counts", "groups", "renames", "filters", "caches", "retries")
FOLLOW_UPS = ("Now add type hints.", "Make it handle empty input.", "Write one test for it.", "Explain the edge case.",
              "Rename the arguments to be clearer.", "Can it be done without a loop?")

# Layers a mode turns off (config sections), on top of the scenario's own settings.
MODES = {
    "on": {},
    "off": {"tuning": {"adaptive": "false"}},
    "no-kernels": {"tuning": {"kernels": "fixed"}},
    "no-drafting": {"speculative": {"enabled": "off"}},
}


@dataclass(frozen=True)
class Phase:
    name: str
    start: float  # scenario minutes
    end: float


@dataclass(frozen=True)
class Scenario:
    name: str
    minutes: float
    phases: tuple[Phase, ...]
    events: tuple[tuple[float, float, str], ...]  # shaded spans (minutes) and their labels
    judged: tuple[str, ...]  # phases whose on/off ratio the scenario is about
    target: str


SCENARIOS = {s.name: s for s in (
    Scenario("neighbour", 9, (Phase("before", 0, 3), Phase("neighbour", 3, 6), Phase("after", 6, 9)),
             ((3, 6, "CPU hog on the worker's last CPU"),), ("neighbour",),
             "during the neighbour on >= 1.5x off; after it, on back to its earlier speed within a minute"),
    Scenario("traffic-shift", 6, (Phase("short turns", 0, 3), Phase("documents", 3, 6)),
             ((3, 6, "3-4k-token documents"),), ("documents",),
             "in the documents phase on >= 1.2x off on p95 TTFT or on throughput"),
    Scenario("new-model", 5, (Phase("first 2 min", 0, 2), Phase("from minute 2", 2, 5)), (), ("from minute 2",),
             "from minute 2 on >= 1.1x off"),
    Scenario("restart", 8, (Phase("warm-up", 0, 3), Phase("steady", 3, 5), Phase("first minute after", 5, 6),
                            Phase("later", 6, 8)),
             ((5, 5, "worker restarted"),), ("first minute after",),
             "on's first minute after the restart >= 0.95x its steady state before; off's slower"),
)}


@dataclass
class Sample:
    start: float  # seconds since the traffic began
    ttft: float
    latency: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    kind: str


@dataclass
class Run:
    mode: str
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    actions: list[tuple[float, str]] = field(default_factory=list)  # (seconds since traffic began, what)
    worth: list[dict] = field(default_factory=list)  # the adaptive report's A/B figures at the end
    downtime: tuple[float, float] | None = None  # restart: (stopped, serving again) in seconds


# ---- traffic ------------------------------------------------------------------------------------

def system_prompt(agent: int) -> str:
    rng = random.Random(4242 + agent)
    lines = [f"You are coding assistant #{agent}. Answer with short, correct Python. Keep explanations to one "
             "sentence.", "", "House rules:"]
    for i in range(24):
        lines.append(f"{i + 1}. " + " ".join(rng.choice(WORDS) for _ in range(14)) + ".")
    return "\n".join(lines)


def user_task(rng: random.Random) -> str:
    name = "_".join(rng.sample(WORDS, 2)) + str(rng.randrange(100))
    return (f"Write a Python function `{name}` that {rng.choice(VERBS)} a list of {rng.choice(WORDS)} "
            f"{rng.choice(WORDS)}s by {rng.choice(WORDS)} and returns the {rng.choice(WORDS)} count.")


# The model's tokenizer (main sets it), so a document is as many tokens as asked: Qwen2.5 gives each
# digit a token, and "word 1234" pairs made a "3,500-token" document ~6,900 tokens there (the
# documents phase of 12-07 finished 3 documents in 270 s, each after 160 s).
document_tokenizer = None


def document(rng: random.Random, tokens: int) -> str:
    """`tokens` tokens of unique text (words and numbers), cut to length with the model's tokenizer."""
    words = [f"{rng.choice(WORDS)} {rng.randrange(10000)}" for _ in range(tokens // 2)]
    body = " ".join(words)
    if document_tokenizer is not None:
        body = document_tokenizer.decode(document_tokenizer.encode(body, add_special=False)[:tokens])
    return "Document:\n" + body + "\n\nIn one sentence, what is this document about?"


async def ask(session: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int, kind: str,
              run: Run, t0: float) -> str:
    body = {"model": "reame", "messages": messages, "max_tokens": max_tokens, "temperature": TEMPERATURE,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, text, usage = None, [], {}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                run.errors += 1
                await response.read()
                await asyncio.sleep(0.5)  # a worker restarting: do not spin
                return ""
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        first = first or time.perf_counter()
                        text.append(choice["delta"]["content"])
    except (aiohttp.ClientError, asyncio.TimeoutError):
        run.errors += 1
        await asyncio.sleep(0.5)
        return ""
    done = time.perf_counter()
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    run.samples.append(Sample(started - t0, (first or done) - started, done - started,
                              usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0), cached, kind))
    return "".join(text)


async def client(index: int, url: str, scenario: Scenario, minute: float, run: Run, t0: float) -> None:
    rng = random.Random(7919 * index + 17)
    stop_at = t0 + scenario.minutes * minute
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        while (now := time.perf_counter()) < stop_at:
            documents = scenario.name == "traffic-shift" and now - t0 >= 3 * minute
            if documents:
                prompt = document(rng, rng.randrange(3000, 4000))
                await ask(session, url, [{"role": "user", "content": prompt}], DOCUMENT_TOKENS, "document", run, t0)
                continue
            messages = [{"role": "system", "content": system_prompt(rng.randrange(AGENTS))},
                        {"role": "user", "content": user_task(rng)}]
            for _ in range(rng.randint(1, 3)):
                if time.perf_counter() >= stop_at:
                    return
                answer = await ask(session, url, messages, CHAT_TOKENS, "chat", run, t0)
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": rng.choice(FOLLOW_UPS)}]


# ---- the scenario's events ----------------------------------------------------------------------

def start_hog() -> subprocess.Popen:
    """A CPU-bound neighbour on this process's last CPU (the worker's too: one NUMA node)."""
    cpu = max(os.sched_getaffinity(0))
    return subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])


async def timeline(scenario: Scenario, minute: float, server, run: Run, t0: float) -> None:
    """Act on the scenario's clock: the neighbour comes and goes; the worker restarts."""
    if scenario.name == "neighbour":
        await asyncio.sleep(3 * minute)
        hog = start_hog()
        say(f"  neighbour started (pid {hog.pid})")
        await asyncio.sleep(3 * minute)
        hog.kill()
        hog.wait()
        say("  neighbour stopped")
    elif scenario.name == "restart":
        await asyncio.sleep(5 * minute)
        worker = next(p for p in server.processes if p.name.startswith("worker"))
        stopped = time.perf_counter() - t0
        say("  restarting the worker")
        await asyncio.to_thread(worker.stop)
        server.processes.remove(worker)
        server.start("worker-restarted", worker.argv)
        while True:
            status, body = await asyncio.to_thread(health, server.url)
            if status == 200 and body.get("workers", 0) >= 1:
                break
            await asyncio.sleep(0.2)
        run.downtime = (stopped, time.perf_counter() - t0)
        say(f"  worker serving again after {run.downtime[1] - run.downtime[0]:.1f} s")


async def drive(url: str, scenario: Scenario, minute: float, clients: int, run: Run, server) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(timeline(scenario, minute, server, run, t0),
                         *(client(i, url, scenario, minute, run, t0) for i in range(clients)))
    return t0


# ---- one run --------------------------------------------------------------------------------------

LOG_ACTIONS = (  # what the worker's tuners did, as their log lines say it (the coordinator's: its history)
    (re.compile(r"kernel tuner: bucket (\S+) rows: (\S+) -> (\S+) promoted"), "kernels {0}: {2}"),
    (re.compile(r"kernel tuner: bucket (\S+) rows: rolled back (\S+) -> (\S+)"), "kernels {0}: back to {2}"),
    (re.compile(r"bucket (\S+) rows: (\S+) -> (\S+): the worker now runs on"), "kernels {0}: {2}"),
    (re.compile(r"speculation (on|off) for steps of (\d+)\+"), "drafting {0} ({1}+)"),
)


def tuner_actions(log_text: str, wall_t0: float) -> list[tuple[float, str]]:
    """(seconds since the traffic began, what) for each tuner action the log records."""
    day = datetime.fromtimestamp(wall_t0).date()
    found = []
    for line in log_text.splitlines():
        stamp = line[:8]
        if not re.fullmatch(r"\d\d:\d\d:\d\d", stamp):
            continue
        for pattern, label in LOG_ACTIONS:
            m = pattern.search(line)
            if m:
                at = datetime.combine(day, datetime.strptime(stamp, "%H:%M:%S").time()).timestamp() - wall_t0
                if at >= 0:
                    found.append((at, label.format(*m.groups())))
                break
    return sorted(found)


def run_mode(model: Path, threads: int, mode: str, scenario: Scenario, minute: float, clients: int,
             directory: Path) -> Run:
    sections = {"engine": {"threads": threads}, "logging": {"level": "info"},
                "tuning": {"profile_interval": 3, "report_interval": max(30, int(minute))}}
    for section, keys in MODES[mode].items():
        sections.setdefault(section, {}).update(keys)
    port = free_port()
    config = write_config(directory, model, port, sections)
    run = Run(mode)
    with gateway_and_worker(f"{scenario.name} {mode}", directory, config, port, progress=say) as server:
        say(f"{scenario.name}, adaptive {mode}: {scenario.minutes * minute:.0f} s of traffic, {clients} clients")
        wall_t0 = time.time()
        asyncio.run(drive(server.url, scenario, minute, clients, run, server))
        try:
            report = get_json(server.url + "/admin/report")
            run.worth = report.get("worth", [])
            say("  " + report.get("text", "").replace("\n", "\n  "))
            run.actions = [(d["at"] - wall_t0, f"knobs v{d['version']} {d['kind']} {d['policy']}: {d['outcome']}")
                           for d in report.get("history", []) if d["at"] >= wall_t0]
        except OSError as exc:
            say(f"  no report: {exc}")
    logs = "".join(path.read_text(errors="replace") for path in sorted(directory.glob("worker*.log")))
    run.actions = sorted(run.actions + tuner_actions(logs, wall_t0))
    return run


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


# ---- summaries ------------------------------------------------------------------------------------

def window(run: Run, lo: float, hi: float) -> dict:
    """Requests finishing in [lo, hi) seconds: output tok/s over the window, p95 latency and TTFT."""
    chosen = [s for s in run.samples if lo <= s.start + s.latency < hi]
    span = max(hi - lo, 1e-9)
    return {"requests": len(chosen), "output_tok_s": round(sum(s.output_tokens for s in chosen) / span, 2),
            "fed_tok_s": round(sum(s.output_tokens + s.prompt_tokens - s.cached_tokens for s in chosen) / span, 1),
            "latency_p95_ms": round(1000 * percentile([s.latency for s in chosen], 0.95, 0.0)),
            "ttft_p95_ms": round(1000 * percentile([s.ttft for s in chosen], 0.95, 0.0))}


def phase_windows(scenario: Scenario, minute: float, run: Run) -> dict[str, dict]:
    out = {}
    for phase in scenario.phases:
        lo, hi = phase.start * minute, phase.end * minute
        if scenario.name == "restart" and run.downtime and phase.name == "first minute after":
            lo, hi = run.downtime[1], run.downtime[1] + minute  # from serving again, not from the stop
        out[phase.name] = window(run, lo, hi)
    return out


def buckets(run: Run, seconds: float, bucket: float) -> list[dict]:
    return [{"t_s": round((b + 1) * bucket, 1), **window(run, b * bucket, (b + 1) * bucket)}
            for b in range(int(seconds // bucket))]


def recovery_s(scenario: Scenario, minute: float, run: Run, bucket: float) -> float | None:
    """neighbour: seconds after the neighbour left until a bucket is back to 90% of the
    before-phase's median bucket."""
    if scenario.name != "neighbour":
        return None
    rows = buckets(run, scenario.minutes * minute, bucket)
    before = [r["output_tok_s"] for r in rows if r["t_s"] <= 3 * minute]
    if not before:
        return None
    level = 0.9 * statistics.median(before)
    for r in rows:
        if r["t_s"] > 6 * minute and r["output_tok_s"] >= level:
            return round(r["t_s"] - 6 * minute, 1)
    return None


def print_phases(scenario: Scenario, minute: float, runs: list[Run]) -> dict:
    print(f"\n{scenario.name}: per phase (requests finishing in it)")
    print(f"{'phase':22} {'mode':12} {'reqs':>5} {'out tok/s':>10} {'fed tok/s':>10} {'lat p95':>9} {'TTFT p95':>9}")
    table = {}
    for phase in scenario.phases:
        for run in runs:
            w = phase_windows(scenario, minute, run)[phase.name]
            table.setdefault(phase.name, {})[run.mode] = w
            print(f"{phase.name:22} {run.mode:12} {w['requests']:>5} {w['output_tok_s']:>10.1f} {w['fed_tok_s']:>10.1f} "
                  f"{w['latency_p95_ms']:>7}ms {w['ttft_p95_ms']:>7}ms")
    return table


def ratios(table: dict, mode: str, base: str = "off") -> dict[str, dict[str, float]]:
    """mode / base per phase: throughput (higher is better) and latencies as base / mode (> 1: better)."""
    out = {}
    for phase, modes in table.items():
        a, b = modes.get(mode), modes.get(base)
        if not a or not b:
            continue
        out[phase] = {"output_tok_s": round(a["output_tok_s"] / b["output_tok_s"], 3) if b["output_tok_s"] else None,
                      "fed_tok_s": round(a["fed_tok_s"] / b["fed_tok_s"], 3) if b["fed_tok_s"] else None,
                      "latency_p95": round(b["latency_p95_ms"] / a["latency_p95_ms"], 3) if a["latency_p95_ms"] else None,
                      "ttft_p95": round(b["ttft_p95_ms"] / a["ttft_p95_ms"], 3) if a["ttft_p95_ms"] else None}
    return out


def plot(scenario: Scenario, minute: float, series: dict[str, list[dict]], runs: list[Run], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for name, rows in series.items():
        x = [r["t_s"] / 60 for r in rows]
        top.plot(x, [r["output_tok_s"] for r in rows], marker="o", markersize=3, label=name)
        bottom.plot(x, [r["latency_p95_ms"] / 1000 for r in rows], marker="o", markersize=3, label=name)
    for ax in (top, bottom):
        for lo, hi, label in scenario.events:
            if scenario.name == "restart":
                continue  # shaded per run below: from the stop until the worker serves again
            ax.axvspan(lo * minute / 60, hi * minute / 60, color="grey", alpha=0.15, label=label if ax is top else None)
        for run in runs:
            if run.downtime:
                ax.axvspan(run.downtime[0] / 60, run.downtime[1] / 60, color="grey", alpha=0.15,
                           label=f"worker down ({run.mode})" if ax is top else None)
        ax.grid(alpha=0.3)
    # What the tuner did with adaptivity on: kernel and knob changes labelled; the draft gate's
    # verdicts (they turn over often) as ticks along the bottom, counted in the legend.
    for run in runs:
        if not run.mode.startswith("on"):
            continue
        gate = [at for at, what in run.actions if what.startswith("drafting")]
        if gate:
            top.plot([at / 60 for at in gate], [0] * len(gate), "|", color="tab:green", markersize=12,
                     label=f"draft gate verdicts ({len(gate)})")
        for at, what in run.actions:
            if not what.startswith("drafting"):
                top.axvline(at / 60, color="tab:blue", alpha=0.3, linewidth=0.8)
                top.annotate(what, (at / 60, top.get_ylim()[1]), rotation=90, fontsize=6, va="top", alpha=0.8)
    top.set_ylim(bottom=0)
    top.set_ylabel("output tok/s")
    bottom.set_ylabel("latency p95 (s)")
    bottom.set_xlabel("minutes (real time)")
    top.set_title(f"bench/adaptive.py --scenario {scenario.name} (scenario minute = {minute:.0f} s); "
                  f"blue lines: the tuner acting (on)", fontsize=9)
    top.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a known model name or a GGUF path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--minute", type=float, default=60.0, help="seconds per scenario minute")
    parser.add_argument("--bucket", type=float, help="seconds per row of the tables and point of the plot "
                                                     "(default: half a scenario minute)")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--modes", default="on,off", help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=1, help="run the modes this many times, alternating order")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    scenario = SCENARIOS[args.scenario]
    model = resolve_model(args.model, MODELS_DIR)
    global document_tokenizer
    document_tokenizer = Tokenizer.from_gguf(model)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}: choose from {list(MODES)}")
    bucket = args.bucket or args.minute / 2
    png = args.png or Path(f"bench-adaptive-{scenario.name}.png")
    out = args.json or Path(f"bench-adaptive-{scenario.name}.json")
    runs: list[Run] = []
    series: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="reame-adaptive-") as tmp:
        for repeat in range(args.repeats):
            for mode in (modes if repeat % 2 == 0 else modes[::-1]):
                directory = Path(tmp) / f"{mode}-{repeat}"
                run = run_mode(model, args.threads, mode, scenario, args.minute, args.clients, directory)
                for log_file in directory.glob("*.log"):  # beside the JSON: what the tuner said, and why
                    shutil.copy(log_file, out.with_name(f"{out.stem}-{mode}-{repeat}-{log_file.name}"))
                name = mode if args.repeats == 1 else f"{mode} #{repeat + 1}"
                rows = buckets(run, scenario.minutes * args.minute, bucket)
                series[name] = rows
                runs.append(run)
                print(f"\n{scenario.name}, adaptive {name} (errors {run.errors})")
                print(f"{'t (s)':>7} {'reqs':>5} {'out tok/s':>10} {'lat p95':>9} {'TTFT p95':>9}")
                for r in rows:
                    print(f"{r['t_s']:>7} {r['requests']:>5} {r['output_tok_s']:>10.1f} {r['latency_p95_ms']:>7}ms "
                          f"{r['ttft_p95_ms']:>7}ms")
                for at, what in run.actions:
                    print(f"  {at:7.0f} s  {what}")
    results = []
    for repeat in range(args.repeats):
        group = runs[repeat * len(modes):(repeat + 1) * len(modes)]
        table = print_phases(scenario, args.minute, group)
        compared = {m: ratios(table, m) for m in modes if m != "off"}
        if "on" in modes:
            for m in modes:
                if m not in ("on", "off"):
                    compared[f"on/{m}"] = ratios(table, "on", m)
        recovery = {r.mode: recovery_s(scenario, args.minute, r, bucket) for r in group}
        results.append({"phases": table, "ratios": compared, "recovery_s": recovery,
                        "downtime": {r.mode: r.downtime for r in group}, "worth": {r.mode: r.worth for r in group},
                        "actions": {r.mode: r.actions for r in group}})
        for name, by_phase in compared.items():
            for phase in scenario.judged:
                if phase in by_phase:
                    r = by_phase[phase]
                    print(f"  {name} vs {'off' if '/' not in name else name.split('/')[1]}, {phase}: "
                          f"output tok/s {r['output_tok_s']}x, p95 latency {r['latency_p95']}x, "
                          f"p95 TTFT {r['ttft_p95']}x (> 1: better)")
        if scenario.name == "restart":
            for run in group:
                steady, after = (table[p][run.mode]["output_tok_s"] for p in ("steady", "first minute after"))
                print(f"  {run.mode}: first minute after the restart / steady before = "
                      f"{after / steady if steady else float('nan'):.2f}x")
        if scenario.name == "neighbour":
            print(f"  back to 90% of the before-phase rate after the neighbour left: {recovery} s")
    print(f"\ntarget: {scenario.target}")
    out.write_text(json.dumps({"scenario": scenario.name, "minute_s": args.minute, "model": str(model),
                               "clients": args.clients, "series": series, "runs": results}, indent=1))
    plot(scenario, args.minute, series, runs, png)
    say(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
