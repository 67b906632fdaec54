"""Gateway + ZeroMQ overhead per request, versus calling the engine directly.

    python bench/gateway.py [--model smollm2-135m] [--requests 300] [--threads 1]

One request at a time over a kept-alive connection (http.client: cheap on the client side),
max_tokens=1, a tiny prompt; p50 and p99 of the wall time per request.

1. null engine: the real gateway and the real worker loop, but a generator that answers at once.
   Its latency *is* the overhead: HTTP parsing, validation, tokenizer and chat template, ZeroMQ
   both ways, JSON. This is the number to compare against the 2 ms budget.
2. real engine: the same requests through a real worker, interleaved with the same generation
   called directly in this process, so that load changes on a shared machine hit both alike.
   The difference of the two is the overhead again, measured under real engine work (noisier).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from shared import blas_env  # noqa: E402
from tests.harness import Server, ServerProcess, free_port, health, write_config  # noqa: E402

blas_env.prefer_native_blas()  # before numpy loads OpenBLAS
from worker.sched.generation import FinishEvent, TokenEvent  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()
PROMPT = [1, 504, 3575, 282, 4649, 314, 253, 1345]
CHAT = [{"role": "user", "content": "Hi"}]
REQUESTS = {
    "completions": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}),
    "chat": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "temperature": 0}),
}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


# ---- the null worker: a real WorkerService around an engine that costs nothing ------------------

class NullGenerator:
    """worker.service's generator interface: every request gets one token at the next step."""
    model_name, arch, n_ctx, vocab_size = "null", "null", 8192, 49152
    hold_until = None

    def __init__(self):
        self._waiting: list[tuple[str, int]] = []

    @property
    def has_work(self) -> bool:
        return bool(self._waiting)

    def add(self, request_id, prompt_ids, params, warm=False) -> None:
        self._waiting.append((request_id, len(prompt_ids)))

    def abort(self, request_id):
        for i, (rid, n) in enumerate(self._waiting):
            if rid == request_id:
                del self._waiting[i]
                return FinishEvent(rid, "abort", n, 0)
        return None

    def abort_all(self):
        return [event for rid, _ in list(self._waiting) if (event := self.abort(rid)) is not None]

    def load(self) -> tuple[int, int]:
        return len(self._waiting), 0

    def step(self):
        events = []
        for rid, n in self._waiting:
            events += [TokenEvent(rid, 28), FinishEvent(rid, "length", n, 1)]
        self._waiting.clear()
        return events


def run_null_worker(config_path: str) -> int:
    import zmq

    from shared.config import load_config
    from shared.protocol import Register
    from worker.pulse import Pulse
    from worker.service import WorkerService

    config = load_config(config_path)
    engine = NullGenerator()
    worker_id = f"null/{os.getpid()}"
    info = Register(worker_id, 0, [0], engine.model_name, "", engine.arch, engine.n_ctx, engine.vocab_size, 1,
                    socket.gethostname(), os.getpid())
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker_id.encode())
    sock.connect(config.endpoint)
    service = WorkerService(engine, sock, info)
    signal.signal(signal.SIGTERM, lambda *_: service.request_drain())
    pulse = Pulse(context, config.endpoint, service, config.server.heartbeat_interval)
    pulse.start()
    service.run()
    pulse.stop()
    sock.close(linger=1000)
    context.term()
    return 0


# ---- processes and measurements -----------------------------------------------------------------

def start_worker(server: Server, name: str, argv: list[str]) -> ServerProcess:
    worker = server.start(name, argv)
    server.wait_ready(timeout=180)
    return worker


def stop_worker(server: Server, worker: ServerProcess) -> None:
    worker.stop(30)
    deadline = time.monotonic() + 10  # until the gateway has let it go
    while time.monotonic() < deadline and health(server.url)[0] != 503:
        time.sleep(0.05)


class Client:
    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port)

    def post(self, path: str, body: bytes) -> float:
        start = time.perf_counter()
        self.conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = self.conn.getresponse()
        payload = response.read()
        elapsed = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"{path}: {response.status} {payload[:200]!r}")
        return elapsed


