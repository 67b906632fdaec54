"""Test doubles for the serving path: a byte-level tokenizer, a scripted engine, and an
in-process gateway + workers (threads, real ZeroMQ over ipc) to test the gateway in milliseconds.

The fake engine answers a prompt with a fixed text (`REPLY`) at temperature 0, or seeded random
letters otherwise, then an end-of-generation token; `step_s` makes each step take time so that
aborts and worker loss can be observed mid-generation.
"""
from __future__ import annotations

import asyncio
import codecs
import dataclasses
import random
import threading
import time
from pathlib import Path

import zmq
from aiohttp import web

from shared.config import Config, parse_config
from shared.errors import ContextLengthError, InvalidRequestError
from shared.protocol import Register
from worker.sampling_params import SamplingParams

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


@dataclasses.dataclass
class Out:
    token: int
    logprob: float | None = None
    top_logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


class FakeEngine:
    model_name = "fake-model"
    arch = "fake"
    n_ctx = 256
    vocab_size = 256 + OFFSET

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.steps = 0  # generated tokens, all requests
        self.closed = 0  # generators closed before their end (aborts)

    def validate(self, prompt_ids, max_tokens):
        if not prompt_ids:
            raise InvalidRequestError("empty prompt", param="prompt")
        if len(prompt_ids) + max_tokens > self.n_ctx:
            raise ContextLengthError("too long", param="max_tokens")

    def script(self, params: SamplingParams) -> list[int]:
        if params.temperature == 0:
            text = REPLY.encode()
        else:
            rng = random.Random(params.seed)
            text = bytes(rng.choice(b"abcdefghij ") for _ in range(40))
        return [b + OFFSET for b in text] + [EOS]

    def generate(self, prompt_ids, params: SamplingParams):
        self.validate(prompt_ids, params.max_tokens)
        tokens = [t for t in self.script(params) if params.logit_bias.get(t, 0) > -100]
        if params.logit_bias.get(EOS, 0) <= -100:  # the "never stop" trick tests use
            tokens = tokens[:-1] * 1000
        finished = False
        try:
            for n, token in enumerate(tokens[:params.max_tokens]):
                if self.step_s:
                    time.sleep(self.step_s)
                self.steps += 1
                out = Out(token)
                if params.logprobs:
                    out.logprob = -0.5
                    out.top_logprobs = [(token, -0.5), (OFFSET, -2.0)][:params.logprobs]
                if token in params.stop_token_ids:
                    out.finish_reason = "stop"
                elif n + 1 == params.max_tokens:
                    out.finish_reason = "length"
                finished = out.finish_reason is not None
                yield out
        finally:
            if not finished:
                self.closed += 1


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
    """A real WorkerService around a FakeEngine, in a thread."""

    def __init__(self, config: Config, name: str, step_s: float = 0.0):
        from worker.pulse import Pulse
        from worker.service import WorkerService

        self.engine = FakeEngine(step_s)
        self.context = zmq.Context()
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, name.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(config.endpoint)
        info = Register(name, 0, [0], self.engine.model_name, "/fake.gguf", "fake", self.engine.n_ctx,
                        self.engine.vocab_size, 1, "elsewhere", 0)
        self.service = WorkerService(self.engine, sock, info, drain_timeout=5.0)
        self.pulse = Pulse(self.context, config.endpoint, self.service, config.server.heartbeat_interval)
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
        self.service.request_stop()
        self.thread.join(5)

    def stop(self) -> None:
        self.service.request_stop()
        self.thread.join(5)


class FakeServer:
    """Gateway (aiohttp, own event loop in a thread) + fake workers; `url` is its base URL."""

    def __init__(self, tmp: Path, extra: str = "", workers: int = 1, step_s: float = 0.0):
        self.config = fake_config(tmp, extra)
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

    def add_worker(self, name: str, step_s: float = 0.0) -> FakeWorker:
        worker = FakeWorker(self.config, name, step_s)
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
