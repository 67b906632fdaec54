"""Test doubles for the serving path: a byte-level tokenizer, a scripted generator, and an
in-process gateway + workers (threads, real ZeroMQ over ipc) to test the gateway in milliseconds.

The fake generator answers a prompt with a fixed text (`REPLY`) at temperature 0, or seeded random
letters otherwise, then an end-of-generation token, advancing up to 8 requests per step (as the
batching worker does); `step_s` makes each step take time so that aborts and worker loss can be
observed mid-generation. A warm request finishes at its first step without a token. Tests script
what the prefix cache reports: `cached_tokens`/`prefix_tokens` for every Finished, and `counters`
for the heartbeats.
"""
from __future__ import annotations

import asyncio
import codecs
import random
import threading
import time
from pathlib import Path

import zmq
from aiohttp import web

from shared.config import Config, override, parse_config
from shared.errors import ContextLengthError, InvalidRequestError
from shared.protocol import Register
from shared.sampling import SamplingParams
from worker.sched.generation import FinishEvent, TokenEvent

BOS, EOS, EOT = 0, 1, 2
OFFSET = 3  # token id = byte value + OFFSET
REPLY = "Hello, world! héllo"


class FakeTokenizer:
    bos_id = BOS
    eos_id = EOS
    eot_ids = frozenset({EOT})
    vocab_size = 256 + OFFSET
    chat_template = ""

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return ([BOS] if add_special else []) + [b + OFFSET for b in text.encode()]

    def token_bytes(self, token: int) -> bytes:
        if token < OFFSET:
            return [b"<s>", b"</s>", b"<eot>"][token]
        return bytes([token - OFFSET])

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return b"".join(self.token_bytes(t) for t in ids if t >= OFFSET or not skip_special).decode(errors="replace")


class FakeDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(bytes([token - OFFSET])) if token >= OFFSET else ""

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class FakeTemplate:
    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        turns = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return turns + ("<assistant>" if add_generation_prompt else "")


class FakeGenerator:
    """The generator interface of worker.sched.generation, scripted: every step advances each running
    request (up to `capacity`, oldest first) by one token of its script."""
    model_name = "fake-model"
    arch = "fake"
    n_ctx = 256
    vocab_size = 256 + OFFSET

    def __init__(self, step_s: float = 0.0, capacity: int = 8):
        self.step_s = step_s
        self.capacity = capacity
        self.hold_until = None
        self.steps = 0  # generated tokens, all requests
        self.closed = 0  # requests aborted before their end
        self.added: list[tuple[str, list[int], SamplingParams, bool]] = []  # id, prompt, params, warm
        self.namespaces: dict[str, bytes] = {}  # id → the cache namespace it came with
        self.speculative: dict[str, bool] = {}  # id → whether it may be drafted for
        self.cached_tokens = 0  # what every Finished reports
        self.prefix_tokens = 0
        self.counters: dict[str, int] = {}  # what the heartbeats carry
        self._requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}  # id → prompt, params, output
        self._warm: set[str] = set()

    def add(self, request_id: str, prompt_ids, params: SamplingParams, warm: bool = False,
            cache_namespace: bytes = b"", speculative: bool = True) -> None:
        if not prompt_ids:
            raise InvalidRequestError("empty prompt", param="prompt")
        if len(prompt_ids) + params.max_tokens > self.n_ctx:
            raise ContextLengthError("too long", param="max_tokens")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="id")
        self.speculative[request_id] = speculative
        self.added.append((request_id, list(prompt_ids), params, warm))
        self.namespaces[request_id] = cache_namespace
        self._requests[request_id] = (list(prompt_ids), params, [])
        if warm:
            self._warm.add(request_id)

    def heartbeat_counters(self) -> dict[str, int]:
        return dict(self.counters)

    def script(self, params: SamplingParams) -> list[int]:
        if params.temperature == 0:
            text = REPLY.encode()
        else:
            rng = random.Random(params.seed)
            text = bytes(rng.choice(b"abcdefghij ") for _ in range(40))
        tokens = [b + OFFSET for b in text if params.logit_bias.get(b + OFFSET, 0) > -100]
        if params.logit_bias.get(EOS, 0) <= -100:  # the "never stop" trick tests use
            return tokens * 1000
        return tokens + [EOS]

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def load(self) -> tuple[int, int]:
        n = len(self._requests)
        return min(n, self.capacity), max(0, n - self.capacity)

    def abort(self, request_id: str):
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return None
        self._warm.discard(request_id)
        self.closed += 1
        return FinishEvent(request_id, "abort", len(entry[0]), len(entry[2]))

    def abort_all(self):
        return [self.abort(rid) for rid in list(self._requests)]

    def step(self):
        if self.step_s:
            time.sleep(self.step_s)
        events = []
        for request_id in list(self._requests)[:self.capacity]:
            prompt, params, output = self._requests[request_id]
            if request_id in self._warm:  # prefill only
                self._warm.discard(request_id)
                del self._requests[request_id]
                events.append(self._finish(request_id, "length", prompt, output))
                continue
            token = self.script(params)[len(output)]
            output.append(token)
            self.steps += 1
            if params.logprobs:
                events.append(TokenEvent(request_id, token, -0.5, [(token, -0.5), (OFFSET, -2.0)][:params.logprobs]))
            else:
                events.append(TokenEvent(request_id, token))
            reason = None
            if token in params.stop_token_ids:
                reason = "stop"
            elif len(output) == params.max_tokens:
                reason = "length"
            if reason:
                del self._requests[request_id]
                events.append(self._finish(request_id, reason, prompt, output))
        return events

    def _finish(self, request_id: str, reason: str, prompt: list[int], output: list[int]) -> FinishEvent:
        return FinishEvent(request_id, reason, len(prompt), len(output), self.cached_tokens, self.prefix_tokens)


