"""The worker's serve loop against a scripted socket: one step per message read, aborts, drain;
and its pulse thread's heartbeats over a real socket."""
from __future__ import annotations

import logging
from collections import deque

import orjson
import zmq

from shared import protocol
from shared.protocol import Abort, Drain, Error, Finished, Generate, Heartbeat, Register, TokenChunk
from shared.sampling import SamplingParams
from tests.fakes import EOS, FakeGenerator
from worker.pulse import Pulse
from worker.sched.generation import FinishEvent, TokenEvent
from worker.service import WorkerService

INFO = Register("w", 0, [0], "fake", "/f.gguf", "fake", 256, 259, 1, "h", 1)


class ScriptedSocket:
    """Delivers queued frames to the loop; `on_send` lets a test react to what the worker sent."""

    def __init__(self):
        self.inbox: deque[bytes] = deque()
        self.sent: list = []
        self.batches: list[list] = []  # what each send_multipart carried
        self.on_send = None

    def poll(self, timeout_ms):
        return len(self.inbox)

    def recv(self, flags=0):
        if not self.inbox:
            raise zmq.Again()
        return self.inbox.popleft()

    def send(self, frame):
        message = protocol.decode(frame)
        self.sent.append(message)
        if self.on_send:
            self.on_send(message)

    def send_multipart(self, frames):
        self.batches.append([protocol.decode(frame) for frame in frames])
        for frame in frames:
            self.send(frame)

    def push(self, message):
        self.inbox.append(protocol.encode(message))


def make(step_s=0.0):
    sock = ScriptedSocket()
    engine = FakeGenerator(step_s)
    service = WorkerService(engine, sock, INFO, drain_timeout=5)
    return service, sock, engine


