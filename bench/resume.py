"""Resumed conversations: TTFT of turn 10 of a conversation continued with `previous_response_id`
(POST /v1/responses), against the same turn sent whole to a server without a prefix cache.

    python bench/resume.py [--model smollm2-135m] [--threads 2] [--rounds 3] [--turn-sentences 9]

Two Reame stacks (a gateway and one worker each): A with the prefix cache (RAM and its own LMDB
store), B with `[prefix_cache] enabled = false`. Each round is one conversation of its own (seeded
text, ~150 tokens per user turn, 16 greedy output tokens per reply, so ~1,500 tokens of history by
turn 10), built on A by turns 1-9, each continuing the last with previous_response_id. Then,
streamed, TTFT = request sent -> first output_text delta:

  resumed (RAM)      A, turn 10 with previous_response_id: the history's K/V are in A's block pool
  whole, no cache    B, turn 10 with the whole conversation (A's replies included) as input items
  resumed (restart)  A stopped after the rounds (gateway and worker) and started again; another
                     turn 10 of the same length with previous_response_id: the conversation comes
                     from the gateway's response store, its K/V from the host's LMDB store

The table gives median TTFT per case, its share of `whole, no cache`, and the prompt and cached
token counts the server reported.

--floor then loads the engine in this process (the servers stopped) and splits turn 10 at the
median lengths: its new tokens prefilled after the cached history, the same tokens at position 0
(their matmuls, attention over themselves only), and the whole prompt, in the server's 512-token
chunks. The difference of the first two is attention over the history, printed against the host's
float32 FMA peak (bench/float_peak.py): the share the resumed turn cannot go below without
faster arithmetic than float32.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import orjson

from benchlib import say  # bench/, the script's directory, is on sys.path
from prefix import SENTENCES, wait_for_store_writes

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.harness import Server, free_port, gateway_and_worker, write_config  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()
MAX_TOKENS = 16
TURNS = 10
CASES = ("resumed (RAM)", "whole, no cache", "resumed (restart)")


@dataclass
class Turn:
    ttft: float
    response_id: str
    text: str
    input_tokens: int
    cached_tokens: int


def user_turn(rng: random.Random, turn: int, sentences: int) -> str:
    return f"Turn {turn}. " + " ".join(rng.choice(SENTENCES) for _ in range(sentences)) + " Summarize briefly."


def ask(url: str, turn_input: str | list, previous: str | None = None, store: bool = True) -> Turn:
    body = {"model": "reame", "input": turn_input, "temperature": 0, "max_output_tokens": MAX_TOKENS,
            "stream": True, "store": store, **({"previous_response_id": previous} if previous else {})}
    request = urllib.request.Request(url + "/v1/responses", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    ttft, final = None, {}
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: "):
                continue
            event = orjson.loads(line[6:])
            if event["type"] == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - started
            elif event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
    text = "".join(part["text"] for item in final["output"] if item["type"] == "message" for part in item["content"])
    usage = final["usage"]
    return Turn(ttft if ttft is not None else float("nan"), final["id"], text, usage["input_tokens"],
                usage["input_tokens_details"]["cached_tokens"])


def start(name: str, directory: Path, model: Path, threads: int, cache: bool) -> Server:
    port = free_port()
    prefix = {"store_path": directory / "prefix-store"} if cache else {"enabled": "false", "store_path": ""}
    # Adaptive tuning off: each stack's coordinator would move its worker to other thread counts
    # and CPUs as the host's load came and went, so A and B would not run the same knobs.
    config = write_config(directory, model, port, {"engine": {"threads": threads}, "prefix_cache": prefix,
                                                   "tuning": {"adaptive": "false"}, "logging": {"level": "info"}})
    return gateway_and_worker(name, directory, config, port, progress=say)


def run(model: Path, threads: int, rounds: int, sentences: int, directory: Path) -> dict[str, list[Turn]]:
    results: dict[str, list[Turn]] = {case: [] for case in CASES}
    last_ids, tenth_b = [], []
    a = start("A (cache)", directory / "a", model, threads, cache=True)
    b = start("B (no cache)", directory / "b", model, threads, cache=False)
    try:
        ask(a.url, "Hi")  # first-request costs (connections, lazy imports) out of the way
        ask(b.url, "Hi", store=False)
        for r in range(rounds):
            rng = random.Random(2000 + r)
            say(f"round {r + 1}/{rounds}: turns 1-{TURNS - 1} on A, then turn {TURNS} on A and on B")
            items: list[dict] = []
            previous = None
            for turn in range(1, TURNS):
                text = user_turn(rng, turn, sentences)
                answer = ask(a.url, text, previous)
                items += [{"role": "user", "content": text}, {"role": "assistant", "content": answer.text}]
                previous = answer.response_id
            tenth = user_turn(rng, TURNS, sentences)
            tenth_b.append(user_turn(rng, TURNS, sentences))  # the same length, for after the restart
            results["resumed (RAM)"].append(ask(a.url, tenth, previous))
            results["whole, no cache"].append(ask(b.url, items + [{"role": "user", "content": tenth}], store=False))
            last_ids.append(previous)
        wait_for_store_writes(a.url)
        say("restart: A's gateway and worker stop and start again")
        a.stop()
        a = start("A (cache)", directory / "a", model, threads, cache=True)
        ask(a.url, "Hi")
        for previous, tenth in zip(last_ids, tenth_b):
            results["resumed (restart)"].append(ask(a.url, tenth, previous))
    finally:
        a.stop()
        b.stop()
    return results


def print_table(title: str, results: dict[str, list[Turn]]) -> None:
    base = statistics.median(t.ttft for t in results["whole, no cache"])
    print(f"\n{title}\n")
    print("| turn 10 | TTFT median (ms) | share of whole | input tokens | cached tokens | uncached share |")
    print("|---|---|---|---|---|---|")
    for case in CASES:
        turns = results[case]
        ttft = statistics.median(t.ttft for t in turns)
        tokens = statistics.median(t.input_tokens for t in turns)
        cached = statistics.median(t.cached_tokens for t in turns)
        # The tokens left to prefill: the floor of the TTFT share if time went by tokens alone
        # (it does not quite: each new token attends to the whole history).
        print(f"| {case} | {ttft * 1000:.0f} | {ttft / base:.0%} | {tokens:.0f} | {cached:.0f} "
              f"| {1 - cached / tokens:.0%} |")


CHUNK = 512  # the server's default prefill_chunk


def print_floor(model: Path, threads: int, total: int, cached: int, repeats: int = 5) -> None:
    """Turn 10's prefill split in the engine (see the module's doc): a table and the floor."""
    import numba
    import numpy as np
    from threadpoolctl import threadpool_limits

    from float_peak import float32_peak
    from shared.config import EngineSection
    from worker.engine.batch import StepChunk
    from worker.engine.engine import load_engine

    engine = load_engine(model, EngineSection(threads=threads, context_length=-(-(total + 64) // 1024) * 1024),
                         progress=say)
    numba.set_num_threads(threads)
    ids = np.random.default_rng(0).integers(100, min(engine.vocab_size, 30000), total)
    table = np.arange(-(-total // engine.kv.block_size), dtype=np.int32)
    new = total - cached

    def prefill(lo: int, hi: int) -> None:
        for s in range(lo, hi, CHUNK):
            e = min(hi, s + CHUNK)
            engine.execute([StepChunk.of(ids[s:e], s, table, e == hi)])

    def timed(lo: int, hi: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            prefill(lo, hi)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    hp = engine.model.hp
    # FLOPs of attention over keys 0..p for one row at position p: q·k and the weighted sum of v,
    # a multiply-add per dimension each, every head of every layer.
    per_key = hp.n_layers * hp.n_heads * hp.head_dim * 4

    def keys(lo: int, hi: int) -> int:  # Σ (p + 1) over positions lo..hi-1
        return (hi * (hi + 1) - lo * (lo + 1)) // 2

    with threadpool_limits(limits=threads, user_api="blas"):
        prefill(0, total)  # compile or load every kernel; the history's K/V are now in place
        say(f"floor: {new} new tokens after {cached}, at 0, and the whole {total}, medians of {repeats}")
        at_depth = timed(cached, total)
        at_zero = timed(0, new)
        whole = timed(0, total)
    history_flops = (keys(cached, total) - keys(0, new)) * per_key
    attention = max(at_depth - at_zero, 1e-9)
    rate = history_flops / attention / 1e9
    peak = float32_peak(threads)
    whole_attention = keys(0, total) * per_key / 1e9 / rate  # at the rate measured above
    best_resumed = at_zero + history_flops / 1e9 / peak
    best_whole = whole - whole_attention + keys(0, total) * per_key / 1e9 / peak
    print(f"\nTurn 10 in the engine alone ({model.name}, {threads} threads, {cached} cached + {new} new tokens, "
          f"chunks of {CHUNK}, medians of {repeats})\n")
    print("| part | ms | share of whole |")
    print("|---|---|---|")
    print(f"| the {new} new tokens at position 0: their matmuls (attention over themselves only) | "
          f"{at_zero * 1000:.0f} | {at_zero / whole:.1%} |")
    print(f"| the {new} new tokens after the {cached} cached | {at_depth * 1000:.0f} | {at_depth / whole:.1%} |")
    print(f"| the difference: attention over the history ({history_flops / 1e9:.1f} GFLOP at {rate:.0f} GFLOP/s, "
          f"{rate / peak:.0%} of the float32 FMA peak, {peak:.0f}) | {attention * 1000:.0f} | {attention / whole:.1%} |")
    print(f"| the whole prompt, nothing cached | {whole * 1000:.0f} | 100% |")
    print(f"\nFloor: were attention at the float32 peak (in the resumed turn and the whole prompt alike), "
          f"the resumed turn's prefill would be {best_resumed / best_whole:.1%} of the whole's, before any server "
          f"time; its matmuls alone are {at_zero / whole:.1%}.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a known model name or a GGUF path")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3, help="conversations (each its own text)")
    parser.add_argument("--turn-sentences", type=int, default=9, help="sentences per user turn (~17 tokens each)")
    parser.add_argument("--floor", action="store_true",
                        help="then split turn 10's prefill in the engine (see above)")
    args = parser.parse_args()
    from shared.model_store import ensure_model

    model = Path(args.model) if args.model.endswith(".gguf") else ensure_model(args.model, MODELS_DIR)
    with tempfile.TemporaryDirectory(prefix="reame-bench-resume-") as tmp:
        results = run(model, args.threads, args.rounds, args.turn_sentences, Path(tmp))
    print_table(f"Reame ({model.name}, {args.threads} threads; median of {args.rounds} conversations, "
                f"{TURNS} turns, {MAX_TOKENS} output tokens per reply)", results)
    if args.floor:
        turns = results["resumed (RAM)"]
        total = round(statistics.median(t.input_tokens for t in turns))
        cached = round(statistics.median(t.cached_tokens for t in turns))
        print_floor(model, args.threads, total, cached)
    return 0


if __name__ == "__main__":
    sys.exit(main())
