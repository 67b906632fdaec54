"""Routing: prefix hit rate and TTFT of multi-turn chats on two workers, prefix affinity vs least loaded.

    python bench/routing.py [--model smollm2-135m] [--conversations 6] [--turns 4] [--clients 2]
                            [--modes affinity,least_loaded] [--repeats 2] [--json FILE]

For each `[gateway] routing` mode a fresh gateway and two workers start (tests/harness.py), each
worker on one CPU with its own RAM prefix cache and no store on disk, as two hosts would have
(the host rule of the router is covered by tests/unit/test_router.py). Each conversation has a
system prompt of its own (~500 tokens of seeded words); `--clients` threads each own a share of
the conversations and sends their turns in a seeded random order per turn (the same in every
mode), so consecutive requests of one client belong to different conversations. Every turn resends the history with the previous answers (greedy, 16
tokens, streamed with usage). Per mode: the share of prompt tokens served from the prefix cache
(`cached_tokens` / `prompt_tokens`) and TTFT p50/p95 of the turns after the first (the first turn
of a conversation is cold in both modes).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchlib import percentile, say  # noqa: E402  (bench/, the script's directory, is on sys.path)
from tests import harness  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()
WORDS = ("river stone market window garden letter engine silver morning paper harbor lantern road "
         "winter forest candle bridge story music number island mirror valley orchard station").split()
QUESTIONS = ["What should I do first?", "Summarise that in one line.", "Any risks?", "And after that?",
             "Give me an example.", "Why?"]


def system_prompt(seed: int, words: int = 380) -> str:
    rng = random.Random(seed)
    return "You are assistant number %d. Rules: " % seed + " ".join(rng.choice(WORDS) for _ in range(words))


def start_stack(directory: Path, model: Path, routing: str) -> harness.Server:
    port = harness.free_port()
    config = harness.write_config(directory, model, port, {
        "gateway": {"routing": routing, "max_queue": 64},
        "prefix_cache": {"store_path": ""},
        "engine": {"threads": 1, "kv_cache_memory": "256MiB", "context_length": 2048},
        "scheduler": {"max_batch_size": 2},
        # Fixed knobs in both modes: only the routing differs.
        "tuning": {"adaptive": "false", "state_path": directory / "tuning"},
        "logging": {"level": "warning"},
    })
    cpus = os.sched_getaffinity(0)
    processes = {"gateway": [sys.executable, "-m", "gateway.main", "--config", str(config)]}
    for i in range(2):
        argv = [sys.executable, "-m", "worker.main", "--config", str(config), "--numa-node", "0"]
        if len(cpus) >= 2:
            argv += ["--cpus", str(sorted(cpus)[i])]
        processes[f"worker-{i}"] = argv
    return harness.start_server(f"reame ({routing})", directory, port, processes, workers=2, progress=say)


def run_client(url: str, conversations: list[int], turns: int, results: list[dict]) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    histories = {c: [{"role": "system", "content": system_prompt(c)}] for c in conversations}
    rng = random.Random(conversations[0])  # the same order in every mode
    for turn in range(turns):
        order = list(conversations)
        rng.shuffle(order)  # a fixed cycle would let least_loaded keep conversations on one worker by chance
        for c in order:
            messages = histories[c] + [{"role": "user", "content": QUESTIONS[(c + turn) % len(QUESTIONS)]}]
            started = time.perf_counter()
            ttft, text, usage = None, [], None
            stream = client.chat.completions.create(model="reame", messages=messages, max_tokens=16, temperature=0,
                                                    stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    ttft = ttft or time.perf_counter() - started
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
            details = usage.prompt_tokens_details
            results.append({"conversation": c, "turn": turn, "ttft": ttft or time.perf_counter() - started,
                            "prompt_tokens": usage.prompt_tokens,
                            "cached_tokens": (details.cached_tokens or 0) if details else 0})
            histories[c] = messages + [{"role": "assistant", "content": "".join(text)}]


def run_mode(model: Path, routing: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="reame-routing-") as tmp:
        with start_stack(Path(tmp), model, routing) as server:
            results: list[dict] = []
            threads = []
            for k in range(args.clients):
                mine = list(range(k, args.conversations, args.clients))
                threads.append(threading.Thread(target=run_client, args=(server.url, mine, args.turns, results)))
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - started
    later = [r for r in results if r["turn"] > 0]
    ttfts = [r["ttft"] for r in later]
    return {"routing": routing, "requests": len(results), "wall_s": wall,
            "hit_rate": sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later)),
            "ttft_p50": statistics.median(ttfts), "ttft_p95": percentile(ttfts, 0.95), "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--conversations", type=int, default=7)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--modes", default="affinity,least_loaded")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--json", help="write the per-request results here")
    args = parser.parse_args()
    from shared.model_store import ensure_model

    model = Path(args.model) if args.model.endswith(".gguf") else ensure_model(args.model, MODELS_DIR)
    modes = args.modes.split(",")
    runs = []
    for repeat in range(args.repeats):  # modes alternate, so load from other processes hits both alike
        for routing in modes:
            say(f"== routing = {routing} (run {repeat + 1}/{args.repeats})")
            runs.append(run_mode(model, routing, args))
    print(f"\n{args.conversations} conversations × {args.turns} turns, {args.clients} clients, 2 workers "
          f"(1 CPU each); hit rate and TTFT over turns 2..{args.turns}; each run, then the medians")
    print(f"{'routing':<22}{'requests':>9}{'prefix hit':>12}{'TTFT p50 ms':>13}{'TTFT p95 ms':>13}{'wall s':>8}")
    medians = {}
    for routing in modes:
        mine = [r for r in runs if r["routing"] == routing]
        medians[routing] = {k: statistics.median(r[k] for r in mine)
                            for k in ("requests", "hit_rate", "ttft_p50", "ttft_p95", "wall_s")}
    for name, row in [(r["routing"], r) for r in runs] + [(f"{m} (median)", medians[m]) for m in modes]:
        print(f"{name:<22}{row['requests']:>9.0f}{row['hit_rate']:>11.1%}{row['ttft_p50'] * 1000:>13.0f}"
              f"{row['ttft_p95'] * 1000:>13.0f}{row['wall_s']:>8.1f}")
    if len(modes) == 2:
        a, b = (medians[m] for m in modes)
        print(f"{modes[0]} / {modes[1]} (medians): TTFT p50 {a['ttft_p50'] / b['ttft_p50']:.2f}×, "
              f"p95 {a['ttft_p95'] / b['ttft_p95']:.2f}×, prefix hit {a['hit_rate']:.1%} vs {b['hit_rate']:.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
