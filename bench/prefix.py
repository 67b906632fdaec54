"""Prefix reuse: TTFT of a ~1,500-token shared prefix + a short question, cold and from each cache tier.

    python bench/prefix.py [--model smollm2-135m] [--threads 2] [--rounds 3] [--prefix-sentences 88]
                           [--peer PATH/TO/llama-server] [--json FILE]

Runs two independent Reame stacks (a gateway and one worker each, own ports and state
directories) that share one prefix store on disk, the way the workers of one host do. Each round
uses a system prompt of its own (~1,500 tokens of ordinary English, seeded per round) and asks
one short question, greedy, 16 tokens, streamed; TTFT = request sent -> first text chunk:

  cold         stack A, first time this prefix is seen anywhere
  warm RAM     stack A again: the prefix is in A's block pool
  new question stack A, same system prompt, another question (the prompt differs after the prefix)
  other worker stack B (running all along, never saw the prefix): restored from the shared store
  restart      after both stacks were stopped and A started again: restored from the store

Every warm answer must equal the cold one (greedy; the K/V are bit-identical), and each reports
`usage.prompt_tokens_details.cached_tokens`. The table gives median TTFT per case and its share of
cold; the store's size per cached token comes from the LMDB directory after the run.

With `--peer`, llama-server (same GGUF, same threads, one slot) answers the same rounds: cold,
then warm (its slot keeps the prompt), then after a restart of the server (it keeps nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from benchlib import say  # bench/, the script's directory, is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.harness import Server, free_port, gateway_and_worker, start_server, write_config  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()
MAX_TOKENS = 16
CASES = ("cold", "warm RAM", "new question", "other worker", "restart")

SENTENCES = [
    "The harbour office records every ship that enters the bay, with its cargo and its crew.",
    "Fishing boats leave before dawn and return in the early afternoon with the day's catch.",
    "The lighthouse was rebuilt in stone after a storm destroyed the old wooden tower.",
    "A ferry crosses to the island four times a day, more often in the summer months.",
    "The market square fills with stalls selling bread, cheese, honey and fresh vegetables.",
    "Children from the nearby villages take the early bus to the school by the river.",
    "The town council meets on the first Monday of each month in the old guild hall.",
    "Visitors often climb the hill behind the church to see the whole coastline at sunset.",
    "The railway reached the town in the last century and brought tourists every weekend.",
    "The museum keeps maps, letters and tools that tell the history of the harbour.",
    "Winter storms sometimes close the ferry for days, and the island relies on its stores.",
    "A small shipyard still builds wooden boats by hand, using timber from the forest inland.",
    "The library opens late on Thursdays so that workers from the docks can borrow books.",
    "In spring, the festival of boats fills the bay with decorated vessels and music.",
    "The bakery near the station makes a famous bread with seeds and a dark crust.",
    "Farmers bring sheep down from the hills in autumn, and the roads fill with flocks.",
    "An old canal connects the harbour to the river, though only small boats use it now.",
    "The weather station on the cliff reports wind and rain to the harbour every hour.",
    "Tourists buy postcards of the lighthouse and eat fried fish on the harbour wall.",
    "The bridge over the river was widened so that lorries could reach the docks directly.",
]
QUESTIONS = ["In one sentence, what happens at the harbour?", "What does the ferry do in winter?"]


def system_prompt(round_no: int, sentences: int) -> str:
    rng = random.Random(1000 + round_no)
    return f"Notes, set {round_no}. " + " ".join(rng.choice(SENTENCES) for _ in range(sentences))


# ---- the stacks -----------------------------------------------------------------------------------

@dataclass
class Stack:
    """A gateway and one worker with a config of their own; the store path is shared."""
    name: str
    directory: Path
    port: int
    server: Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, model: Path, threads: int, store: Path) -> None:
        config = write_config(self.directory, model, self.port, {
            "engine": {"threads": threads}, "prefix_cache": {"store_path": store}, "logging": {"level": "info"}})
        # The logs of a restart are appended to the first run's (gateway.log, worker.log).
        self.server = gateway_and_worker(f"stack {self.name}", self.directory, config, self.port, progress=say)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


@dataclass
class Answer:
    ttft: float
    text: str
    prompt_tokens: int
    cached_tokens: int


def ask(url: str, system: str, question: str, peer: bool = False) -> Answer:
    body = {"model": "reame", "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    if peer:
        body["cache_prompt"] = True
    request = urllib.request.Request(url + "/v1/chat/completions", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    ttft, text, usage = None, [], {}
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text.append(piece)
            usage = event.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return Answer(ttft if ttft is not None else float("nan"), "".join(text), usage.get("prompt_tokens", 0),
                  details.get("cached_tokens") or 0)


def wait_for_store_writes(url: str, timeout: float = 30.0) -> None:
    """Until the worker's store writes stop growing (they run behind the request path)."""
    last, stable_since = -1.0, time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            text = response.read().decode()
        writes = sum(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("reame_prefix_store_writes_total"))
        if writes != last:
            last, stable_since = writes, time.monotonic()
        elif time.monotonic() - stable_since > 1.5:
            return
        time.sleep(0.25)


# ---- the runs --------------------------------------------------------------------------------------

