"""The gateway's WorkerPool against a raw ZeroMQ peer: what it stores of a registration (only a
well-typed one, from a worker whose model fits the tokenizer) and who can reach its socket."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import stat
import subprocess
import sys
import uuid

import orjson
import zmq
import zmq.asyncio

from gateway.metrics import Metrics
from gateway.workers import Job, WorkerPool
from shared import protocol
from shared.protocol import Error, Finished, Kind, Register
from shared.sampling import SamplingParams

GOOD = Register("w0", 0, [0, 1], "SmolLM2", "/m/a.gguf", "llama", 8192, 49152, 2, "elsewhere", 12)


def with_pool(tmp_path, body, **options):
    """Runs `await body(pool, peer)` with a started pool and a DEALER peer named w0 connected to it."""
    async def main():
        pool = WorkerPool(f"ipc://{tmp_path}/state/workers.ipc", Metrics(), heartbeat_interval=0.1, **options)
        await pool.start()
        context = zmq.asyncio.Context()
        peer = context.socket(zmq.DEALER)
        peer.setsockopt(zmq.IDENTITY, b"w0")
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(pool.endpoint)
        try:
            return await body(pool, peer)
        finally:
            peer.close()
            context.term()
            await pool.close()
    return asyncio.run(main())


def register_frame(**changes) -> bytes:
    return bytes([Kind.REGISTER]) + orjson.dumps({**dataclasses.asdict(GOOD), **changes})


async def settle(condition=lambda: False, timeout=1.0) -> None:
    """Waits until condition() holds, or `timeout` seconds (for the absence of an effect)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


def test_a_register_with_a_bad_field_is_dropped_and_logged_never_stored(tmp_path, caplog):
    async def body(pool, peer):
        await peer.send(register_frame(capacity="x"))
        await peer.send(register_frame(pid="12"))
        await settle(timeout=0.3)
        assert pool.workers == {}
        await peer.send(protocol.encode(GOOD))  # the loop is still serving
        await settle(lambda: "w0" in pool.workers)
        assert pool.workers["w0"].info == GOOD

    with caplog.at_level(logging.WARNING, "reame.gateway"):
        with_pool(tmp_path, body)
    assert "dropped a bad frame from b'w0': Register.capacity: expected int, got str" in caplog.text
    assert "dropped a bad frame from b'w0': Register.pid: expected int, got str" in caplog.text


def test_a_worker_whose_model_differs_from_the_tokenizer_is_refused_and_told(tmp_path, caplog):
    async def body(pool, peer):
        await peer.send(protocol.encode(dataclasses.replace(GOOD, vocab_size=32000)))
        answer = protocol.decode(await asyncio.wait_for(peer.recv(), 2))
        await peer.send(protocol.encode(dataclasses.replace(GOOD, arch="gemma3")))
        answer_arch = protocol.decode(await asyncio.wait_for(peer.recv(), 2))
        await settle(timeout=0.2)
        assert pool.workers == {} and not pool.ready
        await peer.send(protocol.encode(GOOD))
        await settle(lambda: "w0" in pool.workers)
        return answer, answer_arch

    with caplog.at_level(logging.ERROR, "reame.gateway"):
        answer, answer_arch = with_pool(tmp_path, body, model_arch="llama", vocab_size=49152)
    assert isinstance(answer, Error) and answer.fatal and answer.error == "ConfigError"
    assert "32000 tokens" in answer.message and "49152" in answer.message
    assert isinstance(answer_arch, Error) and "gemma3" in answer_arch.message
    assert "worker w0 refused: its model (/m/a.gguf) has 32000 tokens, the gateway's tokenizer 49152" in caplog.text


def test_a_refused_worker_is_logged_once_however_often_it_registers(tmp_path, caplog):
    async def body(pool, peer):
        for _ in range(3):
            await peer.send(protocol.encode(dataclasses.replace(GOOD, vocab_size=32000)))
            await asyncio.wait_for(peer.recv(), 2)

    with caplog.at_level(logging.ERROR, "reame.gateway"):
        with_pool(tmp_path, body, model_arch="llama", vocab_size=49152)
    assert caplog.text.count("worker w0 refused") == 1


