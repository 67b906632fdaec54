"""One client posting the largest bodies the gateway takes cannot stall anyone else: prompts are
refused untokenized when they cannot fit, and long ones are tokenized in low-priority processes
(gateway/prompts.py)."""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from tests.e2e.servers import NO_END, auth, gateway_and_worker

MAX_BODY = 4 * 1024 * 1024
PAIR = "<|im_start|><|im_end|>"
LIMIT_MS = 100  # /health's worst answer under the attack
# Streams measured per side. A stall the attack causes shows in each of them; a hiccup of the host
# shows in one (2-core Zen 1 VM: one stream's longest gap 76-183 ms with nothing else running, and
# this test failed 2 runs in 7 on its single attacked stream, 167-246 ms above its single quiet one).
STREAMS = 2
# The attacked stream's least disturbed longest gap may exceed the quiet one's by this much. On that
# host, 2 streams a side: +10 to +110 ms in 8 runs (the tokenizing processes run at nice 19, not
# never); what this guards against is tokenizing on the gateway's threads: gaps of seconds.
STREAM_LIMIT_MS = 200
N_CTX = 8192  # SmolLM2's trained context, under [engine] max_context's default (32768): all of it


@pytest.fixture(scope="module")
def big_body_server(smollm2_gguf, tmp_path_factory):
    with gateway_and_worker(tmp_path_factory.mktemp("large"), smollm2_gguf,
                            gateway={"max_body_bytes": MAX_BODY}) as server:
        yield server


def attack_bodies(n_ctx_bytes: int) -> list[tuple[str, bytes]]:
    """The largest body the gateway reads, and the largest text it must tokenize (just under
    n_ctx × the longest token's bytes), as a completion prompt (all specials) and as a chat message."""
    biggest = PAIR * ((MAX_BODY - 200) // len(PAIR))
    fits = PAIR * (n_ctx_bytes // len(PAIR))
    chat = lambda text: json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1})
    return [("/v1/chat/completions", chat(biggest).encode()),
            ("/v1/completions", json.dumps({"prompt": fits, "max_tokens": 1}).encode()),
            ("/v1/chat/completions", chat(fits).encode())]


def stream_gaps(server) -> list[float]:
    """Seconds between the chunks of one streamed completion."""
    body = {"prompt": "Count to one hundred:", "max_tokens": 40, "temperature": 0, "stream": True,
            "logit_bias": NO_END}
    arrivals = []
    with requests.post(server.url + "/v1/completions", json=body, headers=auth(), stream=True, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter())
    return [b - a for a, b in zip(arrivals[2:], arrivals[3:])]   # from the third: past the prefill


def test_a_maximal_body_delays_no_other_stream_or_health(big_body_server, smollm2_gguf):
    from gateway.tokenizer import Tokenizer
    server = big_body_server
    bound = N_CTX * Tokenizer.from_gguf(smollm2_gguf).max_token_bytes
    bodies = attack_bodies(bound)
    stream_gaps(server)     # the first stream after start-up is not the quiet baseline
    quiet = [max(stream_gaps(server)) for _ in range(STREAMS)]

    stop = threading.Event()
    answers: list[tuple[int, str, float]] = []
    health_ms: list[float] = []

    def attack(path: str, body: bytes) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            r = requests.post(server.url + path, data=body, timeout=120,
                              headers={"Content-Type": "application/json", **auth()})
            answers.append((r.status_code, r.json()["error"]["code"], time.perf_counter() - started))

    def poll_health() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            assert requests.get(server.url + "/health", timeout=10).status_code == 200
            health_ms.append((time.perf_counter() - started) * 1000)
            time.sleep(0.02)

    threads = [threading.Thread(target=attack, args=b) for b in bodies] + [threading.Thread(target=poll_health)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)     # the attack under way first
        attacked = [max(stream_gaps(server)) for _ in range(STREAMS)]
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    quiet_ms, attacked_ms = min(quiet) * 1000, min(attacked) * 1000  # each side's least disturbed stream
    print(f"\nlongest gap quiet {quiet_ms:.0f} ms, under attack {attacked_ms:.0f} ms; /health worst "
          f"{max(health_ms):.0f} ms of {len(health_ms)}; attack answers {len(answers)}, "
          f"slowest {max(a[2] for a in answers):.2f} s")
    assert answers and all(status == 400 and code == "context_length_exceeded" for status, code, _ in answers)
    assert max(health_ms) < LIMIT_MS
    assert attacked_ms < quiet_ms + STREAM_LIMIT_MS