# ---- an in-process gateway with fake workers ---------------------------------------------------

def fake_config(tmp: Path, extra: str = "") -> Config:
    text = f"""
[server]
endpoint = ipc://{tmp}/workers.ipc
heartbeat_interval = 0.1
worker_timeout = 0.6
[gateway]
host = 127.0.0.1
port = 0
max_queue = 8
queue_timeout = 2
max_body_bytes = 20000
{extra}
"""
    return parse_config(text)


class FakeWorker:
    """A real WorkerService around a FakeGenerator, in a thread."""

    def __init__(self, config: Config, name: str, step_s: float = 0.0, profile=None, tuned: bool = False):
        """profile(service) → Profile: what the pulse sends every [tuning] profile_interval; with it
        (or tuned) the worker also takes Strategies (a TuningState at the shipped knobs, as
        worker.main gives), from its first message on."""
        from worker.pulse import Pulse
        from worker.sched.tuning_state import SchedulerKnobs, TuningState
        from worker.service import WorkerService

        self.generator = FakeGenerator(step_s)
        self.context = zmq.Context()
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, name.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(config.endpoint)
        info = Register(name, 0, [0], self.generator.model_name, "/fake.gguf", "fake", self.generator.n_ctx,
                        self.generator.vocab_size, 1, "elsewhere", 0)
        tuning = TuningState(SchedulerKnobs()) if profile is not None or tuned else None
        self.service = WorkerService(self.generator, sock, info, drain_timeout=5.0, tuning=tuning)
        self.pulse = Pulse(self.context, config.endpoint, self.service, config.server.heartbeat_interval,
                           counters=self.generator.heartbeat_counters,
                           profile=None if profile is None else lambda: profile(self.service),
                           profile_interval=config.tuning.profile_interval)
        self.pulse.start()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.service.run()
        finally:
            self.pulse.stop()
            self.service.socket.close()
            self.context.term()

    def crash(self) -> None:
        """Stop without a goodbye, as a killed process would."""
        self.pulse.stop()
        self.service._send = lambda message: None
        self.service._send_many = lambda messages: None
        self.service.request_stop()
        self.thread.join(5)

    def stop(self) -> None:
        self.service.request_stop()
        self.thread.join(5)


class FakeServer:
    """Gateway (aiohttp, own event loop in a thread) + fake workers; `url` is its base URL."""

    def __init__(self, tmp: Path, extra: str = "", workers: int = 1, step_s: float = 0.0,
                 server: dict | None = None):
        """server: [server] keys to set besides fake_config's (CURVE key files)."""
        self.config = fake_config(tmp, extra)
        if server:
            self.config = override(self.config, "server", **server)
        self._start_gateway()
        self.workers = [FakeWorker(self.config, f"w{i}", step_s) for i in range(workers)]
        self.wait_until(lambda: len(self.state.pool.ready) == workers)

    def _start_gateway(self) -> None:
        from gateway.app import build_app
        from gateway.state import build_state

        self.state = build_state(self.config, FakeTokenizer(), FakeTemplate(), FakeDecoder, Path("/m/fake.gguf"))
        self.app = build_app(self.state)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def restart_gateway(self) -> None:
        """A new gateway on the same endpoint; the workers stay as they are."""
        self._stop_gateway()
        self._start_gateway()

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True, shutdown_timeout=1)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        started.set()
        self.loop.run_forever()

    def add_worker(self, name: str, step_s: float = 0.0, profile=None, tuned: bool = False) -> FakeWorker:
        worker = FakeWorker(self.config, name, step_s, profile, tuned)
        self.workers.append(worker)
        return worker

    def wait_until(self, condition, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("condition not met")
            time.sleep(0.01)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self._stop_gateway()

    def _stop_gateway(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
