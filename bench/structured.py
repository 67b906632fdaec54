"""Structured output: what a JSON schema costs, in tok/s at 1 and 8 streams, mask time per token,
and schema compile time.

    python bench/structured.py [--model smollm2-135m] [--threads 2] [--rounds 3] [--max-tokens 96]
                               [--levels 1,8] [--json FILE]

Throughput: one gateway + worker (batch 8), greedy, `--max-tokens` per request, end tokens banned
so every request runs to max_tokens. Each round runs, at each level, the free request and the same
request under each schema, alternately (the host is shared: only numbers of one run compare).
The schemas never complete within max_tokens (at least 500 array items), so on and off generate
the same number of tokens. tok/s = completion tokens of the level's requests / wall time.

Mask time: in this process, llguidance matchers over the model's own token table (as the worker
builds it) follow random allowed tokens; each mask is timed alone (the worker computes them on a
helper thread while the engine runs, so this is an upper bound of what a step can wait for).

Compile time: every schema of tests/e2e/json_schemas.py, as the gateway checks it
(shared.grammar.json_schema_grammar + check_grammar) and as the worker builds its matcher.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests

from benchlib import say  # bench/, the script's directory, is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from shared.grammar import check_grammar, json_schema_grammar, parser_limits, token_table  # noqa: E402
from shared.model_store import resolve_model  # noqa: E402
from shared.vocab import end_of_generation_ids, read_vocab  # noqa: E402
from tests.e2e.json_schemas import SCHEMAS as SUITE  # noqa: E402
from tests.harness import free_port, gateway_and_worker, write_config  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()
API_KEY = "bench-structured"
PROMPT = [{"role": "user", "content": "List many numbers and words as JSON."}]
# Schemas that cannot finish within max_tokens: the constrained run is as long as the free one.
SCHEMAS = {
    "integers": {"type": "array", "minItems": 500, "items": {"type": "integer", "minimum": 0, "maximum": 9999}},
    "records": {"type": "array", "minItems": 500, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b", "c"]}},
        "required": ["name", "ok", "tag"], "additionalProperties": False}},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="GGUF path or known model name")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--levels", default="1,8", help="concurrent streams, e.g. 1,8")
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    model = resolve_model(args.model, MODELS_DIR)

    results = {"compile": compile_times(model), "mask": mask_times(model)}
    results["throughput"] = throughput(model, args, levels)
    print_tables(results, levels)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


# ---- compile and mask, in process -------------------------------------------------------------------

def compile_times(model: Path) -> dict:
    import llguidance

    say(f"compile: {len(SUITE)} schemas of the suite")
    vocab = read_vocab(model)
    table = token_table(vocab, sorted(end_of_generation_ids(vocab)))
    gateway, worker = [], []
    for _, schema in SUITE.values():
        started = time.perf_counter()
        grammar = json_schema_grammar(schema, "schema")
        check_grammar(grammar, "schema")
        gateway.append(time.perf_counter() - started)
        started = time.perf_counter()
        llguidance.LLMatcher(table, grammar, log_level=0, limits=parser_limits())
        worker.append(time.perf_counter() - started)
    return {"gateway_ms": [t * 1e3 for t in gateway], "worker_ms": [t * 1e3 for t in worker]}


def mask_times(model: Path, tokens: int = 200) -> dict:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    vocab = read_vocab(model)
    table = token_table(vocab, sorted(end_of_generation_ids(vocab)))
    rng = np.random.default_rng(0)
    out = {}
    for name, schema in SCHEMAS.items():
        say(f"mask: {name}, {tokens} tokens")
        matcher = llguidance.LLMatcher(table, json_schema_grammar(schema, "schema"), log_level=0,
                                       limits=parser_limits())
        mask = allocate_token_bitmask(1, table.vocab_size)
        times = []
        for _ in range(tokens):
            started = time.perf_counter()
            fill_next_token_bitmask(matcher, mask)
            times.append(time.perf_counter() - started)
            allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:table.vocab_size])
            if not matcher.consume_token(int(rng.choice(allowed))):
                break
        out[name] = [t * 1e6 for t in times]
    return out


# ---- throughput against a live server ---------------------------------------------------------------

def throughput(model: Path, args, levels: list[int]) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    port = free_port()
    config = write_config(directory, model, port, {
        "gateway": {"api_key": API_KEY, "max_queue": 64},
        "engine": {"threads": args.threads},
        "scheduler": {"max_batch_size": max(levels)},
        "logging": {"level": "warning"},
    })
    modes = ["free", *SCHEMAS]
    runs: dict[str, dict[str, list[float]]] = {str(level): {m: [] for m in modes} for level in levels}
    with gateway_and_worker("structured", directory, config, port, progress=say) as server:
        url = server.url + "/v1/chat/completions"
        one(url, None, 4)  # the worker's grammar token table is built at its first constrained request
        one(url, "integers", 4)
        for round_no in range(args.rounds):
            for level in levels:
                # Alternate the order each round so drift on the shared host spreads over all modes.
                for mode in (modes if round_no % 2 == 0 else modes[::-1]):
                    started = time.perf_counter()
                    with ThreadPoolExecutor(level) as pool:
                        tokens = sum(pool.map(lambda _: one(url, None if mode == "free" else mode, args.max_tokens),
                                              range(level)))
                    rate = tokens / (time.perf_counter() - started)
                    runs[str(level)][mode].append(rate)
                    say(f"round {round_no + 1}, {level} stream(s), {mode}: {rate:.1f} tok/s")
    return runs


def one(url: str, schema: str | None, max_tokens: int) -> int:
    body = {"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "logit_bias": {"0": -100, "1": -100, "2": -100}}  # SmolLM2's end tokens: run to max_tokens
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": schema, "schema": SCHEMAS[schema]}}
    r = requests.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600)
    r.raise_for_status()
    answer = r.json()
    if answer["choices"][0]["finish_reason"] != "length":
        raise RuntimeError(f"expected a request cut by max_tokens: {answer['choices'][0]}")
    return answer["usage"]["completion_tokens"]


# ---- report -----------------------------------------------------------------------------------------

def print_tables(results: dict, levels: list[int]) -> None:
    isa = "AVX-512" if "avx512f" in Path("/proc/cpuinfo").read_text() else "AVX2"
    print(f"\nStructured output on {isa}: tok/s, median of rounds (free vs under a schema)")
    print(f"{'streams':>8} {'mode':>10} {'tok/s':>8} {'vs free':>8}")
    for level in levels:
        modes = results["throughput"][str(level)]
        free = statistics.median(modes["free"])
        for mode, rates in modes.items():
            rate = statistics.median(rates)
            print(f"{level:>8} {mode:>10} {rate:>8.1f} {rate / free:>8.3f}")
    print("\nmask time per token (one matcher, µs)")
    print(f"{'schema':>10} {'median':>8} {'p95':>8} {'max':>8}")
    for name, times in results["mask"].items():
        ordered = sorted(times)
        print(f"{name:>10} {statistics.median(times):>8.0f} {ordered[int(0.95 * (len(ordered) - 1))]:>8.0f} "
              f"{ordered[-1]:>8.0f}")
    print(f"\nschema compile time, {len(SUITE)} schemas of the suite (ms)")
    print(f"{'where':>10} {'median':>8} {'max':>8}")
    for where in ("gateway_ms", "worker_ms"):
        times = results["compile"][where]
        print(f"{where[:-3]:>10} {statistics.median(times):>8.2f} {max(times):>8.2f}")


if __name__ == "__main__":
    sys.exit(main())