def test_the_socket_and_its_directory_are_owner_only(tmp_path):
    (tmp_path / "state").mkdir(mode=0o755)  # as an older gateway (or a plain mkdir) left it
    os.chmod(tmp_path / "state", 0o755)

    async def body(pool, peer):
        return (stat.S_IMODE((tmp_path / "state").stat().st_mode),
                stat.S_IMODE((tmp_path / "state" / "workers.ipc").stat().st_mode))

    assert with_pool(tmp_path, body) == (0o700, 0o600)


def test_a_same_host_worker_is_dropped_when_its_process_exits(tmp_path, caplog):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    async def body(pool, peer):
        await peer.send(protocol.encode(dataclasses.replace(GOOD, host=socket.gethostname(), pid=child.pid)))
        await settle(lambda: "w0" in pool.workers)
        assert pool.workers["w0"].local
        child.kill()
        child.wait()
        await settle(lambda: "w0" not in pool.workers)
        assert "w0" not in pool.workers

    with caplog.at_level(logging.INFO, "reame.gateway"):
        with_pool(tmp_path, body, worker_timeout=30)
    assert "worker w0 dropped: its process exited" in caplog.text


def test_a_same_host_worker_whose_process_the_gateway_cannot_see_lives_by_its_heartbeats(tmp_path, caplog):
    """Sandboxed services (systemd's PrivateUsers= + ProtectProc=invisible) hide each other's
    processes: the gateway must not drop a live worker because its pid looks gone."""
    invisible = 2 ** 22 + 7  # above Linux's largest pid_max: no process of this pid is visible

    async def body(pool, peer):
        await peer.send(protocol.encode(dataclasses.replace(GOOD, host=socket.gethostname(), pid=invisible)))
        await settle(lambda: "w0" in pool.workers)
        assert not pool.workers["w0"].local
        await settle(timeout=0.6)  # several sweeps
        assert "w0" in pool.workers

    with caplog.at_level(logging.INFO, "reame.gateway"):
        with_pool(tmp_path, body, worker_timeout=30)
    assert f"worker w0: its process {invisible} is not visible to the gateway" in caplog.text


def test_one_tenants_constrained_choices_hold_a_quarter_of_a_workers_slots(tmp_path):
    """mallory's n = 8 under an ambiguous grammar took every slot of a worker of 8, and alice's
    next request waited for them (bench/abuse.py grammar_stall, issue 41, item 3). Now two of
    them run (8 // 4), alice's and mallory's own free-text job go beside them, and the next
    constrained one goes when one of the two finishes."""
    def job(tenant: str, grammar: str) -> Job:
        return Job(uuid.uuid4().hex, 0, [1, 2, 3], SamplingParams(max_tokens=4, grammar=grammar),
                   asyncio.Queue(), b"", tenant=tenant)

    async def body(pool, peer):
        await peer.send(protocol.encode(dataclasses.replace(GOOD, capacity=8)))
        await settle(lambda: "w0" in pool.workers)
        constrained = [job("mallory", "start: /[ab]+/") for _ in range(8)]
        pool.submit(constrained + [job("mallory", ""), job("alice", "")])
        running = pool.workers["w0"].jobs.values()
        assert sorted((j.tenant, bool(j.params.grammar)) for j in running) == [
            ("alice", False), ("mallory", False), ("mallory", True), ("mallory", True)]
        assert len(pool.queue) == 6 and all(j.params.grammar for j in pool.queue)
        first = next(j for j in running if j.params.grammar)
        await peer.send(protocol.encode(Finished(first.request_id, "stop")))
        await settle(lambda: len(pool.queue) == 5)
        assert [j.tenant for j in pool.workers["w0"].jobs.values() if j.params.grammar] == ["mallory"] * 2

    with_pool(tmp_path, body, worker_timeout=30)


def test_constrained_jobs_of_different_tenants_each_get_their_share(tmp_path):
    def job(tenant: str) -> Job:
        return Job(uuid.uuid4().hex, 0, [1], SamplingParams(grammar="start: /a+/"), asyncio.Queue(), b"",
                   tenant=tenant)

    async def body(pool, peer):
        await peer.send(protocol.encode(dataclasses.replace(GOOD, capacity=4)))
        await settle(lambda: "w0" in pool.workers)
        pool.submit([job("mallory"), job("mallory"), job("alice"), job("bob")])
        assert sorted(j.tenant for j in pool.workers["w0"].jobs.values()) == ["alice", "bob", "mallory"]

    with_pool(tmp_path, body, worker_timeout=30)