def greedy(max_tokens=5, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def of(sock, kind):
    return [m for m in sock.sent if isinstance(m, kind)]


def test_generate_then_drain():
    service, sock, _ = make()
    sock.push(Generate("a", [1, 2], greedy(3)))
    service.request_drain()
    service.run()
    assert isinstance(sock.sent[0], Register)
    assert [m.tokens[0] for m in of(sock, TokenChunk)] == [ord("H") + 3, ord("e") + 3, ord("l") + 3]
    assert of(sock, Finished) == [Finished("a", "length", 2, 3)]
    assert [m.done for m in of(sock, Drain)] == [False, True]


def test_one_step_goes_out_as_one_message():
    """The events of a step (a token per running request, then the finishes) share one multipart
    message, in order, so the gateway wakes once per step."""
    service, sock, engine = make()
    sock.push(Generate("a", [1], greedy(2)))
    sock.push(Generate("b", [1], greedy(3)))
    service.request_drain()
    service.run()
    shapes = [[(type(m).__name__, m.request_id) for m in batch] for batch in sock.batches]
    assert shapes == [
        [("TokenChunk", "a"), ("TokenChunk", "b")],
        [("TokenChunk", "a"), ("Finished", "a"), ("TokenChunk", "b")],
        [("TokenChunk", "b"), ("Finished", "b")],
    ]


def test_a_requests_consecutive_tokens_share_one_chunk():
    """A drafted chunk emits several tokens of one request in one step: one TokenChunk carries
    them (tokens, logprobs and top_logprobs aligned); order across requests is kept."""
    service, sock, _ = make()
    service._emit([TokenEvent("a", 5, -0.25, [(5, -0.25), (6, -1.5)]), TokenEvent("a", 6, -0.5, [(6, -0.5)]),
                   TokenEvent("b", 7), TokenEvent("a", 8, -1.0), FinishEvent("a", "length", 2, 3)])
    assert sock.batches == [[
        TokenChunk("a", [5, 6], [-0.25, -0.5], [[[5, -0.25], [6, -1.5]], [[6, -0.5]]]),
        TokenChunk("b", [7], [None], [[]]),
        TokenChunk("a", [8], [-1.0], [[]]),
        Finished("a", "length", 2, 3),
    ]]


def test_queued_requests_run_in_order_and_abort_removes_from_queue():
    service, sock, _ = make()
    for rid in "abc":
        sock.push(Generate(rid, [1], greedy(2)))
    sock.push(Abort("b"))
    service.request_drain()
    service.run()
    assert [(m.request_id, m.finish_reason) for m in of(sock, Finished)] == [("b", "abort"), ("a", "length"),
                                                                              ("c", "length")]


def test_abort_stops_the_running_request_within_one_step():
    service, sock, engine = make()
    sock.push(Generate("a", [1], greedy(100, logit_bias={EOS: -100.0})))

    def abort_after_three(message):
        if isinstance(message, TokenChunk) and len(of(sock, TokenChunk)) == 3:
            sock.push(Abort("a"))
            service.request_drain()

    sock.on_send = abort_after_three
    service.run()
    assert len(of(sock, TokenChunk)) == 3 and engine.closed == 1
    assert of(sock, Finished) == [Finished("a", "abort", 1, 3)]


def test_invalid_request_answers_an_error_at_once():
    service, sock, _ = make()
    sock.push(Generate("a", [1] * 250, greedy(10)))
    sock.push(Generate("b", [], greedy(1)))
    service.request_drain()
    service.run()
    errors = of(sock, Error)
    assert [(e.request_id, e.error, e.code) for e in errors] == [("a", "ContextLengthError", "context_length_exceeded"),
                                                                  ("b", "InvalidRequestError", None)]


def test_unknown_to_gateway_reregisters():
    service, sock, _ = make()
    sock.push(Heartbeat("w", registered=False))
    service.request_drain()
    service.run()
    assert len(of(sock, Register)) == 2


def test_stop_gives_up_on_running_work():
    service, sock, engine = make()
    sock.push(Generate("a", [1], greedy(100, logit_bias={EOS: -100.0})))
    sock.on_send = lambda m: service.request_stop() if isinstance(m, TokenChunk) else None
    service.run()
    assert engine.closed == 1 and sock.sent[-1] == Drain("w", done=True)


def test_warm_request_reaches_the_generator_and_its_cache_counts_come_back():
    service, sock, engine = make()
    engine.cached_tokens, engine.prefix_tokens = 16, 32
    sock.push(Generate("w", [1] * 40, greedy(1), warm=True))
    sock.push(Generate("g", [1] * 40, greedy(2)))
    service.request_drain()
    service.run()
    assert [(rid, warm) for rid, _, _, warm in engine.added] == [("w", True), ("g", False)]
    assert [m.request_id for m in of(sock, TokenChunk)] == ["g", "g"]  # the warm one prefills only
    assert of(sock, Finished) == [Finished("w", "length", 40, 0, cached_tokens=16, prefix_tokens=32),
                                  Finished("g", "length", 40, 2, cached_tokens=16, prefix_tokens=32)]


def test_a_malformed_generate_is_dropped_and_logged_and_the_next_one_runs(caplog):
    service, sock, engine = make()
    sock.inbox.append(bytes([protocol.Kind.GENERATE]) + orjson.dumps(
        {"request_id": "bad", "prompt_ids": ["1"], "params": {}}))
    sock.push(Generate("a", [1], greedy(1)))
    service.request_drain()
    with caplog.at_level(logging.WARNING, "reame.worker"):
        service.run()
    assert [rid for rid, _, _, _ in engine.added] == ["a"]
    assert "dropped a bad frame: Generate.prompt_ids[0]: expected int" in caplog.text


def test_a_worker_the_gateway_refuses_leaves(caplog):
    service, sock, _ = make()
    sock.push(Error("", "ConfigError", "the gateway refused this worker: its model has 259 tokens", fatal=True))
    with caplog.at_level(logging.ERROR, "reame.worker"):
        service.run()  # returns: no drain or stop was asked for
    assert sock.sent[-1] == Drain("w", done=True)
    assert "the gateway refused this worker" in caplog.text


class _Loaded:
    info = INFO
    read_request = "r7"  # the last Generate its loop read

    def load(self):
        return 1, 2

    def read_ms(self):
        return 40

    def request_register(self):
        pass


def beats(counters, n=2):
    """Run a Pulse against a ROUTER and return its first `n` heartbeats."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind("inproc://pulse")
    pulse = Pulse(context, "inproc://pulse", _Loaded(), 0.01, counters=counters)
    pulse.start()
    try:
        received = []
        while len(received) < n:
            assert router.poll(2000), "the pulse stopped beating"
            received.append(protocol.decode(router.recv_multipart()[1]))
        return received
    finally:
        pulse.stop()
        router.close(linger=0)
        context.term()


def test_heartbeats_carry_the_counters_that_are_heartbeat_fields():
    counters = {"prefix_query_tokens": 64, "store_bytes": 4096, "not_a_field": 1}
    beat = beats(lambda: counters)[0]
    assert beat == Heartbeat("w", active=1, queued=2, read_request="r7", read_ms=40, prefix_query_tokens=64,
                             store_bytes=4096)


def test_failing_counters_cost_the_counters_not_the_heartbeats(caplog):
    def broken():
        raise RuntimeError("store closed")

    with caplog.at_level(logging.ERROR, logger="reame.worker"):
        assert beats(broken, n=3) == [Heartbeat("w", active=1, queued=2, read_request="r7", read_ms=40)] * 3
    assert len([r for r in caplog.records if "counters failed" in r.message]) == 1


def test_the_loop_says_which_generate_it_read_last_and_when():
    """What the pulse reports of the data path: requests read, not merely a process alive."""
    now = [100.0]
    sock = ScriptedSocket()
    service = WorkerService(FakeGenerator(), sock, INFO, clock=lambda: now[0])
    assert service.read_request == ""
    sock.push(Generate("a", [1, 2], greedy(3)))
    sock.push(Generate("b", [1, 2], greedy(3)))
    service._read_messages(0)
    assert service.read_request == "b" and service.read_ms() == 0
    now[0] += 2.5  # a long engine step: what the gateway sent since is not read yet
    assert service.read_ms() == 2500