def bench_null(server: Server, config: Path, n: int, warmup: int) -> dict[str, list[float]]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--null-worker", str(config)]
    worker = start_worker(server, "null-worker", argv)
    client = Client(server.port)
    out = {}
    for name, (path, body) in REQUESTS.items():
        data = json.dumps(body).encode()
        out[name] = [client.post(path, data) for _ in range(warmup + n)][warmup:]
    stop_worker(server, worker)
    return out


def bench_real(server: Server, config: Path, model: Path, threads: int, n: int,
               warmup: int) -> dict[str, tuple[list, list]]:
    from gateway.chat_template import ChatTemplate
    from gateway.tokenizer import Tokenizer
    from shared.config import Config, override
    from worker.engine.engine import load_engine_from_config
    from shared.sampling import SamplingParams
    from worker.sched.one_request import generate_one, solo_generator

    tokenizer = Tokenizer.from_gguf(model)
    chat_ids = tokenizer.encode(ChatTemplate.for_tokenizer(tokenizer).render(CHAT), add_special=True,
                                parse_special=True)
    # This process runs its engine on the worker's CPUs, with as many BLAS threads: the two engines
    # take turns (the pairs are sequential), so both do the same work on the same cores.
    from threadpoolctl import threadpool_limits

    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.sched_setaffinity(0, cpus)
    threadpool_limits(threads)
    engine = load_engine_from_config(override(Config(), "engine", threads=threads), model=str(model),
                                     progress=lambda _m: None)
    generator = solo_generator(engine)
    start_worker(server, "worker", [sys.executable, "-m", "worker.main", "--config", str(config), "--model",
                                    str(model), "--cpus", ",".join(map(str, cpus))])
    client = Client(server.port)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = {}
    for name, ids in (("completions", PROMPT), ("chat", chat_ids)):
        path, body = REQUESTS[name]
        data = json.dumps(body).encode()
        direct, through = [], []
        for i in range(warmup + n):  # interleaved: both see the same machine load
            start = time.perf_counter()
            for _ in generate_one(generator, ids, params):
                pass
            d = time.perf_counter() - start
            h = client.post(path, data)
            if i >= warmup:
                direct.append(d)
                through.append(h)
        out[name] = (direct, through)
    return out


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--null-worker":
        return run_null_worker(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=300, help="per null-engine row")
    parser.add_argument("--real-requests", type=int, default=100, help="per real-engine row (0: skip)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    # A SIGTERM (e.g. from `timeout`) must still stop the gateway and worker we started.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))

    from shared.model_store import ensure_model

    model = ensure_model(args.model, MODELS_DIR)
    print(f"{'request (max_tokens 1)':<24} {'engine':<7} {'direct p50/p99 ms':>18} {'gateway p50/p99 ms':>19} "
          f"{'overhead p50/p99 ms':>20}", flush=True)
    with tempfile.TemporaryDirectory(prefix="reame-bench-") as tmp:
        port = free_port()
        config = write_config(Path(tmp), model, port, {"logging": {"level": "warning"}})
        with Server("gateway", Path(tmp), port) as server:
            server.start("gateway", [sys.executable, "-m", "gateway.main", "--config", str(config)])
            say(f"null engine: {args.requests} requests per row")
            for name, samples in bench_null(server, config, args.requests, args.warmup).items():
                h50, h99 = percentiles(samples)
                print(f"{name:<24} {'null':<7} {'-':>18} {h50 * 1e3:>9.2f} /{h99 * 1e3:>7.2f} "
                      f"{h50 * 1e3:>10.2f} /{h99 * 1e3:>7.2f}", flush=True)
            if args.real_requests:
                say(f"real engine: {args.real_requests} interleaved pairs per row, {args.threads} thread(s)")
                for name, (direct, through) in bench_real(server, config, model, args.threads,
                                                          args.real_requests, args.warmup).items():
                    d50, d99 = percentiles(direct)
                    t50, t99 = percentiles(through)
                    o50, o99 = percentiles([t - d for d, t in zip(direct, through)])
                    print(f"{name:<24} {'real':<7} {d50 * 1e3:>8.2f} /{d99 * 1e3:>7.2f} {t50 * 1e3:>9.2f} /"
                          f"{t99 * 1e3:>7.2f} {o50 * 1e3:>10.2f} /{o99 * 1e3:>7.2f}", flush=True)
    print("\nOne request at a time. Null rows: the engine answers at once, so latency = overhead. "
          "Real rows: overhead = gateway - direct, per interleaved pair.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