def run_reame(model: Path, threads: int, rounds: int, sentences: int, directory: Path) -> dict[str, list[Answer]]:
    store = directory / "prefix-store"
    a = Stack("A", directory / "a", free_port())
    b = Stack("B", directory / "b", free_port())
    results: dict[str, list[Answer]] = {case: [] for case in CASES}
    prompts = [system_prompt(r, sentences) for r in range(rounds)]
    try:
        a.start(model, threads, store)
        b.start(model, threads, store)
        ask(a.url, "Warm-up.", "Hi")  # first-request costs (connections, lazy imports) out of the way
        ask(b.url, "Warm-up.", "Hi")
        for r, system in enumerate(prompts):
            say(f"round {r + 1}/{rounds}: cold, warm RAM, new question, other worker")
            results["cold"].append(ask(a.url, system, QUESTIONS[0]))
            results["warm RAM"].append(ask(a.url, system, QUESTIONS[0]))
            results["new question"].append(ask(a.url, system, QUESTIONS[1]))
            wait_for_store_writes(a.url)
            results["other worker"].append(ask(b.url, system, QUESTIONS[0]))
        say("full restart: both stacks stop; A starts again")
        a.stop()
        b.stop()
        a.start(model, threads, store)
        ask(a.url, "Warm-up.", "Hi")
        for r, system in enumerate(prompts):
            results["restart"].append(ask(a.url, system, QUESTIONS[0]))
    finally:
        a.stop()
        b.stop()
    return results


def run_peer(binary: str, model: Path, threads: int, rounds: int, sentences: int,
             directory: Path) -> dict[str, list[Answer]]:
    results: dict[str, list[Answer]] = {"cold": [], "warm RAM": [], "restart": []}

    def start() -> Server:
        port = free_port()
        argv = [binary, "-m", str(model), "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", "4096",
                "--host", "127.0.0.1", "--port", str(port)]
        # Its /health answers 200 once the model is loaded; it counts no workers. Logs go to peer.log.
        return start_server("llama-server", directory, port, {"peer": argv}, workers=0, progress=say)

    for r in range(rounds):
        system = system_prompt(r, sentences)
        server = start()
        try:
            results["cold"].append(ask(server.url, system, QUESTIONS[0], peer=True))
            results["warm RAM"].append(ask(server.url, system, QUESTIONS[0], peer=True))
        finally:
            server.stop()
        server = start()  # a restart keeps nothing
        try:
            results["restart"].append(ask(server.url, system, QUESTIONS[0], peer=True))
        finally:
            server.stop()
    return results


# ---- the report --------------------------------------------------------------------------------------

def store_bytes(directory: Path) -> int:
    data = directory / "prefix-store" / "data.mdb"
    return data.stat().st_blocks * 512 if data.exists() else 0  # allocated, not the sparse map size


def print_table(title: str, results: dict[str, list[Answer]]) -> dict[str, dict]:
    cold = statistics.median(a.ttft for a in results["cold"])
    rows = {}
    print(f"\n{title}")
    print(f"{'case':<13} {'TTFT p50 s':>10} {'% of cold':>9} {'prompt tok':>10} {'cached tok':>10} {'same text':>9}")
    for case, answers in results.items():
        ttft = statistics.median(a.ttft for a in answers)
        same = "-" if case in ("cold", "new question") else (
            "yes" if all(a.text == c.text for a, c in zip(answers, results["cold"])) else "NO")
        prompt = statistics.median(a.prompt_tokens for a in answers)
        cached = statistics.median(a.cached_tokens for a in answers)
        print(f"{case:<13} {ttft:>10.3f} {100 * ttft / cold:>8.1f}% {prompt:>10.0f} {cached:>10.0f} {same:>9}")
        rows[case] = {"ttft_p50": ttft, "share_of_cold": ttft / cold, "prompt_tokens": prompt,
                      "cached_tokens": cached, "same_text": same, "ttfts": [a.ttft for a in answers]}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a known model name or a GGUF path")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3, help="system prompts (each run cold once)")
    parser.add_argument("--prefix-sentences", type=int, default=88, help="system prompt length (~17 tokens each)")
    parser.add_argument("--peer", help="llama-server binary to compare against in the same run")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    from shared.model_store import ensure_model

    model = Path(args.model) if args.model.endswith(".gguf") else ensure_model(args.model, MODELS_DIR)
    with tempfile.TemporaryDirectory(prefix="reame-bench-prefix-") as tmp:
        directory = Path(tmp)
        ours = run_reame(model, args.threads, args.rounds, args.prefix_sentences, directory)
        report = {"model": model.name, "threads": args.threads, "rounds": args.rounds,
                  "reame": print_table(f"Reame ({model.name}, {args.threads} threads; median of {args.rounds} rounds)", ours)}
        stored = store_bytes(directory)
        cached_tokens = args.rounds * statistics.median(a.cached_tokens for a in ours["restart"])
        if cached_tokens:
            per_token = stored / cached_tokens
            print(f"\nprefix store: {stored / 2**20:.1f} MiB on disk for ~{cached_tokens:.0f} cached prompt tokens "
                  f"(and the answers' blocks): {per_token / 1024:.1f} KiB per token")
            report["store_bytes"], report["store_kib_per_token"] = stored, per_token / 1024
        if args.peer:
            peer = run_peer(args.peer, model, args.threads, args.rounds, args.prefix_sentences, directory)
            report["peer"] = print_table(f"llama-server ({args.threads} threads, 1 slot)", peer)
        else:
            print("\nllama-server: not run (give --peer PATH/TO/llama-server to compare in the same run)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=asdict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
